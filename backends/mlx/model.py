"""The Llama block range as MLX ops: a small attention of our own over a per-slot KV cache.

mlx-lm's attention takes its RoPE offset from the cache length and its mask from the cache shape.
Kafila needs both from outside: positions are *logical* (a rejected draft moves them back) while
the cache is *physical* (rejected positions stay in it, masked out). So the attention here builds
the mask exactly as the OpenVINO stage does, over the S = cache_len + n physical positions:

    visible[i, j] = (j ≤ cache_len + i) AND (attention_mask[j] ≠ 0)        # [n, S]

and rotates q/k with `mx.fast.rope` at the logical positions, in the form llama.cpp uses for the
architecture: llama rotates pairs (2i, 2i+1) ("traditional": GGUF stores its q/k rows permuted
for it), qwen2/qwen3 rotate halves (i, i + D/2). Angle of pair i at position p:
θ_i = p·scale·base^(−2i/D) / factor_i (linear scaling; llama3's rope_freqs factors, passed to
`mx.fast.rope` as `freqs` = base^(2i/D)·factor_i). Qwen3 normalizes each q/k head before RoPE.

Everything is lazy: a forward builds one graph over all blocks, evaluated once by the caller.

Batched rows (`block_rows`): several slots' new tokens are laid one row after another along the
token axis, so each projection is one matmul over all of them (weights read once); only RoPE,
the cache write and the attention loop over the rows, each on its own SlotCache. No padding, no
shared cache layout: a row joins or leaves a batch at no cost, and its attention is the very
computation `block` does for it alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from backends.gguf.families import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from backends.mlx.weights import BlockWeights, MoEWeights

CACHE_STEP = 256  # the KV buffers grow in steps of this many positions (as mlx-lm's KVCache)


@dataclass(frozen=True)
class Dims:
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    rms_eps: float
    rope_traditional: bool = True  # pairs (2i, 2i+1) (llama); False: halves (i, i + D/2) (qwen)
    rope_scale: float = 1.0  # positions × rope_scale (linear scaling)
    rope_freqs: mx.array | None = None  # [D/2] base^(2i/D)·factor_i when the model has rope_freqs
    experts_used: int = 0  # k: experts a token goes through (MoE blocks)
    experts_renorm: bool = False  # the k weights divided by their sum (qwen3moe, Mixtral)
    experts_scale: float = 0.0  # the k weights × this (0 or 1: unscaled)
    # Gemma 3 (backends/gguf/families.py): GeGLU and the q·k scale (its output norms: BlockWeights)
    gelu: bool = False  # GeGLU (gelu_tanh) instead of SwiGLU
    attn_scale: float = 0.0  # q·k scale; 0: 1/sqrt(head size)
    # gpt-oss: experts' activation and routing, YaRN's magnitude on the rotated q and k
    swiglu_oai: bool = False  # x·sigmoid(1.702·x)·(y + 1) with x = min(gate, 7), y = clamp(up, ±7)
    gating: str = "softmax"  # "softmax": over all E, then top-k; "softmax_weight": top-k, then softmax
    rope_magnitude: float = 1.0  # YaRN: cos and sin × this
    rope_dims: int = 0  # RoPE turns the first rope_dims of each head (NEOX halves), the rest pass; 0: all


class SlotCache:
    """One slot's KV: per block a key and a value buffer [1, Hkv, capacity, D], `length` used.
    A windowed block's buffers (`windowed`: sliding-window models) hold the columns from `dropped`
    on only (backends/window.py's rules; the shard drops them: MLXShard._fit)."""

    def __init__(self, n_blocks: int, dims: Dims, dtype: mx.Dtype = mx.float32,
                 shapes: list[tuple[int, int]] | None = None, windowed: tuple[bool, ...] = ()):
        """`shapes`: each block's (KV heads, head size) where they differ (gemma4), else `dims`'."""
        self.n_blocks = n_blocks
        self.dims = dims
        self.shapes = shapes or [(dims.n_kv_heads, dims.head_dim)] * n_blocks
        self.dtype = dtype
        self.length = 0  # physical positions filled
        self.keys: list[mx.array | None] = [None] * n_blocks
        self.values: list[mx.array | None] = [None] * n_blocks
        self.recurrent: dict[int, tuple[mx.array, mx.array]] = {}  # hybrid models' states (hybrid.py)
        self.windowed = windowed or (False,) * n_blocks
        self.dropped = 0  # columns the windowed blocks no longer hold
        self.seen = np.zeros(0, np.int64)  # the mask of the physical columns, as last given

    def offset(self, layer: int) -> int:
        """The physical column of the block's buffer column 0."""
        return self.dropped if self.windowed[layer] else 0

    def reserve(self, n: int) -> None:
        """Make room for n more positions, growing by whole steps (no O(n²) concatenation)."""
        for i in range(self.n_blocks):
            used = self.length - self.offset(i)
            old = self.keys[i]
            if old is not None and used + n <= old.shape[2]:
                continue
            capacity = -(-(used + n) // CACHE_STEP) * CACHE_STEP
            hkv, d = self.shapes[i]
            pad_shape = (1, hkv, capacity - used, d)
            for buffers in (self.keys, self.values):
                # a distinct array per buffer: block() writes into it in place
                pad = mx.zeros(pad_shape, self.dtype)
                old = buffers[i]
                buffers[i] = pad if old is None else mx.concatenate([old[:, :, :used], pad], axis=2)

    def drop(self, start: int) -> None:
        """The windowed blocks keep the columns from `start` on (copied out: a slice would keep
        the whole buffer alive)."""
        cut = start - self.dropped
        for i in range(self.n_blocks):
            if self.windowed[i] and self.keys[i] is not None:
                self.keys[i] = mx.contiguous(self.keys[i][:, :, cut:])
                self.values[i] = mx.contiguous(self.values[i][:, :, cut:])
        self.dropped = start

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None] + [a for s in self.recurrent.values() for a in s]

    def snapshot(self) -> tuple[int, tuple[mx.array, ...], tuple[mx.array, ...]]:
        """The used part of every buffer, as new arrays (MLX arrays are values: later writes to
        the live buffers cannot reach them)."""
        n = self.length
        if n == 0:
            return 0, (), ()
        keys = tuple(k[:, :, : n - self.offset(i)] for i, k in enumerate(self.keys))
        values = tuple(v[:, :, : n - self.offset(i)] for i, v in enumerate(self.values))
        mx.eval(keys, values)
        return n, keys, values

    def load(self, length: int, keys: tuple[mx.array, ...], values: tuple[mx.array, ...], dropped: int = 0) -> None:
        self.length, self.dropped = length, dropped if length else 0
        self.keys = list(keys) if length else [None] * self.n_blocks
        self.values = list(values) if length else [None] * self.n_blocks
        self.seen = np.ones(length, np.int64)


def attention_mask(mask: np.ndarray, cache_len: int, n: int) -> mx.array | str | None:
    """The boolean [n, S] visibility of the module docstring, or a cheaper equivalent:
    None when everything is visible (one new token, nothing masked), "causal" when only the
    causal part applies (MLX aligns it to the lower right, as j ≤ cache_len + i)."""
    if mask.all():
        return None if n == 1 else "causal"
    s = cache_len + n
    causal = np.arange(s)[None, :] <= cache_len + np.arange(n)[:, None]  # [n, S]
    return mx.array(causal & (mask[None, :] != 0))


def rope(x: mx.array, positions: int | mx.array, dims: Dims) -> mx.array:
    """RoPE on x [1, heads, n, D] at logical positions (see the module docstring).

    positions: the first position when the n positions are consecutive (the usual case, one fused
    kernel), else an int32 [n] array of arbitrary positions.
    """
    if dims.rope_magnitude != 1.0:
        return rope(x, positions, dataclasses.replace(dims, rope_magnitude=1.0)) * dims.rope_magnitude
    turned = dims.rope_dims or dims.head_dim
    if isinstance(positions, int):
        base = None if dims.rope_freqs is not None else dims.rope_base
        return mx.fast.rope(
            x, turned, traditional=dims.rope_traditional, base=base,
            scale=dims.rope_scale, offset=positions, freqs=dims.rope_freqs,
        )  # fmt: skip
    if turned < dims.head_dim:  # the first `turned` dims of each head turn, the rest pass (NEOX)
        whole = dataclasses.replace(dims, head_dim=turned, rope_dims=0)
        return mx.concatenate([rope(x[..., :turned], positions, whole), x[..., turned:]], axis=-1)
    half = dims.head_dim // 2
    if dims.rope_freqs is not None:
        inv_freq = 1.0 / dims.rope_freqs  # [D/2]
    else:
        inv_freq = dims.rope_base ** (-mx.arange(half, dtype=mx.float32) * 2 / dims.head_dim)
    theta = dims.rope_scale * positions.astype(mx.float32)[:, None] * inv_freq[None, :]  # [n, D/2]
    cos, sin = mx.cos(theta), mx.sin(theta)
    if dims.rope_traditional:
        pairs = x.reshape(*x.shape[:-1], half, 2)  # [1, heads, n, D/2, 2]: (even, odd) pairs
        a, b = pairs[..., 0], pairs[..., 1]
        rotated = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)  # [1, heads, n, D/2, 2]
        return rotated.reshape(x.shape).astype(x.dtype)
    a, b = x[..., :half], x[..., half:]  # [1, heads, n, D/2] each
    return mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


