"""Where a loopback ring's time goes: the same 3 stages in one process, across processes, and in a session.

    .venv/bin/python -m bench.ring_floor [--model smollm2-135m] [--max-tokens 64] [--rounds 3] [--pauses 0,5,15]
        [--sessions tcp,quic] [--no-session] [--json]

Five ways to run LocalChain's 3-stage split of the model, greedy, the same prompt, side by side,
each round running every way once in turn (so drifting load falls on all of them):

- `chain`: LocalChain in this process (what `kafila run --stages 3` runs).
- `pipes`: the head's stage and lm_head here, the other two stages each in a process of its own;
  a step's hidden state goes round by OS pipes, each process computing on its main thread. What
  separate processes cost by themselves (their caches, their thread pools, waking a process).
- `pipes+thread`: the same, but every process reads the pipe on an asyncio loop and computes on a
  one-thread executor, as a ring member does (kafila/session/ring/node.py's hand-off to the stage's
  worker and back): what the loop ↔ compute-thread hand-offs add.
- `session`: a real 3-member loopback session (kafila.tooling.launch.LocalSession: QUIC edges,
  ring frames over the TCP lane (kafila/session/weights/ring_lane.py), the head's scheduler); its own
  block division (the planner's), so it is compared by tok/s only.
- `session (quic)`: the same with `--ring-lane quic`: ring frames over the QUIC edges, as every
  session carried them before the lane (and as one does where TCP cannot connect).

The differences between neighbours split the ring's cost into processes, thread hand-offs and the
rest (QUIC, frames, scheduling). Decode tok/s is tokens after the first over the time from the
first token to the last; the ratio is each way's median tok/s over `chain`'s.

`--pauses 0,1,5,15` also times one decode forward of the middle stage's shard after a pause of
each many ms, the calling thread sleeping or spinning through it (median of 40): what a stage
that waits for the rest of the ring pays when its turn comes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.session import PROMPT

_HEAD = struct.Struct("<III")  # cache_len, n positions, hidden width (0: stop)


def _stage(index, first: int, last: int, head: bool = False):
    """Blocks first..last of the opened model `index` as an OpenVINO shard at serving precision;
    `head`: with the embedding and the lm_head, as a ring's head holds them."""
    import backends
    from backends.base import ShardSpec

    return backends.load_shard("openvino", ShardSpec(index.path, first, last, embed=head, head=head), "serving",
                               index=index)  # fmt: skip


def _unpack(data: bytes) -> tuple[int, np.ndarray]:
    cache_len, n, width = _HEAD.unpack_from(data)
    return cache_len, np.frombuffer(bytearray(data), np.float32, offset=_HEAD.size).reshape(n, width)


def _pack(cache_len: int, x: np.ndarray) -> bytes:
    return _HEAD.pack(cache_len, *x.shape) + np.ascontiguousarray(x, np.float32).tobytes()


def _step(shard, slot: int, cache_len: int, x: np.ndarray) -> np.ndarray:
    n = len(x)
    positions = np.arange(cache_len, cache_len + n, dtype=np.int64)
    return shard.forward(slot, x, positions, np.ones(cache_len + n, np.int64))


def _member(model_path: str, first: int, last: int, rx, tx, threaded: bool, ready) -> None:
    """One stage's process: read a step from `rx`, compute, write it to `tx`, until a stop."""
    from backends.gguf import open_model

    shard = _stage(open_model(model_path), first, last)
    ready.put(first)
    slot = None

    def one(data: bytes) -> bytes | None:
        nonlocal slot
        cache_len, x = _unpack(data)
        if len(x) == 0:
            return None
        if cache_len == 0:  # a new prompt: a fresh slot
            if slot is not None:
                shard.close_slot(slot)
            slot = shard.open_slot()
        return _pack(cache_len, _step(shard, slot, cache_len, x))

    if not threaded:
        while (out := one(rx.recv_bytes())) is not None:
            tx.send_bytes(out)
        tx.send_bytes(_HEAD.pack(0, 0, 0))
        return

    async def loop() -> None:  # the ring member's shape: the loop reads, the worker computes
        ev = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(max_workers=1)
        got: asyncio.Queue = asyncio.Queue()
        ev.add_reader(rx.fileno(), lambda: got.put_nowait(rx.recv_bytes()))
        while True:
            data = await got.get()
            out = await ev.run_in_executor(pool, one, data)
            if out is None:
                tx.send_bytes(_HEAD.pack(0, 0, 0))
                return
            tx.send_bytes(out)

    asyncio.run(loop())


