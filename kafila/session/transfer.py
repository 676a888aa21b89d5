"""The asyncio side of weight transfer (see weights.py for the protocol and the file layout)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from kafila.session.frames import FrameError, Hello, WeightData, WeightGet
from kafila.session.streams import FrameWriter, StreamClosed, read_frame
from kafila.session.weights import (
    Fetcher,
    Manifest,
    WeightError,
    plan_fetch,
    serve_chunk,
    sha256_range,
    sparse_copy,
    write_at,
)  # fmt: skip

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]  # (bytes done, bytes total)
Check = Callable[[str], None]  # blocking: the copy's verified header against the manifest


async def fetch_weights(reader, writer, name: str, manifest: Manifest, path: str,
                        progress: Progress | None = None, check: Check | None = None) -> dict:  # fmt: skip
    """Fill the sparse copy at `path` with what `manifest` lists and it lacks.

    `check(path)` runs once the copy's header is verified, before any tensor is asked for
    (weights.check_shard: the manifest is this member's shard of that model); it raises to stop.

    Returns {"received_bytes", "tensor_bytes", "fetched_tensors", "seconds"}."""
    start = time.monotonic()
    header, tensors = await asyncio.to_thread(plan_fetch, path, manifest)
    fetcher = Fetcher(manifest, header, tensors)
    out = FrameWriter(writer)
    received = 0
    if not header and check is not None:  # the header in place (all of the copy, maybe): check now
        await asyncio.to_thread(check, path)
    if not fetcher.finished:
        await asyncio.to_thread(sparse_copy, path, manifest.file_bytes)
        await out.send(Hello(name, "weights"))
        await out.send(*fetcher.requests())
        while not fetcher.finished:
            frame = await read_frame(reader, None)
            if not isinstance(frame, WeightData):
                raise WeightError(f"unexpected {type(frame).__name__} frame during the weight transfer")
            received += 16 + len(frame.data)  # prefix + a small header: the bytes that crossed
            offset, data, verify = fetcher.received(frame)
            await asyncio.to_thread(write_at, path, offset, data)
            if verify is not None:
                digest = await asyncio.to_thread(sha256_range, path, verify.offset, verify.n_bytes)
                if digest != verify.sha256:
                    raise WeightError(f"tensor {verify.name} failed its SHA-256 check")
            elif header and offset == fetcher.header_last_offset:
                if await asyncio.to_thread(sha256_range, path, 0, manifest.header_len) != manifest.header_sha256:
                    raise WeightError("the model header failed its SHA-256 check")
                if check is not None:
                    await asyncio.to_thread(check, path)
                fetcher.release()
            if progress:
                progress(fetcher.done_bytes, fetcher.total_bytes)
            if more := fetcher.requests():
                await out.send(*more)
    out.close()
    return {"received_bytes": received, "tensor_bytes": manifest.tensor_bytes,
            "fetched_tensors": len(tensors), "seconds": round(time.monotonic() - start, 3)}  # fmt: skip


async def serve_weights(reader, writer, path: str, file_bytes: int, cache: dict,
                        progress: Callable[[int], None] | None = None) -> int:  # fmt: skip
    """Answer WeightGet frames on one stream until the member closes it; returns bytes sent.

    `progress(n)` after each chunk: the file bytes served so far on this stream (uncompressed,
    so they count against the member's manifest as its own progress does)."""
    out = FrameWriter(writer)
    served = 0
    try:
        while True:
            try:
                frame = await read_frame(reader, None)
            except StreamClosed:
                return out.bytes_sent
            if isinstance(frame, Hello):
                continue
            if not isinstance(frame, WeightGet):
                raise FrameError(f"unexpected {type(frame).__name__} frame on a weight stream")
            data = await asyncio.to_thread(serve_chunk, path, file_bytes, frame, cache)
            await out.send(data)
            served += frame.length
            if progress:
                progress(served)
    finally:
        out.close()


def check_local_file(path: str | None, manifest: Manifest) -> bool:
    """A complete local copy of the model (same digest) needs no transfer at all."""
    if not path or not os.path.isfile(path) or os.path.getsize(path) != manifest.file_bytes:
        return False
    return sha256_range(path, 0, manifest.file_bytes) == manifest.sha256
