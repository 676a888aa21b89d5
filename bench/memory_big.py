"""Memory of big-model shards against the plan, measured side by side in one run.

    .venv/bin/python -m bench.memory_big [--shapes llama-3.2-1b,llama-3-8b] [--members 3]
        [--context 2048] [--concurrency 4] [--max-tokens 16] [--prompt-tokens N] [--backend openvino]
        [--kquant exact|fast|ggml|auto] [--json]

For each shape (a synthetic Q4_K_M GGUF from tests/big_gguf.py with the real model's shapes):
1. 1-stage: `kafila run --model M --max-tokens N` as a child process, sampled every 0.2 s from
   /proc: RSS and PSS while it generates (the last sample before it tears down to exit) and
   its peak RSS (VmHWM: the shard build's transient included).
2. An N-member `kafila demo`-style session (kafila.tooling.launch.LocalSession, the same
   processes `kafila demo` starts): after one answer, each member's /status "memory" (RSS, peak
   RSS, PSS of the process, its shard's tensor bytes, its KV at the planned context×concurrency,
   and the planner's bytes for it).
Ratios printed: RSS, PSS and peak against shard + KV (target ≤ 1.25×) and against the planner's
prediction (target within 10%: 0.90–1.10×): "planned" is planner.member_bytes at the planned
context × concurrency (what admission checks), "predicted now" the same formula at the KV the
process holds when measured (its KV is allocated as it fills). 1-stage uses `kafila run`'s
per-process term (backends.memory.RUN_PROCESS_BYTES and the prefill working set), members the session's. The model files and the members' weight caches live
under tests/big_gguf's cache directory and are reused across runs.
`--prompt-tokens N`: the prompt is a text of about N tokens (the chat form included) instead of one
short line, so the figures are those after a long prompt's chunked prefill (what the plugin keeps
of a chunk's working set shows in RSS) and the peak includes the chunks' working set.
`--kquant`: every OpenVINO stage's weight form (`kafila host --kquant`); the plan is priced for the
form the stage builds (backends.memory.memory_kind: the ggml form holds the file's own blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from backends import DEFAULT_KQUANT, KQUANTS

PROMPT = "Write a short story about a lighthouse keeper."


def _proc_memory(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        with open(f"/proc/{pid}/smaps_rollup") as f:
            rollup = f.read()
    except OSError:
        return None
    from kafila.session.ring.memory import _status_kib

    return {"rss_bytes": _status_kib(status, "VmRSS"), "peak_rss_bytes": _status_kib(status, "VmHWM"),
            "pss_bytes": _status_kib(rollup, "Pss"), "pss_anon_bytes": _status_kib(rollup, "Pss_Anon"),
            "pss_file_bytes": _status_kib(rollup, "Pss_File")}  # fmt: skip


def long_prompt(model: str, tokens: int) -> str:
    """A text whose chat form is at most `tokens` tokens long, as close to it as whole sentences allow."""
    from backends.gguf import open_model
    from kafila.models import load_tokenizer

    tok = load_tokenizer(open_model(model))
    sentence = "The keeper of lighthouse {} wrote down every ship that passed in the night. "

    def text(k: int) -> str:
        return "".join(sentence.format(i) for i in range(k)) + "Which lighthouse saw the most ships?"

    lo, hi = 0, tokens
    while lo < hi:  # the most sentences whose chat form fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _chat_tokens(tok, text(mid)) <= tokens else (lo, mid - 1)
    return text(lo)


def _chat_tokens(tok, text: str) -> int:
    return len(tok.encode(tok.render_chat([{"role": "user", "content": text}])))


def one_stage(model: str, backend: str, context: int, concurrency: int, max_tokens: int,
              prompt: str = PROMPT, kquant: str = DEFAULT_KQUANT) -> dict:  # fmt: skip
    """`kafila run` on the whole model, its memory sampled from outside."""
    from backends.gguf import open_model
    from kafila.session.ring.memory import shard_memory

    index = open_model(model)
    cmd = [sys.executable, "-m", "kafila", "run", "--model", model, "--backend", backend,
           "--kquant", kquant, "--max-tokens", str(max_tokens), "--json", prompt]  # fmt: skip
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = []
    while p.poll() is None:
        sample = _proc_memory(p.pid)
        if sample and sample["rss_bytes"]:
            samples.append(sample)
        time.sleep(0.2)
    out, err = p.communicate()
    if p.returncode != 0 or not samples:
        raise RuntimeError(f"kafila run failed ({p.returncode}): {err[-1000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    # serving: what the process read of itself right after its last token (`kafila run --json`
    # "memory"); sampling from outside caught an 8B process part way through its teardown. The
    # peak is the kernel's VmHWM (the build's transient included), the anon/file split sampled.
    top = max(s["rss_bytes"] for s in samples)
    last = [s for s in samples if s["rss_bytes"] >= top / 2][-1]
    own = result.get("memory") or {}
    serving = {**last, **{k: own[k] for k in ("rss_bytes", "pss_bytes") if own.get(k)}}
    from backends.memory import PREFILL_WORK_BYTES, RUN_PROCESS_BYTES

    kind = _kind(backend, kquant)
    planned = shard_memory(index, 0, index.hparams.n_blocks, True, context, concurrency, kind,
                           RUN_PROCESS_BYTES[kind] + PREFILL_WORK_BYTES)  # fmt: skip
    mem = {**serving, "peak_rss_bytes": samples[-1]["peak_rss_bytes"], **planned,
           "kv_used_tokens": len(result["prompt_ids"]) + result["tokens"]}  # fmt: skip
    return {"name": "1-stage", "blocks": index.hparams.n_blocks, "head": True, **mem,
            "tok_s": result.get("tok_s"), "seconds": round(time.monotonic() - start, 1)}  # fmt: skip


def _kind(backend: str, kquant: str) -> str:
    """The memory tables' key for the form an OpenVINO stage builds from `--kquant` at serving precision."""
    from backends.memory import memory_kind

    if backend != "openvino":
        return backend
    from backends.openvino import ggml_kernels

    return memory_kind(backend, ggml_kernels.resolve(kquant, "serving"))


