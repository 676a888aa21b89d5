"""GGUF tensors as OpenVINO constants: quantized weights stay quantized, decompressed exactly in
the graph.

Every quantized matrix is kept as its GGUF codes, grouped [out, groups, group], and decompressed by
the subgraph the CPU plugin's `CompressedWeightsBlock` matcher folds into a compressed
FullyConnected (checked in tests/test_openvino_fusion.py and tests/test_kquants.py):

    Constant codes [out, groups, group] → Convert(f32) [→ Subtract(zero point f32 [out, groups, 1])]
        → Multiply(scale [out, groups, 1]) → Reshape [out, in] → MatMul(x, ·ᵀ)
        [+ MatMul(each group's sum of x, offset [out, groups]ᵀ)]   (the split form)

  type   codes                 group  scale               zero point      | split form: codes, offset   FullyConnected
  Q8_0   i8 q                  32     f16 d (→ Convert)   —               |                             i8
  Q4_0   i4 q − 8              32     f16 d (→ Convert)   —               |                             i4
  Q4_1   u4 q                  32     f32 d               −m/d            | i4 q − 8, m + 8d            u4 | i4
  Q5_0   i8 q − 16             32     f16 d (→ Convert)   —               |                             i8
  Q5_1   u8 q (0..31)          32     f32 d               −m/d            | i8 q − 16, m + 16d          u8 | i8
  Q4_K   u4 q                  32     f32 d·sc            dmin·m/(d·sc)   | i4 q − 8, 8·d·sc − dmin·m   u4 | i4
  Q5_K   u8 q (0..31)          32     f32 d·sc            dmin·m/(d·sc)   | i8 q − 16, 16·d·sc − dmin·m u8 | i8
  Q6_K   i8 q − 32             16     f32 d·sc            —               |                             i8

Types with an offset per group (w = s·q + o) take one of two exact forms.
- Zero point: (q − z)·s with an f32 z = −o/s, equal to s·q + o to f32 rounding (openvino_genai's
  u4 zero point round(−m/d) is lossy). A group whose scale is 0 holds one value, its offset: it is
  stored as codes 1, zero point 0 and scale = offset, exact again.
- Split, for matrices of split_min_weights() weights or more: w·x = Σ_g s_g·(q − c)·x_g +
  Σ_g (o_g + c·s_g)·Σx_g, a compressed FullyConnected without a zero point plus a small f32 matrix
  (1/32 of the weights, the zero point's bytes) applied to each group's sum of x; exact at f32
  (another summation order), and a scale-0 group needs no special case. The plugin's kernel
  decompresses a weight with one multiply instead of a subtract and a multiply: on a Llama-3.2-1B
  shape the gate/up FullyConnected runs 1.9× faster (bench/ov_kernels.py, docs/BENCHMARKS.md), but
  the second FullyConnected and the ReduceSum cost a fixed 15–20 µs, more than a small matrix
  saves (SmolLM2-135M's are under a million weights) where the plugin infers in bf16; in f32 every
  matrix gains (split_min_weights). Signed codes q − c keep the offsets small;
  with u4 codes the two products nearly cancel for a centred group and bf16 rounding of the group
  sums shows (28× the zero point form's error); with i4 the error at serving precision is that of
  llama.cpp's own Q8_K-activation dot products.
`--kquant fast` (WeightBank(kquant="fast")) gives Q4_K and Q5_K the form of openvino_genai's GGUF
reader and the openvino wheel's GGUF frontend instead: codes u4 | u8, an f16 scale and the zero
point round(−o/s) as a u8 constant, (q − round(z))·s: each weight off by at most s/2, the form the
CPU plugin's compressed FullyConnected decompresses fastest, and of these the only one its int8-activation
(VNNI) path takes where it applies. Q6_K is i8 with groups of 16 in both forms; Q4_1/Q5_1 keep theirs.
Scales are exact (f16 d, or f16 × a 6/8-bit integer in f32). f32 scales: an f16 scale behind a
Convert gets folded into an extra f32 copy of every scale inside the compiled model. F32, F16 and
BF16 matrices become f32 constants (F16 and BF16: 4 bytes per weight in memory against 2 in the file).

Projections that read the same input (q/k/v; gate/up) are concatenated into one matrix where
they share a type; in a mix (Q4_K_M files hold some attn_v/ffn_down in Q6_K) each run of equal
types is its own compressed FullyConnected. The token embedding is not a constant: the shard
reads the rows of each step from the file (ModelIndex.rows, exact), see backends/openvino/shard.py.
Constants wrap numpy buffers without copying (4-bit: element 2i in the low nibble of byte i);
`WeightBank.keep` holds those buffers for as long as the model or compiled model lives.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from backends import DEFAULT_KQUANT, KQUANTS
from backends.errors import BadInput
from backends.gguf import ModelIndex
from backends.gguf.optional import applied_scale, bias_before_scale
from backends.gguf.quant import FLOAT_TYPES, QuantBlocks, split_blocks
from backends.openvino import ggml_kernels
from backends.openvino.ggml_kernels import GGML_QTYPES
from backends.openvino.lowbit import LOWBIT_TYPES, lowbit_forms

F32 = ov.Type.f32
OFFSET_TYPES = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")  # w = s·q + o: a zero point or the split form
# --kquant: "exact" (the forms above), or "fast": FAST_TYPES with an integer (u8) zero point
FAST_TYPES = ("Q4_K", "Q5_K")
# Matrices this large take the split form where the CPU plugin infers in bf16 (module docstring);
# where it infers in f32 (a CPU without bf16: AVX2-only and early AVX-512 ones) every matrix
# does, since decompressing in f32 costs more than the split form's extra nodes: on an AVX2-only
# EPYC the default model decodes 1.11–1.16× faster split, batches of 4 and 8 rows 1.0–1.06×
# (docs/BENCHMARKS.md). None: by the CPU (split_min_weights); tests set a number to pick a form.
SPLIT_MIN_WEIGHTS: int | None = None
BF16_SPLIT_MIN_WEIGHTS = 1 << 22


def split_min_weights() -> int:
    """The smallest matrix (in weights) that takes the split form in this process."""
    if SPLIT_MIN_WEIGHTS is not None:
        return SPLIT_MIN_WEIGHTS
    return BF16_SPLIT_MIN_WEIGHTS if _plugin_infers_in_bf16() else 0


@functools.lru_cache(maxsize=1)
def _plugin_infers_in_bf16() -> bool:
    from backends.openvino.shard import core

    return "BF16" in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


# A quantized tensor larger than this is packed this many file bytes of rows at a time straight
# into the spill file (WeightBank.pack_by_rows): whole, a 128256-row table's codes, scales and file
# pages were the head's build peak (Llama-3.2-1B: 1.8 GB for a 215 MB Q6_K embedding; issue 10).
SPILL_ROWS_BYTES = 16 << 20


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

    def reserve(self, shape: tuple[int, ...], dtype) -> tuple[int, tuple[int, ...], np.dtype]:
        """Room for an array of `shape` and `dtype`, filled by `write`, mapped by `view`."""
        dtype = np.dtype(dtype)
        offset = -(-self._size // self.ALIGN) * self.ALIGN
        self._size = offset + int(np.prod(shape)) * dtype.itemsize
        return offset, tuple(shape), dtype

    def write(self, region: tuple[int, tuple[int, ...], np.dtype], row: int, part: np.ndarray) -> None:
        """Rows row.. of a reserved array ← `part` (same trailing shape and dtype)."""
        offset, shape, dtype = region
        part = np.ascontiguousarray(part, dtype=dtype)
        row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
        self._pwrite(part, offset + row * row_bytes)

    def view(self, region: tuple[int, tuple[int, ...], np.dtype]) -> np.ndarray:
        offset, shape, dtype = region
        view = np.memmap(self._file, dtype=dtype, mode="r+", offset=offset, shape=shape)
        self.maps.append(view)
        return view

    def _pwrite(self, array: np.ndarray, offset: int) -> None:
        data = memoryview(array.reshape(-1).view(np.uint8))  # no copy (memoryview of f16 fails)
        done = 0
        while done < len(data):  # pwrite may write less than asked (Linux: at most ~2 GiB a call)
            done += os.pwrite(self._file.fileno(), data[done:], offset + done)

    def put(self, array: np.ndarray) -> np.ndarray:
        """A file-backed copy of array (same dtype and shape)."""
        array = np.ascontiguousarray(array)
        offset = -(-self._size // self.ALIGN) * self.ALIGN
        self._pwrite(array, offset)
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


@dataclass(frozen=True)
class Packed:
    """A quantized matrix's constants: w = (Convert(q) [− zero])·Convert(scale) [+ offset], [rows, groups, group]."""

    q: ov.Node  # codes [rows, groups, group]: i8 | i4 | u4 | u8
    scale: ov.Node  # [rows, groups, 1] f32, or f16 (Q8_0, Q4_0, Q5_0)
    zero: ov.Node | None  # [rows, groups, 1] f32: OFFSET_TYPES in the zero point form
    offset: ov.Node | None  # [rows, groups] f32, added to each group's weights: the split form
    rows: int
    cols: int


