"""The bulk lane: a member's weights over plain TCP, sealed, when the serving peer is reachable.

Why. Every byte on an edge goes through aioquic: Python handles each 1452-byte packet and its
crypto (≈ 40 µs a packet at both ends), so one host serves ≈ 22 MB/s in all, shared by every
member fetching (docs/BENCHMARKS.md). On a LAN the serving peer is usually reachable directly,
and the kernel's TCP moves a 1 MiB record with a handful of Python calls: AES-GCM over a record
runs at GB/s in `cryptography`, so the lane costs a few Python operations per MiB.

How (kafila.net.bulk_records has the wire format and the handshake):
- The fetcher opens its weight stream on the edge as always, with `Hello(bulk=True)`, and waits
  for the server's first frame before asking for anything. A server with a lane answers with a
  `BulkOffer`: its listener's port, its IP addresses and a fresh random key, inside the edge's
  TLS (pinned certificates), so only that peer learns the key. A server without one answers
  with a decline (`BulkOffer()`, port 0); one from before the lane ignores the flag, and after
  transfer.OFFER_WAIT_S the fetcher goes on without it.
- The fetcher dials every offered address at once (the edge's punched address first) within
  BULK_CONNECT_TIMEOUT_S, proves the key, and checks that the server knows it too. On success it
  closes the QUIC stream and asks for every chunk over TCP (in chunks of BULK_CHUNK_BYTES);
  otherwise the transfer runs on the QUIC stream exactly as
  before, and says why in one line. Waiting for the offer before the first request (rather than
  switching streams mid-transfer) keeps one stream per transfer, so the Fetcher's in-order
  bookkeeping is unchanged; it costs one round trip, plus the connect timeout where TCP is
  blocked, against transfers of seconds to minutes.
- A key is good for one connection, for OFFER_TTL_S. The listener holds at most MAX_LANES
  offers and open lanes together and MAX_HANDSHAKES handshakes at once, each within
  BULK_HANDSHAKE_TIMEOUT_S; a lane silent for BULK_IDLE_TIMEOUT_S is closed. Integrity was already end to end (each tensor's SHA-256 from the
  manifest); the lane adds secrecy and peer authentication for weights that may be private.

`SecureReader` / `SecureWriter` have the readexactly / write / drain / close / wait_closed
calls that transfer.py's frame reader and writer use on a QUIC stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from kafila.net.bulk_records import (
    CLIENT_HELLO_BYTES,
    RECORD_PREFIX,
    SERVER_HELLO_BYTES,
    BulkError,
    ClientHandshake,
    RecordOpener,
    RecordSealer,
    TrafficKeys,
    offer_id,
    parse_client_hello,
    server_answer,
)
from kafila.session.wire.frames import MAX_BULK_HOSTS, WEIGHT_CHUNK_BYTES, BulkOffer

log = logging.getLogger(__name__)

BULK_CONNECT_TIMEOUT_S = 1.5  # a LAN peer answers in milliseconds; NAT/firewall: QUIC goes on
BULK_HANDSHAKE_TIMEOUT_S = 5.0
OFFER_TTL_S = 30.0  # an offer nobody took is void after this
BULK_IDLE_TIMEOUT_S = 120.0  # a lane with no record for this long is closed (a peer that went away)
MAX_LANES = 64  # offers pending + lanes open, per listener: a further weight stream stays on QUIC
MAX_HANDSHAKES = 16  # connections still proving their key, per listener
READ_LIMIT_BYTES = 4 << 20  # asyncio's read buffer: several records before it pauses the socket
WRITE_HIGH_WATER_BYTES = 4 << 20
BULK_CHUNK_BYTES = WEIGHT_CHUNK_BYTES  # what a WeightGet may ask at most: 4 MiB, four records each
BULK_WINDOW_CHUNKS = 4  # 16 MiB in flight: a LAN's bandwidth × delay many times over


class SecureReader:
    """Plaintext out of a TCP stream of sealed records, read like an asyncio StreamReader.

    At the peer's end marker, readexactly raises IncompleteReadError (as a stream's end does);
    a connection cut without one raises ConnectionError; a bad record raises BulkError."""

    def __init__(self, raw: asyncio.StreamReader, opener: RecordOpener) -> None:
        self._raw, self._opener = raw, opener
        self._parts: list[bytes] = []  # whole records' plaintexts not yet read, in order
        self._pos = 0  # bytes of _parts[0] already read
        self._have = 0  # bytes buffered: sum of _parts - _pos
        self.bytes_received = 0  # on the wire
        self.idle_timeout_s: float | None = BULK_IDLE_TIMEOUT_S  # None: no bound (a ring lane)

    async def _record(self) -> bytes | None:
        if self._opener.ended:
            return None
        try:
            prefix = await asyncio.wait_for(self._raw.readexactly(RECORD_PREFIX.size), self.idle_timeout_s)
            body = await self._raw.readexactly(self._opener.record_length(prefix))
        except asyncio.IncompleteReadError:
            raise ConnectionError("the bulk lane was cut (no end marker)") from None
        except TimeoutError:
            raise ConnectionError(f"the bulk lane was silent for {self.idle_timeout_s:g} s") from None
        self.bytes_received += len(prefix) + len(body)
        plaintext = self._opener.open(prefix, body)
        return plaintext or None

    async def readexactly(self, n: int) -> bytes:
        while self._have < n:
            record = await self._record()
            if record is None:
                partial = b"".join(self._parts)[self._pos:]
                self._parts, self._pos, self._have = [], 0, 0
                raise asyncio.IncompleteReadError(partial, n)
            self._parts.append(record)
            self._have += len(record)
        first = self._parts[0]
        if self._pos == 0 and len(first) == n:  # a frame's payload is often the rest of a record
            self._parts.pop(0)
            self._have -= n
            return first
        if len(first) - self._pos >= n:
            out = first[self._pos:self._pos + n]
            self._pos += n
        else:  # across records: one join
            take, size = 0, -self._pos
            while size < n:
                size += len(self._parts[take])
                take += 1
            joined = b"".join(self._parts[:take])
            out = joined[self._pos:self._pos + n]
            rest = joined[self._pos + n:]
            self._parts[:take] = [rest] if rest else []
            self._pos = 0
        if self._parts and self._pos == len(self._parts[0]):
            self._parts.pop(0)
            self._pos = 0
        self._have -= n
        return out


class SecureWriter:
    """Plaintext into sealed records on a TCP stream, written like an asyncio StreamWriter."""

    def __init__(self, raw: asyncio.StreamWriter, sealer: RecordSealer) -> None:
        self._raw, self._sealer = raw, sealer
        self.bytes_sent = 0
        with contextlib.suppress(AttributeError, NotImplementedError, RuntimeError):  # a transport without limits
            raw.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)

    def is_closing(self) -> bool:
        return self._raw.is_closing()

    def write(self, data) -> None:
        if self._raw.is_closing():
            raise ConnectionError("the bulk lane is closed")
        for record in self._sealer.seal(data):
            self.bytes_sent += len(record)
            self._raw.write(record)

    async def drain(self) -> None:
        await self._raw.drain()

    def close(self) -> None:
        """Our end marker, then the socket (after what is buffered has gone)."""
        if not self._sealer.closed and not self._raw.is_closing():
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):  # the peer went first
                self._raw.write(self._sealer.close())
        self._raw.close()

    async def wait_closed(self) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            await self._raw.wait_closed()

    def get_extra_info(self, name: str, default=None):
        return self._raw.get_extra_info(name, default)


def _secure(reader, writer, keys: TrafficKeys, client: bool) -> tuple[SecureReader, SecureWriter]:
    mine, theirs = ((keys.client_to_server, keys.server_to_client) if client
                    else (keys.server_to_client, keys.client_to_server))  # fmt: skip
    return SecureReader(reader, RecordOpener(theirs)), SecureWriter(writer, RecordSealer(mine))


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --- the serving side ----------------------------------------------------------------------


@dataclass
class Ticket:
    """One offer: its frame for the fetcher, and the connection that proves its key."""

    frame: BulkOffer
    id: bytes
    _future: asyncio.Future = field(repr=False)
    _timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    finished: bool = False  # its lane was used and closed

    @property
    def accepted(self) -> bool:
        return self._future.done() and not self._future.cancelled() and self._future.result() is not None

    async def connection(self) -> tuple[SecureReader, SecureWriter] | None:
        """The fetcher's authenticated connection; None once the offer was revoked or expired."""
        return await asyncio.shield(self._future)


