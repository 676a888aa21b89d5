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


def mtp_drafts(path: str, tokens: list[int], h_rows: np.ndarray, k: int, *,
               threads: int = 2) -> tuple[list[int], list[int]]:
    """llama.cpp's multi-token-prediction head on `path` (an MTP context, as its draft-mtp driver in
    common/speculative.cpp runs it): MTP position q is fed `tokens[q]` with the model's final hidden
    `h_rows[q]` (h_{q−1}, after output_norm) in one batch; then each draft feeds the last one with
    the MTP's own h_nextn. Returns (the greedy token after each fed position, the k drafts).

    llama-cpp-python binds the MTP context type and the batch API but not the h_nextn getter
    (C++ linkage in llama-ext.h): it is called by its mangled name."""
    import ctypes

    import llama_cpp
    import llama_cpp.llama_cpp as low

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libllama.so"))
    set_nextn = lib["_Z26llama_set_embeddings_nextnP13llama_contextbb"]
    set_nextn.argtypes, set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
    nextn_ith = lib["_Z30llama_get_embeddings_nextn_ithP13llama_contexti"]
    nextn_ith.argtypes, nextn_ith.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)
    low.llama_backend_init()
    mp = low.llama_model_default_params()
    mp.load_mtp, mp.use_extra_bufts = True, False  # plain kernels, as _plain_cpu_buffers
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        model = low.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path} with its MTP layer")
    cp = low.llama_context_default_params()
    cp.ctx_type, cp.n_ctx = low.LLAMA_CONTEXT_TYPE_MTP, max(64, len(tokens) + k + 8)
    cp.n_batch = cp.n_ubatch = cp.n_ctx
    cp.type_k = cp.type_v = low.GGML_TYPE_F32
    cp.n_threads = cp.n_threads_batch = threads
    ctx = low.llama_init_from_model(model, cp)
    batch = low.llama_batch_ext_init(ctx)
    H = low.llama_model_n_embd(model)
    V = low.llama_vocab_n_tokens(low.llama_model_get_vocab(model))
    set_nextn(ctx, True, False)
    keep: list = []  # the rows' and positions' buffers outlive the batch

    def feed(pairs: list[tuple[int, int, np.ndarray]]) -> None:
        low.llama_batch_ext_clear(batch)
        for token, pos, row in pairs:
            i = low.llama_batch_ext_add_token(batch, 0, int(token))
            keep.append((np.ascontiguousarray(row, np.float32), low.llama_pos(pos)))
            low.llama_batch_ext_set_pos(batch, i, ctypes.byref(keep[-1][1]))
            embd = low.llama_embd(keep[-1][0].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, H)
            if not low.llama_batch_ext_set_embd_token(batch, i, embd):
                raise RuntimeError("llama_batch_ext_set_embd_token refused a row")
            low.llama_batch_ext_set_output_logits(batch, i, True)
        if low.llama_process(ctx, 1, batch) != 0:  # LLAMA_PROCESS_TYPE_DECODE
            raise RuntimeError("llama_process on the MTP context failed")

    def pick(i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(low.llama_get_logits_ith(ctx, i), shape=(V,))))

    try:
        feed([(t, q, h_rows[q]) for q, t in enumerate(tokens)])
        after = [pick(i) for i in range(len(tokens))]
        drafts, last = [after[-1]], len(tokens) - 1
        while len(drafts) < k:
            h = np.ctypeslib.as_array(nextn_ith(ctx, last), shape=(H,)).copy()
            feed([(drafts[-1], len(tokens) + len(drafts) - 1, h)])
            drafts.append(pick(0))
            last = 0
        return after, drafts
    finally:
        low.llama_batch_ext_free(batch)
        low.llama_free(ctx)
        low.llama_model_free(model)
