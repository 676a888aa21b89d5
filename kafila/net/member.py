"""A session participant (host or member): signaling, admission, and edges to other members.

The asyncio layer around the sans-I/O pieces: rendezvous.messages (signaling codec), admission
(the host's HostSession: PAKEs, hellos, roster, kicks) and joining (the joiner's Joiner), which
this class feeds with what the rendezvous delivers and `now`, and whose actions it carries out;
natcheck (via stunclient), punch, edge_table and edge for the ring's edges.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
from typing import Any

import msgpack

from backends.errors import BadInput, Refused
from kafila.net import admission as adm
from kafila.net import joining
from kafila.net.admission import HostAdmission, HostSession
from kafila.net.certs import Identity
from kafila.net.code import parse_code
from kafila.net.edge import Edge, quic_destination_cid
from kafila.net.edge_table import EdgeTable
from kafila.net.handshake import SealedChannel
from kafila.net.host_codes import HostCodes
from kafila.net.joining import Joiner
from kafila.net.natcheck import RESTRICTIVE, NatReport, predict_edge_kind
from kafila.net.pieces import MAX_HOST_MESSAGE_BYTES, MAX_MEMBER_MESSAGE_BYTES
from kafila.net.punch import edge_id_of
from kafila.net.relay_link import RelayLink
from kafila.net.roster import MemberInfo, MemberJoined, MemberLeft, RosterUpdated, SessionEvent, own_entry_problem
from kafila.net.signaling import (
    DROPPED,
    HOST_GONE,
    RESUME_WINDOW_S,
    SIGNAL_TIMEOUT_S,
    Busy,
    Signal,
    local_candidates,
    resume,
)
from kafila.net.sock import MemberSocket
from kafila.net.stunclient import check_nat, resolve
from rendezvous import frames
from rendezvous import messages as m
from rendezvous.errors import ProtocolError

log = logging.getLogger("kafila.net")

Address = tuple[str, int]
HEARTBEAT_S = 1.0  # well under rendezvous.limits.MEMBER_SILENT_S (15 s): seconds of jitter are normal
JOIN_BUSY_RETRY_S = 1.0  # mean pause before asking a busy rendezvous again (randomised ±50 %)
JOIN_BUSY_WAIT_S = 60.0  # how long a joiner keeps asking
EDGE_ALLOCATE_TIMEOUT_S = 5.0
UNKNOWN_PEER_WAIT_S = 3.0  # an edge from a member the roster does not show yet
GROUP_KEY_BYTES = 32


class Member:
    """One participant. Build with `await Member.host(...)` or `await Member.join(...)`."""

    def __init__(self) -> None:
        self.codes: HostCodes | None = None  # the host's: its current code, fresh after a wrong guess
        self.name = ""
        self.is_host = False
        self.nat: NatReport
        self.descriptor: dict = {}
        self.identity: Identity
        self.rid = 0
        self.nameplate = 0
        self._sock: MemberSocket
        self._signal: Signal
        self._rendezvous: Address = ("", 0)
        self._bind_host = "0.0.0.0"
        self._core: HostSession | Joiner | None = None  # admission's machine: roster, channels, keys
        self.handler_errors = 0  # signaling messages whose handling failed (logged in one line)
        self._events: asyncio.Queue[SessionEvent] = asyncio.Queue()
        self._table = EdgeTable()  # which edge each datagram of our socket is for (edge_table.py)
        self._pending_edges: dict[int, collections.deque[asyncio.Future[bytes]]] = {}
        self._accepted: asyncio.Queue[Edge] = asyncio.Queue()
        self._relay: RelayLink  # our binding at the relay, and its frames for our edges
        self._send_delay_ms = 0.0
        self._resume_key = b""  # the host's: proves it to a (restarted) rendezvous
        self._resume_proof = b""  # a member's: messages.resume_proof, from the host's welcome
        self._resumable = True  # False once kicked or the session closed: nothing to resume
        self._signal_ready = asyncio.Event()  # clear while signaling is down (send() waits)
        # the rendezvous lives in the host's process (the welcome says): one that refuses
        # connections means the host has gone, not that a rendezvous is restarting
        self._embedded_rendezvous = False
        self.resumes = 0  # signaling connections this member got back
        self.last_outage_s: float | None = None  # how long signaling was down the last time
        self._lost_at = 0.0
        self._roster_changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.signaling_up = True

    @property
    def allow_direct(self) -> bool:
        """False: every edge stays on the relay (tests, diagnostics)."""
        return self._table.allow_direct

    @allow_direct.setter
    def allow_direct(self, value: bool) -> None:
        self._table.allow_direct = value

    @property
    def _edges(self) -> dict[bytes, Edge]:
        return self._table.edges  # type: ignore[return-value]

    # what admission's machine holds (empty until there is one)
    @property
    def _roster(self) -> dict[str, MemberInfo]:
        return self._core.roster if self._core is not None else {}

    @property
    def _names(self) -> dict[int, str]:
        return self._core.names if self._core is not None else {}

    @property
    def _channels(self) -> dict[int, SealedChannel]:
        return self._core.channels if self._core is not None else {}

    @property
    def _group_key(self) -> bytes:
        return self._core.group_key if self._core is not None else b""

    @property
    def _admission(self) -> HostAdmission | None:
        return self._core.admission if isinstance(self._core, HostSession) else None

    # construction
    @classmethod
    async def host(
        cls, rendezvous: tuple[str, int], name: str, descriptor: dict, *,
        bind_host: str = "0.0.0.0", send_delay_ms: float = 0.0, code_words: int = 3,
        embedded_rendezvous: bool = False,
    ) -> Member:
        """Register a new session at the rendezvous; `.code` is the code to share (code_words
        words: 3, or 4 for a session that stays open long). `embedded_rendezvous`: the rendezvous
        runs in the host's process (kafila host's own), so it ends with the host."""
        self = cls()
        self._embedded_rendezvous = embedded_rendezvous
        await self._open(rendezvous, name, descriptor, bind_host, send_delay_ms, is_host=True)
        try:
            self._resume_key = os.urandom(m.RESUME_KEY_BYTES)
            self._signal.send(m.Open(resume_key=self._resume_key))
            opened = await self._signal.expect(m.Opened, what="no answer to opening the session")
            assert isinstance(opened, m.Opened)
            self.nameplate, self.rid, self._relay.token = opened.nameplate, 0, opened.relay_token
            self.codes = HostCodes(opened.nameplate, code_words,
                                   lambda msg: None if self._closed else self._signal.send(msg))  # fmt: skip
            self._start_relay_binding()
            self.nat = await self._nat_task
            self._core = HostSession(self.code, self.nameplate, self._own_info(),
                                     group_key=os.urandom(GROUP_KEY_BYTES), resume_key=self._resume_key,
                                     embedded=embedded_rendezvous)  # fmt: skip
            self._start_background()
        except BaseException:
            await self._teardown()
            raise
        return self

    @classmethod
    async def join(
        cls, code: str, rendezvous: tuple[str, int], name: str, descriptor: dict, *,
        bind_host: str = "0.0.0.0", send_delay_ms: float = 0.0,
    ) -> Member:
        """Join the session behind `code`: PAKE with the host, then the roster.

        A rendezvous that is "busy" (several machines joining at the same moment: it admits a few
        at a time) is asked again after a short random pause, for up to JOIN_BUSY_WAIT_S."""
        nameplate, normalized = parse_code(code)
        deadline = asyncio.get_running_loop().time() + JOIN_BUSY_WAIT_S
        while True:
            self = cls()
            await self._open(rendezvous, name, descriptor, bind_host, send_delay_ms, is_host=False)
            try:
                await self._join(nameplate, normalized)
                return self
            except Busy:
                await self._teardown()
                if asyncio.get_running_loop().time() >= deadline:
                    raise Refused(f"cannot join {normalized.split('-')[0]}-...: the rendezvous stayed "
                                  f"busy with other joins for {JOIN_BUSY_WAIT_S:g} s; try again") from None
                await asyncio.sleep(JOIN_BUSY_RETRY_S * (0.5 + random.random()))
            except BaseException:
                await self._teardown()
                raise

    async def _open(self, rendezvous: tuple[str, int], name: str, descriptor: dict,
                    bind_host: str, send_delay_ms: float, *, is_host: bool) -> None:
        problem = own_entry_problem(name, descriptor)
        if problem is not None:
            raise BadInput(problem)
        self.name, self.descriptor, self.is_host = name, descriptor, is_host
        self._bind_host = bind_host
        self._rendezvous = await resolve(*rendezvous)
        self.identity = Identity.generate(name)
        self._sock = await MemberSocket.open(bind_host, send_delay_ms=send_delay_ms)
        self._relay = RelayLink(self._sock, self._rendezvous, self._table, closed=lambda: self._closed)
        self._sock.handlers[frames.KIND_RELAY] = self._relay.datagram
        self._sock.handlers[frames.KIND_PUNCH] = self._on_punch
        self._sock.handlers[frames.KIND_QUIC] = self._on_quic
        self._nat_task = asyncio.ensure_future(check_nat(self._sock, self._rendezvous))
        try:
            self._signal = await Signal.connect(self._rendezvous, send_delay_ms)
        except (TimeoutError, OSError) as exc:
            self._nat_task.cancel()
            self._sock.close()
            host, port = rendezvous
            raise Refused(f"cannot reach the rendezvous at {host}:{port}: {exc or 'timeout'}") from None
        self._send_delay_ms = send_delay_ms
        self._signal_ready.set()

    async def _join(self, nameplate: int, code: str) -> None:
        # NAT first: a pending slot must begin its PAKE within seconds (limits.PAKE_START_S), and
        # the host runs one PAKE at a time, so ours is confirmed one round trip later
        self.nat = await self._nat_task
        self._signal.send(m.Join(nameplate))
        try:
            joined = await self._signal.expect(m.Joined, what="no answer to the join")
        except Refused as exc:
            raise Refused(f"cannot join {code.split('-')[0]}-...: {exc} (check the code)") from None
        assert isinstance(joined, m.Joined)
        self.nameplate, self.rid, self._relay.token = nameplate, joined.rid, joined.relay_token
        self._start_relay_binding()
        joiner = self._core = Joiner(code, nameplate, self.rid, self._own_info())
        loop = asyncio.get_running_loop()
        self._execute(joiner.start(loop.time()))
        while joiner.state != joining.JOINED:  # each reply bounded by SIGNAL_TIMEOUT_S; Failed raises
            deliver = await self._signal.expect(m.Deliver, what="no answer from the host")
            assert isinstance(deliver, m.Deliver)
            self._execute(joiner.receive(deliver.sender, deliver.body, loop.time()))
        self._start_background()

    def _own_info(self) -> MemberInfo:
        mapped_ip, _, mapped_port = self.nat.mapped.rpartition(":")
        candidates = [(mapped_ip, int(mapped_port))]
        for addr in local_candidates(self._bind_host, self._sock.local_address[1], self._rendezvous):
            if addr not in candidates:
                candidates.append(addr)
        return MemberInfo(self.name, self.descriptor, self.nat.nat, self.nat.rtt_ms,
                          self.identity.fingerprint, tuple(candidates), self.rid, self.nat)

    # background work
    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"member-{self.name}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start_relay_binding(self) -> None:
        """Once the rendezvous knows us: bind our UDP address for the relay, and heartbeat."""
        self._spawn(self._relay.keep_bound(), "relay-bind")
        self._spawn(self._heartbeat(), "heartbeat")

    def _start_background(self) -> None:
        self._spawn(self._signal_loop(), "signal")
        if isinstance(self._core, HostSession):
            self._spawn(self._admission_timer(self._core), "admission")

    async def _admission_timer(self, core: HostSession) -> None:
        """Drop the id whose PAKE is not confirmed within admission.PAKE_TIMEOUT_S."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(0.5)
            self._execute(core.tick(loop.time()))

    async def _heartbeat(self) -> None:
        while not self._closed:
            self._signal.send(m.Heartbeat())
            await asyncio.sleep(HEARTBEAT_S)

    async def _signal_loop(self) -> None:
        while not self._closed:
            try:
                while not self._closed:
                    message = await self._signal.next()
                    try:
                        self._handle(message)
                    except Exception as exc:  # one bad message never stops the signaling task
                        self.handler_errors += 1
                        log.warning("%s: a %s could not be handled (%s: %s); ignored", self.name,
                                    type(message).__name__, type(exc).__name__, exc)
            except (ConnectionError, OSError, ProtocolError) as exc:
                reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
                if self._closed or not self.signaling_up:
                    return
                failure = await self._resume_signaling(reason)
                if failure is None:
                    continue
                self.signaling_up = False
                log.warning("%s: signaling lost: %s", self.name, failure)
                if not self.is_host:
                    host = self._names.get(0, "host")
                    # not only signaling: the host itself, or the session for this member
                    gone = failure.startswith((HOST_GONE, DROPPED))
                    self._events.put_nowait(MemberLeft(host, failure if gone else f"signaling lost: {failure}"))
                return

    async def _resume_signaling(self, reason: str) -> str | None:
        """Signaling dropped: reconnect to the rendezvous (restarted, or our line back) and prove
        we are still this member (signaling.resume); None once back, else why not."""
        proof = self._resume_key if self.is_host else self._resume_proof
        if not proof or not self._resumable:
            return reason
        self._signal_ready.clear()
        self._signal.writer.close()
        log.warning("%s: signaling lost (%s); asking the rendezvous to take us back", self.name, reason)
        self._lost_at = asyncio.get_running_loop().time()
        back = await resume(self._rendezvous, m.Resume(self.nameplate, self.rid, proof, self._relay.token), reason,
                            name=self.name, send_delay_ms=self._send_delay_ms, closed=lambda: self._closed,
                            refused_means_host_gone=self._embedded_rendezvous and not self.is_host)  # fmt: skip
        if isinstance(back, str):
            return back
        self._signaling_back(back)
        if self.codes is not None:  # a restarted rendezvous forgot the nameplate of a fresh code
            self.codes.resumed(self.nameplate)
        return None

    def _signaling_back(self, signal: Signal) -> None:
        """Resumed: messages lost with the old connection may leave one gap on each channel; the
        relay binding and our relay edges are claimed again (a restarted relay lost them)."""
        self._signal = signal
        self.resumes += 1
        self.last_outage_s = round(asyncio.get_running_loop().time() - self._lost_at, 3)
        for channel in self._channels.values():
            channel.gap_allowed = True
        self._relay.rebind()
        for edge in list(self._edges.values()):
            info = self._roster.get(edge.peer)
            if info is not None and not edge.closed:
                signal.send(m.EdgeResume(edge.edge_id, info.peer_id))
        self._signal_ready.set()
        log.warning("%s: signaling is back after %.1f s (resume %d)", self.name, self.last_outage_s, self.resumes)

    def _handle(self, message: m.Message) -> None:
        now = asyncio.get_running_loop().time()
        if isinstance(message, m.Deliver) and self._core is not None:
            self._execute(self._core.receive(message.sender, message.body, now))
        elif isinstance(message, m.EdgeAllocated):
            self._edge_allocated(message)
        elif isinstance(message, m.PeerLeft) and isinstance(self._core, HostSession):
            self._execute(self._core.left(message.rid, message.reason, now))
        elif isinstance(message, m.Reopened) and isinstance(self._core, HostSession):
            code = self.codes.reopened(message.nameplate) if self.codes else None
            if code is not None:
                self._execute(self._core.reopen(code, message.nameplate))
        elif isinstance(message, m.Notice) and self.is_host:
            log.warning("%s: rendezvous: %s", self.name, message.reason)
        elif isinstance(message, m.SessionClosed) and not self.is_host:
            self.signaling_up = self._resumable = False  # the rendezvous closes the connection next: expected
            self._events.put_nowait(MemberLeft(self._names.get(0, "host"), message.reason))
        elif isinstance(message, m.Error):
            log.warning("%s: rendezvous error: %s", self.name, message.reason)
            if message.code == "kicked":
                self._resumable = False
            for waiters in self._pending_edges.values():
                if waiters and message.code in ("no-such-member", "full"):
                    waiters.popleft().set_exception(Refused(f"edge refused: {message.reason}"))
                    break

    def _execute(self, actions: list[adm.Action] | list[joining.Action]) -> None:
        """Carry out what admission's machine decided: signaling sends, kicks, events."""
        for action in actions:
            if isinstance(action, adm.SendBody):
                self._signal.send(m.Send(action.rid, action.body))
            elif isinstance(action, adm.Drop):
                log.debug("joiner %d: %s; dropped", action.rid, action.reason)
                self._signal.send(m.Kick(action.rid))
            elif isinstance(action, adm.Kick):
                log.warning("member %d: %s; removing it", action.rid, action.reason)
                self._signal.send(m.Kick(action.rid))
            elif isinstance(action, adm.Admit):
                self._signal.send(m.Admit(action.rid))
            elif isinstance(action, adm.CloseNameplate) and self.codes is not None:
                self.codes.wrong_guess(self.name)  # a fresh code for the next joiner
            elif isinstance(action, joining.Welcomed):
                self.name, self._resume_proof = action.name, action.resume_proof
                self.nameplate = action.session  # resume names the session, whichever code we joined by
                self._embedded_rendezvous = action.embedded
                self._roster_changed.set()
            elif isinstance(action, joining.Failed):
                raise Refused(action.reason)
            elif isinstance(action, joining.Close):
                log.error("%s: signaling from the host failed: %s; leaving", self.name, action.reason)
                self._closed = True
                self._signal.writer.close()
            elif isinstance(action, SessionEvent):
                if isinstance(action, (MemberJoined, RosterUpdated)):
                    self._roster_changed.set()  # an edge from a member we did not know may wait
                self._events.put_nowait(action)

    # public API
    @property
    def code(self) -> str | None:
        """The host's current session code (a fresh one after a wrong guess or new_code())."""
        return self.codes.code if self.codes is not None else None

    @property
    def code_void(self) -> bool:
        """The host's: a wrong code was tried at the current code, so it admits nobody now."""
        return self.codes is not None and self.codes.void

    async def new_code(self) -> str:
        """The host's: close the current code and open a fresh one (members stay); the new code."""
        if self.codes is None:
            raise Refused("only the host can open a new code")
        return await self.codes.renew()

    def signaling(self) -> dict:
        """For /status: is signaling up now, how often it came back, the last outage."""
        return {"up": self.signaling_up and self._signal_ready.is_set(), "resumes": self.resumes,
                "last_outage_s": self.last_outage_s}

    def roster(self) -> dict[str, MemberInfo]:
        """name -> MemberInfo: the host's view, or the roster the host last sent."""
        return dict(self._roster)

    async def send(self, to: str, message: Any) -> None:
        """An authenticated message to `to` (members may only send to the host).

        One larger than PIECE_BYTES packed travels in pieces (pieces.py), all written before
        anything else, up to MAX_HOST_MESSAGE_BYTES from the host (a plan and its manifest) and
        MAX_MEMBER_MESSAGE_BYTES from a member."""
        info = self._roster.get(to)
        if info is None:
            raise BadInput(f"no member named {to!r} in this session")
        if not self.is_host and info.peer_id != 0:
            raise BadInput("members can only send to the host")
        if info.peer_id == self.rid:
            raise BadInput("cannot send to yourself")
        packed = msgpack.packb(message, use_bin_type=True)
        limit = MAX_HOST_MESSAGE_BYTES if self.is_host else MAX_MEMBER_MESSAGE_BYTES
        if len(packed) > limit:
            raise BadInput(f"a message of {len(packed)} bytes to {to} exceeds the {limit} bytes "
                           "one session message may carry")  # fmt: skip
        channel = self._channels.get(info.peer_id)
        if channel is None:
            raise Refused(f"no signaling channel to {to}")
        if not self._signal_ready.is_set():  # resuming: seal once it is back (no gap on the channel)
            waiter = asyncio.ensure_future(self._signal_ready.wait())
            try:
                await asyncio.wait({waiter}, timeout=RESUME_WINDOW_S)
            finally:
                waiter.cancel()
            if not self._signal_ready.is_set() or self._closed:
                raise Refused(f"signaling to the rendezvous is down; cannot reach {to}")
        for body in adm.sealed_bodies(channel, message, packed):  # no await between pieces
            self._signal.send(m.Send(info.peer_id, body))
        await self._signal.writer.drain()

    def kick(self, name: str, reason: str) -> None:
        """The host's: remove member `name` from the session now (it hears `reason`; the others get
        the roster without it; MemberLeft follows). Unknown names are ignored."""
        info = self._roster.get(name)
        if not isinstance(self._core, HostSession) or info is None or info.peer_id == self.rid:
            return
        self._execute(self._core.kick(info.peer_id, reason))

    async def recv(self) -> SessionEvent:
        return await self._events.get()

    async def connect(self, peer: str) -> Edge:
        """A QUIC edge to `peer`: up over the relay at once, upgraded to direct underneath."""
        info = self._roster.get(peer)
        if info is None:
            raise BadInput(f"no member named {peer!r} in this session")
        if info.peer_id == self.rid:
            raise BadInput("cannot open an edge to yourself")
        try:
            await asyncio.wait_for(self._relay.bound.wait(), SIGNAL_TIMEOUT_S)
        except TimeoutError:
            ip, port = self._rendezvous
            raise Refused(f"the relay at {ip}:{port} did not acknowledge this member's UDP binding "
                          f"within {SIGNAL_TIMEOUT_S:g} s, so no edge to {peer} can form: check that "
                          f"UDP {port} reaches it (a firewall?)") from None  # fmt: skip
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending_edges.setdefault(info.peer_id, collections.deque()).append(future)
        self._signal.send(m.EdgeRequest(info.peer_id))
        try:
            edge_id = await asyncio.wait_for(future, EDGE_ALLOCATE_TIMEOUT_S)
        except TimeoutError:
            raise Refused(f"the rendezvous did not allocate an edge to {peer} within "
                          f"{EDGE_ALLOCATE_TIMEOUT_S:g} s") from None
        edge = self._new_edge(edge_id, info, is_client=True)
        await edge.connect()
        return edge

    async def accept(self) -> Edge:
        """The next edge a peer opened to us (authenticated)."""
        return await self._accepted.get()

    async def close(self) -> None:
        """Leave the session cleanly (the host sees MemberLeft)."""
        if self._closed:
            return
        signal = getattr(self, "_signal", None)
        if signal is not None:
            try:  # a goodbye is a courtesy: a rendezvous already gone hears of it from the socket
                signal.send(m.Bye())
                await asyncio.wait_for(signal.writer.drain(), 1.0)
            except (ConnectionError, OSError, TimeoutError) as exc:
                log.debug("%s: no goodbye to the rendezvous: %r", self.name, exc)
        await self._teardown()

    # edges
    def _new_edge(self, edge_id: bytes, info: MemberInfo, *, is_client: bool) -> Edge:
        predicted = predict_edge_kind(self.nat.nat, info.nat)
        edge = Edge(
            edge_id=edge_id, peer=info.name, peer_fingerprint=info.fingerprint,
            peer_candidates=list(info.candidates), predicted=predicted, is_client=is_client,
            identity=self.identity, group_key=self._group_key, sock=self._sock,
            relay_addr=self._rendezvous, register_cid=self._table.register_cid,
            on_closed=self._edge_closed,
            on_authed=None if is_client else self._accepted.put_nowait,
            punch_rounds=0 if not self.allow_direct else
            1 if self.nat.nat == info.nat == RESTRICTIVE else 3,
        )
        self._table.add(edge, asyncio.get_running_loop().time())
        return edge

    def _edge_closed(self, edge: Edge) -> None:
        self._table.remove(edge)

    def _edge_allocated(self, message: m.EdgeAllocated) -> None:
        if message.initiator:
            waiters = self._pending_edges.get(message.peer)
            if waiters:
                waiters.popleft().set_result(message.edge_id)
            return
        self._spawn(self._incoming_edge(message), "incoming-edge")

    async def _incoming_edge(self, message: m.EdgeAllocated) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UNKNOWN_PEER_WAIT_S
        while message.peer not in self._names and loop.time() < deadline:
            self._roster_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._roster_changed.wait(), deadline - loop.time())
        name = self._names.get(message.peer)
        if name is None or name == self.name:
            log.warning("edge offered by unknown member %d: ignored", message.peer)
            return
        self._new_edge(message.edge_id, self._roster[name], is_client=False)

    # datagrams from the member socket
    def _on_punch(self, data: bytes, src: Address) -> None:
        self._table.punch(edge_id_of(data), data, src, asyncio.get_running_loop().time())

    def _on_quic(self, data: bytes, src: Address) -> None:
        try:
            cid, initial = quic_destination_cid(data)
        except ProtocolError:
            return
        self._table.quic(cid, initial, data, src)

    async def _teardown(self) -> None:
        self._closed = True
        for edge in list(self._edges.values()):
            try:
                await edge.close()
            except (ConnectionError, OSError, TimeoutError) as exc:  # already broken: it is gone either way
                log.debug("%s: closing the edge to %s: %r", self.name, edge.peer, exc)
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        others = [task for task in self._tasks if task is not current]
        if others:
            await asyncio.wait(others)
        for task in others:
            if not task.cancelled() and task.exception() is not None:
                log.warning("%s: %s had failed: %r", self.name, task.get_name(), task.exception())
        nat_task = getattr(self, "_nat_task", None)
        if nat_task is not None and not nat_task.done():
            nat_task.cancel()
        signal = getattr(self, "_signal", None)
        if signal is not None:
            signal.writer.close()
            try:
                await asyncio.wait_for(signal.writer.wait_closed(), 1.0)
            except (ConnectionError, OSError, TimeoutError) as exc:
                log.debug("%s: signaling closed uncleanly: %r", self.name, exc)
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()