class BulkListener:
    """One TCP listener per process: serves the connections its offers announced."""

    def __init__(self, hosts: tuple[str, ...]) -> None:
        self.hosts = hosts  # the addresses offers name
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._offers: dict[bytes, tuple[bytes, Ticket]] = {}
        self._handshakes = 0
        self._open = 0  # accepted lanes not yet finished
        self.refused = 0  # connections that did not prove a live offer's key

    @classmethod
    async def start(cls, bind_host: str, hosts: Iterable[str]) -> BulkListener:
        """Listen on an ephemeral port of `bind_host`; offers name `hosts` (IP literals; the
        bind address itself when it is one)."""
        self = cls(offer_hosts(bind_host, hosts))
        self._server = await asyncio.start_server(self._connected, bind_host, 0, limit=READ_LIMIT_BYTES,
                                                  backlog=MAX_HANDSHAKES)  # fmt: skip
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def offer(self) -> Ticket | None:
        """A fresh one-connection key (None: no addresses to name, or too many offers pending)."""
        if (not self.hosts or self._server is None or not self._server.is_serving()
                or len(self._offers) + self._open >= MAX_LANES):  # fmt: skip
            return None
        key = os.urandom(32)
        loop = asyncio.get_running_loop()
        ticket = Ticket(BulkOffer(self.port, key, self.hosts), offer_id(key), loop.create_future())
        ticket._timer = loop.call_later(OFFER_TTL_S, self.revoke, ticket)
        self._offers[ticket.id] = (key, ticket)
        return ticket

    def finished(self, ticket: Ticket) -> None:
        """The lane `ticket` opened is done (its connection closed): it no longer counts."""
        if ticket.accepted and not ticket.finished:
            ticket.finished = True
            self._open -= 1

    def revoke(self, ticket: Ticket) -> None:
        """The offer is void (taken over QUIC, expired): a connection with its key is refused."""
        self._offers.pop(ticket.id, None)
        if ticket._timer is not None:
            ticket._timer.cancel()
        if not ticket._future.done():
            ticket._future.set_result(None)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._handshakes >= MAX_HANDSHAKES:
            self.refused += 1
            writer.close()
            return
        self._handshakes += 1
        try:
            hello = await asyncio.wait_for(reader.readexactly(CLIENT_HELLO_BYTES), BULK_HANDSHAKE_TIMEOUT_S)
            oid, _, _ = parse_client_hello(hello)
            key, ticket = self._offers.get(oid, (None, None))
            if key is None or ticket is None:
                raise BulkError("no live offer with that id (unknown, used or expired)")
            answer, keys = server_answer(key, hello, os.urandom(32))
            self._offers.pop(oid, None)  # one connection per key
            if ticket._timer is not None:
                ticket._timer.cancel()
            _tune(writer)
            writer.write(answer)
            ticket._future.set_result(_secure(reader, writer, keys, client=False))
            self._open += 1
        except (BulkError, TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.refused += 1
            peer = writer.get_extra_info("peername")
            log.info("bulk lane: refused a connection from %s: %s", peer, describe(exc))
            writer.close()
        finally:
            self._handshakes -= 1

    async def close(self) -> None:
        for _, ticket in list(self._offers.values()):
            self.revoke(ticket)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError, OSError):  # a lane still draining: it ends with the process
                await asyncio.wait_for(self._server.wait_closed(), 1.0)


