"""The rendezvous's UDP sockets: each answer leaves from the address its request was sent to.

A socket bound to a specific address answers from it by construction. A socket bound to the
wildcard (0.0.0.0, what `kafila host` listens on by default) does not: the kernel picks the
source address of each reply by route, so a member that wrote to one of the machine's addresses
may get its answer from another (0.0.0.0 itself, loopback, a second address on the interface),
and drops it — the member only trusts datagrams from the rendezvous address it used. On Linux
(IP_PKTINFO) the wildcard socket therefore reads the destination address of every datagram and
sends each reply with that address as its source (RFC 5382 / RFC 3261 servers do the same).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable

log = logging.getLogger("kafila.rendezvous")

Address = tuple[str, int]
# (data, source address, the local address it was sent to or None when unknown)
OnDatagram = Callable[[bytes, Address, "str | None"], None]
RECV_BYTES = 65536
WILDCARDS = ("0.0.0.0", "")


class AsyncioEndpoint(asyncio.DatagramProtocol):
    """A plain asyncio datagram endpoint (specific addresses, and platforms without IP_PKTINFO)."""

    def __init__(self, on_datagram: OnDatagram) -> None:
        self.on_datagram = on_datagram
        self.transport: asyncio.DatagramTransport | None = None

    @classmethod
    async def open(cls, host: str, port: int, on_datagram: OnDatagram) -> AsyncioEndpoint:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_datagram_endpoint(lambda: cls(on_datagram), local_addr=(host, port))
        return proto

    @property
    def port(self) -> int:
        assert self.transport is not None
        return self.transport.get_extra_info("sockname")[1]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.on_datagram(data, (addr[0], addr[1]), None)

    def error_received(self, exc: Exception) -> None:  # ICMP errors etc.: not fatal
        log.debug("udp: %s", exc)

    def sendto(self, data: bytes, addr: Address, local: str | None = None) -> None:
        if self.transport is not None:
            self.transport.sendto(data, addr)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class PktinfoEndpoint:
    """A wildcard IPv4 UDP socket that answers from each datagram's destination address."""

    def __init__(self, sock: socket.socket, on_datagram: OnDatagram) -> None:
        self.sock = sock
        self.on_datagram = on_datagram
        self.dropped_sends = 0
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable)

    @classmethod
    async def open(cls, host: str, port: int, on_datagram: OnDatagram) -> PktinfoEndpoint:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_PKTINFO, 1)
            sock.setblocking(False)
            sock.bind((host or "0.0.0.0", port))
        except OSError:
            sock.close()
            raise
        return cls(sock, on_datagram)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def _readable(self) -> None:
        for _ in range(256):  # bounded: other work gets the loop between bursts
            try:
                data, ancillary, _, src = self.sock.recvmsg(RECV_BYTES, socket.CMSG_SPACE(12))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # an ICMP error queued on the socket: not fatal
                log.debug("udp: %s", exc)
                continue
            local = None
            for level, kind, payload in ancillary:
                if level == socket.IPPROTO_IP and kind == socket.IP_PKTINFO and len(payload) >= 12:
                    local = socket.inet_ntoa(payload[8:12])  # in_pktinfo.ipi_addr: the header's destination
            self.on_datagram(data, (src[0], src[1]), local)

    def sendto(self, data: bytes, addr: Address, local: str | None = None) -> None:
        ancillary = []
        if local is not None:  # in_pktinfo {ifindex 0: by route, ipi_spec_dst: our source, ipi_addr}
            pktinfo = struct.pack("=i4s4s", 0, socket.inet_aton(local), bytes(4))
            ancillary.append((socket.IPPROTO_IP, socket.IP_PKTINFO, pktinfo))
        try:
            self.sock.sendmsg([data], ancillary, 0, addr)
        except (BlockingIOError, InterruptedError):
            self.dropped_sends += 1  # a full send buffer drops, as UDP may
        except OSError as exc:
            log.debug("udp send to %s: %s", addr, exc)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()


async def open_endpoint(host: str, port: int, on_datagram: OnDatagram) -> AsyncioEndpoint | PktinfoEndpoint:
    """The UDP socket for host:port: answers from the address asked where the platform allows."""
    if host in WILDCARDS and hasattr(socket, "IP_PKTINFO") and hasattr(socket.socket, "sendmsg"):
        return await PktinfoEndpoint.open(host, port, on_datagram)
    return await AsyncioEndpoint.open(host or "0.0.0.0", port, on_datagram)
