"""Gemma 4 blocks on MLX, as llama.cpp 0.3.36 computes them (backends/gguf/gemma4.py names every
part; backends/openvino/gemma4.py is the same block on OpenVINO).

Each block has its own head counts, head size and rotated dims (`block_dims`: one Dims a block,
and the slot's KV buffers shaped per block: model.SlotCache's `shapes`); the attention itself is
model._attend's, with q·k unscaled (attn_scale 1) and RoPE over the first rope_dims of each head.

Per-layer embeddings and shared KV (the E2B/E4B models) travel with the hidden state in a carried
row (backends/gguf/gemma4.py; backends/openvino/gemma4.py does the same): `Carried` holds a step's
row split, and each block's `kv_routes` entry says whose buffers it attends over: its own, its
source's in this stage, or (the first of a source's sharers here, when the source is another
stage's) a buffer of its own filled from the row; a block reading another's holds an empty one.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from backends.gguf.gemma4 import Gemma4Params
from backends.mlx.model import Dims, SlotCache, _attend, experts_ffn, gelu_tanh, rope
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


def kv_routes(g: Gemma4Params, first: int, last: int) -> list[tuple[str, int]]:
    """Per block of [first, last): ("own", its layer) computes its K and V; ("hold", its layer)
    takes its source's from the carried row into its buffer; ("read", layer) attends over that
    layer's buffer (module docstring)."""
    out, holder = [], {}
    for b in range(first, last):
        s = g.blocks[b].kv_from
        if s == b:
            out.append(("own", b - first))
        elif first <= s:
            out.append(("read", s - first))
        elif s in holder:
            out.append(("read", holder[s]))
        else:
            holder[s] = b - first
            out.append(("hold", b - first))
    return out


class Carried:
    """One step's carried row [1, n, C] split: the hidden state, the per-layer inputs, each shared
    source's step K and V ([1, Hkv, n, D], K turned)."""

    def __init__(self, g: Gemma4Params, hidden: int, row: mx.array) -> None:
        self.g, self.H = g, hidden
        self.hidden = row[..., :hidden]
        n_ple = len(g.blocks) * g.per_layer
        self.ple = row[..., hidden : hidden + n_ple] if g.per_layer else None
        self.kv: dict[int, tuple[mx.array, mx.array]] = {}
        for s in g.shared_sources:
            b, at, width = g.blocks[s], g.kv_columns(hidden, s), g.kv_width(s)
            k, v = (row[..., a : a + width].reshape(1, -1, b.n_kv_heads, b.head_dim).transpose(0, 2, 1, 3)
                    for a in (at, at + width))  # fmt: skip
            self.kv[s] = (k, v)

    def per_layer_inputs(self, x0: mx.array, proj, norm: mx.array, eps: float) -> None:
        """The first stage: every block's per-layer input from x0 (the scaled embedding) and the
        per_layer_token_embd rows in the per-layer columns (backends/gguf/gemma4.py)."""
        P, n = self.g.per_layer, len(self.g.blocks)
        p = (proj(x0) * (1.0 / math.sqrt(self.H))).reshape(*x0.shape[:2], n, P)
        p = mx.fast.rms_norm(p, norm, eps)
        rows = self.ple.reshape(*x0.shape[:2], n, P) * math.sqrt(P)
        self.ple = ((p + rows) * (1.0 / math.sqrt(2.0))).reshape(*x0.shape[:2], n * P)

    def ple_of(self, b: int) -> mx.array:
        P = self.g.per_layer
        return self.ple[..., b * P : (b + 1) * P]

    def row(self, x: mx.array) -> mx.array:
        parts = [x] + ([self.ple] if self.ple is not None else [])
        for s in self.g.shared_sources:
            k, v = self.kv[s]
            parts += [t.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1) for t in (k, v)]
        return mx.concatenate(parts, axis=-1)


def gemma4_block(x: mx.array, w: BlockWeights, cache: SlotCache, layer: int, positions: int | mx.array,
                 mask: mx.array | str | None, dims: Dims, route: tuple[str, int] | None = None,
                 carried: Carried | None = None, b: int = -1) -> mx.array:  # fmt: skip
    """One gemma4 block (model block b) on x [1, n, hidden]; writes its n new keys/values at
    cache.length (`route`: kv_routes', else its own)."""
    _, n, hidden = x.shape
    H, Hkv, D, eps = dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.rms_eps
    kind, buf = route or ("own", layer)
    h = mx.fast.rms_norm(x, w.attn_norm, eps)
    q = mx.fast.rms_norm(w.q(h).reshape(1, n, H, D), w.q_norm, eps)
    if kind == "own":
        raw_k = w.k(h).reshape(1, n, Hkv, D)
        v = raw_k if w.v is None else w.v(h).reshape(1, n, Hkv, D)  # no attn_v: the keys' projection
        k = mx.fast.rms_norm(raw_k, w.k_norm, eps)
        v = mx.fast.rms_norm(v, None, eps)
        source = carried is not None and b in carried.kv
        if source:  # a shared source: its step's K and V travel on, turned once
            carried.kv[b] = k, v = rope(k.transpose(0, 2, 1, 3), positions, dims), v.transpose(0, 2, 1, 3)
        attended = _attend(q, k, v, cache, buf, positions, mask, dims, turned=source)
    elif kind == "hold":
        k, v = carried.kv[carried.g.blocks[b].kv_from]
        attended = _attend(q, k, v, cache, buf, positions, mask, dims, turned=True)
    else:
        attended = _attend(q, None, None, cache, buf, positions, mask, dims)
    o = w.o(attended)  # [1, n, hidden]
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
    if g4 is not None and g4.inp_gate is not None:  # the block's per-layer input, gated by its output
        pe = g4.proj(gelu_tanh(g4.inp_gate(out)) * carried.ple_of(b))
        out = out + mx.fast.rms_norm(pe, g4.post_norm, eps)
    return out if g4 is None or g4.layer_scale is None else out * g4.layer_scale
