"""A ring edge: one QUIC connection (aioquic) between two members, routed underneath.

aioquic sees one stable fake peer address per connection; every datagram it sends goes through
`Edge._send_quic`, which picks the route: a relay DATA frame to the rendezvous, or the raw QUIC
packet to the peer's punched address. Switching routes therefore needs no QUIC migration and the
connection (and its streams) survives the switch.

Identity: the client checks the server's certificate against the pinned fingerprint from the
authenticated roster as soon as the TLS handshake completes. aioquic's server cannot request a
client certificate, so on the first stream the client sends its certificate, the server answers
a fresh nonce, and the client signs  "kafila-edge-v1" | edge id | server fp | client fp | nonce.
Only then is the edge handed to the application on either side. Any mismatch closes the
connection and fails with one clear line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicPacketType, pull_quic_header
from aioquic.quic.recovery import QuicPacketPacer
from cryptography.hazmat.primitives import serialization

from backends.errors import Refused
from kafila.net.certs import Identity, fingerprint, verify_signature
from kafila.net.handshake import derive
from kafila.net.punch import DIRECT, Puncher
from kafila.net.sock import LOOPBACK_MAX_DATAGRAM_BYTES, is_loopback
from rendezvous import frames
from rendezvous.errors import ProtocolError

if TYPE_CHECKING:
    from kafila.net.sock import MemberSocket

log = logging.getLogger("kafila.net")

Address = tuple[str, int]
FAKE_PEER: Address = ("192.0.2.1", 4433)  # TEST-NET-1: what aioquic believes the peer is
ALPN = "kafila-edge-1"
EDGE_MAX_DATA_BYTES = 256 * 1024 * 1024  # connection flow-control window
EDGE_MAX_STREAM_DATA_BYTES = 64 * 1024 * 1024  # per stream
EDGE_MAX_DATAGRAM_BYTES = 1350  # + 9 bytes of relay header stays under common MTUs
# A direct route to a loopback address (peer on this machine) crosses no link (lo's MTU is
# 65536): packets there may be larger, up to what a MemberSocket accepts from loopback
# (LOOPBACK_MAX_DATAGRAM_BYTES, kafila/net/sock.py), and Python's cost is per packet. Every other
# path keeps EDGE_MAX_DATAGRAM_BYTES: there is no path-MTU probing yet, and a LAN address may sit
# behind a VPN-style link with a smaller MTU (a too-large packet there is silently lost, on every
# retransmission).
EDGE_IDLE_TIMEOUT_S = 60.0
EDGE_CONNECT_TIMEOUT_S = 10.0
QUIC_PING_S = 15.0  # keeps QUIC's idle timer (and the NAT) alive on a quiet edge
RELAY_KEEPALIVE_S = 60.0  # keeps the relay allocation alive while direct
AUTH_MAX_BYTES = 8 * 1024
AUTH_STREAM_ID = 0
_LEN = struct.Struct("!H")
# asyncio sleeps in whole milliseconds (epoll), so a pacer that may only burst a few packets
# waits >= 1 ms after each burst: on a fast path the pacing, not the window, set the rate.
# Let the pacer bank this much sending time (at its rate), enough for a burst per timer tick.
PACING_MIN_BURST_S = 0.002
# On a long path aioquic's pacer lets only a quarter window leave at once and spaces the rest
# at cwnd/rtt: at 100 ms RTT a 7-packet activation (a speculative step's K+1 rows) took ~45 ms
# longer per hop than a 2-packet one, which ate most of what speculation saves. A ring edge is
# app-limited (one frame, then silence until the next step), and RFC 9002 §7.7 lets a sender
# burst up to its initial window: let a frame of that many packets leave at once.
PACING_BURST_PACKETS = 10


class _TickPacer(QuicPacketPacer):
    """aioquic's pacer with a bucket of at least PACING_MIN_BURST_S (event-loop timer ticks)
    and at least PACING_BURST_PACKETS packets (never more than the congestion window)."""

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        super().update_rate(congestion_window, smoothed_rtt)
        # on a fast path this allows a tick's worth; never more than a window at once
        window_s = max(smoothed_rtt, 1e-6)
        burst_s = min(PACING_BURST_PACKETS * self._max_datagram_size, congestion_window) / (
            congestion_window / window_s)  # fmt: skip
        self.bucket_max = max(self.bucket_max, min(PACING_MIN_BURST_S, window_s), burst_s)


def quic_configuration(identity: Identity, *, is_client: bool) -> QuicConfiguration:
    config = QuicConfiguration(
        is_client=is_client,
        alpn_protocols=[ALPN],
        max_data=EDGE_MAX_DATA_BYTES,
        max_stream_data=EDGE_MAX_STREAM_DATA_BYTES,
        max_datagram_size=EDGE_MAX_DATAGRAM_BYTES,
        idle_timeout=EDGE_IDLE_TIMEOUT_S,
        congestion_control_algorithm="cubic",
    )
    if is_client:
        config.verify_mode = 0  # ssl.CERT_NONE: no CA here; the fingerprint is pinned below
    else:
        config.certificate = identity.cert
        config.private_key = identity.key
    return config


def quic_destination_cid(datagram: bytes, cid_length: int = 8) -> tuple[bytes, bool]:
    """(destination connection id, is an INITIAL packet) of a QUIC datagram, or ProtocolError."""
    try:
        header = pull_quic_header(Buffer(data=datagram), host_cid_length=cid_length)
    except Exception as exc:
        raise ProtocolError("malformed", "not a QUIC packet") from exc
    return header.destination_cid, header.packet_type == QuicPacketType.INITIAL


def _auth_message(edge_id: bytes, server_fp: str, client_fp: str, nonce: bytes) -> bytes:
    return b"kafila-edge-v1" + edge_id + bytes.fromhex(server_fp) + bytes.fromhex(client_fp) + nonce


async def _read_frame(reader: asyncio.StreamReader) -> dict:
    (length,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if length > AUTH_MAX_BYTES:
        raise ProtocolError("too-large", "edge authentication frame too large")
    data = await reader.readexactly(length)
    try:
        message = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ProtocolError("malformed", "bad edge authentication frame") from exc
    if not isinstance(message, dict):
        raise ProtocolError("malformed", "bad edge authentication frame")
    return message


def _frame(message: dict) -> bytes:
    data = msgpack.packb(message, use_bin_type=True)
    return _LEN.pack(len(data)) + data


class _RouteTransport:
    """The 'transport' aioquic writes to: hands each datagram to the edge's router."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self.edge._send_quic(data)

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def _is_loopback(addr: Address | None) -> bool:
    return addr is not None and is_loopback(addr[0])