class PipeRing:
    """Stage 0 and the head here; stages 1.. in processes of their own, joined by pipes in a ring."""

    def __init__(self, model_path: str, threaded: bool) -> None:
        from backends.gguf import open_model

        index = open_model(model_path)
        splits = index.split_blocks(3)
        self.head = _stage(index, *splits[0], head=True)
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in splits]  # pipes[i]: into stage i (0: back to the head)
        ready = ctx.Queue()
        self.procs = []
        for i in (1, 2):
            rx, tx = pipes[i][0], pipes[(i + 1) % 3][1]
            p = ctx.Process(target=_member, args=(model_path, *splits[i], rx, tx, threaded, ready), daemon=True)
            p.start()
            self.procs.append(p)
        for _ in self.procs:
            ready.get(timeout=300)
        self.to_first, self.back = pipes[1][1], pipes[0][0]
        self._pool = ThreadPoolExecutor(max_workers=1) if threaded else None

    def close(self) -> None:
        self.to_first.send_bytes(_HEAD.pack(0, 0, 0))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()

    def generate(self, prompt: list[int], max_tokens: int) -> list[float]:
        """Greedy tokens' arrival times (perf_counter)."""
        slot = self.head.open_slot()
        times: list[float] = []
        try:
            ids = np.asarray(prompt, np.int64)
            cache_len = 0
            for _ in range(max_tokens):
                n = len(ids)
                positions = np.arange(cache_len, cache_len + n, dtype=np.int64)
                x = self._head_call(self.head.forward, slot, ids, positions, np.ones(cache_len + n, np.int64))
                self.to_first.send_bytes(_pack(cache_len, x))
                _, hidden = _unpack(self.back.recv_bytes())
                token = self._head_call(self.head.greedy, hidden)
                times.append(time.perf_counter())
                cache_len += n
                ids = np.asarray([token], np.int64)
        finally:
            self.head.close_slot(slot)
        return times

    def _head_call(self, fn, *args):
        if self._pool is None:
            return fn(*args)
        return self._pool.submit(fn, *args).result()  # a thread hand-off each way, as the head's


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def chain_times(chain, prompt: list[int], max_tokens: int) -> list[float]:
    return [time.perf_counter() for _ in chain.generate(prompt, max_tokens)]


def pause_costs(model_path: str, pauses_ms: list[float], n: int = 40) -> dict[str, dict[str, float]]:
    """ms per decode forward of stage 1's shard after each pause, sleeping and spinning."""
    from backends.gguf import open_model

    index = open_model(model_path)
    shard = _stage(index, *index.split_blocks(3)[1])
    x = np.full((1, index.hparams.hidden), 0.01, np.float32)
    out: dict[str, dict[str, float]] = {}
    for pause in pauses_ms:
        row = {}
        for how in ("sleep", "spin"):
            slot, times = shard.open_slot(), []
            for i in range(n + 5):
                if how == "sleep":
                    time.sleep(pause / 1000)
                else:
                    end = time.perf_counter() + pause / 1000
                    while time.perf_counter() < end:
                        pass
                t = time.perf_counter()
                _step(shard, slot, i, x)
                times.append((time.perf_counter() - t) * 1000)
            shard.close_slot(slot)
            row[how] = statistics.median(times[5:])
        out[f"{pause:g}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-session", action="store_true", help="skip the real sessions")
    ap.add_argument("--sessions", default="tcp,quic",
                    help="the sessions to run, by ring lane: tcp (--ring-lane auto), quic (--ring-lane quic)")
    ap.add_argument("--pauses", default="", help="ms, comma-separated: also time a forward after each pause")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    from bench.llamacpp_speed import machine
    from kafila.engine.chain import LocalChain
    from kafila.models.registry import resolve_model
    from kafila.models.tokenizer import load_tokenizer_file

    path = resolve_model(a.model)
    tok = load_tokenizer_file(path)
    prompt = tok.encode(PROMPT)
    chain = LocalChain.build(path, 3)
    rings = {"pipes": PipeRing(path, threaded=False), "pipes+thread": PipeRing(path, threaded=True)}
    sessions = {}
    try:
        for lane in ([] if a.no_session else [x for x in a.sessions.split(",") if x]):
            from kafila.tooling.launch import LocalSession

            if lane not in ("tcp", "quic"):
                raise SystemExit(f"--sessions: {lane!r} is not tcp or quic")
            sessions["session" if lane == "tcp" else "session (quic)"] = LocalSession(
                members=3, ring_lane="auto" if lane == "tcp" else "quic",
                log_dir=tempfile.mkdtemp(prefix="kafila-bench-logs-"),
                cache_root=tempfile.mkdtemp(prefix="kafila-bench-cache-")).start(timeout_s=600)  # fmt: skip
        rates: dict[str, list[float]] = {"chain": [], **{k: [] for k in rings}, **{k: [] for k in sessions}}
        for r in range(a.rounds + 1):  # the first round warms up
            got = {"chain": _rate(chain_times(chain, prompt, a.max_tokens))}
            for name, ring in rings.items():
                got[name] = _rate(ring.generate(prompt, a.max_tokens))
            for name, session in sessions.items():
                got[name] = _session_rate(session, a.max_tokens)
            if r:
                for k, v in got.items():
                    rates[k].append(v)
    finally:
        for ring in rings.values():
            ring.close()
        for session in sessions.values():
            session.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    step_ms = {k: 1000 / v for k, v in med.items()}
    out = {"machine": machine(), "model": a.model, "max_tokens": a.max_tokens, "rounds": a.rounds,
           "tok_s": med, "samples": rates, "step_ms": step_ms,
           "ratio_to_chain": {k: v / med["chain"] for k, v in med.items()}}  # fmt: skip
    if a.pauses:
        out["pause_ms"] = pause_costs(path, [float(p) for p in a.pauses.split(",")])
    if a.json:
        print(json.dumps(out))
        return 0
    print(out["machine"])
    prev = None
    for k in rates:
        extra = f"   +{step_ms[k] - step_ms[prev]:.2f} ms/step over {prev}" if prev else ""
        print(f"  {k:15s} {med[k]:6.1f} tok/s  {step_ms[k]:6.2f} ms/step  {med[k] / med['chain']:.2f}× chain{extra}")
        prev = k
    for pause, row in out.get("pause_ms", {}).items():
        print(f"  a forward of stage 1 after a {pause} ms pause: {row['sleep']:.2f} ms sleeping, {row['spin']:.2f} ms spinning")
    return 0


def _session_rate(session, max_tokens: int) -> float:
    from kafila.tooling.launch import stream_chat

    return stream_chat(session.api("m3"), PROMPT, max_tokens)["tok_s"]


if __name__ == "__main__":
    raise SystemExit(main())