def block(
    x: mx.array,
    w: BlockWeights,
    cache: SlotCache,
    layer: int,
    positions: int | mx.array,
    mask: mx.array | str | None,
    dims: Dims,
) -> mx.array:
    """One Llama block on x [1, n, hidden]; writes the n new keys/values at cache.length."""
    q, k, v = _qkv(x, w, dims)
    o = _attend(q, k, v, cache, layer, positions, mask, dims, w.sinks)  # [1, n, H·D]
    return _finish(x, o, w, dims)


def block_rows(
    x: mx.array,
    w: BlockWeights,
    caches: list[SlotCache],
    layer: int,
    positions: list[int | mx.array],
    masks: list[mx.array | str | None],
    ns: list[int],
    dims: Dims,
) -> mx.array:
    """`block` on several slots' rows at once: x [1, T, hidden] holds row r's n_r new tokens after
    row r−1's (T = Σ n_r). Every projection runs once on all T tokens (the weights are read once);
    RoPE, the KV write and the attention run per row, on its own cache, positions and mask, the
    same ops `block` runs for that slot alone."""
    q, k, v = _qkv(x, w, dims)  # [1, T, H, D], [1, T, Hkv, D] ×2
    outs, start = [], 0
    for cache, pos, mask, n in zip(caches, positions, masks, ns):
        rows = slice(start, start + n)
        outs.append(_attend(q[:, rows], k[:, rows], v[:, rows], cache, layer, pos, mask, dims, w.sinks))
        start += n
    return _finish(x, mx.concatenate(outs, axis=1), w, dims)  # [1, T, hidden]


