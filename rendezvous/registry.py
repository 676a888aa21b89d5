"""Sans-I/O session registry: who is in which session, and what to send to whom.

Theory of operation. The asyncio layer numbers each TCP connection (`conn`) and feeds the
registry `connected`, `receive(conn, message)`, `disconnected` and `tick(now)`; each returns
a list of actions: `SendTo(conn, message)` or `CloseConn(conn, reason)`. A connection starts
unassigned and must `Open` (becoming a session's host, rid 0) or `Join` a live nameplate within
HELLO_TIMEOUT_S. Bodies between members are forwarded without being read. The registry never
learns the words of a code: only the nameplate. The host closes the nameplate after a failed
PAKE (`CloseNameplate`), after which joins fail as if the nameplate did not exist.

    unassigned --Open--> host of a new session   --disconnect--> session closed (members told)
    unassigned --Join(live nameplate)--> member   --disconnect/Bye/silence--> PeerLeft to host
    unassigned --anything else / bad Join--> Error, closed
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from rendezvous import messages as m
from rendezvous.limits import (
    HELLO_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_MEMBERS_PER_SESSION,
    MAX_NAMEPLATE,
    MAX_RELAY_EDGES_PER_SESSION,
    MAX_SESSIONS,
    MAX_SIGNAL_FRAMES_PER_S,
    MEMBER_SILENT_S,
    SIGNAL_BURST_FRAMES,
)
from rendezvous.relay import RelayTable, TokenBucket


@dataclass(frozen=True)
class SendTo:
    conn: int
    message: m.Message


@dataclass(frozen=True)
class CloseConn:
    conn: int
    reason: str


Action = SendTo | CloseConn


@dataclass
class _Conn:
    conn: int
    opened_at: float
    last_seen: float
    bucket: TokenBucket
    session: int | None = None  # nameplate (the session's key)
    rid: int | None = None


@dataclass
class _Session:
    nameplate: int
    host_conn: int
    open_for_joins: bool = True
    members: dict[int, int] = field(default_factory=dict)  # rid -> conn
    tokens: dict[int, bytes] = field(default_factory=dict)  # rid -> relay token
    next_rid: int = 1


class Registry:
    def __init__(
        self,
        *,
        stun_port2: int = 0,
        relay: RelayTable | None = None,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes,
        random_below: Callable[[int], int] = secrets.randbelow,
    ) -> None:
        self.stun_port2 = stun_port2
        self.relay = relay if relay is not None else RelayTable()
        self._random_bytes = random_bytes
        self._random_below = random_below
        self._conns: dict[int, _Conn] = {}
        self._sessions: dict[int, _Session] = {}  # by nameplate (live or closed nameplate)
        self.rejected = 0  # requests refused (bad joins, bad messages), for tests and logs

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def members_of(self, nameplate: int) -> list[int]:
        session = self._sessions.get(nameplate)
        return sorted(session.members) if session else []

    # events from the asyncio layer
    def connected(self, conn: int, now: float) -> list[Action]:
        if len(self._conns) >= MAX_CONNECTIONS:
            self.rejected += 1
            return [CloseConn(conn, "too many connections")]
        bucket = TokenBucket(MAX_SIGNAL_FRAMES_PER_S, SIGNAL_BURST_FRAMES)
        self._conns[conn] = _Conn(conn, now, now, bucket)
        return []

    def disconnected(self, conn: int, reason: str, now: float) -> list[Action]:
        state = self._conns.pop(conn, None)
        if state is None or state.session is None:
            return []
        return self._leave(state, reason)

    def receive(self, conn: int, message: m.Message, now: float) -> list[Action]:
        state = self._conns.get(conn)
        if state is None:
            return []
        state.last_seen = now
        if not state.bucket.take(1, now):
            return self._refuse(conn, "rate-limited", "too many signaling messages", fatal=True)
        if state.session is None:
            if isinstance(message, m.Open):
                return self._open(state)
            if isinstance(message, m.Join):
                return self._join(state, message)
            return self._refuse(conn, "not-joined", "open or join a session first", fatal=True)
        session = self._sessions[state.session]
        is_host = state.rid == 0
        if isinstance(message, m.Heartbeat):
            return []
        if isinstance(message, m.Send):
            if not is_host and message.to != 0:
                return self._refuse(conn, "forbidden", "members may only send to the host")
            target = session.members.get(message.to)
            if target is None or message.to == state.rid:
                return self._refuse(conn, "no-such-member", f"no member {message.to}")
            return [SendTo(target, m.Deliver(state.rid, message.body))]
        if isinstance(message, m.EdgeRequest):
            return self._edge(state, session, message.peer, now)
        if isinstance(message, m.Bye):
            self._conns.pop(conn, None)
            return [*self._leave(state, "left"), CloseConn(conn, "bye")]
        if is_host and isinstance(message, m.Kick):
            target = session.members.get(message.rid)
            if target is None or message.rid == 0:
                return []
            kicked = self._conns.pop(target)
            return [*self._leave(kicked, "kicked by host"),
                    SendTo(target, m.Error("kicked", "the host removed you from the session")),
                    CloseConn(target, "kicked")]
        if is_host and isinstance(message, m.CloseNameplate):
            session.open_for_joins = False
            return []
        return self._refuse(conn, "unexpected", f"unexpected {type(message).__name__}")

    def tick(self, now: float) -> list[Action]:
        """Expire silent members and connections that never said hello."""
        actions: list[Action] = []
        for state in list(self._conns.values()):
            if state.session is None and now - state.opened_at > HELLO_TIMEOUT_S:
                del self._conns[state.conn]
                actions.append(CloseConn(state.conn, "no hello"))
            elif state.session is not None and now - state.last_seen > MEMBER_SILENT_S:
                del self._conns[state.conn]
                actions += self._leave(state, "connection lost (no heartbeat)")
                actions.append(CloseConn(state.conn, "silent"))
        self.relay.expire(now)
        return actions

    # transitions
    def _refuse(self, conn: int, code: str, reason: str, *, fatal: bool = False) -> list[Action]:
        self.rejected += 1
        actions: list[Action] = [SendTo(conn, m.Error(code, reason))]
        if fatal:
            self._conns.pop(conn, None)
            actions.append(CloseConn(conn, reason))
        return actions

    def _open(self, state: _Conn) -> list[Action]:
        if len(self._sessions) >= MAX_SESSIONS:
            return self._refuse(state.conn, "full", "the rendezvous is full", fatal=True)
        nameplate = 0
        for _ in range(100):
            candidate = 1 + self._random_below(MAX_NAMEPLATE)
            if candidate not in self._sessions:
                nameplate = candidate
                break
        if not nameplate:
            return self._refuse(state.conn, "full", "no free nameplate", fatal=True)
        session = _Session(nameplate, state.conn)
        self._sessions[nameplate] = session
        token = self._add_member(session, state, 0)
        return [SendTo(state.conn, m.Opened(nameplate, 0, token, self.stun_port2))]

    def _join(self, state: _Conn, message: m.Join) -> list[Action]:
        session = self._sessions.get(message.nameplate)
        if session is None or not session.open_for_joins:
            return self._refuse(
                state.conn, "unknown-nameplate",
                f"no open session with nameplate {message.nameplate}", fatal=True,
            )
        if len(session.members) >= MAX_MEMBERS_PER_SESSION:
            return self._refuse(state.conn, "full", "the session is full", fatal=True)
        rid = session.next_rid
        session.next_rid += 1
        token = self._add_member(session, state, rid)
        return [SendTo(state.conn, m.Joined(rid, token, self.stun_port2))]

    def _add_member(self, session: _Session, state: _Conn, rid: int) -> bytes:
        token = self._random_bytes(m.RELAY_TOKEN_BYTES)
        state.session, state.rid = session.nameplate, rid
        session.members[rid] = state.conn
        session.tokens[rid] = token
        self.relay.add_member(token, session.nameplate, rid)
        return token

    def _edge(self, state: _Conn, session: _Session, peer: int, now: float) -> list[Action]:
        assert state.rid is not None
        target = session.members.get(peer)
        if target is None or peer == state.rid:
            return self._refuse(state.conn, "no-such-member", f"no member {peer} for an edge")
        if self.relay.edges_in(session.nameplate) >= MAX_RELAY_EDGES_PER_SESSION:
            return self._refuse(state.conn, "full", "too many relay edges in this session")
        edge_id = self._random_bytes(m.EDGE_ID_BYTES)
        while self.relay.has_edge(edge_id):
            edge_id = self._random_bytes(m.EDGE_ID_BYTES)
        self.relay.allocate(
            edge_id, session.nameplate, session.tokens[state.rid], session.tokens[peer], now
        )
        return [
            SendTo(state.conn, m.EdgeAllocated(edge_id, peer, True)),
            SendTo(target, m.EdgeAllocated(edge_id, state.rid, False)),
        ]

    def _leave(self, state: _Conn, reason: str) -> list[Action]:
        session = self._sessions.get(state.session) if state.session is not None else None
        if session is None or state.rid is None:
            return []
        session.members.pop(state.rid, None)
        token = session.tokens.pop(state.rid, None)
        if token is not None:
            self.relay.remove_member(token)
        if state.rid != 0:
            if session.host_conn in self._conns:
                return [SendTo(session.host_conn, m.PeerLeft(state.rid, reason[:m.MAX_REASON_CHARS]))]
            return []
        # the host left: the session is over
        del self._sessions[session.nameplate]
        actions: list[Action] = []
        for rid, conn in session.members.items():
            self._conns.pop(conn, None)
            token = session.tokens.pop(rid, None)
            if token is not None:
                self.relay.remove_member(token)
            actions.append(SendTo(conn, m.SessionClosed("the host left the session")))
            actions.append(CloseConn(conn, "session closed"))
        return actions
