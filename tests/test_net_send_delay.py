"""`send_delay_ms` (WAN emulation) delays every path a member sends on: real sockets on 127.0.0.1.

The datagram paths (direct, relay) go through MemberSocket; the TCP signaling to the rendezvous
through DelayedWriter. Each test measures one path against an undelayed control in the same
session, so a path the delay does not reach fails instead of passing on a slow machine.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kafila.net import Member, MemberJoined, Message
from rendezvous.service import Rendezvous
from tests.test_net_loopback import _event, run

LOOP = "127.0.0.1"
DELAY_MS = 300.0
pytestmark = pytest.mark.timeout(60)


async def _delivered_s(sender: Member, receiver: Member, body: dict) -> float:
    """Seconds from `sender.send` (signaling: Send → rendezvous → Deliver) to its arrival."""
    start = time.perf_counter()
    await sender.send(receiver.name, body)
    got = await _event(receiver, Message)
    assert got.body == body
    return time.perf_counter() - start


def test_signaling_is_delayed_by_send_delay() -> None:
    async def main():
        rv = await Rendezvous.start(LOOP, 0)
        host = await Member.host(rv.address, "host", {}, bind_host=LOOP, send_delay_ms=DELAY_MS)
        a = await Member.join(host.code, rv.address, "a", {}, bind_host=LOOP)
        try:
            await _event(host, MemberJoined)
            delayed = await _delivered_s(host, a, {"ping": 1})  # host's TCP writes wait DELAY_MS
            undelayed = await _delivered_s(a, host, {"pong": 1})  # a has no delay: the control
            assert delayed >= DELAY_MS / 1000, (delayed, undelayed)
            assert undelayed < DELAY_MS / 1000, (delayed, undelayed)
        finally:
            await a.close()
            await host.close()  # its Bye waits out the delay, then leaves cleanly
            await rv.close()
    run(main())


def test_relay_path_is_delayed_by_send_delay() -> None:
    async def main():
        rv = await Rendezvous.start(LOOP, 0)
        host = await Member.host(rv.address, "host", {}, bind_host=LOOP, send_delay_ms=DELAY_MS)
        a = await Member.join(host.code, rv.address, "a", {}, bind_host=LOOP)
        host.allow_direct = a.allow_direct = False  # the edge stays on the relay
        try:
            await _event(host, MemberJoined)
            accepting = asyncio.ensure_future(a.accept())
            start = time.perf_counter()
            edge = await host.connect("a")
            peer_edge = await asyncio.wait_for(accepting, 10)
            opened_s = time.perf_counter() - start
            assert edge.kind == peer_edge.kind == "relay"
            # the EdgeRequest, then a QUIC handshake whose host datagrams all cross the relay
            assert opened_s >= 2 * DELAY_MS / 1000, opened_s
            reader, writer = await edge.open_stream()
            writer.write(b"x")
            peer_reader, peer_writer = await peer_edge.accept_stream()
            assert await peer_reader.readexactly(1) == b"x"
            start = time.perf_counter()
            peer_writer.write(b"y")
            assert await reader.readexactly(1) == b"y"
            undelayed = time.perf_counter() - start  # a → relay → host: nobody delays it
            start = time.perf_counter()
            writer.write(b"z")
            assert await peer_reader.readexactly(1) == b"z"
            delayed = time.perf_counter() - start  # host → relay → a
            assert delayed >= DELAY_MS / 1000 > undelayed, (delayed, undelayed)
        finally:
            await a.close()
            await host.close()
            await rv.close()
    run(main())
