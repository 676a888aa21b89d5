"""Which inference precision serving should compile, on this CPU: speed and agreement side by side.

The CPU plugin's default inference precision follows the CPU (bf16 where the CPU has bf16 dot
products: AVX-512-BF16, AMX; f32 elsewhere). Serving fixes it instead (backends/openvino/shard.py,
SERVING_CONFIG), and this benchmark is the measurement behind that choice: for each precision the
plugin offers here, one 1-stage chain on the same file, rounds alternating between them,

- prefill tok/s (a PROMPT-token prompt fed as a chunk) and decode tok/s (TOKENS greedy steps);
- agreement: the first-token logits of a prompt fed whole against the same prompt's prefix taken
  from the KV cache and its last token fed alone (a question asked again through the prompt
  cache; max |Δ| over the vocabulary), and whether 1 and 3 stages give the same greedy ids.

    python -m bench.serving_precision --model GGUF [--prompt 512] [--tokens 24] [--rounds 2]

Prints the machine (CPU model, ISA), the commit and one markdown table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

PRECISIONS = {"f32": "f32", "bf16": "bf16"}


def offered() -> list[str]:
    """The inference precisions the CPU plugin can run here (bf16 only where the CPU has it)."""
    from backends.openvino.shard import core

    caps = core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return ["f32"] + (["bf16"] if "BF16" in caps else [])


def chain_at(path: str, precision: str, stages: int):
    from backends.openvino import shard as shard_mod
    from kafila.engine.chain import LocalChain

    saved = shard_mod.CONFIGS["serving"]
    shard_mod.CONFIGS["serving"] = {**saved, "INFERENCE_PRECISION_HINT": precision}
    try:
        return LocalChain.build(path, stages, "openvino", "serving")
    finally:
        shard_mod.CONFIGS["serving"] = saved


def speed(chain, prompt: list[int], tokens: int) -> tuple[float, float]:
    cursor = chain.open()
    try:
        t0 = time.perf_counter()
        hidden = chain.prefill(cursor, prompt)
        prefill_s = time.perf_counter() - t0
        token = chain.next_token(hidden[-1:])
        t0 = time.perf_counter()
        for _ in range(tokens):
            token = chain.next_token(chain.feed(cursor, [token])[-1:])
        decode_s = time.perf_counter() - t0
    finally:
        chain.close(cursor)
    return len(prompt) / prefill_s, tokens / decode_s


def asked_again_gap(chain, prompt: list[int]) -> float:
    """Max |Δ| of the first-token logits: the prompt fed whole, against its prefix from the cache."""
    first, again = chain.open(), chain.open()
    try:
        want = chain.logits(chain.prefill(first, prompt)[-1:])[0]
        chain.prefill(again, prompt[:-1])
        got = chain.logits(chain.feed(again, prompt[-1:])[-1:])[0]
    finally:
        chain.close(first)
        chain.close(again)
    return float(np.abs(got - want).max())


def greedy(chain, prompt: list[int], tokens: int) -> list[int]:
    return list(chain.generate(prompt, tokens))


def main(argv: list[str] | None = None) -> int:
    from bench._report import header, markdown

    ap = argparse.ArgumentParser(prog="python -m bench.serving_precision", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True,
                    help="a GGUF path, an alias, or a PyPI byte-slice model (kafila/tooling/pypi_gguf.py)")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt length in tokens (default 512)")
    ap.add_argument("--tokens", type=int, default=24, help="decode steps timed (default 24)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per precision, alternating (default 2)")
    a = ap.parse_args(argv)
    from kafila.models import resolve_model
    from kafila.tooling import pypi_gguf

    path = str(pypi_gguf.fetch(a.model)) if a.model in pypi_gguf.MODELS else resolve_model(a.model)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(200, 5000, a.prompt)]
    question = prompt[:40]
    precisions = offered()
    chains = {p: chain_at(path, p, 1) for p in precisions}
    best = {p: [0.0, 0.0] for p in precisions}
    for _ in range(a.rounds):
        for p in precisions:
            pre, dec = speed(chains[p], prompt, a.tokens)
            best[p] = [max(best[p][0], pre), max(best[p][1], dec)]
    rows = []
    for p in precisions:
        gap = asked_again_gap(chains[p], question)
        one = greedy(chains[p], question, 32)
        three = greedy(chain_at(path, p, 3), question, 32)
        rows.append((p, *best[p], gap, one == three))
    print(header())
    print(f"model {Path(path).name}; prompt {a.prompt} tokens, {a.tokens} decode steps, best of {a.rounds} rounds\n")
    base = best["f32"]
    print(markdown(["inference precision", "prefill tok/s", "decode tok/s", "prefill vs f32", "decode vs f32",
                    "asked-again max abs logit diff", "1 = 3 stages (32 greedy ids)"],
                   [(p, f"{pre:.1f}", f"{dec:.2f}", f"{pre / base[0]:.2f}x", f"{dec / base[1]:.2f}x", f"{gap:.4f}",
                     "yes" if same else "no") for p, pre, dec, gap, same in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
