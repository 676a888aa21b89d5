"""Gemma 4 blocks on MLX, as llama.cpp 0.3.36 computes them (backends/gguf/gemma4.py names every
part; backends/openvino/gemma4.py is the same block on OpenVINO).

Each block has its own head counts, head size and rotated dims (`block_dims`: one Dims a block,
and the slot's KV buffers shaped per block: model.SlotCache's `shapes`); the attention itself is
model._attend's, with q·k unscaled (attn_scale 1) and RoPE over the first rope_dims of each head.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from backends.mlx.model import Dims, SlotCache, _attend, experts_ffn, gelu_tanh
from backends.mlx.weights import BlockWeights


def block_dims(hp, index, first: int, last: int) -> list[Dims]:
    """The Dims of blocks [first, last) of a gemma4 model: each block's heads and head size, its
    kind's RoPE (windowed: the windowed base at scale 1; full: the model's base and scale and the
    rope_freqs factors, as mx.fast.rope's periods base^(2i/r)·factor_i over the r turned dims)."""
    fam = hp.family
    factors = index.dequantize("rope_freqs.weight", np.float64) if "rope_freqs.weight" in index.tensors else None
    out = []
    for g in hp.gemma4.blocks[first:last]:
        r = g.rope_dims
        base = fam.rope_base_swa if g.windowed else hp.rope_base
        periods = base ** (np.arange(0, r, 2, dtype=np.float64) / r)
        if not g.windowed:
            periods = periods * factors[: r // 2]
        out.append(Dims(hp.hidden, g.n_heads, g.n_kv_heads, g.head_dim, base, hp.rms_eps, rope_traditional=False,
                        rope_scale=1.0 if g.windowed else hp.rope_scale, rope_freqs=mx.array(periods.astype(np.float32)),
                        experts_used=fam.n_experts_used, experts_renorm=fam.experts_renorm, gelu=True, attn_scale=1.0,
                        rope_dims=r))  # fmt: skip
    return out


def gemma4_block(x: mx.array, w: BlockWeights, cache: SlotCache, layer: int, positions: int | mx.array,
                 mask: mx.array | str | None, dims: Dims) -> mx.array:
    """One gemma4 block on x [1, n, hidden]; writes its n new keys/values at cache.length."""
    _, n, hidden = x.shape
    H, Hkv, D, eps = dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.rms_eps
    h = mx.fast.rms_norm(x, w.attn_norm, eps)
    q = mx.fast.rms_norm(w.q(h).reshape(1, n, H, D), w.q_norm, eps)
    raw_k = w.k(h).reshape(1, n, Hkv, D)
    v = raw_k if w.v is None else w.v(h).reshape(1, n, Hkv, D)  # no attn_v: the keys' projection
    k = mx.fast.rms_norm(raw_k, w.k_norm, eps)
    v = mx.fast.rms_norm(v, None, eps)
    o = w.o(_attend(q, k, v, cache, layer, positions, mask, dims))  # [1, n, hidden]
    a = x + mx.fast.rms_norm(o, w.post_attn_norm, eps)
    y = mx.fast.rms_norm(a, w.ffn_norm, eps)
    f = w.down(gelu_tanh(w.gate(y)) * w.up(y))
    g4 = w.gemma4
    if w.moe is not None:  # the dense FFN and the experts side by side, each normalised on its way out
        f = mx.fast.rms_norm(f, g4.post_ffw_norm_1, eps)
        router = mx.fast.rms_norm(a, None, eps) * (1.0 / math.sqrt(hidden)) * g4.router_scale
        e = experts_ffn(mx.fast.rms_norm(a, g4.pre_ffw_norm_2, eps), w.moe, dims, router_x=router)
        f = f + mx.fast.rms_norm(e, g4.post_ffw_norm_2, eps)
    out = a + mx.fast.rms_norm(f, w.post_ffw_norm, eps)
    return out if g4 is None or g4.layer_scale is None else out * g4.layer_scale
