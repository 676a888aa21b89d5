"""Hybrid (`qwen35`, `qwen35moe`, `qwen3next`) blocks on MLX: the gated delta-net layer and the
gated attention layer, as backends/openvino/delta_net.py computes them (the math and llama.cpp's
sources are described there; backends/gguf/hybrid.py reads the files).

A slot's recurrent state lives beside its KV (model.SlotCache.recurrent: per delta-net block the
conv state [K − 1, C] and the matrix state [Hv, S, S]). The delta rule runs position by position
(a sequential scan, exact at f32, as ggml-cpu's fused op). A cut back inside the last step of
several positions (a verify step's rejected drafts) puts the state back to the step's start and
feeds the kept positions again (`RecurrentSteps` of the OpenVINO shard, the same rule: the shard
keeps the step's start state and inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from backends.mlx.model import Dims, SlotCache, experts_ffn, nn_silu
from backends.mlx.weights import HybridWeights


@dataclass(frozen=True)
class HybridDims:
    recurrent: tuple[bool, ...]  # per block of the shard
    rope_inv: np.ndarray  # [R/2] the rotated dims' frequencies (IMROPE's zeros included)
    k_heads: int
    v_heads: int
    state: int
    conv_kernel: int
    interleaved: bool


def init_state(cache: SlotCache, hd: HybridDims) -> None:
    """Zero recurrent states for the shard's delta-net blocks (a fresh or reset slot)."""
    C = (2 * hd.k_heads + hd.v_heads) * hd.state
    cache.recurrent = {
        i: (mx.zeros((hd.conv_kernel - 1, C)), mx.zeros((hd.v_heads, hd.state, hd.state)))
        for i, r in enumerate(hd.recurrent) if r
    }  # fmt: skip


def _l2(x: mx.array, eps: float) -> mx.array:
    return x / mx.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, w, eps)


def delta_net(x: mx.array, w: HybridWeights, cache: SlotCache, layer: int, dims: Dims, hd: HybridDims) -> mx.array:
    """x [n, H] (after attn_norm) → the delta-net layer's output [n, H]; advances the slot's state."""
    n = x.shape[0]
    S, Hk, Hv, K = hd.state, hd.k_heads, hd.v_heads, hd.conv_kernel
    r = Hv // Hk
    if hd.interleaved:  # qwen3next
        if w.qkv is not None:
            qkv, z = w.qkv(x), w.z(x)
        else:  # per key head: q S, k S, v r·S, z r·S
            g = w.ssm_in(x).reshape(n, Hk, 2 * S + 2 * r * S)
            qkv = mx.concatenate([g[..., :S].reshape(n, -1), g[..., S:2 * S].reshape(n, -1),
                                  g[..., 2 * S:2 * S + r * S].reshape(n, -1)], axis=-1)  # fmt: skip
            z = g[..., 2 * S + r * S:].reshape(n, -1)
        ba = w.ba(x).reshape(n, Hk, 2 * r)
        beta, alpha = ba[..., :r].reshape(n, Hv), ba[..., r:].reshape(n, Hv)
    else:
        qkv, z, beta, alpha = w.qkv(x), w.z(x), w.beta(x), w.alpha(x)
    beta = mx.sigmoid(beta)  # [n, Hv]
    g = mx.logaddexp(alpha + w.dt_bias, mx.zeros_like(alpha)) * w.a  # softplus · a, [n, Hv]
    conv_state, m = cache.recurrent[layer]
    cin = mx.concatenate([conv_state, qkv], axis=0)  # [K − 1 + n, C]
    conv = sum(cin[j:j + n] * w.conv[:, j] for j in range(K))  # [n, C]
    conv = nn_silu(conv)
    kd = Hk * S
    q = _l2(conv[:, :kd].reshape(n, Hk, S), dims.rms_eps) * (1.0 / np.sqrt(S))
    k = _l2(conv[:, kd:2 * kd].reshape(n, Hk, S), dims.rms_eps)
    v = conv[:, 2 * kd:].reshape(n, Hv, S)
    if r > 1:
        if hd.interleaved:  # value head j reads key head j // r
            q, k = (mx.repeat(t, r, axis=1) for t in (q, k))
        else:  # value head j reads key head j mod Hk
            q, k = (mx.concatenate([t] * r, axis=1) for t in (q, k))
    outs = []
    for t in range(n):  # the gated delta rule, one position at a time
        m = m * mx.exp(g[t])[:, None, None]  # [Hv, S_v, S_k]
        mk = (m * k[t][:, None, :]).sum(axis=-1)  # [Hv, S_v]
        d = (v[t] - mk) * beta[t][:, None]
        m = m + d[:, :, None] * k[t][:, None, :]
        outs.append((m * q[t][:, None, :]).sum(axis=-1))  # [Hv, S_v]
    cache.recurrent[layer] = (cin[-(K - 1):], m)
    o = _rms(mx.stack(outs), w.ssm_norm, dims.rms_eps)  # [n, Hv, S]
    o = o * nn_silu(z.reshape(n, Hv, S))
    return w.out(o.reshape(n, Hv * S))


