"""Ring frames over the TCP lane (kafila.session.weights.ring_lane): the offer and its answer on the ring
stream, the fallback to the stream when TCP does not connect or is not offered, the lane tied to
the stream beside it, and --latency-ms on the lane. The ring stream is an in-memory pair here (as
in test_bulk_lane.py); the lane is a real TCP connection on 127.0.0.1 with the real listener."""

import asyncio
import socket
import time

import numpy as np
import pytest

from kafila.session.weights import bulk as B
from kafila.session.wire.frames import Activation, BulkOffer, Hello, Limits, encode
from kafila.session.weights.ring_lane import offer_lane, take_lane
from kafila.session.wire.streams import FrameWriter, StreamClosed, read_frame
from tests.fake_link import Pipe

LIMITS = Limits(hidden=8, context=64, slots=4, vocab=100)


def activation(i: int) -> Activation:
    return Activation(req_id=f"r{i}", slot=0, cache_len=i, pos0=i, zeros=(), hidden=np.full((1, 8), i, np.float32))


class Stream:
    """The ring stream P opened to S: P writes `forth`, S answers on `back` (both in memory)."""

    def __init__(self) -> None:
        self.forth, self.back = Pipe(), Pipe()


async def form(listener, dial, send_delay_ms=0.0):
    """P's and S's ends run concurrently, as the two members do: (P's writer, P's lane, S's
    reader, S's lane, the stream)."""
    s = Stream()
    s.forth.write(encode(Hello("p", "ring", 1, bulk=dial is not None)))
    hello = await read_frame(s.forth.reader, None)
    assert isinstance(hello, Hello) and hello.bulk == (dial is not None)

    async def successor():
        if not hello.bulk:
            return s.forth.reader, None
        return await offer_lane(s.forth.reader, s.back, listener)

    (writer, p_lane), (reader, s_lane) = await asyncio.gather(
        take_lane(s.back.reader, s.forth, dial, send_delay_ms), successor())
    return writer, p_lane, reader, s_lane, s


async def carry(writer, reader, n=3):
    out = FrameWriter(writer, LIMITS)
    for i in range(n):
        await out.send(activation(i))
    return [await read_frame(reader, LIMITS) for _ in range(n)]


def test_frames_take_the_tcp_lane_when_the_successor_is_reachable():
    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        try:
            writer, p_lane, reader, s_lane, s = await form(listener, B.dial)
            quic_before = s.forth.writes
            got = await carry(writer, reader)
            assert s.forth.writes == quic_before  # nothing more on the QUIC stream
            assert [f.pos0 for f in got] == [0, 1, 2] and float(got[2].hidden[0, 0]) == 2.0
            assert isinstance(reader, B.SecureReader) and reader.bytes_received > 3 * 32
            await p_lane.close()
            await s_lane.close()
            return p_lane.kind, s_lane.kind, listener._open
        finally:
            await listener.close()

    p, s, still_open = asyncio.run(run())
    assert (p, s) == ("tcp", "tcp") and still_open == 0  # the lane counts as finished once closed


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_successor_gets_a_decline_and_frames_stay_on_the_stream():
    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        listener.port = _closed_port()  # the offer names a port nobody listens on
        try:
            writer, p_lane, reader, s_lane, s = await form(listener, B.dial)
            got = await carry(writer, reader)
            return p_lane, s_lane, got, writer is s.forth, len(listener._offers)
        finally:
            await listener.close()

    p_lane, s_lane, got, on_stream, offers_left = asyncio.run(run())
    assert (p_lane.kind, s_lane.kind) == ("quic", "quic") and on_stream and offers_left == 0
    assert "cannot reach 127.0.0.1 port" in p_lane.note and "could not reach" in s_lane.note
    assert [f.pos0 for f in got] == [0, 1, 2]


def test_a_successor_without_a_listener_or_a_predecessor_that_asks_none_stays_on_the_stream():
    async def run(dial):
        writer, p_lane, reader, s_lane, s = await form(None, dial)
        got = await carry(writer, reader)
        return p_lane, s_lane, [f.pos0 for f in got], writer is s.forth

    p_lane, s_lane, got, on_stream = asyncio.run(run(B.dial))
    assert p_lane.kind == s_lane.kind == "quic" and got == [0, 1, 2] and on_stream
    assert p_lane.note == "the successor offers no TCP lane" and s_lane.note == "no TCP listener here"
    p_lane, s_lane, got, on_stream = asyncio.run(run(None))  # --ring-lane quic at the predecessor
    assert p_lane.kind == "quic" and p_lane.note is None and s_lane is None and got == [0, 1, 2]