def session(model: str, backend: str, members: int, context: int, concurrency: int, max_tokens: int,
            cache_root: str, prompt: str = PROMPT, kquant: str = DEFAULT_KQUANT) -> list[dict]:  # fmt: skip
    from kafila.tooling.launch import LocalSession, get_json, stream_chat

    s = LocalSession(members=members, model=model, backend=backend, context=context,
                     concurrency=concurrency, cache_root=cache_root, kquant=kquant)  # fmt: skip
    start = time.monotonic()
    s.start(timeout_s=1800)
    try:
        formed = time.monotonic() - start
        answer = stream_chat(s.api(s.names[-1]), prompt, max_tokens, timeout_s=1800)
        used = _prompt_tokens(model, prompt) + (answer.get("tokens") or max_tokens)
        plan = s.plan or get_json(s.api(s.names[0]), "/status")["plan"]
        rows = []
        for name in plan["ring"]:
            mem = get_json(s.api(name), "/status")["memory"]
            rows.append({"name": name, "blocks": plan["blocks"][name], "head": name == plan["head"], **mem,
                         "kv_used_tokens": used,
                         "tok_s": answer["tok_s"], "seconds": round(formed, 1)})  # fmt: skip
        return rows
    finally:
        s.stop()


def _prompt_tokens(model: str, prompt: str) -> int:
    from backends.gguf import open_model
    from kafila.models import load_tokenizer

    return _chat_tokens(load_tokenizer(open_model(model)), prompt)