class _EdgeProtocol(QuicConnectionProtocol):
    def __init__(self, quic: QuicConnection, edge: Edge) -> None:
        super().__init__(quic, stream_handler=edge._incoming_stream)
        self.edge = edge

    def transmit(self) -> None:
        # the packet size follows the route taken now (aioquic re-frames retransmitted data,
        # so a size change mid-connection is safe); the peer advertises no max_udp_payload_size
        # (aioquic: 65527) and reads up to 64 KiB per datagram
        size = self.edge._datagram_size()
        quic = self._quic
        if quic._max_datagram_size != size and quic._handshake_complete:
            quic._max_datagram_size = size
            quic._loss._pacer._max_datagram_size = size
        super().transmit()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        self.edge._quic_event(event)
        super().quic_event_received(event)


class Edge:
    """A QUIC edge to one peer. Up at once over the relay, upgraded to direct when punched."""

    def __init__(
        self,
        *,
        edge_id: bytes,
        peer: str,
        peer_fingerprint: str,
        peer_candidates: list[Address],
        predicted: str,
        is_client: bool,
        identity: Identity,
        group_key: bytes,
        sock: MemberSocket,
        relay_addr: Address,
        register_cid: Callable[[bytes, Edge | None], None],
        on_closed: Callable[[Edge], None],
        on_authed: Callable[[Edge], None] | None = None,
        punch_rounds: int = 3,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.edge_id = edge_id
        self.peer = peer
        self.peer_fingerprint = peer_fingerprint
        self.predicted = predicted
        self.is_client = is_client
        self.identity = identity
        self._sock = sock
        self._relay_addr = relay_addr
        self._register_cid = register_cid
        self._on_closed = on_closed
        self._on_authed_cb = on_authed
        self._loop = loop
        self.started = loop.time()
        self.time_to_data_s: float | None = None
        self.time_to_direct_s: float | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.auth_rtt_s: float | None = None
        self.error: str | None = None
        self.closed = False
        self._protocol: _EdgeProtocol | None = None
        self._quic: QuicConnection | None = None
        self._cids: set[bytes] = set()
        self._streams: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.Queue()
        )
        self._authed = asyncio.Event()
        self._handshake_done = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.puncher = Puncher(
            edge_id, derive(group_key, b"kafila punch" + edge_id), peer_candidates, loop.time(),
            random.Random(os.urandom(8)), rounds=punch_rounds,
        )
        self._punch_wakeup = asyncio.Event()
        self._spawn(self._punch_loop(), "punch")

    # public API
    @property
    def kind(self) -> str:
        return "direct" if self.puncher.state == DIRECT else "relay"

    async def open_stream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new bidirectional stream. Write to it first: the peer sees it with the first bytes."""
        self._check_open()
        await self._authed.wait()
        assert self._protocol is not None
        return await self._protocol.create_stream()

    async def accept_stream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The next stream the peer opened."""
        self._check_open()
        item = await self._streams.get()
        if not item[0] and self.closed:  # sentinel pushed on close
            raise ConnectionError(f"edge to {self.peer} closed: {self.error or 'closed'}")
        return item

    def stats(self) -> dict:
        rtt_s = self.puncher.rtt_s if self.kind == "direct" else self.auth_rtt_s
        return {
            "peer": self.peer,
            "kind": self.kind,
            "predicted": self.predicted,
            "rtt_ms": None if rtt_s is None else round(rtt_s * 1000.0, 3),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "time_to_data_s": self.time_to_data_s,
            "time_to_direct_s": self.time_to_direct_s,
            "direct_address": None if self.puncher.direct is None else
            f"{self.puncher.direct[0]}:{self.puncher.direct[1]}",
        }

    async def close(self) -> None:
        if self._protocol is not None and not self.closed:
            self._protocol.close(reason_phrase="edge closed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._protocol.wait_closed(), 1.0)
        self._finish("closed by this side")

    # lifecycle (driven by Member)
    async def connect(self) -> None:
        """Client side: QUIC handshake over the relay, pin the server, prove ourselves."""
        config = quic_configuration(self.identity, is_client=True)
        quic = QuicConnection(configuration=config)
        self._attach(quic)
        assert self._protocol is not None
        self._protocol.connect(FAKE_PEER)
        try:
            await asyncio.wait_for(self._handshake_done.wait(), EDGE_CONNECT_TIMEOUT_S)
            self._check_open()
            reader, writer = await self._protocol.create_stream()
            writer.write(_frame({"cert": self.identity.cert_der}))
            sent = self._loop.time()
            challenge = await asyncio.wait_for(_read_frame(reader), EDGE_CONNECT_TIMEOUT_S)
            self.auth_rtt_s = self._loop.time() - sent
            nonce = challenge.get("nonce")
            if not isinstance(nonce, bytes) or len(nonce) != 32:
                raise ProtocolError("malformed", "bad nonce from the edge server")
            signed = _auth_message(
                self.edge_id, self.peer_fingerprint, self.identity.fingerprint, nonce
            )
            writer.write(_frame({"sig": self.identity.sign(signed)}))
            verdict = await asyncio.wait_for(_read_frame(reader), EDGE_CONNECT_TIMEOUT_S)
            if verdict.get("ok") is not True:
                raise ProtocolError("auth-failed", f"peer refused us: {verdict.get('error')}")
            writer.write_eof()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            reason = self.error or f"no answer within {EDGE_CONNECT_TIMEOUT_S:.0f} s ({type(exc).__name__})"
            await self._fail(reason)
            raise Refused(f"edge to {self.peer} failed: {reason}") from None
        except ProtocolError as exc:
            await self._fail(exc.reason)
            raise Refused(f"edge to {self.peer} failed: {exc.reason}") from None
        self._mark_authed()

    @property
    def awaiting_initial(self) -> bool:
        """A server edge whose client's first Initial has not arrived yet."""
        return not self.is_client and self._protocol is None and not self.closed

    def datagram(self, data: bytes) -> None:
        """A QUIC datagram for this edge (from the relay or the direct path)."""
        self.bytes_received += len(data)
        if self._protocol is None:
            if self.is_client:
                return
            try:
                cid, initial = quic_destination_cid(data)
            except ProtocolError:
                return
            if not initial:
                return
            config = quic_configuration(self.identity, is_client=False)
            self._attach(QuicConnection(configuration=config, original_destination_connection_id=cid))
            self._add_cid(cid)  # the client's Initial retransmissions still carry this one
        assert self._protocol is not None
        # what QuicConnectionProtocol.datagram_received does, except the transmit: that runs
        # once after the socket's whole burst of datagrams (one ACK and send pass per burst)
        self._protocol._quic.receive_datagram(data, FAKE_PEER, now=self._loop.time())
        self._protocol._process_events()
        self._sock.defer(self._transmit)

    def _transmit(self) -> None:
        if self._protocol is not None:
            self._protocol.transmit()

    def punch_frame(self, frame: bytes, src: Address) -> None:
        try:
            replies = self.puncher.receive(frame, src, self._loop.time())
        except ProtocolError:
            return
        for data, addr in replies:
            self._sock.sendto(data, addr)
        self._note_direct()
        self._punch_wakeup.set()

    # internals
    def _attach(self, quic: QuicConnection) -> None:
        # pinned aioquic 1.7.2: the recovery's pacer is a private attribute (tested)
        quic._loss._pacer = _TickPacer(max_datagram_size=quic._max_datagram_size)
        self._quic = quic
        self._protocol = _EdgeProtocol(quic, self)
        self._protocol.connection_made(_RouteTransport(self))  # type: ignore[arg-type]
        self._add_cid(quic.host_cid)

    def _add_cid(self, cid: bytes) -> None:
        self._cids.add(cid)
        self._register_cid(cid, self)

    def _datagram_size(self) -> int:
        if self.puncher.state == DIRECT and _is_loopback(self.puncher.direct):
            return LOOPBACK_MAX_DATAGRAM_BYTES
        return EDGE_MAX_DATAGRAM_BYTES

    def _send_quic(self, data: bytes) -> None:
        self.bytes_sent += len(data)
        if self.puncher.state == DIRECT and self.puncher.direct is not None:
            self._sock.sendto(data, self.puncher.direct)
        else:
            self._sock.sendto(frames.encode_data(self.edge_id, data), self._relay_addr)

    def _quic_event(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.HandshakeCompleted):
            if self.is_client:
                self._pin_server()
            self._handshake_done.set()
        elif isinstance(event, events.ConnectionIdIssued):
            self._add_cid(event.connection_id)
        elif isinstance(event, events.ConnectionIdRetired):
            self._cids.discard(event.connection_id)
            self._register_cid(event.connection_id, None)
        elif isinstance(event, events.ConnectionTerminated):
            if self.error is None and event.reason_phrase:
                self.error = f"closed by peer: {event.reason_phrase}"
            self._handshake_done.set()
            self._finish(self.error or "connection terminated")

    def _pin_server(self) -> None:
        assert self._protocol is not None
        # aioquic 1.7 offers no public accessor for the peer certificate; its TLS context keeps
        # it in _peer_certificate once CertificateVerify has passed (pinned version, tested).
        cert = getattr(self._quic.tls, "_peer_certificate", None)
        got = fingerprint(cert.public_bytes(serialization.Encoding.DER)) if cert else "none"
        if got != self.peer_fingerprint:
            self.error = (
                f"certificate fingerprint mismatch (expected {self.peer_fingerprint[:16]}..., "
                f"got {got[:16]}...): someone substituted the peer's key"
            )
            self._protocol.close(reason_phrase="certificate fingerprint mismatch")

    def _incoming_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream_id = writer.get_extra_info("stream_id")
        if not self.is_client and stream_id == AUTH_STREAM_ID and not self._authed.is_set():
            self._spawn(self._serve_auth(reader, writer), "auth")
        elif self._authed.is_set():
            self._streams.put_nowait((reader, writer))
        else:
            writer.close()

    async def _serve_auth(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(_read_frame(reader), EDGE_CONNECT_TIMEOUT_S)
            cert = hello.get("cert")
            if not isinstance(cert, bytes) or fingerprint(cert) != self.peer_fingerprint:
                raise ProtocolError(
                    "auth-failed",
                    f"client certificate does not match {self.peer}'s pinned fingerprint",
                )
            nonce = os.urandom(32)
            writer.write(_frame({"nonce": nonce}))
            sent = self._loop.time()
            proof = await asyncio.wait_for(_read_frame(reader), EDGE_CONNECT_TIMEOUT_S)
            self.auth_rtt_s = self._loop.time() - sent
            sig = proof.get("sig")
            signed = _auth_message(self.edge_id, self.identity.fingerprint, self.peer_fingerprint, nonce)
            if not isinstance(sig, bytes) or not verify_signature(cert, sig, signed):
                raise ProtocolError("auth-failed", f"{self.peer} failed to prove its identity")
            writer.write(_frame({"ok": True}))
            writer.write_eof()
            self._mark_authed()
        except ProtocolError as exc:
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):  # the peer may be gone already
                writer.write(_frame({"ok": False, "error": exc.reason}))
            log.warning("edge from %s refused: %s", self.peer, exc.reason)
            await self._fail(exc.reason)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            await self._fail(f"authentication did not complete ({type(exc).__name__})")

    def _mark_authed(self) -> None:
        if self.time_to_data_s is None:
            self.time_to_data_s = self._loop.time() - self.started
        self._authed.set()
        if self._on_authed_cb is not None:
            self._on_authed_cb(self)

    async def _fail(self, reason: str) -> None:
        self.error = self.error or reason
        if self._protocol is not None:
            self._protocol.close(reason_phrase=reason[:100])
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.error = self.error or reason
        for cid in self._cids:
            self._register_cid(cid, None)
        self._cids.clear()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._streams.put_nowait((None, None))  # type: ignore[arg-type]  # wakes accept_stream
        self._on_closed(self)

    def _check_open(self) -> None:
        if self.closed:
            raise ConnectionError(f"edge to {self.peer} is closed: {self.error}")

    def _note_direct(self) -> None:
        if self.puncher.state == DIRECT and self.time_to_direct_s is None:
            self.time_to_direct_s = self._loop.time() - self.started
            log.info("edge to %s is direct via %s after %.3f s", self.peer,
                     self.puncher.direct, self.time_to_direct_s)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=f"edge-{self.peer}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _punch_loop(self) -> None:
        next_ping = self.started + QUIC_PING_S
        next_relay_keepalive = self.started + RELAY_KEEPALIVE_S
        while not self.closed:
            now = self._loop.time()
            for data, addr in self.puncher.datagrams_to_send(now):
                self._sock.sendto(data, addr)
            self._note_direct()
            if now >= next_ping and self._protocol is not None:
                next_ping = now + QUIC_PING_S
                self._quic.send_ping(0)
                self._protocol.transmit()
            if now >= next_relay_keepalive:
                next_relay_keepalive = now + RELAY_KEEPALIVE_S
                self._sock.sendto(frames.encode_data(self.edge_id, b""), self._relay_addr)
            wake = min(self.puncher.get_timer(), next_ping, next_relay_keepalive)
            self._punch_wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._punch_wakeup.wait(), max(0.0, wake - self._loop.time()))
