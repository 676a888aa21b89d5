"""Pieces of the stage graph that some families add to Llama's block (backends/gguf/families.py).

Sliding-window attention: a query at logical position p of a windowed layer sees only keys at
logical positions k with p − k < window (llama.cpp's LLAMA_SWA_TYPE_STANDARD); the layer's KV
holds the newest columns only (backends/openvino/window.py), and its mask is this one's last
columns. A key's logical position is its rank among the visible positions of
its row (cumulative sum of attention_mask − 1): every slot's visible positions are its tokens
at logical positions 0, 1, 2, … in physical order (a prompt is fed from 0; a cut keeps a
prefix; a row group copies a slot's live positions in order; padding is masked out).

Attention sinks (gpt-oss): each head h has a learnt logit s_h that joins every query's softmax
denominator and brings no value: p_j = exp(z_j) / (Σ_k exp(z_k) + exp(s_h)) (llama.cpp's
ggml_soft_max_add_sinks), which is ScaledDotProductAttention-13's optional sink input.

YaRN (gpt-oss's RoPE scaling, ggml's rope_yarn with ext_factor 1): frequency pair i keeps the
original angle θ_i below the low correction dim, takes the interpolated θ_i·freq_scale above the
high one, and mixes the two linearly between; cos and sin are scaled by a magnitude
(backends/gguf/families.py computes both, for the MLX backend too).
"""

from __future__ import annotations

import math

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino.opset13.ops import _get_node_factory_opset13

from backends.gguf.families import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

I64 = ov.Type.i64
F32 = ov.Type.f32
LOWEST_F32 = np.finfo(np.float32).min


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


def window_mask(full: ov.Output, attention_mask: ov.Output, position_ids: ov.Output, window: int) -> ov.Output:
    """The full layers' additive mask `full` f32 [B, 1, L, S] with, in addition, every key more
    than `window` − 1 logical positions before its query masked out."""
    visible = ops.convert(ops.not_equal(attention_mask, ops.constant(np.int64(0))), I64)  # [B, S] 0/1
    key_pos = ops.subtract(ops.cumsum(visible, ops.constant(np.int64(1))), _i64(1))  # [B, S]
    key_pos = ops.unsqueeze(key_pos, _i64(1, 2))  # [B, 1, 1, S]
    query_pos = ops.unsqueeze(position_ids, _i64(1, 3))  # [B, 1, L, 1]
    near = ops.less(ops.subtract(query_pos, key_pos), ops.constant(np.int64(window)))  # [B, 1, L, S]
    return ops.select(near, full, ops.constant(LOWEST_F32)).output(0)


def gelu_tanh(x: ov.Output) -> ov.Output:
    """0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))) (ggml_gelu; Gemma's GeGLU)."""
    return ops.gelu(x, "tanh").output(0)


def geglu(gate: ov.Output, up: ov.Output, ggml: bool = False) -> ov.Output:
    """GELU(tanh)(gate) ⊙ up (Gemma's GeGLU); `ggml` (the ggml form): as ggml computes it, its
    GELU read from an f16 table at the gate rounded to f16 (GgmlGeglu), so the activation the next
    ggml product quantizes is llama.cpp's own."""
    if ggml:
        from backends.openvino import ggml_kernels

        return ggml_kernels.geglu(gate, up)
    return ops.multiply(gelu_tanh(gate), up).output(0)


def softcap(logits: ov.Output, cap: float) -> ov.Output:
    """cap·tanh(logits / cap) (Gemma's final logit soft-capping)."""
    scaled = ops.multiply(logits, ops.constant(np.float32(1.0 / cap)))
    return ops.multiply(ops.tanh(scaled), ops.constant(np.float32(cap))).output(0)


def attention_with_sinks(q: ov.Output, k: ov.Output, v: ov.Output, mask: ov.Output, scale: float,
                         sinks: ov.Node, n_heads: int) -> ov.Output:
    """Attention whose softmax denominators also hold exp(sinks[h]) (module docstring): q [B, nh, L, D],
    k, v [B, nh, S, D], mask f32 [B, 1, L, S], sinks f32 [nh] → [B, nh, L, D]. The SDPA's own sink
    input (v13's sixth, [1, nh, 1, 1]): the CPU plugin keeps its stateful form, the KV cache
    updated in place. (Appending a zero key to K and V for the sink made the plugin copy each
    layer's whole cache every step: gpt-oss decoded at 0.35x llama.cpp.)"""
    sink = ops.reshape(sinks, _i64(1, n_heads, 1, 1), False)
    inputs = [q, k, v, mask, ops.constant(np.float32(scale)).output(0), sink.output(0)]
    return _get_node_factory_opset13().create("ScaledDotProductAttention", inputs, {"causal": False}).output(0)


def swiglu_oai(gate: ov.Output, up: ov.Output) -> ov.Output:
    """gpt-oss's expert activation (ggml_swiglu_oai): x = min(gate, 7), y = clamp(up, −7, 7),
    x·sigmoid(1.702·x)·(y + 1)."""
    x = ops.minimum(gate, ops.constant(np.float32(SWIGLU_OAI_LIMIT)))
    y = ops.clamp(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    glu = ops.multiply(x, ops.sigmoid(ops.multiply(x, ops.constant(np.float32(SWIGLU_OAI_ALPHA)))))
    return ops.multiply(glu, ops.add(y, ops.constant(np.float32(1.0)))).output(0)
