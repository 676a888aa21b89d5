"""Mixture-of-experts decode: the experts the rows picked (Kafila) against every expert every step.

    .venv/bin/python -m bench.moe [--experts 32] [--used 2] [--hidden 256] [--expert-ffn 512]
                                  [--blocks 4] [--tokens 32] [--rounds 3]

A random F32 qwen3moe file of that shape (tests/arch_gguf.py; a 1024-row vocabulary) as one
OpenVINO stage at `serving`, built twice: as Kafila builds it (backends/openvino/moe.py: the
expert tensors Gathered by the step's top-k ids before they are decompressed) and with
moe.READ_ALL_EXPERTS (every expert Gathered and applied at every step, the rows that did not
pick it weighted 0: the same ids). Both decode `--tokens` greedy tokens after a 16-id prompt,
`--rounds` rounds in turn so load from elsewhere falls on both; the median ms per token, the
expert bytes each reads per token (k of E experts per block against all E) and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time

import numpy as np

from bench.llamacpp_speed import machine


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "?"


def _decode_ms(shard, prompt: list[int], tokens: int) -> float:
    slot = shard.open_slot()
    x = np.asarray(prompt, np.int64)
    total, times = 0, []
    for _ in range(tokens + 1):
        total += len(x)
        start = time.perf_counter()
        hidden = shard.forward(slot, x, np.arange(total - len(x), total), np.ones(total, np.int64))
        token = int(np.argmax(shard.logits(hidden[-1:])[0]))
        times.append(time.perf_counter() - start)
        x = np.asarray([token], np.int64)
    shard.close_slot(slot)
    return statistics.median(times[1:]) * 1000  # decode steps only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--used", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from backends import ShardSpec
    from backends.gguf import open_model
    from backends.openvino import moe
    from backends.openvino.shard import OpenVINOShard
    from tests.arch_gguf import write_arch_gguf

    print(machine(), f"commit {_commit()}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        path = write_arch_gguf(f"{root}/moe.gguf", "qwen3moe", blocks=args.blocks, hidden=args.hidden, heads=8,
                               kv_heads=2, tiny_vocab=1024,
                               experts=(args.experts, args.used, args.expert_ffn))  # fmt: skip
        index = open_model(path)
        spec = ShardSpec(path, 0, args.blocks, True, True)
        shards = {}
        for name, read_all in (("selected experts (Kafila)", False), ("every expert", True)):
            moe.READ_ALL_EXPERTS = read_all
            shards[name] = OpenVINOShard(spec, "serving", index=index)
        moe.READ_ALL_EXPERTS = False
        prompt = [int(i) for i in np.random.default_rng(0).integers(0, 1024, 16)]
        ms: dict[str, list[float]] = {n: [] for n in shards}
        for _ in range(args.rounds):
            for name, shard in shards.items():
                ms[name].append(_decode_ms(shard, prompt, args.tokens))
    expert_bytes = sum(t.n_bytes for n, t in index.tensors.items() if "_exps." in n)
    read = {"selected experts (Kafila)": expert_bytes * args.used / args.experts, "every expert": expert_bytes}
    base = statistics.median(ms["every expert"])
    print(f"\nqwen3moe F32, {args.blocks} blocks, hidden {args.hidden}, {args.experts} experts of FFN "
          f"{args.expert_ffn}, top {args.used}; {args.tokens} tokens × {args.rounds} rounds\n")
    print("| build | ms/token (median) | expert MB read/token | time vs every expert | bytes vs every expert |")
    print("|---|---|---|---|---|")
    for name in shards:
        t = statistics.median(ms[name])
        print(f"| {name} | {t:.2f} | {read[name] / 1e6:.1f} | {t / base:.2f}× | {read[name] / expert_bytes:.3f}× |")


if __name__ == "__main__":
    main()
