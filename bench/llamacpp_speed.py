"""Decode speed on a Q4_K_M GGUF: Kafila's 1-stage OpenVINO chain against llama.cpp, side by side.

Both run the same file, the same chat-templated prompt and the same number of threads, greedy,
NEW_TOKENS new tokens with EOS ignored; WARMUPS warm-ups each, then REPEATS rounds in which each
runs once in turn (K L K L …), so load from elsewhere falls on both alike. tok/s is decode
throughput: tokens after the first over the time from the first token to the last (prefill
excluded). The ratio is the median over rounds of Kafila / llama.cpp in the same round.

Precision: each at its serving defaults — Kafila `precision="serving"` (the CPU plugin's defaults:
bf16 where the CPU has it, u8 KV cache, dynamic quantization of activations, group 32), llama.cpp
through llama-cpp-python with its defaults (f16 KV cache; activations quantized to Q8_K for its
K-quant dot products). llama.cpp's greedy step is `eval([token])` + argmax over the logits; Kafila's
is one `forward` with the top-1 in the stage graph.

The files (`--file`, default `smollm2,aligned`), each built once into ~/.cache/kafila-bench/ with
llama.cpp's own quantizer: `smollm2` requantizes the default model (smollm2-135m, Q4_1) to Q4_K_M
(allow_requantize: dequantize, then quantize). SmolLM2-135M's rows are 576 wide, not a multiple of
the K-quants' 256, so llama.cpp falls back to Q5_0 / Q8_0 for those tensors (only ffn_down, 1536
wide, gets K-quants; Kafila serves Q5_0 / Q8_0 exactly, as it does the K-quants). `aligned` is a
random-weight Llama with every row a multiple of 256 (hidden 768, FFN 2048, 30 blocks, SmolLM2's
tokenizer), written as F16 and quantized to Q4_K_M: all matrices Q4_K / Q6_K, what a Q4_K_M of a
larger model is. Or give any GGUF path.
The Kafila rows run only when `kafila inspect` says Kafila serves the file; otherwise the
llama.cpp row is measured alone and the reason is printed.

Threads: on a machine whose cores other processes also use, llama.cpp with every core asked for
collapses (its OpenMP threads spin at barriers waiting for a descheduled partner), so compare at
fewer threads than cores there (`--threads 1,2` on a shared 2-core machine; see docs/BENCHMARKS.md).

Run: `.venv/bin/python -m bench.llamacpp_speed [--file smollm2,aligned|PATH] [--threads 1,2]`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

from bench._report import cpu

NEW_TOKENS = 128
WARMUPS = 2
REPEATS = 5
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
KAFILA = "kafila OpenVINO 1-stage"
LLAMACPP = "llama.cpp (llama-cpp-python)"
ALIGNED = dict(blocks=30, hidden=768, heads=12, kv_heads=4, ffn=2048)  # every row a multiple of 256


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    path = Path(base) / "kafila-bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def machine() -> str:
    """CPU model, core count and the ISA flags that matter to these kernels, and the load now."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu()}; load average {load}"


# --- the Q4_K_M file ---------------------------------------------------------------------------


