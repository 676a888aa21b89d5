"""Asyncio driver of the sans-I/O NatProbe on a member socket (and `kafila netcheck`)."""

from __future__ import annotations

import asyncio
import contextlib

from backends.errors import Refused
from kafila.net.natcheck import NatProbe, NatReport
from kafila.net.sock import MemberSocket
from rendezvous.errors import ProtocolError
from rendezvous.frames import KIND_STUN

Address = tuple[str, int]


async def resolve(host: str, port: int) -> Address:
    """host:port -> (ip, port); a name that does not resolve is a one-line Refused."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=2)  # SOCK_DGRAM
    except OSError as exc:
        raise Refused(f"cannot resolve the rendezvous {host}: {exc}") from None
    ip = infos[0][4][0]
    # A wildcard is where a server listens, not where anyone can send: datagrams to 0.0.0.0 are
    # answered from a real address (127.0.0.1), which the member would then not recognise as
    # the rendezvous. The host's own member reaches its embedded rendezvous over loopback.
    if ip in ("0.0.0.0", "::"):
        ip = "127.0.0.1" if ip == "0.0.0.0" else "::1"
    return (ip, port)


async def check_nat(sock: MemberSocket, primary: Address) -> NatReport:
    """Classify the NAT in front of `sock` against the rendezvous at `primary` (an ip, port)."""
    loop = asyncio.get_running_loop()
    probe = NatProbe(primary, loop.time())
    wake = asyncio.Event()

    def on_stun(data: bytes, src: Address) -> None:
        if probe.receive(data, src, loop.time()):
            wake.set()

    previous = sock.handlers.get(KIND_STUN)
    sock.handlers[KIND_STUN] = on_stun
    try:
        while True:
            now = loop.time()
            probe.handle_timer(now)
            if probe.done:
                break
            for data, addr in probe.datagrams_to_send(now):
                sock.sendto(data, addr)
            timer = probe.get_timer()
            wake.clear()
            delay = 0.05 if timer is None else max(0.0, timer - loop.time())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), delay)
    finally:
        if previous is None:
            sock.handlers.pop(KIND_STUN, None)
        else:
            sock.handlers[KIND_STUN] = previous
    try:
        return probe.report()
    except ProtocolError as exc:
        raise Refused(exc.reason) from None


async def netcheck(rendezvous: Address, *, bind_host: str = "0.0.0.0") -> NatReport:
    """Classify from a fresh socket (NAT state from earlier traffic would change the answer)."""
    primary = await resolve(*rendezvous)
    sock = await MemberSocket.open(bind_host)
    try:
        return await check_nat(sock, primary)
    finally:
        sock.close()
