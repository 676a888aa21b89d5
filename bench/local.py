"""Local benchmark: Kafila's OpenVINO chains (1, 2, 3 stages in one process) against the
monolithic openvino_genai.LLMPipeline on the same GGUF.

Same chat prompt, greedy, NEW_TOKENS new tokens with EOS ignored, WARMUPS warm-ups each, then
REPEATS rounds in which every row runs once in turn (A B C D A B C D …), so load from elsewhere on
the machine falls on all rows alike. tok/s is decode throughput: the tokens after the first over
the time from the first token to the last (prefill excluded, for every row; for the peer 1/TPOT
from its own perf metrics). A row's ratio is the median over rounds of its tok/s over the peer's
tok/s in the same round. Precision: every row uses the CPU plugin's defaults (bf16 inference where
the CPU has it, u8 KV cache, dynamic quantization) — what LLMPipeline compiles with.

Memory (a separate process per chain): resident-set growth from building it and decoding
NEW_TOKENS, measured from a baseline taken with the CPU plugin already started, over the model's
GGUF tensor bytes plus its KV cache at that length. The peer's memory, against the 1-stage chain
from the same baseline in the same run, is bench/memory_local.py's.

Rows are (name, run) pairs, `run()` returning the token timestamps of one generation; other
modules add rows through `extra_rows(index, prompt_text, prompt_ids, new_tokens)` — bench/local_mlx.py
is imported for it when present.

Run: `.venv/bin/python -m bench.local` (or `kafila bench local`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

NEW_TOKENS = 128
WARMUPS = 2
REPEATS = 5
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PEER = "openvino_genai LLMPipeline (peer)"


@dataclass
class Row:
    name: str
    run: Callable[[], list[float]]  # one generation → per-token timestamps (seconds)
    tokens: Callable[[], list[int]] | None = None  # the generated ids, when the row can tell


def decode_tok_s(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def genai_row(path: str, prompt_text: str, new_tokens: int) -> Row:
    import openvino_genai as ov_genai

    pipe = ov_genai.LLMPipeline(path, "CPU")
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = new_tokens
    config.ignore_eos, config.do_sample, config.apply_chat_template = True, False, False

    def run() -> list[float]:
        metrics = pipe.generate([prompt_text], config).perf_metrics
        tpot_s = metrics.get_tpot().mean / 1e3
        return [i * tpot_s for i in range(metrics.get_num_generated_tokens())]  # evenly spaced: 1/TPOT

    return Row(PEER, run)


def chain_row(name: str, chain, prompt: list[int], new_tokens: int) -> Row:
    def generate() -> tuple[list[int], list[float]]:
        ids, stamps = [], []
        for token in chain.generate(prompt, new_tokens):  # no stop ids: EOS ignored
            stamps.append(time.perf_counter())
            ids.append(token)
        return ids, stamps

    return Row(name, lambda: generate()[1], lambda: generate()[0])


def rows(index, prompt_text: str, prompt: list[int], stages: tuple[int, ...], new_tokens: int,
         mlx: bool = True) -> list[Row]:
    from kafila.engine.chain import LocalChain

    out = [genai_row(index.path, prompt_text, new_tokens)]
    for k in stages:
        chain = LocalChain.build(index.path, k, "openvino", "serving", index=index)
        out.append(chain_row(f"kafila OpenVINO {k}-stage", chain, prompt, new_tokens))
    try:
        extra = importlib.import_module("bench.local_mlx") if mlx else None
    except ModuleNotFoundError:
        extra = None
    if extra is not None and hasattr(extra, "extra_rows"):
        out += [Row(*r) if not isinstance(r, Row) else r for r in extra.extra_rows(index, prompt_text, prompt, new_tokens)]
    return out


def measure(rows_: list[Row], warmups: int, repeats: int) -> dict[str, list[float]]:
    for row in rows_:
        for _ in range(warmups):
            row.run()
    samples: dict[str, list[float]] = {r.name: [] for r in rows_}
    for _ in range(repeats):
        for row in rows_:
            samples[row.name].append(decode_tok_s(row.run()))
    return samples


# --- memory (child processes) ------------------------------------------------------------------


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _plugin_up() -> None:
    """Start the CPU plugin (a trivial compile and inference) so the baseline includes it."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino.shard import core

    x = ops.parameter([1, 8], ov.Type.f32)
    core().compile_model(ov.Model([ops.relu(x)], [x]), "CPU").create_infer_request().infer({0: np.ones((1, 8), np.float32)})


