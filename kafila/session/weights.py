"""Weights for one member: only its own tensors' byte ranges, verified, resumable.

Theory of operation. The host sends each member a `Manifest`: the model file's digest and size,
the header region [0, header_len) (metadata and tokenizer, sent bz2-compressed: it is
mostly the tokenizer's text), and for every
tensor of the member's shard its byte range and SHA-256. The member keeps a *sparse local copy*
of the model file: same size, the header and its own tensors at their original offsets, holes
elsewhere. A backend opens it like the real file and reads only its own tensors, so no shard-local
format is needed. Before fetching, the member checks what the copy already holds (each tensor's
digest): an interrupted transfer resumes where it stopped, and a complete local file with the
model's digest is used as it is. Chunks are requested with WeightGet frames, a few in flight at
once, over one edge stream to the host; each tensor is verified as soon as its last chunk lands.

`plan_fetch` and `Fetcher` are sans-I/O; `fetch_weights` / `serve_weights` are the thin asyncio
layer over an edge stream.
"""

from __future__ import annotations

import bz2
import hashlib
import os
from collections import deque
from dataclasses import dataclass

from kafila.session.frames import WEIGHT_CHUNK_BYTES, FrameError, WeightData, WeightGet

FETCH_CHUNK_BYTES = 1 << 20
FETCH_WINDOW_CHUNKS = 8  # chunks in flight: enough to fill a LAN edge, little to redo
MAX_MANIFEST_TENSORS = 4096


class WeightError(Exception):
    """A transfer that cannot complete: a digest mismatch, a bad chunk, a bad manifest."""


@dataclass(frozen=True)
class TensorRange:
    name: str
    offset: int
    n_bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    sha256: str  # the whole model file
    file_bytes: int
    header_len: int  # [0, header_len): GGUF header, metadata, tensor infos
    header_sha256: str
    tensors: tuple[TensorRange, ...]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "file_bytes": self.file_bytes, "header_len": self.header_len,
                "header_sha256": self.header_sha256,
                "tensors": [[t.name, t.offset, t.n_bytes, t.sha256] for t in self.tensors]}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Manifest:
        try:
            tensors = tuple(TensorRange(str(n), int(o), int(b), str(h)) for n, o, b, h in d["tensors"])
            m = cls(str(d["sha256"]), int(d["file_bytes"]), int(d["header_len"]),
                    str(d["header_sha256"]), tensors)  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightError(f"malformed weight manifest ({type(exc).__name__}: {exc})") from None
        if len(tensors) > MAX_MANIFEST_TENSORS or not 0 < m.header_len <= m.file_bytes:
            raise WeightError("weight manifest out of bounds")
        for t in tensors:
            if t.offset < m.header_len or t.n_bytes < 0 or t.offset + t.n_bytes > m.file_bytes:
                raise WeightError(f"tensor {t.name} lies outside the model file")
        return m