def llama_quantize(src: str, dst: str, ftype: str = "Q4_K_M", *, threads: int = 2,
                   allow_requantize: bool = False) -> str:
    """llama.cpp's own quantizer (llama_model_quantize), `src` → `dst` as `ftype`."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    params.allow_requantize = allow_requantize
    tmp = f"{dst}.part"
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} → {ftype}) failed with {rc}")
    os.replace(tmp, dst)
    return dst


def write_aligned_f16(dst: str, tokenizer_source, seed: int = 0) -> str:
    """A random Llama (ALIGNED shape) as F16, with the tokenizer and chat template of `tokenizer_source`."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    meta = tokenizer_source.metadata
    blocks, hidden, heads, kv_heads, ffn = (ALIGNED[k] for k in ("blocks", "hidden", "heads", "kv_heads", "ffn"))
    head_dim = hidden // heads
    tokens = meta["tokenizer.ggml.tokens"]
    w = gguf.GGUFWriter(dst, "llama")
    w.add_name("random llama (rows multiples of 256) with SmolLM2's tokenizer")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_block_count(blocks)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    w.add_chat_template(meta["tokenizer.chat_template"])

    def add(name: str, shape: tuple[int, ...], scale: float) -> None:
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, np.float32))
        else:
            w.add_tensor(name, (rng.standard_normal(shape, np.float32) * scale).astype(np.float16))

    add("token_embd.weight", (len(tokens), hidden), 0.5)
    add("output_norm.weight", (hidden,), 0)
    kv = kv_heads * head_dim
    for b in range(blocks):
        p = f"blk.{b}."
        add(p + "attn_norm.weight", (hidden,), 0)
        add(p + "attn_q.weight", (hidden, hidden), hidden**-0.5)
        add(p + "attn_k.weight", (kv, hidden), hidden**-0.5)
        add(p + "attn_v.weight", (kv, hidden), hidden**-0.5)
        add(p + "attn_output.weight", (hidden, hidden), hidden**-0.5)
        add(p + "ffn_norm.weight", (hidden,), 0)
        add(p + "ffn_gate.weight", (ffn, hidden), hidden**-0.5)
        add(p + "ffn_up.weight", (ffn, hidden), hidden**-0.5)
        add(p + "ffn_down.weight", (hidden, ffn), ffn**-0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


# mixture-of-experts files (tests/arch_gguf.py's kinds, random weights, real tokenizers): every
# expert row 1024 or 256 wide, so llama.cpp's quantizer gives the experts their K-quant / MXFP4
MOE_FILES = {"qwen3moe": ("qwen3moe", "Q4_K_M"), "gpt-oss": ("gpt-oss", "MXFP4_MOE"),
             "qwen35moe": ("qwen35moe", "Q4_K_M")}  # fmt: skip
MOE_SHAPE = {"blocks": 12, "hidden": 1024, "heads": 16, "kv_heads": 4, "experts": (32, 4, 256)}
# the hybrid (Qwen3.5-MoE: delta-net layers, attention every 4th block) at MOE_SHAPE's size:
# tests/hybrid_gguf.py's layout, Qwen2's tokenizer
HYBRID_SHAPE = {"blocks": 12, "hidden": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64, "rope_dims": 32,
                "ffn": 256, "interval": 4, "k_heads": 8, "v_heads": 16, "state": 64, "conv": 4}  # fmt: skip
HYBRID_EXPERTS = {"count": 32, "used": 4, "ffn": 256, "shared_ffn": 256}


def q4_k_m_file(which: str, threads: int) -> str:
    """The benchmark's GGUF: built once into the cache for `smollm2` / `aligned` / the MoE kinds
    (MOE_FILES: qwen3moe as Q4_K_M, gpt-oss as MXFP4_MOE), else a path."""
    from backends.gguf import open_model
    from kafila.models import resolve_model

    if which in MOE_FILES:
        return moe_file(which, threads)
    if which not in ("smollm2", "aligned"):
        return which
    source = open_model(resolve_model("smollm2-135m"))
    dst = cache_dir() / f"{which}.Q4_K_M.gguf"
    if dst.exists():
        return str(dst)
    if which == "smollm2":
        return llama_quantize(source.path, str(dst), threads=threads, allow_requantize=True)
    f16 = cache_dir() / "aligned.F16.gguf"
    write_aligned_f16(str(f16), source)
    try:
        return llama_quantize(str(f16), str(dst), threads=threads)
    finally:
        f16.unlink()


def moe_file(which: str, threads: int) -> str:
    from tests.arch_gguf import write_arch_gguf

    kind, ftype = MOE_FILES[which]
    dst = cache_dir() / f"{which}.{ftype}.gguf"
    if not dst.exists():
        f32 = cache_dir() / f"{which}.F32.gguf"
        if kind == "qwen35moe":
            from tests.hybrid_gguf import write_qwen35_gguf

            write_qwen35_gguf(str(f32), moe=True, tokenizer=True, shape=HYBRID_SHAPE, experts=HYBRID_EXPERTS)
        else:
            write_arch_gguf(str(f32), kind, **MOE_SHAPE)
        try:
            llama_quantize(str(f32), str(dst), ftype, threads=threads)
        finally:
            f32.unlink()
    return str(dst)


# --- the two rows ------------------------------------------------------------------------------


def llamacpp_run(path: str, prompt: list[int], new_tokens: int, threads: int):
    """→ run() returning (ids, token timestamps) of one greedy generation by llama.cpp."""
    import llama_cpp
    import numpy as np

    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + new_tokens + 8, n_batch=512,
                              n_threads=threads, n_threads_batch=threads, verbose=False)  # fmt: skip

    n_vocab = llm.n_vocab()

    def run() -> tuple[list[int], list[float]]:
        llm.reset()
        ids, stamps = [], []
        llm.eval(prompt)
        for _ in range(new_tokens):
            # The last position's logits from the context (llm.scores is never written unless logits_all).
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            stamps.append(time.perf_counter())
            ids.append(token)
            llm.eval([token])
        return ids, stamps

    return run


