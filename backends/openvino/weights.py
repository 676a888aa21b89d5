"""GGUF tensors as OpenVINO constants: 4-bit weights stay 4-bit, decompressed exactly in the graph.

Every quantized projection becomes the decompression subgraph the CPU plugin's
`CompressedWeightsBlock` matcher folds into a compressed FullyConnected:

    Constant i4|i8 [out, in/32, 32] → Convert(f32) → Multiply(Convert(scale f16 [out, in/32, 1]))
        → Reshape [out, in] → MatMul(x, ·ᵀ)

Q4_0 (w = d·(q − 8)) is exactly i4 q − 8 with scale d. Q4_1 (w = d·q + m) is u4 q with an f32
zero point z = −m/d and an f32 scale d per block, w = (q − z)·d: the same CompressedWeightsBlock pattern with a
Subtract, which the CPU plugin runs in its int4 FullyConnected kernel (exact to f32 rounding;
openvino_genai's u4 zero point round(−m/d) is lossy). A block with d = 0 and m ≠ 0 has no zero
point; a tensor holding one falls back to d·(q − 8) as i4 plus the exact correction
blocksum(x) @ (m + 8d)ᵀ, blocksum summing x over each group of 32 inputs (the previous scheme:
one extra small FullyConnected per projection, ≈ 20 % slower decode on the default model).

Projections that read the same input (q/k/v; gate/up) are concatenated into one matrix.
Constants wrap numpy buffers without copying (4-bit: element 2i in the low nibble of byte i);
`WeightBank.keep` holds those buffers for as long as the model or compiled model lives.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from kafila.models import ModelIndex
from kafila.models.quant import QK, QuantBlocks

F32 = ov.Type.f32


def pack_u4(q: np.ndarray) -> np.ndarray:
    """uint8 [..., 32] values 0..15 → uint8 [..., 16], element 2i in the low nibble of byte i."""
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4), dtype=np.uint8)


def unpermute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """GGUF's q/k rows are permuted for interleaved RoPE; restore HF order (rotate_half RoPE).

    Row h·D + 2i + j in GGUF is row h·D + j·D/2 + i in HF order; works on any trailing axes.
    """
    rows = a.shape[0]
    d = rows // n_heads
    return np.ascontiguousarray(
        a.reshape(n_heads, d // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(rows, *a.shape[1:])
    )


class SpillFile:
    """Constant buffers in an unlinked temporary file, mapped back (MAP_SHARED; never written).

    The CPU plugin repacks most weights into its own layout at the first inferences and then
    leaves the originals alone, but the compiled model keeps pointing at them. Anonymous numpy
    buffers would stay resident (≈ the GGUF size again); file-backed pages can be dropped from
    the process with `release()` (MADV_DONTNEED) and come back from the page cache or the file,
    unchanged, if the plugin ever reads them again — unlike freeing them, which is unsafe.
    The file goes in tempfile.gettempdir() ($TMPDIR): on a tmpfs the dropped pages still hold RAM
    (as shared memory, outside the process's RSS); point $TMPDIR at a disk for the real saving.
    """

    ALIGN = 64

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="kafila-ov-weights-")
        self._size = 0
        self.maps: list[np.memmap] = []

    def put(self, array: np.ndarray) -> np.ndarray:
        """A file-backed copy of array (same dtype and shape)."""
        array = np.ascontiguousarray(array)
        offset = -(-self._size // self.ALIGN) * self.ALIGN
        os.pwrite(self._file.fileno(), array.tobytes(), offset)  # (memoryview(array) fails on f16)
        self._size = offset + array.nbytes
        if array.nbytes == 0:
            return array
        view = np.memmap(self._file, dtype=array.dtype, mode="r+", offset=offset, shape=array.shape)
        self.maps.append(view)
        return view

    def release(self) -> None:
        """Drop every mapped page from this process's resident set (contents unchanged)."""
        for m in self.maps:
            m._mmap.madvise(mmap.MADV_DONTNEED)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.maps)


