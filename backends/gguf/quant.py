"""Exact GGML block formats for the quant types Kafila serves.

Every type is split into the same shape: per row, `groups` groups of `group` consecutive weights,
each group an affine form of small integer codes, w = scale·q (+ offset):

  Q8_0  (34 B / 32):  f16 d, 32 × i8 q                     group 32  w = d·q
  Q4_0  (18 B / 32):  f16 d, 16 bytes of nibbles            group 32  w = d·(q − 8)
  Q4_1  (20 B / 32):  f16 d, f16 m, 16 bytes                group 32  w = d·q + m
  Q5_0  (22 B / 32):  f16 d, 4 bytes qh, 16 bytes nibbles   group 32  w = d·(q − 16), q 0..31
  Q5_1  (24 B / 32):  f16 d, f16 m, 4 bytes qh, 16 bytes    group 32  w = d·q + m, q 0..31
  Q4_K  (144 B / 256): f16 d, f16 dmin, 12 bytes of 6-bit scales sc / mins m, 128 bytes of nibbles
                                                            group 32  w = (d·sc)·q − (dmin·m), q 0..15
  Q5_K  (176 B / 256): as Q4_K + 32 bytes of 5th bits (qh)  group 32  likewise, q 0..31
  Q6_K  (210 B / 256): 128 bytes low nibbles (ql), 64 bytes high 2 bits (qh), 16 × i8 sc, f16 d
                                                            group 16  w = (d·sc)·(q − 32), q 0..63
  Q2_K  (84 B / 256): 16 bytes scales (sc low 4 bits, m high 4), 64 bytes of 2-bit codes, f16 d, f16 dmin
                                                            group 16  w = (d·sc)·q − (dmin·m), q 0..3
  Q3_K  (110 B / 256): 32 bytes hmask, 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, f16 d
                                                            group 16  w = (d·(sc − 32))·q, q −4..3
  IQ4_NL (18 B / 32): f16 d, 16 bytes of nibbles            group 32  w = d·K[q], K = KVALUES_IQ4NL
  IQ4_XS (136 B / 256): f16 d, u16 scales_h, 4 bytes scales_l, 128 bytes of nibbles
                                                            group 32  w = (d·(ls − 32))·K[q]
  MXFP4 (17 B / 32): u8 e (E8M0), 16 bytes of nibbles      group 32  w = 2^(e−128)·KVALUES_MXFP4[q]

The lookup types (IQ4_*, MXFP4) keep in `q` the table's values (int8), not the nibbles: w = scale·q
then holds for every type. Their products are exact in f32 too (an f16 times a 6-bit integer times
a 7-bit value; MXFP4's scale is a power of two), as in ggml's dequantize_row_*.

For the K-quants, scale = d·sc and offset = −(dmin·m) are products of an f16 and a 6- or 8-bit
integer, exact in f32, and scale·q is exact in f32 too, so f32 computes w with one rounding
(the sum), exactly as ggml does; float64 computes it without any.

Nibble order (Q4_0/Q4_1/Q5_0/Q5_1): element j of a block is the low nibble of byte j, element
j+16 the high nibble; Q5_0/Q5_1's 5th bit of element j is bit j of qh read as a little-endian
uint32 (bit j mod 8 of qh byte j div 8), as ggml's dequantize_row_q5_0/q5_1. d·q is exact in f32
for every 32-weight type (an f16 times an integer below 2^8), so Q4_1/Q5_1 round once (+ m).
Q4_K/Q5_K: sub-block pair (2i, 2i+1) is the low / high nibbles of bytes 32i..32i+31; Q5_K's 5th
bit of element l of sub-block j is bit j of qh[l]. Q6_K: in each 128-weight half, element 32k + l
takes ql[l + 32·(k mod 2)]'s nibble k div 2 and bits 2k..2k+1 of qh[l].
Q2_K/Q3_K: in each 128-weight half h, sub-block 8h + 2k + i (k 0..3, i 0..1) is bits 2k..2k+1 of
qs[32h + 16i .. +16]; Q3_K's sign bit (0: q − 4) of that sub-block's element l is bit 4h + k of
hmask[16i + l]. Q3_K's scale j is 4 bits of byte j mod 8 (low nibble for j < 8) and 2 bits of byte
8 + j mod 4 (bits 2·(j div 4)..), as its kmask shuffle. IQ4_XS's 6-bit scale of group g is nibble
g mod 2 of scales_l[g div 2] and bits 2g..2g+1 of scales_h. IQ4_NL/IQ4_XS/MXFP4 nibbles are in
Q4_0's order (low nibbles first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # weights per block of the 32-weight types
QK_K = 256  # weights per super-block of the K-quants
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_WEIGHTS = {"Q8_0": QK, "Q4_0": QK, "Q4_1": QK, "Q5_0": QK, "Q5_1": QK,
                 "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K,
                 "Q2_K": QK_K, "Q3_K": QK_K, "IQ4_NL": QK, "IQ4_XS": QK_K, "MXFP4": QK}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210,
               "Q2_K": 84, "Q3_K": 110, "IQ4_NL": 18, "IQ4_XS": 136, "MXFP4": 17}
CODE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5,
             "Q4_K": 4, "Q5_K": 5, "Q6_K": 8,
             "Q2_K": 2, "Q3_K": 3, "IQ4_NL": 8, "IQ4_XS": 8, "MXFP4": 8}  # bits per stored code (q's range)
# ggml-common.h's tables: IQ4_NL/IQ4_XS's non-linear 4-bit grid, and MXFP4's E2M1 values doubled
# (its scale is then 2^(e − 128), half the E8M0 value: GGML_E8M0_TO_FP32_HALF)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
CODE_BIAS = {"Q4_0": 8, "Q5_0": 16}  # q' = q − bias for the symmetric types with unsigned codes


@dataclass(frozen=True)
class QuantBlocks:
    """A quantized tensor split into its parts, each shaped [rows, groups, ...].

    w[r, g·group + i] = scale[r, g]·q'[r, g, i] (+ offset[r, g]), q' = q − 8 for Q4_0,
    q − 16 for Q5_0, else q.
    """

    qtype: str
    q: np.ndarray  # codes [rows, groups, group]: uint8 (Q4_0/Q4_1/Q4_K 0..15, Q5_* 0..31, Q2_K 0..3) or
    #                int8 (Q8_0; Q6_K stored as q − 32 in −32..31; Q3_K −4..3; IQ4_*/MXFP4 the table's values)
    scale: np.ndarray  # [rows, groups]: float16 d (Q8_0, Q4_0/1, Q5_0/1, IQ4_NL) or float32 (K-quants,
    #                    IQ4_XS: d·sc; MXFP4: 2^(e − 128); exact)
    offset: np.ndarray | None  # [rows, groups]: Q4_1/Q5_1's f16 min m, Q4_K/Q5_K/Q2_K's f32 −dmin·m; else None

    @property
    def group(self) -> int:
        """Weights per group sharing one scale (32; 16 for Q6_K, Q2_K, Q3_K)."""
        return self.q.shape[-1]

    @property
    def bits(self) -> int:
        """Bits of one stored code (Q6_K's codes are stored as i8 q − 32)."""
        return CODE_BITS[self.qtype]

    def dequantize(self, dtype=np.float64) -> np.ndarray:
        """The exact weights [rows, cols] (in f32: bit for bit what ggml computes)."""
        w = self._values(self.q, self.scale, self.offset, dtype)
        return w.reshape(w.shape[0], -1)

    def rows(self, ids: np.ndarray, dtype=np.float64) -> np.ndarray:
        """Rows `ids` of the weights, dequantized (an embedding lookup): ids [n] → [n, cols]."""
        ids = np.asarray(ids, np.int64)
        offset = None if self.offset is None else self.offset[ids]
        w = self._values(self.q[ids], self.scale[ids], offset, dtype)
        return w.reshape(*ids.shape, -1)

    def _values(self, q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, dtype) -> np.ndarray:
        q = q.astype(dtype)
        if self.qtype in CODE_BIAS:
            q = q - float(CODE_BIAS[self.qtype])
        w = q * scale.astype(dtype)[..., None]  # exact
        if offset is not None:
            w = w + offset.astype(dtype)[..., None]  # the one rounding (f32)
        return w


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., 16] → uint8 [..., 32] in GGML order (low nibbles first, then high)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def unpack_q5(qh: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's qh uint8 [..., 4] and nibbles uint8 [..., 16] → codes uint8 [..., 32] in 0..31:
    element j's 5th bit is bit j of qh as a little-endian uint32."""
    high = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")  # [..., 32], element order
    return unpack_nibbles(packed) | (high << 4)


def _f16(b: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] → float32 [...] (an f16 stored little-endian)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K/Q5_K → (sc, m) uint8 [..., 8], 6 bits each (get_scale_min_k4):
    j < 4: sc = s[j] & 63, m = s[j+4] & 63; j ≥ 4: the low 4 bits from s[j+4], the top 2 from the
    high bits of s[j−4] (sc) and s[j] (m)."""
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, m


def _split_k(qtype: str, blocks: np.ndarray) -> QuantBlocks:
    """blocks uint8 [rows, nsb, bytes] of 256-weight super-blocks → QuantBlocks of groups 32 / 16."""
    rows, nsb, _ = blocks.shape
    if qtype == "Q6_K":
        ql, qh = blocks[..., 0:128], blocks[..., 128:192]  # per super-block
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, nsb, 16]
        d = _f16(blocks[..., 208:210])  # [rows, nsb]
        ql = ql.reshape(rows, nsb, 2, 2, 32)  # [.., half, k mod 2, l]
        low = np.stack([ql & 0x0F, ql >> 4], axis=3)  # [.., half, k div 2, k mod 2, l]
        low = low.reshape(rows, nsb, 2, 4, 32)  # [.., half, k, l]
        high = qh.reshape(rows, nsb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
        q = (low | ((high & 3) << 4)).astype(np.int16) - 32  # [.., half, k, l] in −32..31
        q = q.astype(np.int8).reshape(rows, nsb * 16, 16)
        scale = (d[..., None] * sc).reshape(rows, nsb * 16)  # exact in f32
        return QuantBlocks(qtype, q, scale, None)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, nsb]
    sc, m = _k_scales_mins(blocks[..., 4:16])  # [rows, nsb, 8]
    qs = blocks[..., -128:].reshape(rows, nsb, 4, 32)  # pair of sub-blocks per 32 bytes
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, nsb, 8, 32)  # sub-block j = 2·pair + nibble
    if qtype == "Q5_K":
        qh = blocks[..., 16:48].reshape(rows, nsb, 1, 32)
        q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4)
    scale = (d[..., None] * sc.astype(np.float32)).reshape(rows, nsb * 8)
    offset = -(dmin[..., None] * m.astype(np.float32)).reshape(rows, nsb * 8)
    return QuantBlocks(qtype, np.ascontiguousarray(q.reshape(rows, nsb * 8, 32)), scale, offset)


# Rows are decoded this many raw bytes at a time: the decoders' temporaries (int16 codes, the
# stacked nibbles) are several times a part's size, and on a whole 128256-row embedding they made
# the build's peak (1.8 GB for Llama-3.2-1B's 215 MB Q6_K table; issue 10).
SPLIT_CHUNK_BYTES = 8 << 20


def split_blocks(qtype: str, raw: np.ndarray, rows: int, cols: int) -> QuantBlocks:
    """Split the raw bytes of a [rows, cols] tensor of type `qtype` into its parts, decoding
    SPLIT_CHUNK_BYTES of rows at a time into the whole outputs (rows are independent: the same
    values as one pass)."""
    nb = cols // BLOCK_WEIGHTS[qtype]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, nb, BLOCK_BYTES[qtype])
    step = max(1, SPLIT_CHUNK_BYTES // max(1, nb * BLOCK_BYTES[qtype]))
    if rows <= step:
        return _split_rows(qtype, blocks)
    part = _split_rows(qtype, blocks[:step])
    out = [None if a is None else np.empty((rows, *a.shape[1:]), a.dtype) for a in (part.q, part.scale, part.offset)]
    for r in range(0, rows, step):
        if r:
            part = _split_rows(qtype, blocks[r:r + step])
        for whole, a in zip(out, (part.q, part.scale, part.offset)):
            if whole is not None:
                whole[r:r + step] = a
    return QuantBlocks(qtype, out[0], out[1], out[2])


def _split_rows(qtype: str, blocks: np.ndarray) -> QuantBlocks:
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        return _split_k(qtype, blocks)
    if qtype in LOWBIT_SPLITTERS:
        return LOWBIT_SPLITTERS[qtype](blocks)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == "Q8_0":
        return QuantBlocks(qtype, blocks[..., 2:].copy().view(np.int8), scale, None)
    if qtype == "Q4_0":
        return QuantBlocks(qtype, unpack_nibbles(blocks[..., 2:]), scale, None)
    if qtype == "Q5_0":
        return QuantBlocks(qtype, unpack_q5(blocks[..., 2:6], blocks[..., 6:]), scale, None)
    offset = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    if qtype == "Q5_1":
        return QuantBlocks(qtype, unpack_q5(blocks[..., 4:8], blocks[..., 8:]), scale, offset)
    return QuantBlocks(qtype, unpack_nibbles(blocks[..., 4:]), scale, offset)


def _split_q2_k(blocks: np.ndarray) -> QuantBlocks:
    """Q2_K super-blocks uint8 [rows, nsb, 84] → codes 0..3 in groups of 16 (dequantize_row_q2_K)."""
    rows, nsb, _ = blocks.shape
    sc, qs = blocks[..., 0:16], blocks[..., 16:80]
    d, dmin = _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])  # [rows, nsb]
    q = _two_bit_planes(qs)  # [rows, nsb, 16, 16]
    scale = (d[..., None] * (sc & 0x0F).astype(np.float32)).reshape(rows, nsb * 16)  # exact in f32
    offset = -(dmin[..., None] * (sc >> 4).astype(np.float32)).reshape(rows, nsb * 16)
    return QuantBlocks("Q2_K", q.reshape(rows, nsb * 16, 16), scale, offset)


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes of 2-bit codes [..., 64] → [..., 16 sub-blocks, 16] uint8 0..3: half h,
    shift k, byte run i gives sub-block 8h + 2k + i (see the module docstring)."""
    qs = qs.reshape(*qs.shape[:-1], 2, 1, 2, 16)  # [.., h, ·, i, l]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1, 1)
    return ((qs >> shifts) & 3).reshape(*qs.shape[:-4], 16, 16)  # [.., h, k, i, l] → sub-block, l


def _split_q3_k(blocks: np.ndarray) -> QuantBlocks:
    """Q3_K super-blocks uint8 [rows, nsb, 110] → int8 codes −4..3 in groups of 16 (dequantize_row_q3_K)."""
    rows, nsb, _ = blocks.shape
    hmask, qs, s = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = _f16(blocks[..., 108:110])  # [rows, nsb]
    low = _two_bit_planes(qs).reshape(rows, nsb, 2, 4, 2, 16)  # [.., h, k, i, l]
    bit = (4 * np.arange(2, dtype=np.uint8)).reshape(2, 1, 1, 1) + np.arange(4, dtype=np.uint8).reshape(4, 1, 1)
    high = (hmask.reshape(rows, nsb, 1, 1, 2, 16) >> bit) & 1  # [.., h, k, i, l]: 1 keeps q, 0 takes 4 off
    q = low.astype(np.int8) - 4 * (1 - high.astype(np.int8))
    j = np.arange(16)
    nib = np.where(j < 8, s[..., j % 8] & 0x0F, s[..., j % 8] >> 4)  # [rows, nsb, 16]
    top = (s[..., 8 + j % 4] >> (2 * (j // 4)).astype(np.uint8)) & 3
    sc = (nib | (top << 4)).astype(np.float32) - 32  # −32..31
    scale = (d[..., None] * sc).reshape(rows, nsb * 16)  # exact in f32
    return QuantBlocks("Q3_K", np.ascontiguousarray(q.reshape(rows, nsb * 16, 16)), scale, None)


def _split_iq4_nl(blocks: np.ndarray) -> QuantBlocks:
    """IQ4_NL blocks uint8 [rows, nb, 18] → the grid's values (int8) in groups of 32, f16 d."""
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    return QuantBlocks("IQ4_NL", KVALUES_IQ4NL[unpack_nibbles(blocks[..., 2:])], scale, None)


def _split_iq4_xs(blocks: np.ndarray) -> QuantBlocks:
    """IQ4_XS super-blocks uint8 [rows, nsb, 136] → the grid's values in groups of 32, f32 d·(ls − 32)."""
    rows, nsb, _ = blocks.shape
    d = _f16(blocks[..., 0:2])
    scales_h = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)[..., 0].astype(np.uint32)  # [rows, nsb]
    g = np.arange(8)
    low = (blocks[..., 4 + g // 2] >> (4 * (g % 2)).astype(np.uint8)) & 0x0F  # [rows, nsb, 8]
    high = (scales_h[..., None] >> (2 * g).astype(np.uint32)) & 3
    ls = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
    scale = (d[..., None] * ls.astype(np.float32)).reshape(rows, nsb * 8)  # exact in f32
    q = KVALUES_IQ4NL[unpack_nibbles(blocks[..., 8:].reshape(rows, nsb, 8, 16))]
    return QuantBlocks("IQ4_XS", q.reshape(rows, nsb * 8, 32), scale, None)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """uint8 E8M0 exponents → float32 2^(e − 128), built from bits as GGML_E8M0_TO_FP32_HALF does
    (e < 2 are subnormals; e = 255 is 2^127, not NaN)."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32)
    return bits.view(np.float32)


def _split_mxfp4(blocks: np.ndarray) -> QuantBlocks:
    """MXFP4 blocks uint8 [rows, nb, 17] → the doubled E2M1 values (int8) in groups of 32, f32 2^(e − 128)."""
    return QuantBlocks("MXFP4", KVALUES_MXFP4[unpack_nibbles(blocks[..., 1:])], e8m0_half(blocks[..., 0]), None)


LOWBIT_SPLITTERS = {"Q2_K": _split_q2_k, "Q3_K": _split_q3_k, "IQ4_NL": _split_iq4_nl,
                    "IQ4_XS": _split_iq4_xs, "MXFP4": _split_mxfp4}


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """BF16 bytes → float32, exactly (a bf16 is the top half of an f32)."""
    return (np.asarray(raw, np.uint8).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
