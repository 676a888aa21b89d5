"""Encode float weights as GGML K-quant blocks (Q4_K, Q5_K, Q6_K) for test files.

The gguf package only dequantizes K-quants, so test GGUFs get their bytes from here. This is a
plain round-to-nearest quantizer, not llama.cpp's (which searches scales); what matters is that
the bytes are valid blocks, laid out as ggml-common.h says, so that gguf.quants.dequantize and
llama.cpp read back the same weights Kafila does. `encode_k(parts)` packs given parts (codes,
scales, mins) directly, so tests can also build adversarial blocks.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float [...] → uint8 [..., 2]."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m uint8 [..., 8] in 0..63 → the 12 packed bytes (inverse of get_scale_min_k4)."""
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((m[..., 4:8] & 0x0F) << 4)
    return out


def encode_k(qtype: str, d, dmin, sc, m, q) -> np.ndarray:
    """Pack parts of [rows, nsb] super-blocks into raw bytes uint8 [rows, nsb·bytes].

    Q4_K/Q5_K: d, dmin float [rows, nsb]; sc, m uint8 [rows, nsb, 8] (0..63); q uint8 [rows, nsb, 8, 32].
    Q6_K: d float [rows, nsb]; sc int8 [rows, nsb, 16]; q uint8 [rows, nsb, 2, 4, 32] (0..63); dmin, m unused.
    """
    q = np.asarray(q, np.uint8)
    rows, nsb = q.shape[:2]
    if qtype == "Q6_K":
        low, high = q & 0x0F, q >> 4  # [.., half, k, l]
        ql = (low[..., 0:2, :] | (low[..., 2:4, :] << 4)).reshape(rows, nsb, 128)  # k, k+2 share a byte
        qh = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6))
        parts = [ql, qh.reshape(rows, nsb, 64), np.asarray(sc, np.int8).view(np.uint8), _f16_bytes(np.asarray(d))]
    else:
        pairs = q.reshape(rows, nsb, 4, 2, 32)
        qs = ((pairs[..., 0, :] & 0x0F) | ((pairs[..., 1, :] & 0x0F) << 4)).reshape(rows, nsb, 128)
        head = [_f16_bytes(np.asarray(d)), _f16_bytes(np.asarray(dmin)), _pack_scales_mins(sc, m)]
        if qtype == "Q5_K":
            bits = (q >> 4) & 1  # [.., j, l]
            qh = np.zeros((rows, nsb, 32), np.uint8)
            for j in range(8):
                qh |= bits[..., j, :] << j
            head.append(qh)
        parts = [*head, qs]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def quantize_k(data: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) → raw K-quant bytes [rows, cols/256·bytes]."""
    x = np.asarray(data, np.float64)
    rows, cols = x.shape
    nsb = cols // QK_K
    if qtype == "Q6_K":
        g = x.reshape(rows, nsb, 16, 16)
        s = np.abs(g).max(-1) / 31.0  # [rows, nsb, 16], per-16 scale
        d = (s.max(-1) / 127.0).astype(np.float16)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(d[..., None] > 0, np.rint(s / d.astype(np.float64)[..., None]), 0).clip(-128, 127)
            step = (d.astype(np.float64)[..., None] * sc)[..., None]
            q = np.where(step > 0, np.rint(g / step), 0).clip(-32, 31) + 32
        q = q.reshape(rows, nsb, 2, 4, 32)
        return encode_k(qtype, d, None, sc.astype(np.int8), None, q.astype(np.uint8))
    top = 15 if qtype == "Q4_K" else 31
    g = x.reshape(rows, nsb, 8, 32)
    lo = np.minimum(g.min(-1), 0.0)  # [rows, nsb, 8]; w = s·q − mn with mn = −lo ≥ 0
    s = (g.max(-1) - lo) / top
    d = (s.max(-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[..., None] > 0, np.rint(s / d.astype(np.float64)[..., None]), 0).clip(0, 63)
        m = np.where(dmin[..., None] > 0, np.rint(-lo / dmin.astype(np.float64)[..., None]), 0).clip(0, 63)
        step = (d.astype(np.float64)[..., None] * sc)[..., None]
        mn = (dmin.astype(np.float64)[..., None] * m)[..., None]
        q = np.where(step > 0, np.rint((g + mn) / step), 0).clip(0, top)
    return encode_k(qtype, d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8))