def offer_hosts(bind_host: str, hosts: Iterable[str]) -> tuple[str, ...]:
    """The IP literals an offer names: the bind address when it is one, else `hosts` (this
    machine's candidates), without duplicates or names, at most MAX_BULK_HOSTS."""
    out: list[str] = []
    for h in ([bind_host] if bind_host not in ("", "0.0.0.0", "::") else list(hosts)):
        try:
            ip = ipaddress.ip_address(h)
        except ValueError:
            continue
        if not ip.is_unspecified and str(ip) not in out:
            out.append(str(ip))
    return tuple(out[:MAX_BULK_HOSTS])


# --- the fetching side ---------------------------------------------------------------------


async def dial(offer: BulkOffer, prefer: Iterable[str] = (),
               connect_timeout_s: float = BULK_CONNECT_TIMEOUT_S) -> tuple[SecureReader, SecureWriter]:  # fmt: skip
    """The authenticated lane an offer names: every address at once (`prefer` first: where the
    edge already reached the peer), the first to connect proves the key. BulkError otherwise."""
    hosts = list(dict.fromkeys([*prefer, *offer.hosts]))[:MAX_BULK_HOSTS]
    where = f"{', '.join(hosts)} port {offer.port}"
    tries = [asyncio.create_task(asyncio.open_connection(h, offer.port, limit=READ_LIMIT_BYTES)) for h in hosts]
    won, errors = None, []
    try:
        pending = set(tries)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout_s
        while pending and won is None:
            done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if not done:
                break
            for t in done:
                if t.exception() is not None:
                    errors.append(describe(t.exception()))
                elif won is None:
                    won = t
    finally:
        for t in tries:
            if not t.done():
                t.cancel()
        await asyncio.wait(tries)
        for t in tries:  # every connection but the winner's
            if t is not won and not t.cancelled() and t.exception() is None:
                t.result()[1].close()
    if won is None:
        why = "; ".join(dict.fromkeys(errors)) or f"no answer within {connect_timeout_s:g} s"
        raise BulkError(f"cannot reach {where}: {why}")
    reader, writer = won.result()
    _tune(writer)
    hs = ClientHandshake(offer.key, os.urandom(32))
    try:
        writer.write(hs.hello())
        answer = await asyncio.wait_for(reader.readexactly(SERVER_HELLO_BYTES), BULK_HANDSHAKE_TIMEOUT_S)
        keys = hs.finish(answer)
    except asyncio.IncompleteReadError:
        writer.close()
        raise BulkError(f"{where} refused the key (wrong, used or expired)") from None
    except (TimeoutError, ConnectionError, OSError) as exc:
        writer.close()
        raise BulkError(f"no bulk lane handshake with {where}: {describe(exc)}") from None
    except BulkError:
        writer.close()
        raise
    return _secure(reader, writer, keys, client=True)


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
