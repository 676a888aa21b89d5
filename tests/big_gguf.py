"""Big GGUFs with the exact shapes of real Llama models in Q4_K_M's layout, for tests and benchmarks.

Written at run time (never committed) into a cache directory and reused across runs, keyed by
shape, seed and FORMAT_VERSION: the 8B file is ~4.9 GB, written in seconds, not quantized.

Shapes (`SHAPES`):
- "llama-3.2-1b": 16 blocks, hidden 2048, FFN 8192, 32 heads, 8 KV heads, vocab 128256, tied
  embeddings, llama3 RoPE factors (`rope_freqs.weight`: factor 32, low 1, high 4, original 8192),
  context 131072. ~0.8 GB.
- "llama-3-8b": 32 blocks, hidden 4096, FFN 14336, 32 heads, 8 KV heads, vocab 128256, separate
  output.weight, context 8192. ~4.9 GB.
- "gpt-oss-20b": gpt-oss-20b's shape in llama.cpp's MXFP4_MOE layout: 24 blocks, hidden 2880,
  64 heads and 8 KV heads of 64, a sink per head, q/k/v/output biases, 32 experts of FFN 2880
  (top 4) with their biases, every other layer windowed (128), YaRN (factor 32, original 4096);
  experts MXFP4, every other matrix Q8_0, the router and the small tensors F32, as
  llama-quantize writes MXFP4_MOE (the router is never quantized). The vocabulary is Llama 3's
  (128,256 rows; the real model's o200k has 201,088), so the head is ~0.45 GB smaller than the
  real one's. ~11.6 GB.
- "llama-3-70b": 80 blocks, hidden 8192, FFN 28672, 64 heads, 8 KV heads: for planning only.
  Its tensor data is a hole (`truncate`, all-zero blocks: valid, d = 0), so the file takes a few MB
  of disk although it reports ~42 GB; `open_model`, `inspect` and `plan` read only the header.

Types follow llama.cpp's Q4_K_M (llama_tensor_get_type_impl in src/llama-quant.cpp): Q4_K for every
matrix, except attn_v.weight and ffn_down.weight in the blocks where `use_more_bits(i, n)` holds
(i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2) which get Q6_K, and attn_v.weight elsewhere on a 70B
model which gets Q5_K; output.weight is Q6_K, and token_embd.weight too when it is tied (the 1B),
else Q4_K; norms and rope_freqs F32.

Blocks are random bytes with their scales (d, and dmin for Q4_K/Q5_K, in f16; MXFP4's E8M0
exponent byte) overwritten by a sane value chosen per tensor so that weights have a standard
deviation near 1/sqrt(columns): any bytes are a valid block once its scales are finite (layouts:
tests/kquant_encode.py, backends/gguf/quant.py). Norms are near 1, other F32 tensors (biases,
sinks, the router) small random values. Activations stay finite; the generated text is noise.

The tokenizer is llama.cpp's Llama 3 BPE vocabulary (ggml-vocab-llama-bpe.gguf, 128256 tokens),
copied key by key.

Use: `path = big_model("llama-3.2-1b")`, or from a shell
`python -m tests.big_gguf llama-3-8b` (prints the path).
"""

from __future__ import annotations

import functools
import os
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

FORMAT_VERSION = 1  # bump when the bytes written for a (shape, seed) change
CHUNK_BYTES = 16 << 20
POOL_BYTES = 64 << 20
QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q8_0": 34, "MXFP4": 17}
BLOCK_WEIGHTS = {"Q8_0": 32, "MXFP4": 32}  # the others: QK_K
# the spread of one weight per unit of d, for random codes, scales and mins (see _d_for);
# Q8_0: the rms of a random int8; MXFP4: of ggml's doubled E2M1 table, whose unit is 2^(e − 128)
_SPREAD = {"Q4_K": 216.0, "Q5_K": 432.0, "Q6_K": 1370.0, "Q8_0": 73.9, "MXFP4": 5.85}


@dataclass(frozen=True)
class Shape:
    name: str
    blocks: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128256
    context: int = 8192
    rope_base: float = 500000.0
    tied: bool = False
    llama3_rope: dict | None = None  # rope_freqs factors (convert_hf_to_gguf's "llama3" rope type)
    model_type_70b: bool = False  # llama.cpp's LLM_TYPE_70B: attn_v Q5_K where not Q6_K
    weights: bool = True  # False: tensor data left as a hole (planning only)
    arch: str = "llama"  # "gpt-oss": the fields below
    experts: tuple[int, int, int] | None = None  # (E, k, expert FFN)
    head_size: int = 0  # 0: hidden // heads
    window: int = 0  # sliding window of the windowed layers
    yarn: tuple[float, int] | None = None  # (factor, original context)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


