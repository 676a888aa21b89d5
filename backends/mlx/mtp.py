"""A file's multi-token-prediction block on MLX: what backends/openvino/mtp.py computes (its
docstring: llama.cpp's qwen35 / qwen35moe `graph_mtp`), for an MLX head (`--speculate mtp`).

Rows in are [e_q | h_{q−1}] (backends.gguf.hybrid.mtp_inputs), rows out the block's h' after
its head norm; `greedy(h')` is the MTP head's top-1 of the last row. The slot's KV cache, masks
and cuts are MLXShard's: the block is an attention block of the hybrid model (hybrid.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from backends.base import ShardSpec
from backends.gguf import ModelIndex
from backends.gguf.hybrid import mtp_block
from backends.mlx.hybrid import hybrid_block
from backends.mlx.model import SlotCache
from backends.mlx.shard import MLXShard


class MLXMtpShard(MLXShard):
    """The MTP block of `index` on MLX (the interface of backends.openvino.mtp.MtpShard)."""

    def __init__(self, index: ModelIndex, precision: str = "serving") -> None:
        b = mtp_block(index)
        super().__init__(ShardSpec(index.path, b, b + 1, embed=False, head=True), precision, index=index, mtp=True)

    def _forward_hybrid(self, slot: int, cache: SlotCache, x: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                        visible: mx.array | str | None) -> np.ndarray:
        n, H, own = len(x), self.dims.hidden, self.weights.mtp
        rows = mx.array(np.asarray(x, dtype=np.float32).reshape(n, 2 * H))
        eps = self.dims.rms_eps
        both = mx.concatenate([mx.fast.rms_norm(rows[:, :H], own.enorm, eps),
                               mx.fast.rms_norm(rows[:, H:], own.hnorm, eps)], axis=-1)  # fmt: skip
        self._mind_cache(1, n)
        cache.reserve(n)
        h = hybrid_block(own.eh_proj(both), self.weights.blocks[0], cache, 0,
                         np.asarray(positions, dtype=np.int64).reshape(-1), visible, self.dims, self.hybrid)  # fmt: skip
        cache.length += n
        out = mx.fast.rms_norm(h, own.head_norm, eps)
        mx.eval(out, cache.arrays())
        return np.array(out, dtype=np.float32)

    def _logits(self, hidden: np.ndarray) -> mx.array:
        """The MTP head on h' (already normalised by the block's head norm)."""
        h = mx.array(np.asarray(hidden, dtype=np.float32).reshape(-1, self.dims.hidden))
        return self.weights.mtp.head(h).astype(mx.float32)


__all__ = ["MLXMtpShard"]