def kafila_run(path: str, prompt: list[int], new_tokens: int, threads: int):
    """→ run() for Kafila's 1-stage OpenVINO chain at serving precision, on `threads` threads."""
    from backends.base import ShardSpec
    from backends.gguf import open_model
    from backends.openvino.shard import CONFIGS, OpenVINOShard
    from kafila.engine.chain import LocalChain

    index = open_model(path)
    config = {**CONFIGS["serving"], "INFERENCE_NUM_THREADS": str(threads)}
    spec = ShardSpec(index.path, 0, index.hparams.n_blocks, embed=True, head=True)
    chain = LocalChain([OpenVINOShard(spec, "serving", index=index, config=config)])

    def run() -> tuple[list[int], list[float]]:
        ids, stamps = [], []
        for token in chain.generate(prompt, new_tokens):  # no stop ids: EOS ignored
            stamps.append(time.perf_counter())
            ids.append(token)
        return ids, stamps

    return run


def decode_tok_s(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def measure(path: str, info: dict, prompt: list[int], threads: int, args) -> None:
    """One table: Kafila (when served) and llama.cpp on `threads` threads each, rounds interleaved."""
    from kafila.cli import import_openvino_without_telemetry

    rows = {LLAMACPP: llamacpp_run(path, prompt, args.tokens, threads)}
    if info["served"]:
        import_openvino_without_telemetry()
        rows = {KAFILA: kafila_run(path, prompt, args.tokens, threads), **rows}
    else:
        print(f"kafila: not served, llama.cpp alone: {info['why_not']}")
    ids = {}
    for name, run in rows.items():
        for _ in range(args.warmups):
            ids[name] = run()[0]
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, run in rows.items():
            samples[name].append(decode_tok_s(run()[1]))
    ref = samples[LLAMACPP]
    print(f"\n{os.path.basename(path)}, {threads} thread(s) each:")
    print("| configuration | decode tok/s (median) | × llama.cpp (median of per-round ratios) |\n|---|---:|---:|")
    for name, s in samples.items():
        ratio = statistics.median(x / r for x, r in zip(s, ref))
        print(f"| {name} | {statistics.median(s):.1f} | {ratio:.2f} |")
    print("samples (tok/s):", json.dumps({k: [round(x, 1) for x in v] for k, v in samples.items()}))
    if len(ids) == 2:
        a, b = ids.values()
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"same greedy tokens: {'all' if at == len(a) else f'the first {at}'} of {len(a)}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.llamacpp_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--file", default="smollm2,aligned",
                        help="comma-separated: smollm2 | aligned | qwen3moe | gpt-oss | a GGUF path (default smollm2,aligned)")
    parser.add_argument("--threads", default=str(os.cpu_count() or 1),
                        help="comma-separated thread counts, each used by both (default: all cores)")
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--warmups", type=int, default=WARMUPS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args(argv)

    from backends.gguf import open_model
    from kafila.commands.inspect import describe
    from kafila.models import load_tokenizer, resolve_model

    from bench._report import header

    print(header(), flush=True)
    with contextlib.suppress(Exception):
        import llama_cpp

        print("llama.cpp:", llama_cpp.__version__, llama_cpp.llama_print_system_info().decode().strip(), flush=True)
    # The prompt from the default model's tokenizer: every file here carries SmolLM2's vocabulary.
    tok = load_tokenizer(open_model(resolve_model("smollm2-135m")))
    # a file without a chat template (the MoE kinds' llama-bpe vocabulary): the plain prompt
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": PROMPT}]) if tok.chat_template else PROMPT)
    threads = [int(t) for t in args.threads.split(",")]
    print(f"{args.tokens} new tokens; {args.warmups} warm-ups, {args.repeats} rounds; threads {threads}")
    for which in args.file.split(","):
        path = q4_k_m_file(which, max(threads))
        info = describe(path)
        shares = ", ".join(f"{q} {v['share'] * 100:.1f}%" for q, v in info["quant_types"].items())
        print(f"\nfile: {path} ({info['file_bytes'] / 1e6:.1f} MB; {info['file_type']}; tensor bytes: {shares})")
        for n in threads:
            measure(path, info, prompt, n, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
