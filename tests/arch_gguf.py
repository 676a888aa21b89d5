"""Small random-weight F32 GGUFs of each architecture Kafila serves, with real tokenizer metadata,
written at test time (never committed) for the llama.cpp comparison (tests/test_llamacpp_arch.py).

Kinds (all 2 blocks, hidden 64, 4 query heads, 2 KV heads, tied embeddings, RoPE base 10000):
- "llama":        Llama's layout, q/k rows permuted by convert_hf_to_gguf for pairwise RoPE.
- "llama3":       the same weights (same seed) plus `rope_freqs.weight`, the llama3 frequency
                  factors computed as convert_hf_to_gguf does (factor 8, low 1, high 4) with a short
                  original context (256) so that factors from 1 to 8 bite within a few hundred
                  positions: with head size 16 they are 1, 1, 1, ≈4.8, 8, 8, 8, 8.
- "llama-linear": the "llama" weights with rope.scaling.type linear, factor 4.
- "qwen2":        q/k/v biases, rows as HF has them (NEOX RoPE).
- "qwen3":        per-head q/k RMSNorm weights, no biases, explicit key/value length 32 (≠ 64/4).
Kinds of the families (tests/test_arch_families.py; 3 blocks):
- "gemma3":       Gemma 3: q/k norms, post-attention and post-FFN norms, GeGLU, embedding scale,
                  sliding window 8 on blocks 0 and 2 (pattern period 2) with their own RoPE base
                  (freq_base_swa 10000 vs 1e6 on the full block 1), logit soft-capping 30.
- "qwen3moe":     Qwen3's attention, 8 experts of FFN 32, top 2, renormalised.
- "qwen2moe":     Qwen2's biases, 8 experts of FFN 32, top 2 (not renormalised), a gated shared expert,
                  an untied output.weight (llama.cpp requires one).
- "mixtral":      Llama with 4 experts of FFN 128 (llama.cpp: feed_forward_length), top 2 (Mixtral's layout).
- "gpt-oss":      gpt-oss: q/k/v and attention-output biases, a sink per head, post_attention_norm as the
                  FFN's norm, 8 experts of FFN 32 with biases and a biased router, top 2 (softmax over
                  the 2), swiglu_oai; sliding window 8 on the even blocks (the default pattern, period 2);
                  YaRN factor 4 over an original context of 64 (below the 104 positions the tests
                  reach); an untied output.weight (llama.cpp requires one). `gpt_oss_parts` drops the
                  sinks (written as −1e30: exp(sink) = 0 in f32) or YaRN, for the tests that show both bite.
The llama kinds and gpt-oss copy the tokenizer of llama.cpp's ggml-vocab-llama-bpe.gguf (Llama 3,
128256 tokens: llama.cpp 0.3.36 ships no o200k vocabulary file), the qwen kinds ggml-vocab-qwen2.gguf's
(151936 tokens): the embedding is 33–39 MB.

Weights are scaled so that attention is far from uniform (RoPE matters) and the greedy ids vary.
"""

from __future__ import annotations

import functools
import math
import os

import gguf
import numpy as np

from tests.llamacpp_files import vocab_file

KINDS = ("llama", "llama3", "llama-linear", "qwen2", "qwen3")
FAMILY_KINDS = ("gemma3", "qwen3moe", "qwen2moe", "mixtral", "gpt-oss")
ARCH_OF = {"mixtral": "llama"}
EXPERTS = {"qwen3moe": (8, 2, 32), "qwen2moe": (8, 2, 32), "mixtral": (4, 2, 128), "gpt-oss": (8, 2, 32)}  # E, k, F
GEMMA3_WINDOW = 8
GPT_OSS_WINDOW = 8
GPT_OSS_PARTS = ("sinks", "yarn")
GPT_OSS_YARN_FACTOR = 4.0
GPT_OSS_YARN_ORIGINAL_CONTEXT = 64
NO_SINK = -1e30  # a sink logit whose exp is 0 in f32: as if the head had none
BIASED_QKV_KINDS = ("qwen2", "qwen2moe", "gpt-oss")
ROPE_BASE = 10000.0
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 256}


def llama3_rope_factors(head_dim: int, base: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position: int) -> np.ndarray:
    """rope_freqs.weight [D/2] exactly as convert_hf_to_gguf writes it for rope_type "llama3"."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(vocab_name: str) -> tuple[tuple[str, object, gguf.GGUFValueType, object], ...]:
    """Every tokenizer.* key of llama.cpp's vocab file as (key, value, type, array item type)."""
    reader = gguf.GGUFReader(str(vocab_file(vocab_name)), "r")
    out = []
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub_type))
    return tuple(out)


def _copy_tokenizer(w: gguf.GGUFWriter, vocab_name: str) -> int:
    """Copy llama.cpp's tokenizer metadata into w; returns the vocabulary size."""
    n_vocab = 0
    for key, value, vtype, sub_type in _tokenizer_fields(vocab_name):
        w.add_key_value(key, value, vtype, sub_type)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    return n_vocab


