"""Exact GGML block formats for the quant types Kafila serves.

Every block covers 32 consecutive weights of one row. Nibble order (Q4_*): element j of a block is
the low nibble of byte j, element j+16 the high nibble of byte j.
  Q8_0: f16 d, 32 x i8 q             w = d·q
  Q4_0: f16 d, 16 bytes of nibbles   w = d·(q − 8)
  Q4_1: f16 d, f16 m, 16 bytes       w = d·q + m
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # weights per block, every supported quantized type


@dataclass(frozen=True)
class QuantBlocks:
    """A quantized tensor split into its parts, each shaped [rows, cols // 32, ...]."""

    qtype: str
    q: np.ndarray  # uint8 [rows, nb, 32] in 0..15 (Q4_*) or int8 [rows, nb, 32] (Q8_0)
    scale: np.ndarray  # float16 [rows, nb]
    offset: np.ndarray | None  # float16 [rows, nb]: Q4_1's min; None otherwise

    def dequantize(self, dtype=np.float64) -> np.ndarray:
        """The exact weights [rows, cols] (every f16 and integer is exact in f32/f64)."""
        q = self.q.astype(dtype)
        if self.qtype == "Q4_0":
            q = q - 8.0
        w = q * self.scale.astype(dtype)[..., None]
        if self.offset is not None:
            w = w + self.offset.astype(dtype)[..., None]
        return w.reshape(w.shape[0], -1)


BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., 16] → uint8 [..., 32] in GGML order (low nibbles first, then high)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def split_blocks(qtype: str, raw: np.ndarray, rows: int, cols: int) -> QuantBlocks:
    """Split the raw bytes of a [rows, cols] tensor of type `qtype` into its parts."""
    nb = cols // QK
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, nb, BLOCK_BYTES[qtype])
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == "Q8_0":
        return QuantBlocks(qtype, blocks[..., 2:].copy().view(np.int8), scale, None)
    if qtype == "Q4_0":
        return QuantBlocks(qtype, unpack_nibbles(blocks[..., 2:]), scale, None)
    offset = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    return QuantBlocks(qtype, unpack_nibbles(blocks[..., 4:]), scale, offset)