def memory_child(model: str, stages: int, new_tokens: int) -> dict:
    """Run in a fresh process: RSS growth of building a `stages`-stage chain and decoding, over the
    model's GGUF tensor bytes + its KV cache at that length (u8 values). The peer is measured
    against the 1-stage chain, from one baseline in the same run, by bench.memory_local (the old
    peer child here read its RSS after the pipeline had been freed)."""
    from backends.gguf import open_model
    from kafila.engine.chain import LocalChain
    from kafila.models import load_tokenizer, resolve_model

    index = open_model(resolve_model(model))
    _plugin_up()
    tok = load_tokenizer(index)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": PROMPT}]))
    before = _rss()
    chain = LocalChain.build(index.path, stages, "openvino", "serving", index=index)
    list(chain.generate(prompt, new_tokens))
    grown = _rss() - before
    tokens = len(prompt) + new_tokens
    kv = index.hparams.n_blocks * tokens * index.kv_bytes_per_token_per_block(bytes_per_value=1)
    gguf = sum(t.n_bytes for t in index.tensors.values())
    return {"stages": stages, "rss_growth": grown, "gguf_bytes": gguf, "kv_bytes": kv, "ratio": grown / (gguf + kv)}


def memory(model: str, stages: tuple[int, ...], new_tokens: int) -> list[dict]:
    out = []
    for k in stages:  # (the peer against the 1-stage chain, same baseline, same run: bench.memory_local)
        proc = subprocess.run([sys.executable, "-m", "bench.local", "--memory-child", str(k), "--model", model,
                               "--tokens", str(new_tokens)], capture_output=True, text=True, check=True)
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


# --- report ------------------------------------------------------------------------------------


def table(samples: dict[str, list[float]], same: dict[str, str], mem: list[dict]) -> str:
    peer = samples.get(PEER, [])
    rounds = len(peer) or REPEATS
    lines = [f"| configuration | tok/s (median of {rounds}) | × peer (median of per-round ratios) | same tokens as 1-stage |",
             "|---|---:|---:|---|"]
    for name, s in samples.items():
        ratio = statistics.median(x / p for x, p in zip(s, peer))
        lines.append(f"| {name} | {statistics.median(s):.1f} | {ratio:.2f} | {same.get(name, 'n/a')} |")
    if mem:
        lines += ["", "| process | RSS growth (MB) | GGUF bytes (MB) | KV (MB) | RSS / (GGUF + KV) |", "|---|---:|---:|---:|---:|"]
        for m in mem:
            name = f"kafila OpenVINO {m['stages']}-stage"
            lines.append(f"| {name} | {m['rss_growth'] / 1e6:.1f} | {m['gguf_bytes'] / 1e6:.1f} | "
                         f"{m['kv_bytes'] / 1e6:.2f} | {m['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.local", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--stages", default="1,2,3", help="chain lengths, comma separated")
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--warmups", type=int, default=WARMUPS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory rows")
    parser.add_argument("--no-mlx", action="store_true",
                        help="skip the MLX rows (mlx-lm's peer reads Q4_0/Q4_1/Q8_0 GGUFs, not K-quants)")
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child is not None:
        print(json.dumps(memory_child(args.model, args.memory_child, args.tokens)))
        return 0

    from backends.gguf import open_model

    from kafila.models import load_tokenizer, resolve_model

    stages = tuple(int(s) for s in args.stages.split(","))
    index = open_model(resolve_model(args.model))
    tok = load_tokenizer(index)
    prompt_text = tok.render_chat([{"role": "user", "content": PROMPT}])
    prompt = tok.encode(prompt_text)
    rows_ = rows(index, prompt_text, prompt, stages, args.tokens, mlx=not args.no_mlx)
    same: dict[str, str] = {}
    first = next((r for r in rows_ if r.name.endswith("1-stage") and r.tokens), None)
    if first is not None:
        want = first.tokens()
        for r in rows_:
            if r.tokens is not None and r.name.startswith("kafila OpenVINO"):
                same[r.name] = "yes" if r.tokens() == want else "NO"
    samples = measure(rows_, args.warmups, args.repeats)
    from bench._report import header

    print(header())
    print(table(samples, same, []))
    print("samples (tok/s):", json.dumps({k: [round(x, 1) for x in v] for k, v in samples.items()}), flush=True)
    del rows_
    if not args.no_memory:
        print(table({}, {}, memory(args.model, stages, args.tokens)).split("\n\n", 1)[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