def _qkv(x: mx.array, w: BlockWeights, dims: Dims) -> tuple[mx.array, mx.array, mx.array]:
    """RMSNorm → q, k, v [1, n, H|Hkv, D] (qwen3: each q/k head normalized)."""
    _, n, _ = x.shape
    H, Hkv, D = dims.n_heads, dims.n_kv_heads, dims.head_dim
    h = mx.fast.rms_norm(x, w.attn_norm, dims.rms_eps)  # [1, n, hidden]
    q = w.q(h).reshape(1, n, H, D)  # [1, n, H, D]
    k = w.k(h).reshape(1, n, Hkv, D)  # [1, n, Hkv, D]
    if w.q_norm is not None:  # qwen3: RMSNorm over each head's D values
        q = mx.fast.rms_norm(q, w.q_norm, dims.rms_eps)
        k = mx.fast.rms_norm(k, w.k_norm, dims.rms_eps)
    v = w.v(h).reshape(1, n, Hkv, D)  # [1, n, Hkv, D]
    return q, k, v


def _attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    cache: SlotCache,
    layer: int,
    positions: int | mx.array,
    mask: mx.array | str | None,
    dims: Dims,
    sinks: mx.array | None = None,
    turned: bool = False,
) -> mx.array:
    """One slot's attention: RoPE at its positions, its n new keys/values written at
    cache.length, attention over its cache with its mask (and gpt-oss's sinks) → [1, n, H·D].
    `turned`: k and v come as [1, Hkv, n, D], k already turned (gemma4's shared KV); k None: the
    block's buffers already hold the step's keys and values (a block sharing them)."""
    _, n, H, D = q.shape
    off = cache.offset(layer)  # a windowed block holds the newest columns only (SlotCache)
    start, end = cache.length - off, cache.length + n - off
    if off and isinstance(mask, mx.array):
        mask = mask[:, off:]
    q = rope(q.transpose(0, 2, 1, 3), positions, dims)  # [1, H, n, D]
    keys, values = cache.keys[layer], cache.values[layer]  # [1, Hkv, capacity, D]
    if k is not None:
        if not turned:
            k = rope(k.transpose(0, 2, 1, 3), positions, dims)  # [1, Hkv, n, D]
            v = v.transpose(0, 2, 1, 3)  # [1, Hkv, n, D]
        keys[:, :, start:end] = k.astype(keys.dtype)
        values[:, :, start:end] = v.astype(values.dtype)
        cache.keys[layer], cache.values[layer] = keys, values
    o = mx.fast.scaled_dot_product_attention(
        q, keys[:, :, :end], values[:, :, :end], scale=dims.attn_scale or D**-0.5, mask=mask, sinks=sinks
    )  # [1, H, n, D], GQA handled by the kernel
    return o.transpose(0, 2, 1, 3).reshape(1, n, H * D)  # [1, n, H·D]


