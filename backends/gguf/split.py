"""Split GGUF models (llama.cpp's gguf-split: PREFIX-00001-of-00003.gguf, …) joined into one file.

Why. The big models people pool machines for are published split (Hugging Face caps a file at
50 GB: gpt-oss-120b comes in 3 parts). Kafila reads a model as byte ranges of one file: the index,
the host's digests, the weight transfer and every member's sparse copy share that one layout. So
a split model is joined once, on the machine that opens it, into the file `llama-gguf-split
--merge` would write (the first part's metadata less the split keys, every part's tensors in
order, each aligned), kept in a cache beside a note of the parts it came from: the next open of
unchanged parts takes the joined file at once. Tensor bytes are copied, never decoded.

Every failure is one line of BadInput: a later part given, a part missing, parts that disagree
with their names or with each other, too little disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable

from backends.errors import BadInput
from backends.gguf.header import DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFHeader, read_header

SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")  # llama_split_path: "%s-%05d-of-%05d.gguf"
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
MAX_PARTS = 999  # far more than any published model (a 1 TB model in 50 GB files is 20)
COPY_CHUNK_BYTES = 16 << 20
SPARE_DISK_BYTES = 1 << 30  # what a join leaves free on the cache's disk at least


def split_part(path: str) -> tuple[int, int] | None:
    """(part, count) of a gguf-split file name (1-based), or None."""
    m = SPLIT_NAME.match(os.path.basename(path))
    return (int(m.group(2)), int(m.group(3))) if m else None


def part_paths(first: str) -> list[str]:
    """Every part's path, from any part's (the first's, as a rule)."""
    m = SPLIT_NAME.match(first)
    if m is None:
        raise BadInput(f"{first} is not named as a part of a split GGUF (PREFIX-00001-of-0000N.gguf)")
    prefix, count = m.group(1), int(m.group(3))
    return [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def joined_path(first: str, cache_dir: str) -> str:
    """Where the parts beginning with `first` are joined: cache_dir/PREFIX.gguf."""
    m = SPLIT_NAME.match(os.path.basename(first))
    assert m is not None, first
    return os.path.join(cache_dir, f"{m.group(1)}.gguf")


def join_parts(first: str, cache_dir: str, say: Callable[[str], None] = lambda line: None) -> str:
    """The path of one GGUF holding the split model whose first part is `first`: joined into
    `cache_dir` now (`say` tells a person why it takes a while), or earlier from the same parts."""
    part = split_part(first)
    if part is None:
        raise BadInput(f"{first} is not named as a part of a split GGUF (PREFIX-00001-of-0000N.gguf)")
    if part[0] != 1:
        raise BadInput(f"{first} is part {part[0]} of a {part[1]}-part split GGUF: give the first part, "
                       f"{os.path.basename(part_paths(first)[0])}")  # fmt: skip
    if not 1 <= part[1] <= MAX_PARTS:
        raise BadInput(f"{first}: a split GGUF of {part[1]} parts (Kafila joins 1..{MAX_PARTS})")
    paths = part_paths(first)
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise BadInput(f"part {os.path.basename(missing[0])} of the split GGUF {os.path.basename(first)} is missing "
                       f"({len(missing)} of {len(paths)} parts missing): download every part into one folder")
    out = joined_path(first, cache_dir)
    note = out + ".parts.json"
    sources = [_identity(p) for p in paths]
    if os.path.isfile(out) and _read_note(note) == sources:
        return out
    headers = [read_header(p, lambda key: key in SPLIT_KEYS or key == "general.alignment") for p in paths]
    _check_parts(paths, headers)
    total = sum(t.n_bytes for h in headers for t in h.tensors)
    os.makedirs(cache_dir, exist_ok=True)
    free = shutil.disk_usage(cache_dir).free
    if free < total + SPARE_DISK_BYTES:
        raise BadInput(f"joining {os.path.basename(first)}'s {len(paths)} parts needs {total / 1e9:.1f} GB free in "
                       f"{cache_dir}; it has {free / 1e9:.1f} GB (free some, or join them elsewhere with "
                       f"`llama-gguf-split --merge` and give that file)")  # fmt: skip
    say(f"joining the {len(paths)} parts of {os.path.basename(first)} into one file ({total / 1e9:.1f} GB, "
        f"once) in {cache_dir}…")  # fmt: skip
    tmp = f"{out}.{os.getpid()}.partial"
    try:
        _write_joined(tmp, paths, headers)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with open(note, "w") as f:
        json.dump(sources, f)
    return out


def _identity(path: str) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def _read_note(path: str) -> list | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _check_parts(paths: list[str], headers: list[GGUFHeader]) -> None:
    """Each part says it is the part its name says, of as many; the first counts every tensor;
    no tensor is in two parts (what llama.cpp's loader checks of split files)."""
    count = len(paths)
    for i, (path, h) in enumerate(zip(paths, headers)):
        no, n = h.metadata.get("split.no"), h.metadata.get("split.count")
        if no != i or n != count:  # split.no counts from 0
            said = f"part {no + 1} of {n}" if isinstance(no, int) and isinstance(n, int) else "no part of a split"
            raise BadInput(f"{path} says it is {said}, but its name says part {i + 1} of {count}: "
                           "the parts do not belong together")  # fmt: skip
    expected = headers[0].metadata.get("split.tensors.count")
    names = [t.name for h in headers for t in h.tensors]
    if expected is not None and expected != len(names):
        raise BadInput(f"{paths[0]} says the split model has {expected} tensors; its parts hold {len(names)}")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise BadInput(f"tensor {name} is in two parts of {paths[0]}'s split model")
        seen.add(name)


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _write_joined(out: str, paths: list[str], headers: list[GGUFHeader]) -> None:
    """One GGUF v3: the first part's metadata less the split keys (copied as bytes), every tensor
    info with its offset in the joined data section, then each tensor's bytes, aligned."""
    import gguf

    first = headers[0]
    alignment = int(first.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    kept = [(start, end) for key, start, end in first.kv_spans if key not in SPLIT_KEYS]
    tensors = [t for h in headers for t in h.tensors]
    infos, offset = [], 0
    for t in tensors:
        type_id = gguf.GGMLQuantizationType[t.type_name].value
        infos.append(_string(t.name) + struct.pack(f"<I{len(t.dims)}QIQ", len(t.dims), *t.dims, type_id, offset))
        offset += -(-t.n_bytes // alignment) * alignment
    with open(out, "wb") as dst:
        dst.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(kept)))
        with open(paths[0], "rb") as src:
            for start, end in kept:
                src.seek(start)
                dst.write(src.read(end - start))
        for info in infos:
            dst.write(info)
        dst.write(b"\0" * (-dst.tell() % alignment))
        for path, h in zip(paths, headers):
            with open(path, "rb") as src:
                for t in h.tensors:
                    src.seek(t.offset)
                    left = t.n_bytes
                    while left:
                        chunk = src.read(min(left, COPY_CHUNK_BYTES))
                        if not chunk:
                            raise BadInput(f"{path} ends inside tensor {t.name}: the part is truncated")
                        dst.write(chunk)
                        left -= len(chunk)
                    dst.write(b"\0" * (-t.n_bytes % alignment))
        dst.flush()
        os.fsync(dst.fileno())
