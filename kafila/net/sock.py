"""The member's one UDP socket: STUN, relay frames, punch probes and QUIC, by first byte.

`send_delay_ms` delays every datagram this socket sends by that many milliseconds, in order
(a user-space WAN emulation; tc netem is not available on the machines this runs on).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from rendezvous.frames import kind_of

log = logging.getLogger("kafila.net")

Address = tuple[str, int]
Handler = Callable[[bytes, Address], None]


class MemberSocket(asyncio.DatagramProtocol):
    def __init__(self, send_delay_ms: float = 0.0) -> None:
        self.send_delay_s = max(0.0, float(send_delay_ms)) / 1000.0
        self.transport: asyncio.DatagramTransport | None = None
        self.handlers: dict[str, Handler] = {}
        self._queue: collections.deque[tuple[float, bytes, Address]] = collections.deque()
        self._drain: asyncio.TimerHandle | None = None
        self.sent_datagrams = 0
        self.dropped = 0

    @classmethod
    async def open(cls, bind_host: str = "0.0.0.0", bind_port: int = 0, *,
                   send_delay_ms: float = 0.0) -> MemberSocket:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_datagram_endpoint(
            lambda: cls(send_delay_ms), local_addr=(bind_host, bind_port)
        )
        return proto

    @property
    def local_address(self) -> Address:
        assert self.transport is not None
        name = self.transport.get_extra_info("sockname")
        return (name[0], name[1])

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        kind = kind_of(data)
        handler = self.handlers.get(kind) if kind else None
        if handler is None:
            self.dropped += 1
            return
        try:
            handler(data, (addr[0], addr[1]))
        except Exception:  # one bad datagram must never stop the socket
            self.dropped += 1
            log.exception("handling a %s datagram from %s failed", kind, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("member socket: %s", exc)

    def sendto(self, data: bytes, addr: Address) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.sent_datagrams += 1
        if self.send_delay_s <= 0:
            self.transport.sendto(data, addr)
            return
        loop = asyncio.get_running_loop()
        self._queue.append((loop.time() + self.send_delay_s, data, addr))
        if self._drain is None:
            self._drain = loop.call_at(self._queue[0][0], self._release)

    def _release(self) -> None:
        self._drain = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._queue and self._queue[0][0] <= now:
            _, data, addr = self._queue.popleft()
            if self.transport is not None and not self.transport.is_closing():
                self.transport.sendto(data, addr)
        if self._queue:
            self._drain = loop.call_at(self._queue[0][0], self._release)

    def close(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        self._queue.clear()
        if self.transport is not None:
            self.transport.close()
