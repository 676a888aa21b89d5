"""The OpenVINO constants of the small quant types (Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4), exactly.

Each keeps the pattern backends/openvino/weights.py's docstring describes (codes → Convert
[− zero point] → Multiply(scale) → a compressed FullyConnected), with codes the plugin compresses:

  type    codes               group  scale          zero point   | split form: codes, offset
  Q2_K    u2 q (0..3)         16     f32 d·sc       dmin·m/(d·sc) | i4 q − 2, 2·d·sc − dmin·m
  Q3_K    i4 q (−4..3)        16     f32 d·(sc−32)  —
  IQ4_NL  i8 K[q]             32     f16 d          —
  IQ4_XS  i8 K[q]             32     f32 d·(ls−32)  —
  MXFP4   f4e2m1 q            32     f32 2^(e−127)  —

MXFP4's nibbles are E2M1 codes, a type the plugin compresses (FullyConnected f4e2m1): ggml's
table holds the E2M1 values doubled, so the scale is doubled back (2^(e−127), the E8M0 value
itself; exact). IQ4's grid is no OpenVINO type: IQ4_NL/IQ4_XS hold the grid's values as i8 codes
(exact), 8 bits a weight against their 4.25–4.5 in the file. Q2_K is the one type with an offset; it takes the zero point or the split form by the
same size rule as Q4_K (weights.split_min_weights), centred on 2 so that the i4 codes stay small
(the plugin compresses u2 too, but there is no i2 for the split form).
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from backends.gguf.quant import KVALUES_MXFP4, QuantBlocks

LOWBIT_TYPES = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4")
Q2_K_CENTRE = 2  # split form: codes q − 2 in −2..1
MXFP4_CODE_OF_VALUE = np.zeros(25, np.int8)  # ggml's doubled E2M1 value + 12 → its 4-bit code
MXFP4_CODE_OF_VALUE[KVALUES_MXFP4[::-1].astype(np.int16) + 12] = np.arange(15, -1, -1)  # code 0 wins for 0


def pack_i4(q: np.ndarray) -> np.ndarray:
    """int8 [..., 2n] (−8..7, or 4-bit codes 0..15) → uint8 [..., n], element 2i in the low nibble
    of byte i (two's complement)."""
    u = q.astype(np.uint8) & np.uint8(0x0F)
    return np.ascontiguousarray(u[..., 0::2] | (u[..., 1::2] << 4), dtype=np.uint8)


def pack_u2(q: np.ndarray) -> np.ndarray:
    """uint8 [..., 4n] values 0..3 → uint8 [..., n], element 4i + k in bits 2k..2k+1 of byte i."""
    q = q.reshape(*q.shape[:-1], -1, 4).astype(np.uint8)
    return np.ascontiguousarray(q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6))


def lowbit_forms(b: QuantBlocks, split: bool) -> list[tuple[np.ndarray | None, ov.Type | None]]:
    """[codes, scale, zero point, offset] of blocks b as weights._forms gives them (array, element
    type of packed 4-bit codes or None; None where the form has none). split: Q2_K takes the split form."""
    none = (None, None)
    if b.qtype == "Q2_K":
        s, o = b.scale.astype(np.float32), b.offset.astype(np.float32)
        if split:  # w = s·q + o = s·(q − 2) + (o + 2s)
            q = (b.q.astype(np.int8) - Q2_K_CENTRE).astype(np.int8)
            return [(pack_i4(q), ov.Type.i4), (s[..., None], None), none, (o + np.float32(Q2_K_CENTRE) * s, None)]
        flat = s == 0  # a scale-0 group is the constant o: codes 1, zero point 0, scale o
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.where(flat, np.float32(0), -o / s).astype(np.float32)
        codes = np.where(flat[..., None], np.uint8(1), b.q).astype(np.uint8)
        scale = np.where(flat, o, s).astype(np.float32)
        return [(pack_u2(codes), ov.Type.u2), (scale[..., None], None), (zero[..., None], None), none]
    if b.qtype == "Q3_K":
        return [(pack_i4(b.q), ov.Type.i4), (b.scale.astype(np.float32)[..., None], None), none, none]
    if b.qtype == "MXFP4":  # the table's values back to their E2M1 codes (±0 both 0)
        codes = MXFP4_CODE_OF_VALUE[b.q.astype(np.int16) + 12]
        return [(pack_i4(codes), ov.Type.f4e2m1), ((np.float32(2) * b.scale.astype(np.float32))[..., None], None),
                none, none]
    if b.qtype not in LOWBIT_TYPES:
        raise ValueError(f"{b.qtype} is not one of {LOWBIT_TYPES}")
    scale_type = np.float16 if b.qtype == "IQ4_NL" else np.float32  # IQ4_NL: the file's f16 d
    return [(b.q.astype(np.int8, copy=False), None), (b.scale.astype(scale_type)[..., None], None), none, none]