def _finish(x: mx.array, o: mx.array, w: BlockWeights, dims: Dims) -> mx.array:
    """o_proj → residual → RMSNorm → SwiGLU (Gemma: GeGLU; or the experts') → residual:
    [1, n, hidden]; Gemma normalizes the attention's and the FFN's outputs before their adds."""
    o = w.o(o)
    if w.post_attn_norm is not None:
        o = mx.fast.rms_norm(o, w.post_attn_norm, dims.rms_eps)
    x = x + o  # [1, n, hidden]
    h = mx.fast.rms_norm(x, w.ffn_norm, dims.rms_eps)
    if w.moe is not None:
        return x + experts_ffn(h, w.moe, dims)
    f = w.down((gelu_tanh(w.gate(h)) if dims.gelu else nn_silu(w.gate(h))) * w.up(h))
    if w.post_ffw_norm is not None:
        f = mx.fast.rms_norm(f, w.post_ffw_norm, dims.rms_eps)
    return x + f  # [1, n, hidden]


def experts_ffn(h: mx.array, m: MoEWeights, dims: Dims, router_x: mx.array | None = None) -> mx.array:
    """The mixture of experts as llama.cpp's build_moe_ffn computes it for these families: softmax
    over the E router logits, the top k, their weights renormalised and scaled as the family says;
    each token through its k experts' SwiGLU (Gemma 4: GeGLU) only; qwen2moe adds its shared expert
    gated by sigmoid(gate_inp_shexp · h). h [1, n, hidden] → [1, n, hidden]; `router_x` [1, n,
    hidden]: the router's input where it is not h (gemma4)."""
    _, n, hidden = h.shape
    t = h.reshape(n, hidden)  # [T, H]
    logits = m.router(t if router_x is None else router_x.reshape(n, hidden)).astype(mx.float32)  # [T, E] (+ gpt-oss's bias)
    probs = mx.softmax(logits, axis=-1) if dims.gating == "softmax" else logits
    k = dims.experts_used
    ids = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # [T, k]: the k most probable
    weights = mx.take_along_axis(probs, ids, axis=-1)  # [T, k]
    if dims.gating == "softmax_weight":  # gpt-oss: softmax over the k chosen logits
        weights = mx.softmax(weights, axis=-1)
    if dims.experts_renorm:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    if dims.experts_scale not in (0.0, 1.0):
        weights = weights * dims.experts_scale
    xe = t.reshape(n, 1, 1, hidden)  # [T, 1, 1, H]
    g, u = m.gate(xe, ids), m.up(xe, ids)  # [T, k, 1, F]
    act = swiglu_oai(g, u) if dims.swiglu_oai else (gelu_tanh(g) if dims.gelu else nn_silu(g)) * u
    y = m.down(act, ids).squeeze(-2)  # [T, k, H]
    out = (y * weights[..., None].astype(y.dtype)).sum(axis=1)  # [T, H]
    if m.shared is not None:
        gate, up, down = m.shared
        gated = mx.sigmoid(m.shared_gate(t)).reshape(n, 1)  # [T, 1] (the gate is one row, stored [H] or [1, H])
        out = out + gated * down(nn_silu(gate(t)) * up(t))  # [T, H]
    return out.reshape(1, n, hidden)


def nn_silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def gelu_tanh(x: mx.array) -> mx.array:
    """0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))) (ggml_gelu; Gemma's GeGLU)."""
    return 0.5 * x * (1.0 + mx.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def window_mask(mask: np.ndarray, cache_len: int, positions: np.ndarray, window: int) -> mx.array:
    """A windowed layer's [n, S] visibility: the full one (attention_mask's) and, in addition,
    no key more than `window` − 1 logical positions before its query; a key's logical position
    is its count among the visible physical positions before it (as the OpenVINO stage's)."""
    n, s = len(positions), cache_len + len(positions)
    causal = np.arange(s)[None, :] <= cache_len + np.arange(n)[:, None]  # [n, S]
    visible = mask != 0
    key_pos = np.cumsum(visible) - 1  # [S]
    near = positions[:, None] - key_pos[None, :] < window
    return mx.array(causal & visible[None, :] & near)


def swiglu_oai(gate: mx.array, up: mx.array) -> mx.array:
    """gpt-oss's expert activation (ggml_swiglu_oai): x = min(gate, 7), y = clamp(up, −7, 7),
    x·sigmoid(1.702·x)·(y + 1)."""
    x = mx.minimum(gate, SWIGLU_OAI_LIMIT)
    y = mx.clip(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return x * mx.sigmoid(SWIGLU_OAI_ALPHA * x) * (y + 1.0)