SHAPES = {
    "llama-3.2-1b": Shape("llama-3.2-1b", 16, 2048, 8192, 32, 8, context=131072, tied=True,
                          llama3_rope={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position": 8192}),  # fmt: skip
    "llama-3-8b": Shape("llama-3-8b", 32, 4096, 14336, 32, 8),
    "gpt-oss-20b": Shape("gpt-oss-20b", 24, 2880, 2880, 64, 8, context=131072, rope_base=150000.0,
                         arch="gpt-oss", experts=(32, 4, 2880), head_size=64, window=128,
                         yarn=(32.0, 4096)),  # fmt: skip
    "llama-3-70b": Shape("llama-3-70b", 80, 8192, 28672, 64, 8, model_type_70b=True, weights=False),
}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp), integer division as in C++."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_plan(shape: Shape) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, type, numpy shape (rows, cols), (experts, rows, cols) or (n,)) of every tensor, in
    the file's order."""
    if shape.arch == "gpt-oss":
        return _gpt_oss_plan(shape)
    h, kv_rows = shape.hidden, shape.kv_heads * shape.head_dim
    out: list[tuple[str, str, tuple[int, ...]]] = []
    if shape.llama3_rope:
        out.append(("rope_freqs.weight", "F32", (shape.head_dim // 2,)))
    out.append(("token_embd.weight", "Q6_K" if shape.tied else "Q4_K", (shape.vocab, h)))
    for b in range(shape.blocks):
        more = use_more_bits(b, shape.blocks)
        v_type = "Q6_K" if more else ("Q5_K" if shape.model_type_70b else "Q4_K")
        p = f"blk.{b}."
        out += [
            (p + "attn_norm.weight", "F32", (h,)),
            (p + "attn_q.weight", "Q4_K", (h, h)),
            (p + "attn_k.weight", "Q4_K", (kv_rows, h)),
            (p + "attn_v.weight", v_type, (kv_rows, h)),
            (p + "attn_output.weight", "Q4_K", (h, h)),
            (p + "ffn_norm.weight", "F32", (h,)),
            (p + "ffn_gate.weight", "Q4_K", (shape.ffn, h)),
            (p + "ffn_up.weight", "Q4_K", (shape.ffn, h)),
            (p + "ffn_down.weight", "Q6_K" if more else "Q4_K", (h, shape.ffn)),
        ]  # fmt: skip
    out.append(("output_norm.weight", "F32", (h,)))
    if not shape.tied:
        out.append(("output.weight", "Q6_K", (shape.vocab, h)))
    return out


def _gpt_oss_plan(shape: Shape) -> list[tuple[str, str, tuple[int, ...]]]:
    """gpt-oss's tensors as llama-quantize's MXFP4_MOE writes them (module docstring)."""
    h, q_rows, kv_rows = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    n_exp, _, ffn = shape.experts
    out: list[tuple[str, str, tuple[int, ...]]] = [("token_embd.weight", "Q8_0", (shape.vocab, h))]
    for b in range(shape.blocks):
        p = f"blk.{b}."
        out += [
            (p + "attn_norm.weight", "F32", (h,)),
            (p + "attn_q.weight", "Q8_0", (q_rows, h)), (p + "attn_q.bias", "F32", (q_rows,)),
            (p + "attn_k.weight", "Q8_0", (kv_rows, h)), (p + "attn_k.bias", "F32", (kv_rows,)),
            (p + "attn_v.weight", "Q8_0", (kv_rows, h)), (p + "attn_v.bias", "F32", (kv_rows,)),
            (p + "attn_output.weight", "Q8_0", (h, q_rows)), (p + "attn_output.bias", "F32", (h,)),
            (p + "attn_sinks.weight", "F32", (shape.heads,)),
            (p + "post_attention_norm.weight", "F32", (h,)),
            (p + "ffn_gate_inp.weight", "F32", (n_exp, h)), (p + "ffn_gate_inp.bias", "F32", (n_exp,)),
            (p + "ffn_gate_exps.weight", "MXFP4", (n_exp, ffn, h)), (p + "ffn_gate_exps.bias", "F32", (n_exp, ffn)),
            (p + "ffn_up_exps.weight", "MXFP4", (n_exp, ffn, h)), (p + "ffn_up_exps.bias", "F32", (n_exp, ffn)),
            (p + "ffn_down_exps.weight", "MXFP4", (n_exp, h, ffn)), (p + "ffn_down_exps.bias", "F32", (n_exp, h)),
        ]  # fmt: skip
    out += [("output_norm.weight", "F32", (h,)), ("output.weight", "Q8_0", (shape.vocab, h))]
    return out


def n_bytes(qtype: str, dims: tuple[int, ...]) -> int:
    if qtype == "F32":
        return 4 * int(np.prod(dims))
    return int(np.prod(dims)) // BLOCK_WEIGHTS.get(qtype, QK_K) * BLOCK_BYTES[qtype]


def cache_dir() -> Path:
    base = os.environ.get("KAFILA_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kafila-tests"
    )
    return Path(base) / "big-gguf"


def big_model(shape: str = "llama-3.2-1b", seed: int = 0, directory: str | os.PathLike | None = None) -> str:
    """The path of the model of `shape` (written now unless the cache already holds it)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose from {', '.join(SHAPES)}")
    root = Path(directory) if directory is not None else cache_dir()
    path = root / f"{shape}-{_layout(SHAPES[shape])}-seed{seed}-v{FORMAT_VERSION}.gguf"
    if path.exists():
        return str(path)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".part{os.getpid()}")
    try:
        write_big_gguf(tmp, SHAPES[shape], seed)
        os.replace(tmp, path)  # whole or absent: an interrupted write is never reused
    finally:
        if tmp.exists():
            tmp.unlink()
    return str(path)


def _layout(shape: Shape) -> str:
    return "mxfp4_moe" if shape.arch == "gpt-oss" else "q4_k_m"


def file_bytes(shape: Shape) -> int:
    """Roughly the size of the file (tensor data only): to check free disk before writing."""
    return sum(n_bytes(t, d) for _, t, d in tensor_plan(shape))


def write_big_gguf(path: str | os.PathLike, shape: Shape, seed: int = 0) -> None:
    """Write the GGUF of `shape` at `path`, streaming: memory stays at a few chunks."""
    from tests.arch_gguf import llama3_rope_factors

    plan = tensor_plan(shape)
    if shape.weights:
        need = file_bytes(shape) + (64 << 20)
        free = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
        if free.f_bavail * free.f_frsize < need:
            raise OSError(f"{shape.name} needs {need / 1e9:.1f} GB free next to {path}")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"kafila-synthetic-{shape.name}")
    w.add_block_count(shape.blocks)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    if shape.arch == "gpt-oss":
        _add_gpt_oss_keys(w, shape)
    else:
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for name, qtype, dims in plan:
        if qtype == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), n_bytes(qtype, dims))
        else:
            *outer, cols = dims
            row_bytes = cols // BLOCK_WEIGHTS.get(qtype, QK_K) * BLOCK_BYTES[qtype]
            w.add_tensor_info(name, (*outer, row_bytes), np.dtype(np.uint8),
                              n_bytes(qtype, dims), raw_dtype=gguf.GGMLQuantizationType[qtype])  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    fout = w.fout[0]
    n_own = len(w.kv_data[0])
    tokenizer = tokenizer_kv_bytes(shape.vocab)
    fout.write(b"".join(tokenizer))
    end = fout.tell()
    fout.seek(16)  # n_kv: u64 after the magic, the version and n_tensors
    fout.write(struct.pack("<Q", n_own + len(tokenizer)))
    fout.seek(end)
    w.write_ti_data_to_file()
    w.write_padding(fout, fout.tell())
    if not shape.weights:
        end = fout.tell() + sum(gguf.GGUFWriter.ggml_pad(n_bytes(t, d), w.data_alignment) for _, t, d in plan)
        fout.truncate(end)  # a hole: zero blocks, no disk
        w.close()
        return
    pool = rng.integers(0, 256, size=POOL_BYTES, dtype=np.uint8)
    pool = np.concatenate([pool, pool[:CHUNK_BYTES]])  # any block-aligned slice of CHUNK_BYTES fits
    for name, qtype, dims in plan:
        if qtype == "F32":
            if name == "rope_freqs.weight":
                data = llama3_rope_factors(shape.head_dim, shape.rope_base, **shape.llama3_rope)
            elif "norm" in name:  # RMSNorm weights near 1
                data = (1.0 + 0.05 * rng.standard_normal(dims)).astype(np.float32)
            else:  # biases, sinks, the router: small
                data = (F32_SCALE.get(name.rsplit(".", 2)[-2], 0.02) * rng.standard_normal(dims)).astype(np.float32)
            data.tofile(fout)
            w.write_padding(fout, data.nbytes)
            continue
        _write_blocks(fout, qtype, dims, pool, rng)
        w.write_padding(fout, n_bytes(qtype, dims))
    w.close()


# gpt-oss's other F32 tensors, by name: the router's logits near unit spread (its input is normed)
F32_SCALE = {"attn_sinks": 1.0, "ffn_gate_inp": 1.0 / 48}


def _add_gpt_oss_keys(w: gguf.GGUFWriter, shape: Shape) -> None:
    n_exp, used, ffn = shape.experts
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(used)
    w.add_expert_feed_forward_length(ffn)
    w.add_sliding_window(shape.window)
    factor, original = shape.yarn
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(factor)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@functools.lru_cache(maxsize=1)
def _vocab_kv_spans() -> tuple[bytes, ...]:
    """The raw key/value records of every tokenizer.* key of llama.cpp's ggml-vocab-llama-bpe.gguf.

    Copied byte for byte: gguf.GGUFReader takes tens of seconds on 128k tokens, a walk over
    the records' lengths well under one."""
    from tests.llamacpp_files import vocab_file

    buf = vocab_file("llama-bpe").read_bytes()
    if buf[:4] != b"GGUF":
        raise RuntimeError("ggml-vocab-llama-bpe.gguf is not a GGUF file")
    (n_kv,) = struct.unpack_from("<Q", buf, 16)
    pos, out = 24, []

    def skip(pos: int, vtype: int, count: int = 1) -> int:
        if vtype == _STRING:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            return pos
        if vtype == _ARRAY:
            for _ in range(count):
                item, n = struct.unpack_from("<IQ", buf, pos)
                pos = skip(pos + 12, item, n)
            return pos
        return pos + _SCALAR_BYTES[vtype] * count

    for _ in range(n_kv):
        start = pos
        (klen,) = struct.unpack_from("<Q", buf, pos)
        key = buf[pos + 8 : pos + 8 + klen].decode()
        (vtype,) = struct.unpack_from("<I", buf, pos + 8 + klen)
        pos = skip(pos + 12 + klen, vtype)
        if key.startswith("tokenizer."):
            out.append(buf[start:pos])
    return tuple(out)


def tokenizer_kv_bytes(vocab: int) -> tuple[bytes, ...]:
    spans = _vocab_kv_spans()
    tokens = next(s for s in spans if s[8:29] == b"tokenizer.ggml.tokens")
    (count,) = struct.unpack_from("<Q", tokens, 8 + 21 + 4 + 4)
    if count != vocab:
        raise RuntimeError(f"llama-bpe has {count} tokens, the shape needs {vocab}")
    return spans


def _d_for(qtype: str, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """f16 bytes of d and dmin so that weights spread about 1/sqrt(cols) around ~0 (MXFP4: its
    E8M0 exponent byte e, the unit being 2^(e − 128), and no dmin)."""
    d = 1.0 / (_SPREAD[qtype] * np.sqrt(cols))
    if qtype == "MXFP4":
        return np.array([round(128 + np.log2(d))], np.uint8), np.zeros(0, np.uint8)
    # Q4_K: w = d·sc·q − dmin·m with q ~ U(0..15), sc, m ~ U(0..63): dmin = 7.5·d centres it
    dmin = 7.5 * d if qtype == "Q4_K" else 15.5 * d
    return np.array([d], np.float16).view(np.uint8), np.array([dmin], np.float16).view(np.uint8)


def _write_blocks(fout, qtype: str, dims: tuple[int, ...], pool: np.ndarray, rng) -> None:
    cols = dims[-1]
    bb = BLOCK_BYTES[qtype]
    total = n_bytes(qtype, dims)
    d16, dmin16 = _d_for(qtype, cols)
    per_chunk = CHUNK_BYTES // bb * bb
    n_pool_blocks = POOL_BYTES // bb
    done = 0
    while done < total:
        n = min(per_chunk, total - done)
        start = int(rng.integers(0, n_pool_blocks)) * bb
        chunk = pool[start : start + n].copy().reshape(-1, bb)  # (blocks, bytes)
        if qtype == "Q6_K":  # ql[128] qh[64] scales[16] d
            chunk[:, 208:210] = d16
        elif qtype == "Q8_0":  # d qs[32]
            chunk[:, 0:2] = d16
        elif qtype == "MXFP4":  # e qs[16]
            chunk[:, 0:1] = d16
        else:  # d dmin scales[12] (qh[32]) qs[128]
            chunk[:, 0:2] = d16
            chunk[:, 2:4] = dmin16
        fout.write(chunk.data)
        done += n


def main(argv: list[str]) -> int:
    shape = argv[0] if argv else "llama-3.2-1b"
    seed = int(argv[1]) if len(argv) > 1 else 0
    start = time.monotonic()
    path = big_model(shape, seed)
    print(path)
    print(f"{os.path.getsize(path) / 1e9:.2f} GB in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