def write_arch_gguf(path: str | os.PathLike, kind: str, *, blocks: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128, seed: int = 0, arch: str | None = None,
                    tiny_vocab: int = 0, extra_kv: dict | None = None,
                    extra_tensors: dict[str, tuple[int, ...]] | None = None,
                    experts: tuple[int, int, int] | None = None,
                    gpt_oss_parts: tuple[str, ...] = GPT_OSS_PARTS) -> str:
    """A random F32 GGUF of `kind` (see the module docstring).

    For the refusal tests: `arch` overrides general.architecture, `tiny_vocab` > 0 writes that many
    embedding rows and no tokenizer (milliseconds instead of seconds), `extra_kv` adds
    {key: (value, GGUFValueType)} and `extra_tensors` adds {name: shape} random F32 tensors;
    `experts` (E, k, expert FFN) overrides a MoE kind's (bench/moe.py); `gpt_oss_parts` are the
    parts a gpt-oss file has of ("sinks", "yarn").
    """
    if kind not in KINDS + FAMILY_KINDS:
        raise ValueError(f"unknown kind {kind!r}: choose from {KINDS + FAMILY_KINDS}")
    arch = arch or ARCH_OF.get(kind) or ("llama" if kind.startswith("llama") else kind)
    head_dim = 32 if kind in ("qwen3", "qwen3moe", "gemma3") else hidden // heads
    qk_norm = kind in ("qwen3", "qwen3moe", "gemma3")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"kafila-test-{kind}")
    w.add_block_count(blocks)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if qk_norm:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1e6 if kind == "gemma3" else ROPE_BASE)
    if kind == "gemma3":
        w.add_sliding_window(GEMMA3_WINDOW)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)
        w.add_float32(f"{arch}.final_logit_softcapping", 30.0)
    if kind == "gpt-oss":
        w.add_sliding_window(GPT_OSS_WINDOW)
        if "yarn" in gpt_oss_parts:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(GPT_OSS_YARN_FACTOR)
            w.add_rope_scaling_orig_ctx_len(GPT_OSS_YARN_ORIGINAL_CONTEXT)
    experts = experts or EXPERTS.get(kind)
    if experts:
        n_exp, n_used, exp_ffn = experts
        w.add_expert_count(n_exp)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(exp_ffn)
        if kind == "qwen2moe":
            w.add_expert_shared_feed_forward_length(ffn)
    if kind == "llama-linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
    w.add_layer_norm_rms_eps(1e-5 if arch in ("llama", "gpt-oss") else 1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, (value, vtype) in (extra_kv or {}).items():
        w.add_key_value(key, value, vtype)
    vocab = tiny_vocab or _copy_tokenizer(w, "qwen2" if kind.startswith("qwen") else "llama-bpe")
    untied = kind in ("qwen2moe", "gpt-oss")

    def add(name: str, shape: tuple[int, ...], scale: float, mean: float = 0.0) -> None:
        w.add_tensor(name, (mean + rng.standard_normal(shape) * scale).astype(np.float32))

    add("token_embd.weight", (vocab, hidden), 0.125 if kind == "gemma3" else 1.0)  # tied: also the lm_head
    add("output_norm.weight", (hidden,), 0.1, 1.0)
    if untied:
        add("output.weight", (vocab, hidden), 1.0)
    if kind == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, ROPE_BASE, **LLAMA3_ROPE))
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    for b in range(blocks):
        p = f"blk.{b}."
        add(p + "attn_norm.weight", (hidden,), 0.1, 1.0)
        add(p + "attn_q.weight", (q_rows, hidden), 0.25)
        add(p + "attn_k.weight", (kv_rows, hidden), 0.25)
        add(p + "attn_v.weight", (kv_rows, hidden), 0.3)
        if kind in BIASED_QKV_KINDS:
            add(p + "attn_q.bias", (q_rows,), 0.5)
            add(p + "attn_k.bias", (kv_rows,), 0.5)
            add(p + "attn_v.bias", (kv_rows,), 0.5)
        if qk_norm:
            add(p + "attn_q_norm.weight", (head_dim,), 0.5, 1.0)
            add(p + "attn_k_norm.weight", (head_dim,), 0.5, 1.0)
        add(p + "attn_output.weight", (hidden, q_rows), 0.3)
        if kind == "gpt-oss":
            add(p + "attn_output.bias", (hidden,), 0.3)
            sinks = (1.0 + rng.standard_normal(heads)).astype(np.float32)  # drawn either way: same other weights
            w.add_tensor(p + "attn_sinks.weight", sinks if "sinks" in gpt_oss_parts else np.full(heads, NO_SINK, np.float32))
        add(p + ("post_attention_norm.weight" if kind == "gpt-oss" else "ffn_norm.weight"), (hidden,), 0.1, 1.0)
        if kind == "gemma3":
            add(p + "post_attention_norm.weight", (hidden,), 0.1, 1.0)
            add(p + "post_ffw_norm.weight", (hidden,), 0.1, 1.0)
        if experts:
            n_exp, _, exp_ffn = experts
            add(p + "ffn_gate_inp.weight", (n_exp, hidden), 0.5)
            add(p + "ffn_gate_exps.weight", (n_exp, exp_ffn, hidden), 0.3)
            add(p + "ffn_up_exps.weight", (n_exp, exp_ffn, hidden), 0.3)
            add(p + "ffn_down_exps.weight", (n_exp, hidden, exp_ffn), 0.3)
            if kind == "gpt-oss":
                add(p + "ffn_gate_inp.bias", (n_exp,), 0.5)
                add(p + "ffn_gate_exps.bias", (n_exp, exp_ffn), 0.5)
                add(p + "ffn_up_exps.bias", (n_exp, exp_ffn), 0.5)
                add(p + "ffn_down_exps.bias", (n_exp, hidden), 0.3)
            if kind == "qwen2moe":
                add(p + "ffn_gate_inp_shexp.weight", (hidden,), 0.3)
                add(p + "ffn_gate_shexp.weight", (ffn, hidden), 0.2)
                add(p + "ffn_up_shexp.weight", (ffn, hidden), 0.2)
                add(p + "ffn_down_shexp.weight", (hidden, ffn), 0.2)
            continue
        add(p + "ffn_gate.weight", (ffn, hidden), 0.2)
        add(p + "ffn_up.weight", (ffn, hidden), 0.2)
        add(p + "ffn_down.weight", (hidden, ffn), 0.2)
    for name, shape in (extra_tensors or {}).items():
        add(name, shape, 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
