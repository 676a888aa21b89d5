"""The rendezvous service: the asyncio layer around Registry, StunResponder and RelayTable.

One TCP listener (signaling) and one UDP socket (STUN + relay) share the primary port; a second
UDP socket on another port (and optionally one on an alternate IP) answers STUN for RFC 5780
classification. All state is in memory. Input that breaks a rule is dropped (UDP) or answered
with an Error and the connection closed (TCP); the service itself never stops on bad input.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging

from rendezvous import frames
from rendezvous import messages as m
from rendezvous.errors import ProtocolError
from rendezvous.limits import MAX_DATAGRAM_BYTES
from rendezvous.limits import MAX_CONNECTIONS
from rendezvous.quiet import BoundedLog, fd_share, quiet_accept_errors
from rendezvous.registry import Action, CloseConn, Log, Registry, SendTo
from rendezvous.relay import RelayTable
from rendezvous.stun import ALTERNATE_IP, PRIMARY, SECOND_PORT, StunResponder
from rendezvous.udp import AsyncioEndpoint, PktinfoEndpoint, open_endpoint

log = logging.getLogger("kafila.rendezvous")

TICK_S = 0.25
MAX_WRITE_BUFFER_BYTES = 4 * 1024 * 1024  # a member that reads slower than this is dropped
TCP_READ_BYTES = 64 * 1024
BIND_ATTEMPTS = 20
LOCAL_ADDRESSES_MAX = 65536  # remembered "which of our addresses did this peer write to" entries
FD_SHARE = 0.5  # of the fds above quiet.FD_RESERVE: signaling connections (the API takes a quarter)


class Rendezvous:
    """Registry, signaling, STUN on two ports and a ciphertext relay, in one process."""

    def __init__(self, registry: Registry, stun_responder: StunResponder) -> None:
        self.registry = registry
        self.stun = stun_responder
        self._server: asyncio.Server | None = None
        self._udp: dict[int, AsyncioEndpoint | PktinfoEndpoint] = {}
        self._local_of: dict[tuple[str, int], str] = {}  # peer address -> our address it wrote to
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._tasks: set[asyncio.Task] = set()
        self._conn_ids = itertools.count(1)
        self._ticker: asyncio.Task | None = None
        self.address: tuple[str, int] = ("", 0)
        self.stun_port2 = 0
        self.udp_dropped = 0
        self.dropped_senders = 0  # members dropped for flooding a connection that reads slower
        # connections at once, from the fd limit: accept() must never fail for want of fds
        self.max_connections = min(MAX_CONNECTIONS, fd_share(FD_SHARE))
        # connections oldest first, until seen in a session (or its line): the evictable ones among them
        self._fresh: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evicted = 0  # silent connections closed to make room for a new one
        self.quiet = BoundedLog(log)

    @classmethod
    async def start(
        cls,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        alternate_ip: str | None = None,
        relay: RelayTable | None = None,
        max_sessions: int | None = None,
    ) -> Rendezvous:
        """Listen on host:port (TCP + UDP), a second UDP port, and alternate_ip if given.

        max_sessions=1 for the rendezvous embedded in `kafila host`: it serves its own session."""
        registry = Registry(relay=relay) if max_sessions is None else Registry(relay=relay, max_sessions=max_sessions)
        self = cls(registry, StunResponder(port2=0, alternate_ip=alternate_ip))
        last_error: OSError | None = None
        for _ in range(BIND_ATTEMPTS if port == 0 else 1):
            server = await asyncio.start_server(self._connection, host, port)
            bound = server.sockets[0].getsockname()[1]
            try:
                primary = await open_endpoint(host, bound, self._receiver(PRIMARY))
            except OSError as exc:  # UDP port taken: try another pair
                last_error = exc
                server.close()
                await server.wait_closed()
                continue
            self._server, self._udp[PRIMARY] = server, primary
            break
        else:
            raise OSError(f"cannot bind the rendezvous on {host}:{port}: {last_error}")
        # A fixed port's STUN twin is the next port (7473 -> 7474: one firewall rule to write);
        # any free port when that one is taken or the primary was chosen by the system.
        try:
            second = await open_endpoint(host, bound + 1 if port else 0, self._receiver(SECOND_PORT))
        except OSError:
            second = await open_endpoint(host, 0, self._receiver(SECOND_PORT))
        self._udp[SECOND_PORT] = second
        self.stun_port2 = self._udp[SECOND_PORT].port
        if alternate_ip is not None:
            self._udp[ALTERNATE_IP] = await open_endpoint(alternate_ip, 0, self._receiver(ALTERNATE_IP))
        self.stun.port2 = self.stun_port2
        self.registry.stun_port2 = self.stun_port2
        self.address = (host, bound)
        self._ticker = asyncio.create_task(self._tick_forever(), name="rendezvous-tick")
        quiet_accept_errors(asyncio.get_running_loop(), self.quiet)
        log.info("rendezvous on %s:%d (tcp+udp), stun also on udp %d", host, bound, self.stun_port2)
        return self

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers.values()):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for endpoint in self._udp.values():
            endpoint.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def serve_forever(self) -> None:
        """Run until cancelled."""
        await asyncio.Event().wait()

    # TCP signaling
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        conn = next(self._conn_ids)
        if not self._make_room():
            writer.close()
            if task is not None:
                self._tasks.discard(task)
            return
        self._writers[conn] = writer
        self._fresh[conn] = None
        loop = asyncio.get_running_loop()
        reason = "disconnected"
        peer = writer.get_extra_info("peername")
        try:
            self._apply(self.registry.connected(conn, loop.time(), peer[0] if peer else ""))
            frame_reader = m.FrameReader()
            while conn in self._writers:
                data = await reader.read(TCP_READ_BYTES)
                if not data:
                    break
                try:
                    messages = frame_reader.feed(data)
                except ProtocolError as exc:
                    self.registry.rejected += 1
                    self._send(conn, m.Error(exc.code, exc.reason[: m.MAX_REASON_CHARS]))
                    reason = f"protocol error: {exc.reason}"
                    break
                for message in messages:
                    self._apply(self.registry.receive(conn, message, loop.time()), origin=conn)
        except (ConnectionError, OSError):
            reason = "connection lost"
        except asyncio.CancelledError:
            # close() cancels every connection; end normally: Python 3.11's start_server callback
            # calls task.exception() on a cancelled task and logs a traceback per connection
            reason = "rendezvous closing"
        finally:
            self._fresh.pop(conn, None)
            self._apply(self.registry.disconnected(conn, reason, loop.time()))
            self._close_writer(conn)
            if task is not None:
                self._tasks.discard(task)

    def _make_room(self) -> bool:
        """At the cap, the oldest connection in no session (idle, or dribbling half a frame) makes
        room for the new one: such connections cannot keep a joiner (or the host resuming) out,
        nor take the fds."""
        if len(self._writers) < self.max_connections:
            return True
        while self._fresh:
            oldest, _ = self._fresh.popitem(last=False)
            if oldest in self._writers and self.registry.unassigned(oldest):
                self.evicted += 1
                self.quiet.note("evicted", f"{self.max_connections} signaling connections are open (cap "
                                "from the fd limit); closing the oldest that is in no session")  # fmt: skip
                self._close_writer(oldest)
                return True
        self.quiet.note("full", f"{self.max_connections} signaling connections are open, each in a "
                        "session (cap from the fd limit); refusing new ones")  # fmt: skip
        return False

    def _apply(self, actions: list[Action], origin: int | None = None) -> None:
        """Carry out the registry's actions; `origin` is the connection whose message caused them."""
        for action in actions:
            if isinstance(action, SendTo):
                self._send(action.conn, action.message, origin)
            elif isinstance(action, CloseConn):
                self._close_writer(action.conn)
            elif isinstance(action, Log):
                log.warning("rendezvous: %s", action.text)

    def _send(self, conn: int, message: m.Message, origin: int | None = None) -> None:
        """Write a frame; when the receiver's buffer is full, a member flooding it is dropped.

        A member that sends faster than the host reads must not get the host dropped (that ends
        the session for everyone): the sender is dropped instead. Only when the host itself is
        the sender (a plan to a member that does not read) is the slow receiver dropped."""
        writer = self._writers.get(conn)
        if writer is None or writer.is_closing():
            return
        frame = m.encode(message)
        if writer.transport.get_write_buffer_size() + len(frame) > MAX_WRITE_BUFFER_BYTES:
            if origin is not None and origin != conn and not self.registry.is_host(origin):
                log.info("signaling connection %d floods %d; dropping the sender", origin, conn)
                self.dropped_senders += 1
                self._apply(self.registry.disconnected(origin, "sent faster than the host reads",
                                                       asyncio.get_running_loop().time()))
                self._close_writer(origin)
                return
            log.warning("signaling connection %d reads too slowly; closing it", conn)
            self._close_writer(conn)
            return
        writer.write(frame)

    def _close_writer(self, conn: int) -> None:
        writer = self._writers.pop(conn, None)
        if writer is not None:
            writer.close()

    async def _tick_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self._apply(self.registry.tick(loop.time()))
            except Exception:  # a bug in one tick must not stop the service
                log.exception("rendezvous tick failed")

    # UDP: STUN and relay
    def _receiver(self, index: int):
        return lambda data, src, local: self._datagram(data, src, index, local)

    def _datagram(self, data: bytes, src: tuple[str, int], index: int, local: str | None = None) -> None:
        if len(data) > MAX_DATAGRAM_BYTES:
            self.udp_dropped += 1
            return
        if local is not None and self._local_of.get(src) != local:
            self._local_of.pop(src, None)
            if len(self._local_of) >= LOCAL_ADDRESSES_MAX:
                del self._local_of[next(iter(self._local_of))]  # the oldest entry
            self._local_of[src] = local
        kind = frames.kind_of(data)
        if kind == frames.KIND_STUN:
            answer = self.stun.respond(data, src, index)
            if answer is not None:
                self._sendto(answer[1], answer[0], src)
        elif kind == frames.KIND_RELAY and index == PRIMARY:
            now = asyncio.get_running_loop().time()
            out = self.registry.relay.receive(data, src, now)
            if out is not None:
                self._sendto(PRIMARY, out[0], out[1])
        else:
            self.udp_dropped += 1

    def _sendto(self, index: int, data: bytes, addr: tuple[str, int]) -> None:
        endpoint = self._udp.get(index)
        if endpoint is not None:
            # from the address this peer writes to (the alternate IP answers from itself)
            endpoint.sendto(data, addr, self._local_of.get(addr) if index != ALTERNATE_IP else None)
