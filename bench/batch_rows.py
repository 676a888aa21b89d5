"""Batched decode rows on one OpenVINO shard: B slots' decode steps as one `forward_batch` against
the same B steps as B single-slot `forward`s, side by side in one run.

The model is tests/big_gguf's "llama-3.2-1b" (Llama 3.2 1B's exact shapes in Q4_K_M's layout, random
weights, ~0.8 GB; written once into the test cache), the shard its blocks `--blocks` (default all
16, with the token embedding, without the 128k-row lm_head). Every row is a separate slot
prefilled with its own prompt of a different length (`--context` + 8·i tokens), so the batch has
rows of different cache lengths; the sequential side has its own B slots with the same prompts.

For each B in `--rows` (default 1, 2, 4, 8): WARMUPS steps each, then REPEATS rounds in which the
sequential side and the batched side each run STEPS decode steps in turn (S B S B …, so load from
elsewhere falls on both alike); a step is B new tokens, one per row. Reported: the median over
rounds of the mean time per step, for B sequential forwards and for one batched forward, their
ratio (sequential ÷ batched: the speed-up of aggregate decode at that stage), the batched time
per row, and the first batched step, which also builds the row group (the join: the B rows' KV
copied into one state, paid once per change of membership, not by the steady-state steps).
B = 1 is the single-slot path on both sides (forward_batch of one slot in no group is `forward`),
so its ratio shows the run's noise.

Precision `--precision` (default serving: the CPU plugin's defaults, bf16 where the CPU has it,
u8 KV, dynamic quantization; or f32). Memory: the 1B shard with 16 slots of a few hundred
positions stays under 2 GiB.

Run: `.venv/bin/python -m bench.batch_rows [--blocks 0:16] [--rows 1,2,4,8] [--context 128]`;
`--model smollm2-135m` (or any GGUF) for another model than the 1B shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

WARMUPS = 2
STEPS = 4
REPEATS = 5


class Rows:
    """B slots of one shard, each at its own position; `step` feeds every row one token."""

    def __init__(self, shard, prompts: list[np.ndarray], hidden: int, rng) -> None:
        self.shard, self.hidden, self.rng = shard, hidden, rng
        self.slots = [shard.open_slot() for _ in prompts]
        self.lengths = []
        for slot, p in zip(self.slots, prompts):
            shard.forward(slot, self._x(p), np.arange(len(p)), np.ones(len(p), np.int64))
            self.lengths.append(len(p))

    def _x(self, ids: np.ndarray) -> np.ndarray:
        if self.shard.spec.embed:
            return ids
        return self.rng.standard_normal((len(ids), self.hidden)).astype(np.float32)

    def _inputs(self):
        xs = [self._x(self.rng.integers(0, 1000, 1)) for _ in self.slots]
        pos = [np.array([n]) for n in self.lengths]
        masks = [np.ones(n + 1, np.int64) for n in self.lengths]
        return xs, pos, masks

    def step_sequential(self) -> None:
        for slot, x, p, m in zip(self.slots, *self._inputs()):
            self.shard.forward(slot, x, p, m)
        self.lengths = [n + 1 for n in self.lengths]

    def step_batched(self) -> list:
        """One decode step of every row in one forward; each row's hidden [1, H]."""
        hiddens = self.shard.forward_batch(self.slots, *self._inputs())
        self.lengths = [n + 1 for n in self.lengths]
        return hiddens

    def close(self) -> None:
        for slot in self.slots:
            self.shard.close_slot(slot)


def per_step(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def measure(shard, b: int, context: int, hidden: int, steps: int, repeats: int, warmups: int) -> dict:
    rng = np.random.default_rng(b)
    prompts = [rng.integers(0, 1000, context + 8 * i) for i in range(b)]
    seq, bat = Rows(shard, prompts, hidden, rng), Rows(shard, prompts, hidden, rng)
    try:
        first_start = time.perf_counter()
        bat.step_batched()  # builds the group: the join copy plus one step
        first_s = time.perf_counter() - first_start
        for _ in range(warmups):
            seq.step_sequential()
            bat.step_batched()
        s_times, b_times = [], []
        for _ in range(repeats):
            s_times.append(per_step(seq.step_sequential, steps))
            b_times.append(per_step(bat.step_batched, steps))
        s_ms, b_ms = 1e3 * statistics.median(s_times), 1e3 * statistics.median(b_times)
        return {"rows": b, "sequential_ms": s_ms, "batched_ms": b_ms, "ratio": s_ms / b_ms,
                "batched_ms_per_row": b_ms / b, "first_batched_ms": 1e3 * first_s,
                "cache_lengths": [len(p) for p in prompts]}  # fmt: skip
    finally:
        seq.close()
        bat.close()


def table(rows: list[dict]) -> str:
    lines = ["| rows B | B sequential forwards ms/step | one forward_batch ms/step | ratio | batched ms/row "
             "| first batched step ms (join + step) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['rows']} | {r['sequential_ms']:.1f} | {r['batched_ms']:.1f} | {r['ratio']:.2f}× "
                     f"| {r['batched_ms_per_row']:.1f} | {r['first_batched_ms']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b", help="a tests/big_gguf shape")
    ap.add_argument("--model", help="a GGUF path or alias instead of --shape (e.g. smollm2-135m)")
    ap.add_argument("--blocks", default="", help="FIRST:LAST (default: every block)")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--head", action="store_true",
                    help="with the lm_head and its greedy pick, as `kafila run` builds one stage (needs the last block)")
    ap.add_argument("--context", type=int, default=128, help="row i's prompt is CONTEXT + 8·i tokens")
    ap.add_argument("--precision", default="serving", choices=("serving", "f32"))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from backends import ShardSpec
    from backends.gguf import open_model
    from backends.openvino import OpenVINOShard
    from bench.llamacpp_speed import machine
    from kafila.models.registry import resolve_model
    from tests.big_gguf import big_model

    index = open_model(resolve_model(args.model) if args.model else big_model(args.shape))
    name = args.model or args.shape
    hp = index.hparams
    first, last = (int(v) for v in args.blocks.split(":")) if args.blocks else (0, hp.n_blocks)
    if args.head and last != hp.n_blocks:
        ap.error("--head needs the shard to end at the last block")
    spec = ShardSpec(index.path, first, last, embed=first == 0, head=args.head)
    built = time.perf_counter()
    shard = OpenVINOShard(spec, args.precision, index=index)
    print(machine(), flush=True)
    print(f"model {name} ({index.path}), shard blocks [{first}, {last}) of {hp.n_blocks}"
          f"{' + embedding' if spec.embed else ''}{' + lm_head' if spec.head else ''}, precision {args.precision}, "
          f"built in {time.perf_counter() - built:.1f} s", flush=True)  # fmt: skip
    rows = []
    for b in (int(v) for v in args.rows.split(",")):
        rows.append(measure(shard, b, args.context, hp.hidden, args.steps, args.repeats, WARMUPS))
        print(f"  B={b}: {rows[-1]['sequential_ms']:.1f} ms sequential, {rows[-1]['batched_ms']:.1f} ms batched",
              flush=True)  # fmt: skip
    print(table(rows))
    print(f"(cache lengths {args.context} + 8·i per row; {args.steps} steps × {args.repeats} rounds, medians)")
    if args.json:
        print(json.dumps({"machine": machine(), "shape": name, "blocks": [first, last],
                          "precision": args.precision, "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
