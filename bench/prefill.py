"""A prompt's prefill on one OpenVINO shard: the attention mask as the graph builds it (additive f32)
against a boolean mask of the same positions, side by side in one run.

    .venv/bin/python -m bench.prefill [--model smollm2-135m | --shape llama-3.2-1b] [--lengths 64,512,2048]
                                      [--rounds 3] [--precision serving|f32] [--json]

The shard holds the whole model (embedding, every block, the head folded in: `kafila run
--stages 1`'s shard). Two shards are built in one process, one per mask form: "float" is
backends/openvino/graph.causal_mask as it is (0 where a position is seen, the lowest f32
elsewhere, added to the scores); "bool" turns that mask back into the boolean form the graph used
before (seen = mask == 0), everything else equal. For each prompt length L, each round feeds a
fresh slot L positions in chunks of kafila.session.ring.chunks.prefill_chunk_tokens(hidden) (what
the ring's head feeds a step) and times it; the forms alternate within a round (float, bool, then
bool, float: load from elsewhere falls on both alike). Reported per L: the median prefill ms of
each form, bool ÷ float, and the float form's prefill tok/s. The greedy token after the prompt is
compared between the forms (the same, or how many differ, at serving precision a near-tie can flip).
Chunks after the first are a quarter of the first (chunks.later_chunk_tokens, as the head
feeds them); `--equal-chunks` adds a side fed in chunks of the full size throughout (the rule
before), to compare the time. `--chunk N` sets the first chunk's size (the later ones a quarter of
it). `--whole` adds a side, the float form fed each prompt in one forward (no chunks): a chunk
after the first attends to the slot's past KV, which the plugin's attention runs far slower than
a fresh prompt's (docs/BENCHMARKS.md).
`--shape` takes tests/big_gguf's synthetic shapes (llama-3.2-1b, llama-3-8b; built once into the
test cache); `--model` any model name or GGUF path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from bench.llamacpp_speed import machine


def build(path: str, form: str, precision: str):
    """The whole model as one OpenVINO shard with the mask `form` ("float" as built, or "bool")."""
    import openvino.opset13 as ops

    from backends.base import ShardSpec
    from backends.gguf import open_model
    from backends.openvino import graph
    from backends.openvino.shard import OpenVINOShard

    index = open_model(path)
    made = graph.causal_mask
    if form == "bool":
        graph.causal_mask = lambda am, n: ops.equal(made(am, n), ops.constant(np.float32(0.0))).output(0)
    try:
        return OpenVINOShard(ShardSpec(path, 0, index.hparams.n_blocks, True, True), precision, index=index)
    finally:
        graph.causal_mask = made


def prefill(shard, ids: np.ndarray, chunk: int, later: int | None = None) -> tuple[float, int]:
    """(ms to feed `ids` into a fresh slot, `chunk` positions the first forward and `later` (default
    `chunk`) each one after, the greedy token after)."""
    slot = shard.open_slot()
    try:
        start = time.perf_counter()
        at = 0
        while at < len(ids):
            part = ids[at:at + (chunk if at == 0 else later or chunk)]
            hidden = shard.forward(slot, part, np.arange(at, at + len(part)), np.ones(at + len(part), np.int64))
            at += len(part)
        ms = (time.perf_counter() - start) * 1000
        return ms, shard.greedy(hidden)
    finally:
        shard.close_slot(slot)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model name or GGUF path (default: smollm2-135m unless --shape)")
    p.add_argument("--shape", help="a synthetic shape of tests/big_gguf (llama-3.2-1b, llama-3-8b)")
    p.add_argument("--lengths", default="64,512,2048", help="prompt lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", choices=("serving", "f32"), default="serving")
    p.add_argument("--whole", action="store_true", help="also the float form with each prompt in one forward")
    p.add_argument("--equal-chunks", action="store_true", help="also the float form in equal full chunks")
    p.add_argument("--chunk", type=int, help="the first chunk's positions (default: prefill_chunk_tokens)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        print("bench.prefill: --lengths takes comma-separated whole numbers", file=sys.stderr)
        return 2
    if not all(1 <= n <= 32768 for n in lengths) or not 1 <= args.rounds <= 20 or not 1 <= (args.chunk or 1) <= 32768:
        print("bench.prefill: lengths and --chunk 1..32768, --rounds 1..20", file=sys.stderr)
        return 2
    from kafila.models.registry import resolve_model
    from kafila.session.ring.chunks import later_chunk_tokens, prefill_chunk_tokens

    if args.shape:
        from tests.big_gguf import big_model

        path = big_model(args.shape)
    else:
        path = resolve_model(args.model or "smollm2-135m")
    shards = {form: build(path, form, args.precision) for form in ("float", "bool")}
    hp = shards["float"].index.hparams
    vocab, chunk = hp.vocab, args.chunk or prefill_chunk_tokens(hp.hidden)
    later = later_chunk_tokens(chunk)
    print(machine(), flush=True)
    print(f"{path}: {hp.n_blocks} blocks, hidden {hp.hidden}, one shard of the whole model at {args.precision} "
          f"precision, chunks of {chunk} then {later} positions, median of {args.rounds} rounds (forms alternated)", flush=True)
    rng = np.random.default_rng(0)
    for shard in shards.values():  # the first inferences of each shape prepare kernels
        prefill(shard, rng.integers(0, vocab, 16), chunk)
    out = {}
    sides = ["float", "bool"] + (["whole"] if args.whole else []) + (["equal"] if args.equal_chunks else [])
    print(f"{'positions':>9} | {'bool ms':>9} | {'float ms':>9} | bool ÷ float | float tok/s | same token"
          + (" | float in one forward ms | chunked ÷ one" if args.whole else "")
          + (f" | equal chunks of {chunk} ms | equal ÷ float" if args.equal_chunks else ""))  # fmt: skip
    for n in lengths:
        ids = rng.integers(0, vocab, n)
        ms: dict[str, list[float]] = {side: [] for side in sides}
        tokens: dict[str, list[int]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                first = n if side == "whole" else chunk
                t, token = prefill(shards["bool" if side == "bool" else "float"], ids, first,
                                   chunk if side == "equal" else later)  # fmt: skip
                ms[side].append(t)
                tokens[side].append(token)
        f, b = statistics.median(ms["float"]), statistics.median(ms["bool"])
        same = sum(x == y for x, y in zip(tokens["float"], tokens["bool"]))
        out[str(n)] = {"float_ms": f, "bool_ms": b, "ratio": b / f, "float_tok_s": n / f * 1000,
                       "same_token": same, "rounds": args.rounds, "samples": ms}  # fmt: skip
        line = f"{n:>9} | {b:>9.1f} | {f:>9.1f} | {b / f:>10.2f}× | {n / f * 1000:>11.0f} | {same}/{args.rounds}"
        if args.whole:
            w = out[str(n)]["whole_ms"] = statistics.median(ms["whole"])
            line += f" | {w:>23.1f} | {f / w:>12.2f}×"
        if args.equal_chunks:
            e = out[str(n)]["equal_ms"] = statistics.median(ms["equal"])
            line += f" | {e:>10.1f} | {e / f:>12.2f}×"
        print(line, flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