def test_the_end_of_the_stream_beside_the_lane_closes_the_lane():
    """The QUIC edge ends (closed at a teardown, or timed out: the peer vanished): the ring's
    reader at S sees its stream end, and P's next write fails, as on QUIC."""

    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        try:
            writer, p_lane, reader, s_lane, s = await form(listener, B.dial)
            await carry(writer, reader, 1)
            s.forth.close()  # the edge's end, as S's stream reader sees it
            with pytest.raises(StreamClosed):
                await asyncio.wait_for(read_frame(reader, LIMITS), 5)
            s.back.close()  # and as P's does
            await asyncio.wait_for(asyncio.shield(p_lane.watcher), 5)
            with pytest.raises(StreamClosed):
                for _ in range(3):  # the close reaches the transport at once; a write after it fails
                    await FrameWriter(writer, LIMITS).send(activation(1))
                    await asyncio.sleep(0.05)
        finally:
            await listener.close()

    asyncio.run(run())


@pytest.mark.parametrize("stream_ends", [False, True])
def test_a_lane_whose_tcp_ends_alone_is_marked_broke(stream_ends, monkeypatch):
    """The TCP connection ends while the QUIC stream beside it stays up: P marks its lane broke
    (its member then keeps that successor's frames on QUIC). When the stream ends too within the
    grace (a teardown: both end, TCP often first) it is no break."""
    from kafila.session.weights import ring_lane

    monkeypatch.setattr(ring_lane, "BREAK_GRACE_S", 0.5)

    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        try:
            writer, p_lane, reader, s_lane, s = await form(listener, B.dial)
            await carry(writer, reader, 1)
            await s_lane.close()  # S's end of the TCP connection closes; the QUIC stream does not
            if stream_ends:
                await asyncio.sleep(0.1)
                s.back.close()
            await asyncio.wait_for(asyncio.shield(p_lane.watcher), 5)
            return p_lane.broke
        finally:
            await listener.close()

    assert asyncio.run(run()) is not stream_ends


def test_anything_on_the_stream_after_the_lane_is_up_closes_it():
    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        try:
            writer, p_lane, reader, s_lane, s = await form(listener, B.dial)
            s.forth.write(encode(BulkOffer()))  # a late decline: the two ends disagree
            with pytest.raises(StreamClosed):
                await asyncio.wait_for(read_frame(reader, LIMITS), 5)
        finally:
            await listener.close()

    asyncio.run(run())


def test_a_successor_that_closes_the_stream_is_one_clear_error_at_the_predecessor():
    async def run():
        s = Stream()
        s.back.close()  # S refused the Hello and closed the edge
        with pytest.raises(StreamClosed):
            await take_lane(s.back.reader, s.forth, B.dial)
        s = Stream()
        s.back.write(encode(Hello("s", "ring", 1)))
        with pytest.raises(StreamClosed, match="answered the ring Hello with a Hello frame"):
            await take_lane(s.back.reader, s.forth, B.dial)

    asyncio.run(run())


def test_latency_emulation_delays_the_lane_but_not_its_sender():
    """--latency-ms on the lane is a link's latency: frames arrive that much later, in order, while
    the sender goes on at once (as on a QUIC edge, whose datagrams are delayed below the stream),
    so several micro-batches can be in flight on one edge."""

    async def run(delay_ms):
        listener = await B.BulkListener.start("127.0.0.1", [])
        try:
            writer, p_lane, reader, s_lane, s = await form(listener, B.dial, send_delay_ms=delay_ms)
            out = FrameWriter(writer, LIMITS)
            t0 = time.monotonic()
            for i in range(3):
                await out.send(activation(i))
            sent = time.monotonic() - t0
            got = [await read_frame(reader, LIMITS) for _ in range(3)]
            return sent, time.monotonic() - t0, [f.pos0 for f in got]
        finally:
            await listener.close()

    sent, arrived, order = asyncio.run(run(120.0))
    assert sent < 0.06 and arrived >= 0.12 and order == [0, 1, 2], (sent, arrived)