class WeightBank:
    """Builds constants and decompression subgraphs for one model's tensors."""

    def __init__(self, index: ModelIndex, spill: bool = False) -> None:
        self.index = index
        self.keep: list[np.ndarray] = []  # numpy buffers the constants point into
        self.spill = SpillFile() if spill else None  # or a file holding them (see SpillFile)
        self._compressed: dict[str, tuple[ov.Node, ov.Node]] = {}  # one buffer per tensor, shared by models

    def release_pages(self) -> None:
        """With a spill file: drop the constants' pages from the resident set (safe at any time)."""
        if self.spill is not None:
            self.spill.release()

    def _const(self, array: np.ndarray, element_type: ov.Type | None = None, shape=None) -> ov.Node:
        array = np.ascontiguousarray(array)
        if self.spill is not None and array.nbytes >= 4096:
            array = self.spill.put(array)
        self.keep.append(array)
        if element_type is None:
            return ov.op.Constant(ov.Tensor(array, shared_memory=True))
        return ov.op.Constant(ov.Tensor(array, ov.Shape(list(shape)), element_type))

    def vector(self, name: str, unpermute_heads: int = 0) -> ov.Node:
        """A norm weight or bias as an f32 constant [n]."""
        v = self.index.dequantize(name, np.float32)
        return self._const(unpermute_rows(v, unpermute_heads) if unpermute_heads else v)

    def blocks(self, name: str, unpermute_heads: int = 0) -> QuantBlocks:
        b = self.index.blocks_of(name)
        if not unpermute_heads:
            return b
        un = lambda a: None if a is None else unpermute_rows(a, unpermute_heads)  # noqa: E731
        return QuantBlocks(b.qtype, un(b.q), un(b.scale), un(b.offset))

    def project(self, x: ov.Output, parts: list[tuple[str, int]]) -> list[ov.Output]:
        """x [..., in] through the matrices `parts` ((name, heads to un-permute or 0), same input)
        as one concatenated projection; returns one output [..., out_i] per part."""
        infos = [self.index.tensors[name] for name, _ in parts]
        qtypes = {t.qtype for t in infos}
        if len(parts) == 1 and qtypes <= {"Q8_0", "Q4_0"} and not parts[0][1]:  # e.g. a tied lm_head
            y = self.quantized_linear(x, self.blocks(parts[0][0]), name=parts[0][0])
        elif len(qtypes) == 1 and qtypes <= {"Q8_0", "Q4_0", "Q4_1"}:
            bl = [self.blocks(name, heads) for name, heads in parts]
            y = self.quantized_linear(x, QuantBlocks(
                bl[0].qtype,
                np.concatenate([b.q for b in bl]),
                np.concatenate([b.scale for b in bl]),
                None if bl[0].offset is None else np.concatenate([b.offset for b in bl]),
            ))
        else:  # float (or mixed) matrices: one f32 constant
            ws = []
            for name, heads in parts:
                w = self.index.dequantize(name, np.float32)
                ws.append(unpermute_rows(w, heads) if heads else w)
            y = linear(x, self._const(np.concatenate(ws)).output(0))
        if len(parts) == 1:
            return [y]
        sizes = np.array([t.shape[0] for t in infos], np.int64)
        return list(ops.variadic_split(y, ops.constant(np.int64(-1)), ops.constant(sizes)).outputs())

    def quantized_linear(self, x: ov.Output, b: QuantBlocks, name: str | None = None) -> ov.Output:
        """x [..., in] @ w[out, in]ᵀ for GGML blocks b, exactly (see the module docstring)."""
        rows, nb, _ = b.q.shape
        if b.qtype == "Q4_1" and not np.any((b.scale == 0) & (b.offset != 0)):
            return linear(x, self._zero_point_weight(b))
        q_node, scale_node = self.compressed(b, name)
        w = ops.multiply(ops.convert(q_node, F32), ops.convert(scale_node, F32))  # [out, nb, 32]
        w = ops.reshape(w, ops.constant(np.array([rows, nb * QK], np.int64)), False)  # [out, in]
        y = linear(x, w.output(0))  # [..., out]
        if b.qtype != "Q4_1":
            return y
        m8 = b.offset.astype(np.float32) + 8 * b.scale.astype(np.float32)  # m′ [out, nb]
        lead = [0] * (x.get_partial_shape().rank.get_length() - 1)  # keep the leading dims
        groups = ops.reshape(x, ops.constant(np.array(lead + [nb, QK], np.int64)), True)  # [..., nb, 32]
        sums = ops.reduce_sum(groups, ops.constant(np.int64(-1)), False)  # [..., nb]
        return ops.add(y, linear(sums.output(0), self._const(m8).output(0))).output(0)

    def _zero_point_weight(self, b: QuantBlocks) -> ov.Output:
        """Q4_1 as u4 q, f32 zero point −m/d and f32 scale d: (q − z)·d → [out, in]."""
        rows, nb, _ = b.q.shape
        d = b.scale.astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(d != 0, -b.offset.astype(np.float32) / d, 0).astype(np.float32)[..., None]  # [out, nb, 1]
        q = self._const(pack_u4(b.q), ov.Type.u4, (rows, nb, QK))
        w = ops.subtract(ops.convert(q, F32), self._const(z))
        # f32 scale (exact: d is f16): an f16 scale behind a Convert gets folded into an extra f32
        # copy of every scale inside the compiled model.
        w = ops.multiply(w, self._const(b.scale.astype(np.float32)[..., None]))  # [out, nb, 32]
        return ops.reshape(w, ops.constant(np.array([rows, nb * QK], np.int64)), False).output(0)

    def compressed(self, b: QuantBlocks, name: str | None = None) -> tuple[ov.Node, ov.Node]:
        """(q constant i8|i4 [rows, nb, 32], scale f16 [rows, nb, 1]) with w = scale·q (+ m′ for Q4_1).
        With `name`, the constants are made once and shared (the tied embedding and lm_head)."""
        if name is not None:
            if name not in self._compressed:
                self._compressed[name] = self.compressed(b)
            return self._compressed[name]
        rows, nb, _ = b.q.shape
        if b.qtype == "Q8_0":
            q_node = self._const(b.q.astype(np.int8))  # i8 [rows, nb, 32]
        else:  # Q4_0, Q4_1: q − 8 as i4 (two's complement nibble = q xor 8)
            q_node = self._const(pack_u4(b.q ^ np.uint8(8)), ov.Type.i4, (rows, nb, QK))
        return q_node, self._const(b.scale.astype(np.float16)[..., None])


def linear(x: ov.Output, weight: ov.Output) -> ov.Output:
    """x [..., in] @ weight[out, in]ᵀ → [..., out]."""
    return ops.matmul(x, weight, transpose_a=False, transpose_b=True).output(0)
