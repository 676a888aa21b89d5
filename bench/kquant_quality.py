"""What `--kquant fast` changes: next-token distributions of the fast weight form against the exact
one on a real Q4_K_M file, beside llama.cpp's own distance from the exact values (issue 36).

    .venv/bin/python -m bench.kquant_quality [--file qwen1.5b|PATH] [--tokens 32] [--prompts 6]
        [--threads 2] [--free-running]

The reference is Kafila's exact form at `--precision f32` (the file's weights to f32 rounding,
f32 compute: what the suite checks gives llama.cpp's greedy ids). For each of PROMPTS
(chat-templated) it decodes `--tokens` greedy tokens with the reference, then feeds prompt +
continuation once to every row (teacher forcing: every row sees the same tokens) and compares
the next-token distribution at each continuation position with the reference's:
- KL(ref ‖ row) in nats, mean and max over positions (softmax of f64 logits);
- top-1 agreement: the share of positions whose argmax equals the reference's;
- with `--free-running`, greedy: positions of each row's own greedy continuation that equal the
  reference's before the first difference, summed over prompts (a decode per row and prompt).
Rows: Kafila fast at f32 (the weight form's cost alone), Kafila exact, fast and ggml (ggml's own
kernels: llama.cpp's arithmetic, the serving default where it builds) at serving precision, and
llama.cpp (llama-cpp-python, f32 KV cache): its Q8_K activation rounding is its own distance from
the exact values; the ggml row should sit beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import numpy as np

from bench.kquant_speed import commit, gguf_path
from bench.llamacpp_speed import machine

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
    "Translate to French: the lighthouse keeper found a message in a bottle.",
    "What is 17 times 23? Answer with the number only.",
    "List three uses of the Rust borrow checker.",
    "Write a SQL query that counts orders per customer.",
)
ROWS = ("kafila fast f32", "kafila exact serving", "kafila fast serving", "kafila ggml serving", "llama.cpp")


def kafila_chain(path: str, precision: str, kquant: str, threads: int):
    from backends.base import ShardSpec
    from backends.gguf import open_model
    from backends.openvino.shard import CONFIGS, OpenVINOShard
    from kafila.engine.chain import LocalChain

    index = open_model(path)
    config = {**CONFIGS[precision], "INFERENCE_NUM_THREADS": str(threads)}
    spec = ShardSpec(index.path, 0, index.hparams.n_blocks, embed=True, head=True)
    return LocalChain([OpenVINOShard(spec, precision, index=index, config=config, kquant=kquant)])


def kafila_logits(chain, ids: list[int], start: int) -> np.ndarray:
    """Logits [len(ids) − start, V] predicting ids[start + 1 …] (and one past the end)."""
    cursor = chain.open()
    try:
        hidden = chain.feed(cursor, ids)
        return chain.head.logits(hidden[start:]).astype(np.float64)
    finally:
        chain.close(cursor)


def llamacpp(path: str, threads: int, n_ctx: int):
    """llama.cpp with every position's logits, an f32 KV cache and plain CPU buffers (as the
    suite's reference, tests/llamacpp_ref.py: a checkout's bench)."""
    import llama_cpp

    from tests.llamacpp_ref import _plain_cpu_buffers

    kw = dict(model_path=path, n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads, n_threads_batch=threads,
              logits_all=True, verbose=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)  # fmt: skip
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null), _plain_cpu_buffers():
        return llama_cpp.Llama(**kw)


def llamacpp_greedy(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    ids = []
    for _ in range(n):
        ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        if len(ids) < n:
            llm.eval([ids[-1]])
    return ids


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p ‖ q) per row, nats."""
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.kquant_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="qwen1.5b", help="qwen1.5b | a GGUF path")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"the first N of the {len(PROMPTS)} prompts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--free-running", action="store_true", help="also each row's own greedy continuation")
    args = ap.parse_args(argv)
    if not 1 <= args.tokens <= 512 or not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--tokens 1..512, --prompts 1..{len(PROMPTS)}")

    from kafila.cli import import_openvino_without_telemetry

    import_openvino_without_telemetry()
    from backends.gguf import open_model
    from kafila.models import load_tokenizer

    path = gguf_path(args.file)
    print(machine())
    print(f"commit: {commit()}; file {os.path.basename(path)}; {args.prompts} prompts × {args.tokens} "
          f"greedy tokens; reference: kafila exact at --precision f32")  # fmt: skip
    tok = load_tokenizer(open_model(path))
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": p}])) for p in PROMPTS[: args.prompts]]
    ref = kafila_chain(path, "f32", "exact", args.threads)
    chains = {"kafila fast f32": kafila_chain(path, "f32", "fast", args.threads),
              "kafila exact serving": kafila_chain(path, "serving", "exact", args.threads),
              "kafila fast serving": kafila_chain(path, "serving", "fast", args.threads),
              "kafila ggml serving": kafila_chain(path, "serving", "ggml", args.threads)}  # fmt: skip
    llm = llamacpp(path, args.threads, max(len(p) for p in prompts) + args.tokens + 8)
    n_vocab = llm.n_vocab()
    kls: dict[str, list[np.ndarray]] = {r: [] for r in ROWS}
    top1: dict[str, list[np.ndarray]] = {r: [] for r in ROWS}
    greedy: dict[str, int] = dict.fromkeys(ROWS, 0)
    for prompt in prompts:
        cont = list(ref.generate(prompt, args.tokens))
        ids = prompt + cont[:-1]  # the positions predicting cont[0], …, cont[-1]
        want = kafila_logits(ref, ids, len(prompt) - 1)
        rows = {name: kafila_logits(chain, ids, len(prompt) - 1) for name, chain in chains.items()}
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)], dtype=np.float64).reshape(len(ids), n_vocab)
        rows["llama.cpp"] = scores[len(prompt) - 1:]
        for name, got in rows.items():
            kls[name].append(kl(want, got))
            top1[name].append(np.argmax(got, -1) == np.argmax(want, -1))
        print(f"prompt {len(kls[ROWS[0]])} of {len(prompts)}: mean KL " + ", ".join(
            f"{n} {kls[n][-1].mean():.2e}" for n in ROWS), flush=True)  # fmt: skip
        if not args.free_running:
            continue
        own = {name: list(chain.generate(prompt, args.tokens)) for name, chain in chains.items()}
        own["llama.cpp"] = llamacpp_greedy(llm, prompt, args.tokens)
        for name, got in own.items():
            greedy[name] += next((i for i, (a, b) in enumerate(zip(got, cont)) if a != b), len(cont))
    total = len(prompts) * args.tokens
    free = " | own greedy tokens equal before the first difference" if args.free_running else ""
    print(f"\n| row vs kafila exact f32 | KL mean (nats) | KL max | top-1 agreement (teacher-forced){free} |")
    print("|---|---:|---:|---:|" + ("---:|" if free else ""))
    for name in ROWS:
        k = np.concatenate(kls[name])
        print(f"| {name} | {k.mean():.2e} | {k.max():.2e} | {np.concatenate(top1[name]).mean() * 100:.1f}% |"
              + (f" {greedy[name]} of {total} |" if free else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
