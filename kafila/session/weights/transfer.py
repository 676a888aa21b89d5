"""The asyncio side of weight transfer (see weights.py for the protocol and the file layout)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kafila.net.bulk_records import BulkError
from kafila.session.weights.bulk import BULK_CHUNK_BYTES, BULK_WINDOW_CHUNKS
from kafila.session.wire.frames import BulkOffer, FrameError, Hello, WeightData, WeightGet
from kafila.session.wire.streams import FrameWriter, StreamClosed, read_frame
from kafila.session.weights.manifest import (
    Fetcher,
    Manifest,
    TensorRange,
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


@dataclass
class Lanes:
    """How a fetch may move to the bulk lane (kafila.session.weights.bulk), and what it did: `lane` is
    "tcp" when the TCP lane carried the chunks, else "quic"; `note` says why not, when the
    server offered a lane that could not be used (or offered none)."""

    dial: Dial
    lane: str = "quic"
    note: str | None = None


Dial = Callable[[BulkOffer], Awaitable[tuple]]  # an offer → (reader, writer) of the lane, or raises
OFFER_WAIT_S = 3.0  # a server from before the bulk lane never answers a bulk Hello: go on without


async def fetch_weights(reader, writer, name: str, manifest: Manifest, path: str,
                        progress: Progress | None = None, check: Check | None = None,
                        lanes: Lanes | None = None) -> dict:  # fmt: skip
    """Fill the sparse copy at `path` with what `manifest` lists and it lacks.

    `check(path)` runs once the copy's header is verified, before any tensor is asked for
    (weights.check_shard: the manifest is this member's shard of that model); it raises to stop.
    With `lanes`, the Hello asks for the bulk lane and the server answers first with a BulkOffer
    (or a decline): when `lanes.dial` connects, every chunk is asked for over TCP (in larger
    chunks); otherwise all stays on this stream.

    Returns {"received_bytes", "tensor_bytes", "fetched_tensors", "seconds", "lane"}."""
    start = time.monotonic()
    header, tensors = await asyncio.to_thread(plan_fetch, path, manifest)
    fetcher = Fetcher(manifest, header, tensors)
    out = FrameWriter(writer)
    disk = _Disk(path)
    received = 0
    early: asyncio.Task | None = None  # the stream's first frame, when no offer came in time
    if not header and check is not None:  # the header in place (all of the copy, maybe): check now
        await asyncio.to_thread(check, path)
    try:
        if not fetcher.finished:
            await asyncio.to_thread(sparse_copy, path, manifest.file_bytes)
            await out.send(Hello(name, "weights", bulk=lanes is not None))
            if lanes is not None:
                lane, early = await _take_offer(reader, lanes)
                if lane is not None:
                    out.close()  # the QUIC stream's part is done: everything comes over TCP
                    reader, out = lane[0], FrameWriter(lane[1])
                    fetcher.chunk_bytes, fetcher.window_chunks = BULK_CHUNK_BYTES, BULK_WINDOW_CHUNKS
                    lanes.lane = "tcp"
            await out.send(*fetcher.requests())
            late_offer = early is not None  # an offer after OFFER_WAIT_S: too late, ignored
            while not fetcher.finished:
                if early is not None:
                    frame, early = await early, None
                else:
                    frame = await read_frame(reader, None)
                if isinstance(frame, BulkOffer) and late_offer:
                    late_offer = False
                    continue
                late_offer = False
                if not isinstance(frame, WeightData):
                    raise WeightError(f"unexpected {type(frame).__name__} frame during the weight transfer")
                received += 16 + len(frame.data)  # prefix + a small header: the bytes that crossed
                offset, data, verify = fetcher.received(frame)
                await disk.write(offset, data, fetcher.chunk_tensor, verify is not None)
                if verify is None and header and offset == fetcher.header_last_offset:
                    await disk.settle()
                    if await asyncio.to_thread(sha256_range, path, 0, manifest.header_len) != manifest.header_sha256:
                        raise WeightError("the model header failed its SHA-256 check")
                    if check is not None:
                        await asyncio.to_thread(check, path)
                    fetcher.release()
                if progress:
                    progress(fetcher.done_bytes, fetcher.total_bytes)
                if more := fetcher.requests():
                    await out.send(*more)
            await disk.settle()
    finally:
        if early is not None:
            early.cancel()
            await asyncio.wait({early})
        out.close()
        await disk.close()
    return {"received_bytes": received, "tensor_bytes": manifest.tensor_bytes,
            "fetched_tensors": len(tensors), "seconds": round(time.monotonic() - start, 3),
            "lane": lanes.lane if lanes is not None else "quic"}  # fmt: skip


DISK_BACKLOG_CHUNKS = 4  # chunks received and not yet written (and verified): bounds the memory


class _Disk:
    """The sparse copy's writes, in arrival order on one worker thread, so the loop goes on
    receiving meanwhile; each tensor's SHA-256 is taken over its chunks as they are written (a
    tensor's chunks arrive in order, on one stream) and checked once its last one is. At most
    DISK_BACKLOG_CHUNKS wait; a failed digest raises WeightError when its turn is awaited."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: deque[tuple[asyncio.Future, TensorRange | None]] = deque()
        self._hashes: dict[str, hashlib._Hash] = {}  # tensor → the digest of its chunks so far

    async def write(self, offset: int, data: bytes, tensor: TensorRange | None, last: bool) -> None:
        """Queue chunk `data` at `offset` (of `tensor`; None: the header); `last`: its last chunk."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kafila-fetch")
        job = asyncio.get_running_loop().run_in_executor(self._pool, self._write, offset, data, tensor, last)
        self._jobs.append((job, tensor if last else None))
        while len(self._jobs) > DISK_BACKLOG_CHUNKS:
            await self._next()

    async def settle(self) -> None:
        """Everything received so far is written and verified."""
        while self._jobs:
            await self._next()

    async def _next(self) -> None:
        job, tensor = self._jobs[0]
        digest = await job
        self._jobs.popleft()
        if tensor is not None and digest != tensor.sha256:
            raise WeightError(f"tensor {tensor.name} failed its SHA-256 check")

    async def close(self) -> None:
        """After a failure too: what was queued has landed (or failed) before the fetch returns."""
        if self._jobs:
            await asyncio.wait([j for j, _ in self._jobs])
            for j, _ in self._jobs:
                j.exception()  # retrieved: the failure that ended the fetch is the one reported
            self._jobs.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


    def _write(self, offset: int, data: bytes, tensor: TensorRange | None, last: bool) -> str | None:
        """Blocking, on the worker: write, hash (hashlib lets the loop run meanwhile)."""
        write_at(self.path, offset, data)
        if tensor is None:
            return None
        h = self._hashes.setdefault(tensor.name, hashlib.sha256())
        h.update(data)
        return self._hashes.pop(tensor.name).hexdigest() if last else None


async def _take_offer(reader, lanes: Lanes) -> tuple[tuple | None, asyncio.Task | None]:
    """(the TCP lane or None, the first frame's read when it did not come within OFFER_WAIT_S:
    still running, it belongs to the transfer). A lane that does not come up is one log line."""
    first = asyncio.create_task(read_frame(reader, None))
    await asyncio.wait({first}, timeout=OFFER_WAIT_S)
    if not first.done():
        lanes.note = f"the server sent no bulk lane offer within {OFFER_WAIT_S:g} s (an older version?)"
        log.info("weights: %s; fetching over the QUIC stream", lanes.note)
        return None, first
    frame = first.result()
    if not isinstance(frame, BulkOffer):
        raise WeightError(f"unexpected {type(frame).__name__} frame before any weight was asked for")
    if frame.declined:
        lanes.note = "the server offers no TCP lane"
        return None, None
    try:
        return await lanes.dial(frame), None
    except (BulkError, OSError) as exc:
        lanes.note = str(exc) or type(exc).__name__
    log.warning("weights: no TCP lane (%s); fetching over the QUIC stream", lanes.note)
    return None, None


async def serve_weights(reader, writer, path: str, file_bytes: int, cache: dict,
                        progress: Callable[[int], None] | None = None, bulk=None,
                        on_lane: Callable[[str], None] | None = None, hello: Hello | None = None) -> int:  # fmt: skip
    """Answer WeightGet frames on one stream until the member closes it; returns bytes sent.

    `progress(n)` after each chunk: the file bytes served so far on this stream (uncompressed,
    so they count against the member's manifest as its own progress does). With `bulk` (a
    bulk.BulkListener), a Hello that asks for the bulk lane is answered with an offer, and the
    chunks asked for over TCP are served too (counted in the same figures); `on_lane("tcp")`
    once the member connected there. `hello`: the stream's Hello when the caller read it already
    (to see what the stream is for)."""
    out = FrameWriter(writer)
    served = 0
    ticket = None
    tcp: asyncio.Task | None = None

    def count(n: int) -> None:
        nonlocal served
        served += n
        if progress:
            progress(served)

    answered = False

    async def offer(hello: Hello) -> None:
        nonlocal ticket, tcp, answered
        if hello.bulk and hello.purpose == "weights" and not answered:
            answered = True  # one answer per stream: an offer, or a decline (BulkOffer())
            ticket = bulk.offer() if bulk is not None else None
            await out.send(ticket.frame if ticket is not None else BulkOffer())
            if ticket is not None:
                tcp = asyncio.create_task(_serve_lane(bulk, ticket, path, file_bytes, cache, count, on_lane))

    try:
        try:
            if hello is not None:
                await offer(hello)
            await _serve_stream(reader, out, path, file_bytes, cache, count, offer)
        finally:
            out.close()
        if tcp is not None:
            if not ticket.accepted:
                bulk.revoke(ticket)  # fetched over QUIC: the key is void now
            return out.bytes_sent + await tcp
        return out.bytes_sent
    finally:
        if tcp is not None:
            if not tcp.done():
                bulk.revoke(ticket)
                tcp.cancel()
            await asyncio.wait({tcp})
            if not tcp.cancelled():
                tcp.exception()  # retrieved: the error that ended the stream is the one raised


async def _serve_lane(listener, ticket, path: str, file_bytes: int, cache: dict, count, on_lane) -> int:
    lane = await ticket.connection()
    if lane is None:
        return 0
    reader, writer = lane
    if on_lane is not None:
        on_lane("tcp")
    out = FrameWriter(writer)
    try:
        await _serve_stream(reader, out, path, file_bytes, cache, count, None)
    finally:
        out.close()
        listener.finished(ticket)
    return out.bytes_sent


SERVE_AHEAD_CHUNKS = 2  # chunks read from the file while the one before is being sent


async def _serve_stream(reader, out: FrameWriter, path: str, file_bytes: int, cache: dict, count,
                        on_hello) -> None:  # fmt: skip
    """Serve one stream's WeightGets until the member closes it: a reader task takes the
    requests and starts reading their chunks (SERVE_AHEAD_CHUNKS ahead, in worker threads);
    this loop sends them in order."""
    ahead: asyncio.Queue = asyncio.Queue(SERVE_AHEAD_CHUNKS)

    async def take() -> None:
        try:
            while True:
                try:
                    frame = await read_frame(reader, None)
                except StreamClosed:
                    break
                if isinstance(frame, Hello):
                    if on_hello is not None:
                        await on_hello(frame)
                    continue
                if not isinstance(frame, WeightGet):
                    raise FrameError(f"unexpected {type(frame).__name__} frame on a weight stream")
                chunk = asyncio.ensure_future(asyncio.to_thread(serve_chunk, path, file_bytes, frame, cache))
                await ahead.put((frame, chunk))
        except Exception as exc:  # noqa: BLE001 (handed to the sending loop, which raises it in its turn)
            await ahead.put((exc, None))
            return
        await ahead.put((None, None))

    taker = asyncio.create_task(take())
    try:
        while True:
            get, chunk = await ahead.get()
            if isinstance(get, Exception):
                raise get
            if get is None:
                return
            data = await chunk
            await out.send(data)
            count(get.length)
    finally:
        taker.cancel()
        await asyncio.wait({taker})
        while not ahead.empty():  # chunks read for a member that is gone
            _, left = ahead.get_nowait()
            if left is not None:
                left.cancel()


def check_local_file(path: str | None, manifest: Manifest) -> bool:
    """A complete local copy of the model (same digest) needs no transfer at all."""
    if not path or not os.path.isfile(path) or os.path.getsize(path) != manifest.file_bytes:
        return False
    return sha256_range(path, 0, manifest.file_bytes) == manifest.sha256