def gated_attention(x: mx.array, w: HybridWeights, cache: SlotCache, layer: int, positions: np.ndarray,
                    mask: mx.array | str | None, dims: Dims, hd: HybridDims) -> mx.array:
    """x [n, H] (after attn_norm) → the gated attention's output [n, H]; writes the KV."""
    n = x.shape[0]
    D, H, Hkv = dims.head_dim, dims.n_heads, dims.n_kv_heads
    qg = w.q(x).reshape(n, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(n, H * D)
    q = _rms(q, w.q_norm, dims.rms_eps)
    k = _rms(w.k(x).reshape(n, Hkv, D), w.k_norm, dims.rms_eps)
    v = w.v(x).reshape(n, Hkv, D)
    q, k = _partial_rope(q, positions, hd.rope_inv), _partial_rope(k, positions, hd.rope_inv)
    start, end = cache.length, cache.length + n
    keys, values = cache.keys[layer], cache.values[layer]
    keys[:, :, start:end] = k.transpose(1, 0, 2)[None]
    values[:, :, start:end] = v.transpose(1, 0, 2)[None]
    cache.keys[layer], cache.values[layer] = keys, values
    o = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], keys[:, :, :end], values[:, :, :end],
                                             scale=D**-0.5, mask=mask)  # [1, H, n, D]  # fmt: skip
    o = o[0].transpose(1, 0, 2).reshape(n, H * D) * mx.sigmoid(gate)
    return w.o(o)


def _partial_rope(x: mx.array, positions: np.ndarray, inv: np.ndarray) -> mx.array:
    """NEOX RoPE of the first R = 2·len(inv) dims of x [n, heads, D] at `positions`; the rest pass."""
    R = 2 * len(inv)
    theta = mx.array((positions[:, None].astype(np.float32) * inv[None, :].astype(np.float32)))  # [n, R/2]
    cos, sin = mx.cos(theta)[:, None, :], mx.sin(theta)[:, None, :]
    a, b = x[..., : R // 2], x[..., R // 2:R]
    rot = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return mx.concatenate([rot, x[..., R:]], axis=-1) if R < x.shape[-1] else rot


def hybrid_block(x: mx.array, w: HybridWeights, cache: SlotCache, layer: int, positions: np.ndarray,
                 mask: mx.array | str | None, dims: Dims, hd: HybridDims) -> mx.array:
    """One hybrid block on x [n, H]: norm → delta net or gated attention → residual → norm → FFN →
    residual."""
    y = _rms(x, w.attn_norm, dims.rms_eps)
    if hd.recurrent[layer]:
        x = x + delta_net(y, w, cache, layer, dims, hd)
    else:
        x = x + gated_attention(y, w, cache, layer, positions, mask, dims, hd)
    y = _rms(x, w.ffn_norm, dims.rms_eps)
    if w.moe is not None:
        return x + experts_ffn(y[None], w.moe, dims)[0]
    return x + w.down(nn_silu(w.gate(y)) * w.up(y))
