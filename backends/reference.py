"""The numerical yardstick: an exact float64 numpy forward of a block range (not a serving path).

Weights are dequantized exactly (every GGML quant value is exact in float64). The block is written
as llama.cpp's graphs for llama / qwen2 / qwen3 compute it (src/models/*.cpp, ggml's rope op), in
GGUF's own layout: llama's q/k rows stay permuted and rotate in pairs (2i, 2i+1) ("normal" RoPE),
qwen's rotate halves (i, i + D/2) ("neox"). The OpenVINO graph, which un-permutes llama's rows and
uses rotate_half for both, is thereby checked against an independent formulation; this one is
checked against llama.cpp itself (tests/test_llamacpp_arch.py). RoPE angle of pair i at position
p: θ_i = p·scale·base^(−2i/D) / factor_i (linear scaling, llama3 rope_freqs factors).
KV per slot, attention over physical positions honouring the mask, RoPE at the given logical
positions: the same contract as backends.base.Shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.base import HeadOps, ShardSpec
from backends.gguf import ModelIndex, open_model
from backends.gguf.families import require_llama_blocks

F64 = np.float64


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_angles(positions: np.ndarray, d: int, base: float, scale: float = 1.0,
                factors: np.ndarray | None = None) -> np.ndarray:
    """θ [n, D/2]: θ[p, i] = positions[p]·scale·base^(−2i/D) / factors[i] (ggml's rope cache)."""
    inv_freq = base ** (-np.arange(0, d, 2, dtype=F64) / d)  # [D/2]
    if factors is not None:
        inv_freq = inv_freq / factors
    return positions[:, None].astype(F64) * scale * inv_freq[None, :]


def rope_interleaved(x: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """x [n, heads, D]: rotate each pair (x[2i], x[2i+1]) by θ [n, D/2] ("normal" RoPE)."""
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # [n, 1, D/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def rope_neox(x: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """x [n, heads, D]: rotate each pair (x[i], x[i + D/2]) by θ [n, D/2] ("neox" RoPE)."""
    half = x.shape[-1] // 2
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # [n, 1, D/2]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


@dataclass
class _Slot:
    k: list[np.ndarray] = field(default_factory=list)  # per block [S, nkv, D]
    v: list[np.ndarray] = field(default_factory=list)


class ReferenceShard(HeadOps):
    """Float64 forward of blocks [first, last) (see backends.base.Shard)."""

    def __init__(self, spec: ShardSpec, precision: str = "f32", index: ModelIndex | None = None) -> None:
        self.spec = spec
        self.precision = precision  # always float64; accepted for the common signature
        self.index = index if index is not None else open_model(spec.model_path)
        self.index.check_range(spec.first, spec.last)
        require_llama_blocks(self.index.hparams, "reference")
        self.h = self.index.hparams
        self._blocks = [self._load_block(b) for b in range(spec.first, spec.last)]
        self._rope = rope_neox if self.h.rope_neox else rope_interleaved
        self._rope_factors = self.index.dequantize("rope_freqs.weight", F64) if self.h.rope_freq_factors else None
        self._embed = self.index.blocks_of("token_embd.weight") if spec.embed and self._quantized("token_embd.weight") else None
        self._lm_head: np.ndarray | None = None
        self._slots: dict[int, _Slot] = {}

    def _quantized(self, name: str) -> bool:
        return self.index.tensors[name].qtype not in ("F32", "F16", "BF16")

    def _load_block(self, b: int) -> dict[str, np.ndarray]:
        p = f"blk.{b}."
        names = [n[len(p):] for n in self.index.tensors if n.startswith(p)]
        return {n: self.index.dequantize(p + n, F64) for n in names}

    # --- slots -------------------------------------------------------------------------

    def open_slot(self) -> int:
        slot = next(i for i in range(len(self._slots) + 1) if i not in self._slots)
        n = len(self._blocks)
        h = self.h
        empty = np.zeros((0, h.n_kv_heads, h.head_dim), F64)
        self._slots[slot] = _Slot([empty] * n, [empty] * n)
        return slot

    def close_slot(self, slot: int) -> None:
        del self._slots[slot]

    def trim(self, slot: int, length: int) -> None:
        s = self._slots[slot]
        if self._blocks and length > s.k[0].shape[0]:
            raise ValueError(f"slot {slot} holds {s.k[0].shape[0]} positions, not {length}")
        self._slots[slot] = _Slot([k[:length] for k in s.k], [v[:length] for v in s.v])

    def capture(self, slot: int) -> Any:
        s = self._slots[slot]
        return _Slot(list(s.k), list(s.v))  # arrays are never mutated in place

    def restore(self, slot: int, state: Any) -> None:
        self._slots[slot] = _Slot(list(state.k), list(state.v))

    # --- compute -----------------------------------------------------------------------

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """token ids [n] → [n, H] float64."""
        if self._embed is None:
            return self.index.dequantize("token_embd.weight", F64)[ids]
        return self._embed.rows(ids, F64)

    def forward_exact(self, slot: int, x: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """forward in float64 throughout; returns float64 [n, H]."""
        state = self._slots[slot]
        x = self.embed(np.asarray(x, np.int64)) if self.spec.embed else np.asarray(x, F64)
        n = x.shape[0]
        positions = np.asarray(positions, np.int64)
        mask = np.asarray(mask, np.int64)
        total = state.k[0].shape[0] + n if self._blocks else len(mask)
        if len(mask) != total:
            raise ValueError(f"mask covers {len(mask)} positions, the cache holds {total} after this feed")
        # new token i sees physical j iff j ≤ total − n + i and mask[j] ≠ 0
        visible = (np.arange(total)[None, :] <= (total - n + np.arange(n))[:, None]) & (mask[None, :] != 0)
        h = self.h
        theta = rope_angles(positions, h.head_dim, h.rope_base, h.rope_scale, self._rope_factors)  # [n, D/2]
        for i, w in enumerate(self._blocks):
            x, state.k[i], state.v[i] = self._block(w, x, theta, visible, state.k[i], state.v[i])
        return x

    def _block(self, w, x, theta, visible, k_past, v_past):
        h = self.h
        D, nh, nkv = h.head_dim, h.n_heads, h.n_kv_heads
        n = x.shape[0]
        y = rms_norm(x, w["attn_norm.weight"], h.rms_eps)
        q = y @ w["attn_q.weight"].T + w.get("attn_q.bias", 0.0)
        k = y @ w["attn_k.weight"].T + w.get("attn_k.bias", 0.0)
        v = y @ w["attn_v.weight"].T + w.get("attn_v.bias", 0.0)
        q, k = q.reshape(n, nh, D), k.reshape(n, nkv, D)  # [n, nh, D], [n, nkv, D]
        if h.qk_norm:  # qwen3: RMSNorm over each head's D values
            q = rms_norm(q, w["attn_q_norm.weight"], h.rms_eps)
            k = rms_norm(k, w["attn_k_norm.weight"], h.rms_eps)
        q, k = self._rope(q, theta), self._rope(k, theta)
        k_all = np.concatenate([k_past, k])  # [S, nkv, D]
        v_all = np.concatenate([v_past, v.reshape(n, nkv, D)])
        group = nh // nkv
        kh = np.repeat(k_all, group, axis=1).transpose(1, 0, 2)  # [nh, S, D]
        vh = np.repeat(v_all, group, axis=1).transpose(1, 0, 2)
        scores = np.einsum("nhd,hsd->hns", q, kh) / np.sqrt(D)  # [nh, n, S]
        scores = np.where(visible[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attn = np.einsum("hns,hsd->nhd", probs, vh).reshape(n, nh * D)
        x = x + attn @ w["attn_output.weight"].T
        y = rms_norm(x, w["ffn_norm.weight"], h.rms_eps)
        x = x + (silu(y @ w["ffn_gate.weight"].T) * (y @ w["ffn_up.weight"].T)) @ w["ffn_down.weight"].T
        return x, k_all, v_all

    def forward(self, slot: int, x: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self.forward_exact(slot, x, positions, mask).astype(np.float32)

    def forward_batch(self, slots, xs, positions, masks) -> list[np.ndarray]:
        """Row by row: the yardstick has no weights to share, only results to match."""
        return [self.forward(*row) for row in zip(slots, xs, positions, masks)]

    def logits_exact(self, hidden: np.ndarray) -> np.ndarray:
        if not self.spec.head:
            raise ValueError(f"shard [{self.spec.first}, {self.spec.last}) holds no head")
        if self._lm_head is None:
            name = "token_embd.weight" if self.h.tied_embeddings else "output.weight"
            self._lm_head = self.index.dequantize(name, F64)
        y = rms_norm(np.asarray(hidden, F64), self.index.dequantize("output_norm.weight", F64), self.h.rms_eps)
        return y @ self._lm_head.T

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.logits_exact(hidden).astype(np.float32)

    def greedy(self, hidden: np.ndarray) -> int:
        return int(np.argmax(self.logits_exact(np.asarray(hidden)[-1:])[0]))
