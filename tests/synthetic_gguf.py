"""Tiny GGUF files built at test time with the gguf package's GGUFWriter (never committed).

`write_llama_gguf` writes a small random Llama (default: 4 blocks, hidden 64, 4 heads, 2 KV heads,
Q4_1 matrices, Q8_0 embedding, byte-level tokenizer and a ChatML template) that loads in
milliseconds; the broken variants exercise every refusal path of kafila.models.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
from gguf import quants

from tests.kquant_encode import quantize_k

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 single-byte tokens
    merges = ["a b", "ab c"]
    tokens += ["ab", "abc", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, types, merges


def write_llama_gguf(
    path: str | os.PathLike,
    *,
    blocks: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    qtype: str = "Q4_1",
    embed_qtype: str = "Q8_0",
    arch: str = "llama",
    qkv_bias: bool = False,
    tied: bool = True,
    seed: int = 0,
    odd_tensor: tuple[str, str] | None = None,
    tensor_types: dict[str, str] | None = None,
    context_length: int = 512,
) -> str:
    """A random Llama-shaped GGUF; `odd_tensor=(name, qtype)` stores one tensor in another type.

    `qtype` may also be a K-quant (Q4_K/Q5_K/Q6_K: hidden and ffn multiples of 256) or BF16;
    `tensor_types` maps a tensor name, or a block tensor's name without `blk.N.` (every block),
    to its own type, as in llama.cpp's mixes (e.g. {"attn_v.weight": "Q6_K"}).
    """
    rng = np.random.default_rng(seed)
    tokens, types, merges = _byte_level_vocab()
    vocab = len(tokens)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def add(name: str, shape: tuple[int, ...], kind: str, scale: float = 0.05) -> None:
        if odd_tensor and odd_tensor[0] == name:
            kind = odd_tensor[1]
        short = name.split(".", 2)[2] if name.startswith("blk.") else name
        kind = (tensor_types or {}).get(name, (tensor_types or {}).get(short, kind))
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            data = (1.0 + data).astype(np.float32)  # norms near 1
        if kind == "F32":
            w.add_tensor(name, data)
        elif kind == "F16":
            w.add_tensor(name, data.astype(np.float16))
        elif kind in ("Q4_K", "Q5_K", "Q6_K"):  # the gguf package cannot quantize these
            t = getattr(gguf.GGMLQuantizationType, kind)
            w.add_tensor(name, quantize_k(data, kind), raw_dtype=t)
        elif kind in ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"):  # llama.cpp's own quantizer
            from tests.ggml_quants import ggml_quantize

            w.add_tensor(name, ggml_quantize(kind, data.reshape(-1, shape[-1])).reshape(*shape[:-1], -1),
                         raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        elif kind == "Q8_1":  # a type Kafila does not serve (ggml's activation type): random blocks
            t = gguf.GGMLQuantizationType.Q8_1
            bw, bb = gguf.GGML_QUANT_SIZES[t]
            raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // bw * bb), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=t)
        else:
            t = getattr(gguf.GGMLQuantizationType, kind)
            w.add_tensor(name, quants.quantize(data, t), raw_dtype=t)

    add("token_embd.weight", (vocab, hidden), embed_qtype, 0.5)
    add("output_norm.weight", (hidden,), "F32")
    if not tied:
        add("output.weight", (vocab, hidden), qtype)
    kv = kv_heads * head_dim
    for b in range(blocks):
        p = f"blk.{b}."
        add(p + "attn_norm.weight", (hidden,), "F32")
        add(p + "attn_q.weight", (hidden, hidden), qtype, 0.15)
        add(p + "attn_k.weight", (kv, hidden), qtype, 0.15)
        add(p + "attn_v.weight", (kv, hidden), qtype)
        if qkv_bias:
            add(p + "attn_q.bias", (hidden,), "F32")
            add(p + "attn_k.bias", (kv,), "F32")
            add(p + "attn_v.bias", (kv,), "F32")
        add(p + "attn_output.weight", (hidden, hidden), qtype)
        add(p + "ffn_norm.weight", (hidden,), "F32")
        add(p + "ffn_gate.weight", (ffn, hidden), qtype)
        add(p + "ffn_up.weight", (ffn, hidden), qtype)
        add(p + "ffn_down.weight", (hidden, ffn), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_not_gguf(path: str | os.PathLike) -> str:
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 this is a zip file, not a model" * 10)
    return str(path)


def write_truncated(path: str | os.PathLike, keep_fraction: float = 0.5) -> str:
    """A valid tiny GGUF cut short (its tensor data ends past the end of the file)."""
    write_llama_gguf(path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep_fraction))
    return str(path)
