"""The member's one UDP socket: STUN, relay frames, punch probes and QUIC, by first byte.

`send_delay_ms` delays every datagram this socket sends by that many milliseconds, in order
(a user-space WAN emulation; tc netem is not available on the machines this runs on). Every
path a member sends on goes through it: direct datagrams, relay frames (sent to the rendezvous
over this socket) and, through `DelayedWriter`, the TCP signaling to the rendezvous, so an
emulated member is that far from everything, not only from its direct peers.

Throughput: asyncio's datagram transport reads one datagram per event-loop iteration, so a
QUIC burst cost one loop turn (and one aioquic transmit) per packet. This socket reads up to
READ_BURST datagrams per readiness event and runs the `defer`red flushes (an edge's transmit)
once after the whole burst: one ACK/send pass per burst instead of per datagram. Sends go
straight to the kernel (a queue only when the socket buffer is full), with no timer in between
unless `send_delay_ms` > 0.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import ipaddress
import logging
import socket
from collections.abc import Callable

from rendezvous.errors import ProtocolError
from rendezvous.frames import kind_of
from rendezvous.limits import MAX_DATAGRAM_BYTES

log = logging.getLogger("kafila.net")

Address = tuple[str, int]
Handler = Callable[[bytes, Address], None]
READ_BURST = 256  # datagrams read per readiness event before yielding to the loop
RECV_MAX_BYTES = 65535
# A peer on this machine (a loopback source) may send QUIC datagrams this large: lo's MTU is
# 65536, and Python's cost is per packet (kafila/net/edge.py sends them on a loopback route).
# aioquic writes a packet's length in a 2-byte varint, so a packet stays under 16384 bytes.
LOOPBACK_MAX_DATAGRAM_BYTES = 16000
SOCKET_BUFFER_BYTES = 4 << 20  # asked for; the kernel caps it at net.core.[rw]mem_max
HANDLER_ERRORS_LOGGED = 3  # then only debug lines: a stranger's datagrams must not flood the log
SEND_QUEUE_MAX = 4096  # datagrams waiting for a full send buffer; beyond that they drop (UDP)


class DelayedWriter:
    """A StreamWriter whose writes reach the stream `send_delay_ms` later, in order.

    The signaling connection's half of the WAN emulation: `write` queues, `drain` waits until
    the queue has been written and then drains the stream, `close` drops what is still queued.
    With `wait_delivery=False`, `drain` does not wait for the delay (a link with latency, not a
    slow one: a ring edge's sender goes on while its frames are in flight, as on a QUIC edge).
    """

    def __init__(self, writer: asyncio.StreamWriter, send_delay_ms: float, wait_delivery: bool = True) -> None:
        self.writer = writer
        self.wait_delivery = wait_delivery
        self.send_delay_s = max(0.0, float(send_delay_ms)) / 1000.0
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._empty = asyncio.Event()
        self._empty.set()

    def write(self, data: bytes) -> None:
        if self.writer.is_closing():
            return
        loop = asyncio.get_running_loop()
        self._queue.append((loop.time() + self.send_delay_s, data))
        self._empty.clear()
        if self._timer is None:
            self._timer = loop.call_at(self._queue[0][0], self._release)

    def _release(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        while self._queue and self._queue[0][0] <= loop.time():
            _, data = self._queue.popleft()
            if not self.writer.is_closing():
                self.writer.write(data)
        if self._queue:
            self._timer = loop.call_at(self._queue[0][0], self._release)
        else:
            self._empty.set()

    async def drain(self) -> None:
        if self.wait_delivery:
            await self._empty.wait()
        await self.writer.drain()

    def is_closing(self) -> bool:
        return self.writer.is_closing()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queue.clear()
        self._empty.set()
        self.writer.close()

    async def wait_closed(self) -> None:
        await self.writer.wait_closed()


def delayed_writer(
    writer: asyncio.StreamWriter, send_delay_ms: float, wait_delivery: bool = True
) -> asyncio.StreamWriter | DelayedWriter:
    """`writer` itself without a delay, else a DelayedWriter around it."""
    return DelayedWriter(writer, send_delay_ms, wait_delivery) if send_delay_ms > 0 else writer


class MemberSocket:
    def __init__(self, send_delay_ms: float = 0.0) -> None:
        self.send_delay_s = max(0.0, float(send_delay_ms)) / 1000.0
        self.handlers: dict[str, Handler] = {}
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._queue: collections.deque[tuple[float, bytes, Address]] = collections.deque()
        self._drain: asyncio.TimerHandle | None = None
        self._blocked: collections.deque[tuple[bytes, Address]] = collections.deque()
        self._deferred: dict[Callable[[], None], None] = {}  # ordered set
        self._in_burst = False
        self._flush_soon: asyncio.Handle | None = None
        self.sent_datagrams = 0
        self.dropped = 0
        self.malformed = 0  # datagrams a decoder refused (ProtocolError)
        self.handler_errors = 0  # datagrams whose handler failed otherwise (a bug)

    @classmethod
    async def open(cls, bind_host: str = "0.0.0.0", bind_port: int = 0, *,
                   send_delay_ms: float = 0.0) -> MemberSocket:
        self = cls(send_delay_ms)
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(bind_host, bind_port, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
                except OSError:
                    pass
            sock.bind(sockaddr)
        except BaseException:
            sock.close()
            raise
        self._sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._read_ready)
        return self

    @property
    def transport(self) -> MemberSocket | None:  # kept for callers that checked it
        return None if self._closed else self

    def is_closing(self) -> bool:
        return self._closed

    @property
    def local_address(self) -> Address:
        assert self._sock is not None
        name = self._sock.getsockname()
        return (name[0], name[1])

    # receiving
    def _read_ready(self) -> None:
        sock = self._sock
        if sock is None:
            return
        self._in_burst = True
        try:
            for _ in range(READ_BURST):
                try:
                    data, addr = sock.recvfrom(RECV_MAX_BYTES)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:  # ICMP errors surface here: not fatal
                    log.debug("member socket: %s", exc)
                    continue
                self.datagram_received(data, addr)
                if self._closed:
                    return
        finally:
            self._in_burst = False
            self._run_deferred()

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        large = len(data) > MAX_DATAGRAM_BYTES and is_loopback(addr[0])
        kind = kind_of(data, LOOPBACK_MAX_DATAGRAM_BYTES if large else MAX_DATAGRAM_BYTES)
        handler = self.handlers.get(kind) if kind else None
        if handler is None:
            self.dropped += 1
            return
        try:
            handler(data, (addr[0], addr[1]))
        except ProtocolError as exc:  # anyone can send us garbage: counted, one debug line
            self.dropped += 1
            self.malformed += 1
            log.debug("a bad %s datagram from %s: %s", kind, addr, exc.reason)
        except Exception as exc:  # one bad datagram must never stop the socket (nor flood the log)
            self.dropped += 1
            self.handler_errors += 1
            if self.handler_errors <= HANDLER_ERRORS_LOGGED:
                log.warning("handling a %s datagram from %s failed: %s: %s", kind, addr,
                            type(exc).__name__, exc)
            else:
                log.debug("handling a %s datagram from %s failed: %r", kind, addr, exc)

    def defer(self, flush: Callable[[], None]) -> None:
        """Run `flush` once after the datagrams being read now (or soon, outside a burst)."""
        self._deferred[flush] = None
        if not self._in_burst and self._flush_soon is None and self._loop is not None:
            self._flush_soon = self._loop.call_soon(self._run_deferred)

    def _run_deferred(self) -> None:
        self._flush_soon = None
        while self._deferred:
            flush = next(iter(self._deferred))
            del self._deferred[flush]
            try:
                flush()
            except Exception:
                log.exception("flushing after a burst failed")

    # sending
    def sendto(self, data: bytes, addr: Address) -> None:
        if self._closed or self._sock is None:
            return
        self.sent_datagrams += 1
        if self.send_delay_s <= 0:
            self._send_now(data, addr)
            return
        loop = asyncio.get_running_loop()
        self._queue.append((loop.time() + self.send_delay_s, data, addr))
        if self._drain is None:
            self._drain = loop.call_at(self._queue[0][0], self._release)

    def _send_now(self, data: bytes, addr: Address) -> None:
        if self._blocked:
            if len(self._blocked) < SEND_QUEUE_MAX:
                self._blocked.append((data, addr))
            else:
                self.dropped += 1
            return
        try:
            self._sock.sendto(data, addr)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            self._blocked.append((data, addr))
            self._loop.add_writer(self._sock.fileno(), self._write_ready)  # type: ignore[union-attr]
        except OSError as exc:  # unreachable, too big, ...: a lost UDP datagram
            if exc.errno not in (errno.EAGAIN,):
                log.debug("member socket send to %s: %s", addr, exc)

    def _write_ready(self) -> None:
        while self._blocked and self._sock is not None:
            data, addr = self._blocked[0]
            try:
                self._sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("member socket send to %s: %s", addr, exc)
            self._blocked.popleft()
        if self._sock is not None:
            self._loop.remove_writer(self._sock.fileno())  # type: ignore[union-attr]

    def _release(self) -> None:
        self._drain = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._queue and self._queue[0][0] <= now:
            _, data, addr = self._queue.popleft()
            if not self._closed:
                self._send_now(data, addr)
        if self._queue:
            self._drain = loop.call_at(self._queue[0][0], self._release)

    def close(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        if self._flush_soon is not None:
            self._flush_soon.cancel()
            self._flush_soon = None
        self._queue.clear()
        self._blocked.clear()
        self._deferred.clear()
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
                self._loop.remove_writer(self._sock.fileno())
            self._sock.close()


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
