"""llama.cpp (through llama-cpp-python) as the external reference: greedy ids on a GGUF file.

`greedy_ids` feeds token ids (no tokenizer involved) and takes the argmax of llama.cpp's logits
step by step, with an f32 KV cache so that a float GGUF gives llama.cpp's full-precision answer.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np


@contextlib.contextmanager
def _plain_cpu_buffers():
    """Llama() loads its weights into plain CPU buffers: no extra buffer types (AMX, repacked).

    llama.cpp's AMX buffers crash the process on some AMX machines (a general protection fault in
    libggml-cpu at the first inference: ggml-org/llama.cpp#20824, the fix #26954 is open), and a
    native build uses them wherever the CPU has AMX. A reference needs the plain kernels' answer,
    not their speed; llama-cpp-python has no argument for this, so the default model parameters
    it starts from are wrapped while it loads."""
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def plain():
        params = default()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = plain
    try:
        yield
    finally:
        low.llama_model_default_params = default


def _llama(path: str, n_ctx: int, threads: int, f32_kv: bool):
    import llama_cpp

    kw = dict(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads,
              n_threads_batch=threads, logits_all=False, verbose=False, seed=0)  # fmt: skip
    if f32_kv:
        kw.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null), _plain_cpu_buffers():
        return llama_cpp.Llama(**kw)


def greedy_ids(path: str, prompt_ids: list[int], n_tokens: int, *, threads: int = 2,
               f32_kv: bool = True, n_ctx: int | None = None) -> list[int]:
    """llama.cpp's greedy continuation of `prompt_ids`: `n_tokens` ids (never stops at EOS)."""
    return greedy_run(path, prompt_ids, n_tokens, threads=threads, f32_kv=f32_kv, n_ctx=n_ctx)[0]


def greedy_run(path: str, prompt_ids: list[int], n_tokens: int, *, threads: int = 2,
               f32_kv: bool = True, n_ctx: int | None = None) -> tuple[list[int], np.ndarray]:
    """(ids, logits [n_tokens, vocab]): the greedy continuation and the logits each id was taken from.

    llama-cpp-python keeps no scores unless logits_all (its `eval` leaves `scores` zero), so the
    logits of the last evaluated position are read from the context (llama_get_logits_ith(−1)).
    """
    import llama_cpp

    n_ctx = n_ctx or max(64, len(prompt_ids) + n_tokens + 8)
    llm = _llama(path, n_ctx, threads, f32_kv)
    try:
        n_vocab = llm.n_vocab()
        ids: list[int] = []
        rows: list[np.ndarray] = []
        llm.eval(list(prompt_ids))
        for _ in range(n_tokens):
            ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32)  # a copy
            token = int(np.argmax(logits))
            ids.append(token)
            rows.append(logits)
            llm.eval([token])
        return ids, np.stack(rows)
    finally:
        llm.close()


def tokenize(path: str, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
    """llama.cpp's tokenization of `text` with the vocabulary in `path` (vocab_only)."""
    import llama_cpp

    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return list(llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))
    finally:
        llm.close()


def quantize(src: str, dst: str, ftype: str, *, threads: int = 2) -> str:
    """llama.cpp's own quantizer: `src` (F32/F16 GGUF) → `dst` as `ftype` ("Q4_K_M", "Q5_K_M", "Q6_K", …)."""
    import llama_cpp

    return _llama_quantize(src, dst, getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), ftype, threads)


def f32_copy(src: str, dst: str, *, threads: int = 2) -> str:
    """llama.cpp's own quantizer writing `src` with every matrix as F32: its dequantization of the
    file's blocks, the exact values a quantized file stands for (a reference that does not round
    activations as llama.cpp's K-quant dot products do, so it does not depend on the CPU's kernels)."""
    import llama_cpp

    return _llama_quantize(src, dst, llama_cpp.LLAMA_FTYPE_ALL_F32, "F32", threads, requantize=True)


def _llama_quantize(src: str, dst: str, ftype: int, label: str, threads: int, requantize: bool = False) -> str:
    """llama_model_quantize(src → dst as `ftype`); `requantize`: from a file already quantized."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = requantize
    params.nthread = threads
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} → {label}) failed with {rc}")
    return str(dst)
