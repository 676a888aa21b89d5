"""A ring edge's frames over the TCP lane when the successor is reachable, else its QUIC stream.

Why. Every ring frame on a QUIC edge goes through aioquic in Python: packing, encryption, ACKs
and loss detection cost about 2 ms a hop at both ends (docs/BENCHMARKS.md, "Where the ring's cost
is"), on the same cores the stages compute on. Members on one machine or one LAN usually reach
each other over TCP, where the kernel does that work and a frame is one sealed record
(kafila.net.bulk_records: AES-256-GCM, a key learnt only inside the edge's TLS).

The exchange, on the ring stream the predecessor P opens to its successor S (QUIC, pinned
certificates), after S has accepted P as its plan's predecessor:

    P → S   Hello(purpose="ring", bulk=True)
    S → P   BulkOffer (S's listener: port, addresses, a fresh key), or a decline (port 0)
    P       dials the offer (kafila.session.weights.bulk.dial); on success it writes every ring frame
            to the TCP lane, and nothing more to the QUIC stream; otherwise it writes a decline
            back to S on the QUIC stream, then every ring frame there, as without a lane
    S       reads from whichever comes first: the lane's connection, or the decline

Both ends keep the QUIC stream open beside the lane, for what TCP alone does not tell: a peer
whose machine vanished (the QUIC edge's idle timeout) and a teardown by the host (the edge is
closed). When that stream ends, or carries anything after the lane is up, the lane is closed:
the ring's reader sees its stream end and the session degrades as it would on QUIC.

`--latency-ms` applies to the lane too (a DelayedWriter), so WAN emulation measures the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kafila.net.sock import delayed_writer
from kafila.session.weights.bulk import BULK_CONNECT_TIMEOUT_S, BULK_HANDSHAKE_TIMEOUT_S, BulkError
from kafila.session.wire.frames import BulkOffer, FrameError
from kafila.session.wire.streams import FrameWriter, StreamClosed, read_frame

log = logging.getLogger(__name__)

# S waits this long for P's answer to its offer: P's dial fails within the connect and handshake
# timeouts, then its decline crosses the edge
ANSWER_WAIT_S = BULK_CONNECT_TIMEOUT_S + BULK_HANDSHAKE_TIMEOUT_S + 10.0

# P counts its lane as broken (Lane.broke) when the QUIC stream beside it is still up this long
# after the TCP connection ended
BREAK_GRACE_S = 2.0

Dial = Callable[[BulkOffer], Awaitable[tuple]]  # an offer → the lane's (reader, writer), or raises


@dataclass
class Lane:
    """What one end of a ring edge carries frames on: "tcp" or "quic", and why not TCP."""

    kind: str = "quic"
    note: str | None = None  # why the frames stay on QUIC, when a lane was tried or refused
    watcher: asyncio.Task | None = None  # ties the TCP lane to the QUIC stream (None on QUIC)
    # the QUIC stream's writer beside a TCP lane: held, since a StreamWriter that is collected
    # closes its stream, which the other end takes for the edge's end
    stream_writer: object = None
    # P's end: the TCP lane ended while the QUIC stream beside it did not (a path that drops TCP
    # connections, or the successor's process gone before its edge times out); the member then
    # keeps that successor's frames on QUIC (Participant._lanes_broken)
    broke: bool = False
    peer: object = None  # who the lane leads to (the successor's name and certificate), set by the member

    def as_dict(self) -> dict:
        return {"lane": self.kind} | ({"lane_note": self.note[:300]} if self.note else {})

    async def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            await asyncio.wait({self.watcher})


# --- the predecessor's end: it writes ---------------------------------------------------------


async def take_lane(reader, writer, dial: Dial | None, send_delay_ms: float = 0.0) -> tuple[object, Lane]:
    """P's end, after it wrote Hello(bulk=dial is not None) on the ring stream (`reader`,
    `writer`): the writer ring frames go to, and the Lane. Without `dial` the stream is used as
    it is. StreamClosed when S closed the stream (it refused the Hello)."""
    if dial is None:
        return writer, Lane()
    try:
        answer = await read_frame(reader, None)
    except FrameError as exc:
        raise StreamClosed(f"the successor's answer to the ring Hello is malformed: {exc}") from None
    if not isinstance(answer, BulkOffer):
        raise StreamClosed(f"the successor answered the ring Hello with a {type(answer).__name__} frame")
    if answer.declined:
        return writer, Lane(note="the successor offers no TCP lane")
    try:
        tcp_reader, tcp_writer = await dial(answer)
    except (BulkError, OSError) as exc:
        note = str(exc) or type(exc).__name__
        log.info("ring: no TCP lane to the successor (%s); frames go over the QUIC stream", note)
        await FrameWriter(writer).send(BulkOffer())
        return writer, Lane(note=note)
    tcp_reader.idle_timeout_s = None  # the successor never writes here; an idle ring is not a dead one
    lane = Lane("tcp", stream_writer=writer)
    lane.watcher = asyncio.create_task(_tie(reader, tcp_reader, tcp_writer, lane=lane), name="ring-lane-tie")
    return delayed_writer(tcp_writer, send_delay_ms, wait_delivery=False), lane


# --- the successor's end: it reads ------------------------------------------------------------


async def offer_lane(reader, writer, listener) -> tuple[object, Lane]:
    """S's end, once P's Hello(bulk=True) was accepted: answer it with an offer from `listener`
    (a bulk.BulkListener; None: decline) and return the reader ring frames come from, and the
    Lane. StreamClosed when P goes away or answers with anything but a decline."""
    ticket = listener.offer() if listener is not None else None
    out = FrameWriter(writer)
    if ticket is None:
        await out.send(BulkOffer())
        return reader, Lane(note="no TCP listener here" if listener is None else "the TCP listener is full")
    await out.send(ticket.frame)
    connection = asyncio.ensure_future(ticket.connection())
    decline = asyncio.ensure_future(read_frame(reader, None))
    try:
        done, _ = await asyncio.wait({connection, decline}, timeout=ANSWER_WAIT_S,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if connection in done and connection.result() is not None:
            tcp_reader, tcp_writer = connection.result()
            tcp_reader.idle_timeout_s = None  # a ring may be idle for hours; the QUIC edge watches it
            lane = Lane("tcp", stream_writer=writer)
            lane.watcher = asyncio.create_task(_tie(reader, None, tcp_writer, listener, ticket), name="ring-lane-tie")
            return tcp_reader, lane
        if decline not in done:  # nothing in time, or the offer withdrawn (the listener closing)
            raise StreamClosed(f"the predecessor neither took nor declined the TCP lane within {ANSWER_WAIT_S:g} s")
        frame = decline.result()
        if not (isinstance(frame, BulkOffer) and frame.declined):
            raise StreamClosed(f"the predecessor answered the lane offer with a {type(frame).__name__} frame")
        return reader, Lane(note="the predecessor could not reach this member over TCP")
    except FrameError as exc:
        raise StreamClosed(f"the predecessor's answer to the lane offer is malformed: {exc}") from None
    finally:
        listener.revoke(ticket)  # taken or not, the key is void now
        for f in (connection, decline):
            if not f.done():
                f.cancel()
        await asyncio.wait({connection, decline})
        for f in (connection, decline):
            if not f.cancelled():
                f.exception()  # retrieved: the outcome above is what counts


async def _tie(quic_reader, tcp_reader, tcp_writer, listener=None, ticket=None, lane: Lane | None = None) -> None:
    """Close the TCP lane when the QUIC stream beside it ends or carries anything (the edge
    closed, the peer vanished, a confused peer), or when `tcp_reader` (P's end: S never writes
    to the lane) reaches its end: either way the ring's own reader or writer then fails. P's
    `lane` is marked broke when TCP ended first."""
    waits = [asyncio.ensure_future(quic_reader.read(1))]
    if tcp_reader is not None:
        waits.append(asyncio.ensure_future(_record_or_end(tcp_reader)))
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        log.info("ring: TCP lane closed (%s)", "the QUIC stream beside it ended or carried data"
                 if waits[0] in done else "the TCP connection ended")  # fmt: skip
        if lane is not None and waits[0] not in done:
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                tcp_writer.close()  # the ring's next write fails at once
            # a teardown ends both, TCP often first; a lane that broke alone leaves the stream up
            done, _ = await asyncio.wait([waits[0]], timeout=BREAK_GRACE_S)
            lane.broke = not done
    finally:
        for w in waits:
            w.cancel()
        await asyncio.wait(waits)
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):  # already closed with its socket
            tcp_writer.close()
        if listener is not None and ticket is not None:
            listener.finished(ticket)


async def _record_or_end(tcp_reader) -> None:
    # the lane's end, however it comes: a closed socket, a cut record, a record that fails to open
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, OSError, BulkError):
        await tcp_reader.readexactly(1)


__all__ = ["Lane", "offer_lane", "take_lane"]
