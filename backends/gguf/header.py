"""The header of a GGUF file — metadata and tensor infos — read without gguf.GGUFReader.

GGUFReader builds numpy arrays for every part of every field, one per token string: ~20 s on
Llama 3's 128k-token vocabulary. This reader unpacks the same header with struct from an mmap
(≈ 0.12 s there, all keys; ≈ 0.04 s skipping the vocabulary arrays as open_model does: bench/
header_read.py) and never touches tensor data. open_model, the tokenizer and `kafila inspect`
all read GGUF headers here.

Layout (GGUF v2/v3, little-endian; llama.cpp's ggml/src/gguf.cpp):

  "GGUF"  u32 version  u64 n_tensors  u64 n_kv
  n_kv ×      string key, u32 value type, value
  n_tensors × string name, u32 n_dims, u64 dims[n_dims] (ggml order: row length first),
              u32 ggml type, u64 offset (relative to the data section, a multiple of the alignment)
  padding to general.alignment (u32, default 32), then the data section.

A string is a u64 byte length and UTF-8 bytes; an array is a u32 item type, a u64 count and the
items. Values come back as the Python objects gguf's `ReaderField.contents()` gives (int, float,
bool, str, lists of them); strings that are not valid UTF-8 are decoded with U+FFFD replacements.
Every failure is one line of BadInput: missing file, bad magic, unsupported version, truncated
or damaged header.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from backends.errors import BadInput

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
HEADER_BYTES = 24  # magic, version, n_tensors, n_kv
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
_U64 = struct.Struct("<Q")
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset


@dataclass(frozen=True)
class TensorEntry:
    """One tensor info of the header."""

    name: str
    type_name: str  # ggml's name of its type, as gguf.GGMLQuantizationType spells it ("Q4_K", "F32", …)
    dims: tuple[int, ...]  # ggml order: (row length, rows, …)
    offset: int  # absolute byte offset of its data in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order: (rows, row length) for matrices, (n,) for vectors."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    file_bytes: int
    version: int
    metadata: dict[str, object]  # the keys kept (all unless read_header was given `keep`)
    tensors: tuple[TensorEntry, ...]  # in file order; empty when read_header was told not to read them
    data_offset: int  # where the data section starts
    kv_spans: tuple[tuple[str, int, int], ...] = ()  # every key's [start, end) bytes, key and value


class _Damaged(Exception):
    """A header that contradicts itself or ends early; read_header turns it into BadInput."""


def read_header(path: str, keep: Callable[[str], bool] | None = None, *, tensors: bool = True) -> GGUFHeader:
    """The header of the GGUF at `path`: metadata (only keys for which `keep(key)` is true, when
    given: values of the others are skipped, not decoded) and, when `tensors`, the tensor infos."""
    if not os.path.exists(path):
        raise BadInput(f"model file not found: {path} (give a GGUF path or an alias; see `kafila models`)")
    if not os.path.isfile(path):
        raise BadInput(f"model path is not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise BadInput(f"not a GGUF file (bad magic {magic!r}): {path}")
        file_bytes = os.fstat(f.fileno()).st_size
        if file_bytes < HEADER_BYTES:
            raise BadInput(f"cannot read GGUF {path}: it is truncated ({file_bytes} bytes, no complete header)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf, path, file_bytes, keep, tensors)
    except (_Damaged, struct.error, ValueError, UnicodeDecodeError, OverflowError, IndexError) as exc:
        raise BadInput(f"cannot read GGUF {path}: it is damaged or truncated ({type(exc).__name__}: {exc})") from None
    finally:
        buf.close()


def _parse(buf: mmap.mmap, path: str, size: int, keep: Callable[[str], bool] | None, want_tensors: bool) -> GGUFHeader:
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0 and version:
        raise BadInput(f"GGUF {path} is big-endian; Kafila reads little-endian GGUF files")
    if version not in SUPPORTED_VERSIONS:
        raise BadInput(f"GGUF {path} is version {version}; Kafila reads versions 2 and 3")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES > size - HEADER_BYTES:
        raise _Damaged(f"{n_kv} keys and {n_tensors} tensors cannot fit in {size} bytes")
    reader = _Reader(buf, size)
    metadata: dict[str, object] = {}
    seen: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    spans: list[tuple[str, int, int]] = []
    for _ in range(n_kv):
        start = reader.at
        key = reader.string(strict=True)
        if key in seen:
            raise _Damaged(f"duplicate key {key}")
        seen.add(key)
        kind = reader.scalar("<I")
        if key == "general.alignment":
            if kind != _UINT32:
                raise _Damaged("general.alignment is not a u32")
            alignment = reader.scalar("<I")
            if alignment == 0 or alignment & (alignment - 1):
                raise _Damaged(f"general.alignment {alignment} is not a power of two")
            if keep is None or keep(key):
                metadata[key] = alignment
            spans.append((key, start, reader.at))
            continue
        wanted = keep is None or keep(key)
        value = reader.value(kind, wanted)
        if wanted:
            metadata[key] = value
        spans.append((key, start, reader.at))
    if not want_tensors:
        return GGUFHeader(path, size, version, metadata, (), 0, tuple(spans))

    import gguf  # ggml's type names and block sizes (the import is light next to the reading)

    infos = []
    for _ in range(n_tensors):
        name = reader.string(strict=True)
        n_dims = reader.scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Damaged(f"tensor {name} has {n_dims} dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, reader.at)
        reader.at += 8 * n_dims
        type_id = reader.scalar("<I")
        rel_offset = reader.scalar("<Q")
        infos.append((name, dims, type_id, rel_offset))
    data_offset = -(-reader.at // alignment) * alignment

    entries: list[TensorEntry] = []
    names: set[str] = set()
    for name, dims, type_id, rel_offset in infos:
        if name in names:
            raise _Damaged(f"duplicate tensor {name}")
        names.add(name)
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise _Damaged(f"tensor {name} has unknown type {type_id}") from None
        block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if dims[0] % block_weights:  # no whole number of blocks per row: llama.cpp refuses it too
            raise BadInput(f"GGUF {path}: tensor {name}: row length {dims[0]} is not a multiple of "
                           f"{qtype.name}'s block of {block_weights} weights")
        if rel_offset % alignment:
            raise _Damaged(f"tensor {name}: offset {rel_offset} is not a multiple of the alignment {alignment}")
        n_elements = 1
        for d in dims:
            n_elements *= d
        entries.append(TensorEntry(name, qtype.name, tuple(int(d) for d in dims), data_offset + rel_offset,
                                   n_elements // block_weights * block_bytes))
    return GGUFHeader(path, size, version, metadata, tuple(entries), data_offset, tuple(spans))


class _Reader:
    """A cursor over the header bytes."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.at = buf, size, HEADER_BYTES

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return v

    def string(self, strict: bool = False, keep: bool = True) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.at)
        start, end = self.at + 8, self.at + 8 + length
        if end > self.size:
            raise _Damaged("a string runs past the end of the file")
        self.at = end
        if not keep:
            return ""
        return self.buf[start:end].decode("utf-8", errors="strict" if strict else "replace")

    def value(self, kind: int, keep: bool) -> object:
        if kind in _SCALARS:
            v = self.scalar(_SCALARS[kind])
            return v if keep else None
        if kind == _STRING:
            return self.string(keep=keep)
        if kind != _ARRAY:
            raise _Damaged(f"unknown value type {kind}")
        item, count = struct.unpack_from("<IQ", self.buf, self.at)
        self.at += 12
        if item in _SCALARS:
            import numpy as np

            width = struct.calcsize(_SCALARS[item])
            end = self.at + width * count
            if end > self.size:
                raise _Damaged("an array runs past the end of the file")
            data = np.frombuffer(self.buf, np.dtype(_SCALARS[item]), count, self.at).tolist() if keep else None
            self.at = end
            return data
        if item == _STRING:
            return self._strings(count, keep)
        if count > self.size - self.at:  # every item takes at least one byte
            raise _Damaged("an array runs past the end of the file")
        values = [self.value(item, keep) for _ in range(count)]
        return values if keep else None

    def _strings(self, count: int, keep: bool) -> list[str] | None:
        """An array of strings, as vocabularies hold hundreds of thousands: one tight loop over the
        lengths, then one decode of all the bytes (each u64 length turned into a NUL separator)."""
        buf, at, size = self.buf, self.at, self.size
        if count * 8 > size - at:
            raise _Damaged("an array runs past the end of the file")
        first, length_at = at, _U64.unpack_from
        if not keep:  # only the walk to the next key (a length past the end raises struct.error)
            for _ in range(count):
                at += 8 + length_at(buf, at)[0]
            if at > size:
                raise _Damaged("an array runs past the end of the file")
            self.at = at
            return None
        starts: list[int] = []
        mark = starts.append
        for _ in range(count):
            mark(at)
            at += 8 + length_at(buf, at)[0]
        if at > size:
            raise _Damaged("an array runs past the end of the file")
        self.at = at
        if count == 0:
            return []
        import numpy as np

        raw = np.frombuffer(bytearray(buf[first:at]), np.uint8)  # a copy: the mmap is never exported
        prefix = np.asarray(starts, np.int64) - first
        raw[prefix[1:] + 7] = 0  # the last byte of each length after the first: the separator
        kept = np.ones(raw.size, bool)
        kept[(prefix[:, None] + np.arange(8)).ravel()] = False  # (count, 8): every length's bytes…
        kept[prefix[1:] + 7] = True  # …but the separators
        out = raw[kept].tobytes().decode("utf-8", "replace").split("\x00")
        if len(out) != count:  # a string holds a NUL itself: one decode each
            out = [buf[s + 8:s + 8 + length_at(buf, s)[0]].decode("utf-8", "replace") for s in starts]
        return out