def sha256_range(path: str, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            chunk = f.read(min(left, 8 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


class DigestCache:
    """The host's per-tensor digests, computed once per model file."""

    def __init__(self, index) -> None:  # kafila.models.ModelIndex
        self.index = index
        self._digests: dict[str, str] = {}
        self.header_len = min(t.offset for t in index.tensors.values())
        self._header = sha256_range(index.path, 0, self.header_len)

    def manifest(self, first: int, last: int, head: bool) -> Manifest:
        ranges = []
        for t in self.index.shard_tensors(first, last, head):
            if t.name not in self._digests:
                self._digests[t.name] = sha256_range(self.index.path, t.offset, t.n_bytes)
            ranges.append(TensorRange(t.name, t.offset, t.n_bytes, self._digests[t.name]))
        return Manifest(self.index.sha256, self.index.file_bytes, self.header_len, self._header, tuple(ranges))


# --- sans-I/O ------------------------------------------------------------------------------


def plan_fetch(path: str, manifest: Manifest) -> tuple[bool, list[TensorRange]]:
    """(header needed?, tensors needed) given what the local copy at `path` already holds."""
    if not os.path.isfile(path) or os.path.getsize(path) != manifest.file_bytes:
        return True, list(manifest.tensors)
    header = sha256_range(path, 0, manifest.header_len) != manifest.header_sha256
    return header, [t for t in manifest.tensors if sha256_range(path, t.offset, t.n_bytes) != t.sha256]


@dataclass(frozen=True)
class _Chunk:
    offset: int
    length: int
    tensor: TensorRange | None  # None: the header
    last: bool  # the tensor's last chunk: verify it once written


class Fetcher:
    """Which chunks to ask for next, and what to do with each that arrives.

    `requests()` hands out WeightGet frames keeping FETCH_WINDOW_CHUNKS in flight; `received`
    checks a chunk against what was asked (same order: one stream), inflates it, and returns
    (offset, bytes, tensor to verify or None, header done?) for the caller to write."""

    def __init__(self, manifest: Manifest, header: bool, tensors: list[TensorRange]) -> None:
        self.manifest = manifest
        self._todo: deque[_Chunk] = deque()
        if header:
            self._todo.append(_Chunk(0, manifest.header_len, None, True))  # one compressed request
        for t in tensors:
            for off in range(t.offset, t.offset + t.n_bytes, FETCH_CHUNK_BYTES):
                length = min(FETCH_CHUNK_BYTES, t.offset + t.n_bytes - off)
                self._todo.append(_Chunk(off, length, t, off + length == t.offset + t.n_bytes))
        self._asked: deque[_Chunk] = deque()
        self.total_bytes = sum(c.length for c in self._todo)
        self.done_bytes = 0
        self.wire_bytes = 0  # compressed header + raw tensor bytes as they arrived

    @property
    def finished(self) -> bool:
        return not self._todo and not self._asked

    def requests(self) -> list[WeightGet]:
        out = []
        while self._todo and len(self._asked) < FETCH_WINDOW_CHUNKS:
            c = self._todo.popleft()
            if c.tensor is None and c.length > WEIGHT_CHUNK_BYTES:
                raise WeightError(f"model header of {c.length} bytes exceeds one chunk")
            self._asked.append(c)
            out.append(WeightGet(c.offset, c.length, compress=c.tensor is None))
        return out

    def received(self, frame: WeightData) -> tuple[int, bytes, TensorRange | None]:
        if not self._asked:
            raise WeightError("a weight chunk nobody asked for")
        c = self._asked.popleft()
        if (frame.offset, frame.length) != (c.offset, c.length):
            raise WeightError(f"weight chunk at {frame.offset} does not answer the request at {c.offset}")
        data = frame.data
        self.wire_bytes += len(data)
        if frame.compressed:
            try:
                data = bz2.BZ2Decompressor().decompress(data, c.length)
            except (OSError, ValueError, EOFError) as exc:
                raise WeightError(f"corrupt compressed chunk: {exc}") from None
        if len(data) != c.length:
            raise WeightError(f"weight chunk at {c.offset} has {len(data)} bytes, expected {c.length}")
        self.done_bytes += c.length
        return c.offset, data, (c.tensor if c.last else None)


def serve_chunk(path: str, file_bytes: int, get: WeightGet, cache: dict | None = None) -> WeightData:
    """The host's answer to one WeightGet (any range of the file, at most one chunk)."""
    if get.offset + get.length > file_bytes:
        raise FrameError(f"weight range [{get.offset}, {get.offset + get.length}) beyond the file")
    key = (get.offset, get.length, get.compress)
    if cache is not None and key in cache:
        return cache[key]
    with open(path, "rb") as f:
        f.seek(get.offset)
        data = f.read(get.length)
    out = WeightData(get.offset, get.length, get.compress, bz2.compress(data, 9) if get.compress else data)
    if cache is not None and get.compress:
        cache[key] = out  # the header: every member asks for the same bytes
    return out


# --- files -------------------------------------------------------------------------------


def sparse_copy(path: str, file_bytes: int) -> None:
    """Create (or keep) a file of `file_bytes` with holes where nothing was written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "ab") as f:
        if f.tell() != file_bytes:
            f.truncate(file_bytes)


def write_at(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    finally:
        os.close(fd)


def local_copy_path(cache_dir: str, manifest: Manifest) -> str:
    return os.path.join(cache_dir, f"{manifest.sha256[:32]}.gguf")