def predicted_now(row: dict, context: int, concurrency: int) -> int:
    """The planner's memory model (planner.member_bytes) at the KV the process holds when
    measured (the positions of one answer), not at the planned context × concurrency: the KV is
    allocated as it fills, so this is the figure RSS must match within 10%."""
    return int(row["planned_weights_bytes"] + row["kv_bytes"] * row["kv_used_tokens"] / (context * concurrency))


def ratios(row: dict) -> dict:
    base = row["shard_bytes"] + row["kv_bytes"]
    out = {}
    for key in ("rss", "pss", "peak_rss"):
        v = row.get(f"{key}_bytes")
        out[f"{key}/shard+kv"] = None if v is None else round(v / base, 3)
        out[f"{key}/planned"] = None if v is None else round(v / row["planned_bytes"], 3)
        out[f"{key}/predicted_now"] = None if v is None else round(v / row["predicted_now_bytes"], 3)
    return out


def table(shape: str, rows: list[dict]) -> str:
    def mb(v):
        return "?" if v is None else f"{v / 1e6:.0f}"

    def x(v):
        return "?" if v is None else f"{v:.2f}×"

    lines = [f"### {shape}", "",
             "| process | blocks | shard MB | KV MB | planned MB | predicted now MB | RSS MB | PSS MB | peak MB "
             "| RSS/(shard+KV) | PSS/(shard+KV) | peak/(shard+KV) | RSS/predicted now | peak/predicted now "
             "| peak/planned |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        q = ratios(r)
        lines.append(f"| {r['name']}{' (head)' if r['head'] else ''} | {r['blocks']} | {mb(r['shard_bytes'])} "
                     f"| {mb(r['kv_bytes'])} | {mb(r['planned_bytes'])} | {mb(r['predicted_now_bytes'])} "
                     f"| {mb(r['rss_bytes'])} | {mb(r['pss_bytes'])} | {mb(r['peak_rss_bytes'])} "
                     f"| {x(q['rss/shard+kv'])} | {x(q['pss/shard+kv'])} | {x(q['peak_rss/shard+kv'])} "
                     f"| {x(q['rss/predicted_now'])} | {x(q['peak_rss/predicted_now'])} "
                     f"| {x(q['peak_rss/planned'])} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-1b", help="comma-separated tests/big_gguf shapes")
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of about N tokens (0: one short line)")
    ap.add_argument("--backend", default="openvino")
    ap.add_argument("--kquant", default=DEFAULT_KQUANT, choices=KQUANTS, help="every OpenVINO stage's weight form")
    ap.add_argument("--skip-session", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from bench._report import header

    print(header(), flush=True)
    if not 0 <= args.prompt_tokens < args.context - args.max_tokens:
        ap.error("--prompt-tokens must leave room for --max-tokens inside --context")
    from tests.big_gguf import big_model, cache_dir

    report = {}
    for shape in args.shapes.split(","):
        model = big_model(shape)
        now = lambda r: {**r, "predicted_now_bytes": predicted_now(r, args.context, args.concurrency)}  # noqa: E731
        prompt = long_prompt(model, args.prompt_tokens) if args.prompt_tokens else PROMPT
        rows = [now(one_stage(model, args.backend, args.context, args.concurrency, args.max_tokens,
                              prompt, args.kquant))]  # fmt: skip
        print(table(shape, rows), file=sys.stderr, flush=True)
        if not args.skip_session:
            cache = os.path.join(cache_dir(), "member-caches", shape)
            rows += [now(r) for r in session(model, args.backend, args.members, args.context, args.concurrency,
                                             args.max_tokens, cache, prompt, args.kquant)]  # fmt: skip
        report[shape] = [{**r, **ratios(r)} for r in rows]
        print(table(shape, rows), flush=True)
        print(f"(context {args.context} × concurrency {args.concurrency}, a prompt of "
              f"{_prompt_tokens(model, prompt)} tokens; targets: ≤ 1.25× shard+KV, "
              f"0.90–1.10× planned; {args.backend}, --kquant {args.kquant})", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