class WeightBank:
    """Builds constants and decompression subgraphs for one model's tensors."""

    def __init__(self, index: ModelIndex, spill: bool = False, kquant: str = DEFAULT_KQUANT) -> None:
        if kquant not in KQUANTS:
            raise BadInput(f"unknown --kquant {kquant!r} (choose from {', '.join(KQUANTS)})")
        if kquant == "ggml":
            ggml_kernels.require()
        self.index = index
        self.kquant = kquant  # the K-quants' form: "exact", "fast" (integer zero points) or "ggml"
        self.keep: list[np.ndarray] = []  # numpy buffers the constants point into
        self.spill = SpillFile() if spill else None  # or a file holding them (see SpillFile)
        self.file_maps: list[np.memmap] = []  # the GGUF's pages under ggml op weights
        self._shared: dict[str, Packed | ov.Node] = {}  # one buffer per whole tensor, shared by models

    def release_pages(self) -> None:
        """With a spill file: drop the constants' pages from the resident set (safe at any time);
        and the file pages the ggml op's matrices were read from (it holds its repacked copy;
        a private mapping never written comes back from the file if read again)."""
        if self.spill is not None:
            self.spill.release()
        for m in self.file_maps:
            m._mmap.madvise(mmap.MADV_DONTNEED)

    def _const(self, array: np.ndarray, element_type: ov.Type | None = None, shape=None,
               spilled: bool = False) -> ov.Node:
        array = np.ascontiguousarray(array)
        if self.spill is not None and array.nbytes >= 4096 and not spilled:
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

    def _dense(self, name: str, unpermute_heads: int = 0) -> np.ndarray:
        w = self.index.dequantize(name, np.float32)  # F32 / F16 / BF16, exact
        return unpermute_rows(w, unpermute_heads) if unpermute_heads else w

    def _whole(self, name: str) -> Packed | ov.Node:
        """The tensor's constants as stored (no un-permuting), made once: the stage and head
        models share one buffer."""
        if name not in self._shared:
            t = self.index.tensors[name]
            if t.qtype in FLOAT_TYPES:
                self._shared[name] = self._const(self._dense(name))
            elif self.spill is not None and t.n_bytes > SPILL_ROWS_BYTES:
                self._shared[name] = self.pack_by_rows(name)
            else:
                self._shared[name] = self.pack(self.blocks(name))
        return self._shared[name]

    def project(self, x: ov.Output, parts: list[tuple[str, int]]) -> list[ov.Output]:
        """x [..., in] through the matrices `parts` ((name, heads to un-permute or 0), same input);
        returns one output [..., out_i] per part. Neighbours of one type share one FullyConnected."""
        infos = [self.index.tensors[name] for name, _ in parts]
        kinds = ["float" if t.qtype in FLOAT_TYPES else t.qtype for t in infos]
        outs: list[ov.Output] = []
        i = 0
        while i < len(parts):
            j = i + 1
            while j < len(parts) and kinds[j] == kinds[i]:
                j += 1
            run = parts[i:j]  # parts[i:j] share a type: one matrix
            if self.kquant == "ggml" and kinds[i] in GGML_QTYPES:
                y = self._ggml_linear(x, run)
            elif len(run) == 1 and not run[0][1]:
                whole = self._whole(run[0][0])
                y = self.packed_linear(x, whole) if isinstance(whole, Packed) else linear(x, whole.output(0))
            elif kinds[i] == "float":
                y = linear(x, self._const(np.concatenate([self._dense(n, h) for n, h in run])).output(0))
            else:
                bl = [self.blocks(n, h) for n, h in run]
                y = self.quantized_linear(x, QuantBlocks(
                    bl[0].qtype,
                    np.concatenate([b.q for b in bl]),
                    np.concatenate([b.scale for b in bl]),
                    None if bl[0].offset is None else np.concatenate([b.offset for b in bl]),
                ))  # fmt: skip
            if len(run) == 1:
                ys = [y]
            else:
                sizes = ops.constant(np.array([t.shape[0] for t in infos[i:j]], np.int64))
                ys = ops.variadic_split(y, ops.constant(np.int64(-1)), sizes).outputs()
            outs.extend(self._scale_and_bias(y, name, heads) for y, (name, heads) in zip(ys, run))
            i = j
        return outs

    def _scale_and_bias(self, y: ov.Output, name: str, heads: int) -> ov.Output:
        """The matrix's optional .scale {1} and .bias applied as llama.cpp applies them
        (backends/gguf/optional.py): (W·x)·s + b, but (W·x + b)·s in a feed-forward (build_ffn)."""
        base = name.removesuffix(".weight")
        scale_name = applied_scale(self.index.hparams.arch, name, self.index.tensors)
        scale = self.vector(scale_name) if scale_name else None
        bias = self.vector(base + ".bias", heads) if base + ".bias" in self.index.tensors else None
        if scale is not None and not bias_before_scale(name):
            y, scale = ops.multiply(y, scale).output(0), None
        if bias is not None:
            y = ops.add(y, bias).output(0)
        return y if scale is None else ops.multiply(y, scale).output(0)

    def _ggml_linear(self, x: ov.Output, run: list[tuple[str, int]]) -> ov.Output:
        """x through the matrices `run` (one block type) as one GgmlMatMul on the file's own
        blocks: rows are whole blocks, so un-permuting and concatenating move bytes, not values."""
        infos = [self.index.tensors[name] for name, _ in run]
        parts = []
        for name, heads in run:
            raw = self._file_blocks(name)
            parts.append(unpermute_rows(raw, heads) if heads else raw)
        raw = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if len(parts) > 1 and self.spill is not None and ggml_kernels.REPACK:  # droppable once repacked
            raw = self.spill.put(raw)
        return ggml_kernels.matmul(x, raw, infos[0].qtype, raw.shape[0], infos[0].shape[1], self.keep)

    def _file_blocks(self, name: str) -> np.ndarray:
        """[rows, row bytes] of a ggml op's matrix: the file's pages, mapped copy-on-write
        (OpenVINO wants a writable buffer to share; nothing writes it)."""
        t = self.index.tensors[name]
        raw = np.memmap(self.index.path, np.uint8, "c", t.offset, (t.shape[0], t.n_bytes // t.shape[0]))
        if ggml_kernels.REPACK:  # the op keeps its repacked copy; else it reads these pages every step
            self.file_maps.append(raw)
        return raw

    def swiglu(self, x: ov.Output, prefix: str, suffix: str = "") -> ov.Output:
        """x through block `prefix`'s SwiGLU feed-forward, down(silu(gate · x) ⊙ up · x), of
        ffn_gate{suffix}, ffn_up{suffix}, ffn_down{suffix} ("_shexp": a shared expert). In the
        ggml form, one GgmlFfn node (llama.cpp's build_ffn, its SiLU included) where it serves all
        three matrices and none has a bias or scale; else of projections."""
        names = [prefix + f"ffn_{m}{suffix}.weight" for m in ("gate", "up", "down")]
        infos = [self.index.tensors[n] for n in names]
        arch = self.index.hparams.arch
        if self.kquant == "ggml" and all(t.qtype in GGML_QTYPES for t in infos) and not any(
                n.removesuffix(".weight") + ".bias" in self.index.tensors or applied_scale(arch, n, self.index.tensors)
                for n in names):  # fmt: skip
            return ggml_kernels.swiglu_ffn(x, [self._file_blocks(n) for n in names], [t.qtype for t in infos],
                                           infos[0].shape[0], infos[2].shape[0], self.keep)  # fmt: skip
        return swiglu_of_projections(self, x, names)

    def quantized_linear(self, x: ov.Output, b: QuantBlocks) -> ov.Output:
        """x [..., in] @ w[out, in]ᵀ for GGML blocks b, exactly (see the module docstring)."""
        return self.packed_linear(x, self.pack(b))

    @staticmethod
    def packed_linear(x: ov.Output, p: Packed) -> ov.Output:
        """x [..., in] @ w[out, in]ᵀ: the compressed FullyConnected of the codes and scales, plus
        the offsets times each group's sum of x where the type has offsets (the split form)."""
        w = _scaled_codes(p)  # [out, groups, group]
        y = linear(x, ops.reshape(w, ops.constant(np.array([p.rows, p.cols], np.int64)), False).output(0))
        if p.offset is None:
            return y
        groups = p.offset.get_output_shape(0)[1]
        lead = [0] * (x.get_partial_shape().rank.get_length() - 1)
        grouped = ops.reshape(x, ops.constant(np.array([*lead, groups, p.cols // groups], np.int64)), True)
        sums = ops.reduce_sum(grouped, ops.constant(np.int64(-1)), False)  # [..., groups]
        return ops.add(y, linear(sums.output(0), p.offset.output(0))).output(0)

    def pack(self, b: QuantBlocks) -> Packed:
        """The constants of GGML blocks b in their compressed form (see the module docstring)."""
        rows, groups, group = b.q.shape
        c = [None if a is None else self._const(a, kind, b.q.shape if kind else None) for a, kind in _forms(b, rows * groups * group, self.kquant)]
        return Packed(*c, rows, groups * group)

    def pack_by_rows(self, name: str) -> Packed:
        """`pack(self.blocks(name))` made SPILL_ROWS_BYTES of the file's rows at a time straight
        into the spill file (rows are independent: the same constants), so the whole tensor's
        codes, scales and file pages are never in memory at once."""
        t = self.index.tensors[name]
        rows, cols = t.shape
        row_bytes = t.n_bytes // rows
        raw = self.index.raw(name)
        step = max(1, SPILL_ROWS_BYTES // row_bytes)
        regions: list = []
        kinds: list = []
        for r in range(0, rows, step):
            n = min(step, rows - r)
            b = split_blocks(t.qtype, raw[r * row_bytes: (r + n) * row_bytes], n, cols)
            forms = _forms(b, rows * cols, self.kquant)
            if not regions:
                regions = [None if a is None else self.spill.reserve((rows, *a.shape[1:]), a.dtype) for a, _ in forms]
                kinds = [kind for _, kind in forms]
                shape = (rows, *b.q.shape[1:])
            for region, (a, _) in zip(regions, forms):
                if a is not None:
                    self.spill.write(region, r, a)
            raw._mmap.madvise(mmap.MADV_DONTNEED)  # the file's pages are read once, not kept
        c = [None if reg is None else self._const(self.spill.view(reg), kind, shape if kind else None, spilled=True)
             for reg, kind in zip(regions, kinds)]  # fmt: skip
        return Packed(*c, rows, cols)


def _scaled_codes(p: Packed) -> ov.Output:
    """(Convert(q) [− zero])·scale (the pattern the plugin compresses)."""
    w = ops.convert(p.q, F32)
    if p.zero is not None:
        zero = p.zero if p.zero.get_output_element_type(0) == F32 else ops.convert(p.zero, F32)  # fast: u8
        w = ops.subtract(w, zero)
    scale = p.scale
    if scale.get_output_element_type(0) != F32:
        scale = ops.convert(scale, F32)
    return ops.multiply(w, scale).output(0)


def _forms(b: QuantBlocks, weights: int, kquant: str = "exact") -> list[tuple[np.ndarray | None, ov.Type | None]]:
    """The constant arrays of GGML blocks b, of a matrix of `weights` weights, as [codes, scale,
    zero point, offset], each (array, element type of packed 4-bit codes or None); an array is None
    where the form has none (see the module docstring). Each row's constants depend on that row alone."""
    if b.qtype in LOWBIT_TYPES:  # Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4: backends/openvino/lowbit.py
        return lowbit_forms(b, split=weights >= split_min_weights())
    none = (None, None)
    if kquant == "fast" and b.qtype in FAST_TYPES:
        codes, scale, zero = _integer_zero_point_form(b)
        q = (codes, None) if b.bits == 5 else (pack_u4(codes), ov.Type.u4)  # u8 0..31 | u4
        return [q, (scale[..., None], None), (zero[..., None], None), none]
    if b.qtype in OFFSET_TYPES and weights < split_min_weights():
        codes, scale, zero = _zero_point_form(b)
        q = (codes, None) if b.bits == 5 else (pack_u4(codes), ov.Type.u4)  # u8 0..31 | u4
        return [q, (scale[..., None], None), (zero[..., None], None), none]
    if b.qtype == "Q4_0" or b.qtype in OFFSET_TYPES and b.bits == 4:  # q − 8 as i4 (nibble q xor 8)
        q = (pack_u4(b.q ^ np.uint8(8)), ov.Type.i4)
    elif b.qtype == "Q5_0" or b.qtype in OFFSET_TYPES:  # q − 16 as i8 [rows, groups, 32] in −16..15
        q = ((b.q.astype(np.int16) - 16).astype(np.int8), None)
    else:  # Q8_0, Q6_K (stored as q − 32): i8 [rows, groups, 32 | 16]
        q = (b.q.astype(np.int8, copy=False), None)
    if b.qtype in OFFSET_TYPES:  # the split form: w = s·q + o = s·(q − c) + (o + c·s)
        s = b.scale.astype(np.float32)
        o = b.offset.astype(np.float32) + np.float32(1 << (b.bits - 1)) * s
        return [q, (s[..., None], None), none, (o, None)]
    scale_type = np.float32 if b.qtype == "Q6_K" else np.float16  # Q8_0/Q4_0/Q5_0: the file's f16 d
    return [q, (b.scale.astype(scale_type)[..., None], None), none, none]


def _zero_point_form(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8, scale f32, zero point f32) with (codes − zero)·scale = scale·q + offset.

    z = −offset/scale; a group with scale 0 is the constant `offset`: codes 1, z 0, scale offset."""
    s = b.scale.astype(np.float32)
    o = b.offset.astype(np.float32)
    flat = s == 0  # [rows, groups]
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, np.float32(0), -o / s).astype(np.float32)
    codes = np.where(flat[..., None], np.uint8(1), b.q).astype(np.uint8)
    return codes, np.where(flat, o, s).astype(np.float32), zero


def _integer_zero_point_form(b: QuantBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8, scale f16, zero point uint8): the fast form, (codes − round(z))·scale with
    z = −offset/scale rounded to an integer in 0..255 (each weight moves by at most scale/2, the
    offset's rounding; the f16 scale's own rounding, 2⁻¹¹ of it, is small beside that). A group
    with scale 0 is the constant `offset`: codes 1, zero 0, scale offset. f16 scales as
    openvino_genai's: on one 8960 × 1536 matrix at serving precision the plugin ran this form in
    4.9 ms with f16 scales, 7.0 ms with f32 ones, 11.3 ms in the exact split form (bench.ov_kernels)."""
    codes, scale, zero = _zero_point_form(b)
    return codes, scale.astype(np.float16), np.clip(np.rint(zero), 0, 255).astype(np.uint8)


def swiglu_of_projections(bank, x: ov.Output, names: list[str]) -> ov.Output:
    """down(silu(gate · x) ⊙ up · x) of the matrices `names` (gate, up, down) built of `bank`'s
    projections (a WeightBank, or the probe's stand-in)."""
    gate, up = bank.project(x, [(names[0], 0), (names[1], 0)])
    (down,) = bank.project(ops.multiply(ops.swish(gate), up).output(0), [(names[2], 0)])
    return down


def linear(x: ov.Output, weight: ov.Output) -> ov.Output:
    """x [..., in] @ weight[out, in]ᵀ → [..., out]."""
    return ops.matmul(x, weight, transpose_a=False, transpose_b=True).output(0)


# While those first inferences repack, the constants' file pages the plugin has read are dropped
# every RELEASE_EVERY_S by a helper thread (infer() runs without the GIL): otherwise the whole
# spill file is resident beside the plugin's new copy at once, and that was the serving peak
# (Llama-3.2-1B one stage: 2.5 GB peak for 1.4 GB serving; issue 10).
RELEASE_EVERY_S = 0.02


@contextlib.contextmanager
def releasing_pages(bank: WeightBank, active: bool) -> Iterator[None]:
    """Drop the spill file's pages every RELEASE_EVERY_S while the block runs (when `active`)."""
    if not active or bank.spill is None:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(RELEASE_EVERY_S):
            bank.release_pages()

    thread = threading.Thread(target=loop, name="kafila-ov-release", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
