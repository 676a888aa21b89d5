"""Sans-I/O session registry: who is in which session, and what to send to whom.

Theory of operation. The asyncio layer numbers each TCP connection (`conn`) and feeds the
registry `connected`, `receive(conn, message)`, `disconnected` and `tick(now)`; each returns
a list of actions: `SendTo(conn, message)` or `CloseConn(conn, reason)`. A connection starts
unassigned and must `Open` (becoming a session's host, rid 0) or `Join` a live nameplate within
HELLO_TIMEOUT_S. Bodies between members are forwarded without being read. The registry never
learns the words of a code: only the nameplate. The host closes the nameplate after a failed
PAKE (`CloseNameplate`), after which joins fail as if the nameplate did not exist.

Admission before power: a joined id is *pending* until the host, after a confirmed PAKE, sends
`Admit(rid)`. A pending id may send at most PENDING_BODIES_MAX bodies (PENDING_BYTES_MAX in
all) to the host, heartbeats and Bye: no EdgeRequest, no relay binding, no message to anyone
else. At most MAX_PENDING_PER_SESSION ids are pending at once, and each for PENDING_TIMEOUT_S.
Every connection has a frame rate and a byte budget. A fatal refusal drops the connection
*everywhere* (session, relay, the host told with PeerLeft), so no id outlives its connection,
and the host's `Kick` of an id that is already gone does nothing.

    unassigned --Open--> host of a new session (admitted)  --disconnect--> session closed
    unassigned --Join(live nameplate, room)--> pending --Admit--> member
    pending/member --disconnect/Bye/silence/Kick/fatal refusal--> gone (PeerLeft to host)
    pending --PENDING_TIMEOUT_S, a quota, anything but Send-to-host/Heartbeat/Bye--> gone
    unassigned --Resume(nameplate, rid, proof)--> member again (admitted), or the host of a
                  session re-created at that nameplate (a restarted rendezvous)
    unassigned --anything else / bad Join / bad Resume--> Error, closed

Resume (messages.py): a session remembers the resume key its host drew. A member's `Resume`
carries `resume_proof(key, nameplate, rid)`, which only the host can have given it (in the sealed
welcome, after admission), so a resumed id is admitted at once. A rendezvous that restarted knows
no session: the host's `Resume` re-creates it with the key it proves, and members then resume
into it. Relay edges the restarted relay lost come back when both ends send `EdgeResume`.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from rendezvous import messages as m
from rendezvous.limits import (
    EDGE_CLAIM_TTL_S,
    HELLO_TIMEOUT_S,
    HOST_SIGNAL_BURST_BYTES,
    HOST_SIGNAL_BURST_FRAMES,
    HOST_SIGNAL_BYTES_PER_S,
    HOST_SIGNAL_FRAMES_PER_S,
    JOIN_WAIT_S,
    MAX_CONNECTIONS,
    MAX_MEMBERS_PER_SESSION,
    MAX_NAMEPLATE,
    MAX_PENDING_PER_SESSION,
    MAX_PENDING_PER_SOURCE,
    MAX_RELAY_EDGES_PER_MEMBER,
    MAX_RELAY_EDGES_PER_SESSION,
    MAX_SESSIONS,
    MAX_SIGNAL_FRAMES_PER_S,
    MAX_WAITING_JOINS,
    MEMBER_SIGNAL_BURST_BYTES,
    MEMBER_SIGNAL_BYTES_PER_S,
    MEMBER_SILENT_S,
    PAKE_START_S,
    PENDING_BODIES_MAX,
    PENDING_BYTES_MAX,
    PENDING_TIMEOUT_S,
    RESUMED_RID_BASE,
    SIGNAL_BURST_FRAMES,
    SIGNAL_FRAME_COST_BYTES,
)
from rendezvous.relay import RelayTable, TokenBucket
from rendezvous.sources import SourceCounts, UnknownJoins


@dataclass(frozen=True)
class SendTo:
    conn: int
    message: m.Message


@dataclass(frozen=True)
class CloseConn:
    conn: int
    reason: str


@dataclass(frozen=True)
class Log:
    text: str  # a warning for the rendezvous' own log (someone scans nameplates)


Action = SendTo | CloseConn | Log


@dataclass
class _Conn:
    conn: int
    opened_at: float
    last_seen: float
    bucket: TokenBucket  # frames
    byte_bucket: TokenBucket  # body bytes
    session: int | None = None  # nameplate (the session's key)
    rid: int | None = None
    admitted: bool = False  # the host (always) or a member the host admitted after its PAKE
    joined_at: float = 0.0
    pending_bodies: int = 0
    pending_bytes: int = 0
    source: str = ""  # the peer's address (IP), for per-source limits
    waiting: int | None = None  # the nameplate of the session whose pending slot it waits for
    began: bool = False  # a pending id sent its first body (its PAKE)


@dataclass
class _Session:
    nameplate: int
    host_conn: int
    open_for_joins: bool = True
    members: dict[int, int] = field(default_factory=dict)  # rid -> conn (pending ones too)
    pending: set[int] = field(default_factory=set)  # rids not admitted yet
    tokens: dict[int, bytes] = field(default_factory=dict)  # rid -> relay token
    next_rid: int = 1
    resume_key: bytes = b""  # the host's (Open); empty: nobody can resume into this session
    edge_claims: dict[bytes, tuple[int, int, float]] = field(default_factory=dict)  # EdgeResume: edge -> (rid, peer, at)
    gone: set[int] = field(default_factory=set)  # ids the host was told left: they cannot resume
    join_plate: int = 0  # the nameplate joins use (Reopen moves it; `nameplate` stays the session's id)
    waiting: collections.deque = field(default_factory=collections.deque)  # conns in line for a slot
    refused: SourceCounts = field(default_factory=SourceCounts)  # joins refused, told to the host

    def __post_init__(self) -> None:
        self.join_plate = self.join_plate or self.nameplate


class Registry:
    def __init__(
        self,
        *,
        stun_port2: int = 0,
        relay: RelayTable | None = None,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes,
        random_below: Callable[[int], int] = secrets.randbelow,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self.stun_port2 = stun_port2
        self.relay = relay if relay is not None else RelayTable()
        self.max_sessions = max_sessions  # 1 for the rendezvous embedded in `kafila host`
        self._random_bytes = random_bytes
        self._random_below = random_below
        self._conns: dict[int, _Conn] = {}
        self._sessions: dict[int, _Session] = {}  # by nameplate (live or closed nameplate)
        self._aliases: dict[int, int] = {}  # a reopened session's join nameplate -> its nameplate
        self._unknown = UnknownJoins()  # per source: joins to nameplates that do not exist
        self.rejected = 0  # requests refused (bad joins, bad messages), for tests and logs

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    @property
    def connection_count(self) -> int:
        return len(self._conns)

    def members_of(self, nameplate: int) -> list[int]:
        """Every rid of the session, pending ones included."""
        session = self._sessions.get(nameplate)
        return sorted(session.members) if session else []

    def pending_of(self, nameplate: int) -> list[int]:
        session = self._sessions.get(nameplate)
        return sorted(session.pending) if session else []

    def unassigned(self, conn: int) -> bool:  # in no session, no line: the service may close it for room
        state = self._conns.get(conn)
        return state is not None and state.session is None and state.waiting is None

    def is_host(self, conn: int) -> bool:
        state = self._conns.get(conn)
        return state is not None and state.session is not None and state.rid == 0

    # events from the asyncio layer
    def connected(self, conn: int, now: float, source: str = "") -> list[Action]:
        if len(self._conns) >= MAX_CONNECTIONS:
            self.rejected += 1
            return [CloseConn(conn, "too many connections")]
        bucket = TokenBucket(MAX_SIGNAL_FRAMES_PER_S, SIGNAL_BURST_FRAMES)
        byte_bucket = TokenBucket(MEMBER_SIGNAL_BYTES_PER_S, MEMBER_SIGNAL_BURST_BYTES)
        self._conns[conn] = _Conn(conn, now, now, bucket, byte_bucket, source=source)
        return []

    def disconnected(self, conn: int, reason: str, now: float) -> list[Action]:
        state = self._conns.pop(conn, None)
        if state is not None and state.waiting is not None:
            session = self._sessions.get(state.waiting)
            if session is not None and conn in session.waiting:
                session.waiting.remove(conn)
        if state is None or state.session is None:
            return []
        return self._leave(state, reason)

    def receive(self, conn: int, message: m.Message, now: float) -> list[Action]:
        state = self._conns.get(conn)
        if state is None:
            return []
        state.last_seen = now
        cost = SIGNAL_FRAME_COST_BYTES + len(getattr(message, "body", b""))
        if not state.bucket.take(1, now) or not state.byte_bucket.take(cost, now):
            return self._refuse(conn, "rate-limited", "too many signaling messages", fatal=True)
        if state.waiting is not None:  # in line for a pending slot: it can only wait
            if isinstance(message, m.Heartbeat):
                return []
            return self._refuse(conn, "not-joined", "wait for the answer to your join", fatal=True)
        if state.session is None:
            if isinstance(message, m.Open):
                return self._open(state, message)
            if isinstance(message, m.Join):
                return self._join(state, message, now)
            if isinstance(message, m.Resume):
                return self._resume(state, message, now)
            return self._refuse(conn, "not-joined", "open or join a session first", fatal=True)
        session = self._sessions[state.session]
        if isinstance(message, m.Heartbeat):
            return []
        if isinstance(message, m.Bye):
            return self._drop(state, "left", "bye")
        if not state.admitted:
            return self._pending(state, session, message)
        is_host = state.rid == 0
        if isinstance(message, m.Send):
            if not is_host and message.to != 0:
                return self._refuse(conn, "forbidden", "members may only send to the host")
            target = session.members.get(message.to)
            if target is None or message.to == state.rid:
                return self._refuse(conn, "no-such-member", f"no member {message.to}")
            return [SendTo(target, m.Deliver(state.rid, message.body))]  # type: ignore[arg-type]
        if isinstance(message, m.EdgeRequest):
            return self._edge(state, session, message.peer, now)
        if isinstance(message, m.EdgeResume):
            return self._edge_resume(state, session, message, now)
        if is_host and isinstance(message, m.Kick):
            target = session.members.get(message.rid)
            kicked = self._conns.get(target) if target is not None else None
            if kicked is None or message.rid == 0:
                return []  # an id that is already gone (or the host itself): nothing to do
            return [SendTo(target, m.Error("kicked", "the host removed you from the session")),  # type: ignore[arg-type]
                    *self._drop(kicked, "kicked by host", "kicked")]
        if is_host and isinstance(message, m.Admit):
            if message.rid in session.pending:
                session.pending.discard(message.rid)
                admitted = self._conns[session.members[message.rid]]
                admitted.admitted = True
                self.relay.add_member(session.tokens[message.rid], session.nameplate, message.rid)
            return []  # admitting an id that is gone or already admitted: nothing to do
        if is_host and isinstance(message, m.CloseNameplate):
            session.open_for_joins = False
            return []
        if is_host and isinstance(message, m.Reopen):
            return self._reopen(state, session, message.nameplate)
        return self._refuse(conn, "unexpected", f"unexpected {type(message).__name__}")

    def tick(self, now: float) -> list[Action]:
        """Expire silent members, pending ids never admitted, connections that never said hello."""
        actions: list[Action] = []
        for state in list(self._conns.values()):
            if state.conn not in self._conns:
                continue  # dropped with its session during this tick
            if state.waiting is not None:
                if now - state.joined_at > JOIN_WAIT_S:
                    actions += self._refuse(state.conn, "busy", "too many joins at once; try again in a moment",
                                            fatal=True)  # fmt: skip
            elif state.session is None and now - state.opened_at > HELLO_TIMEOUT_S:
                del self._conns[state.conn]
                actions.append(CloseConn(state.conn, "no hello"))
            elif state.session is not None and now - state.last_seen > MEMBER_SILENT_S:
                actions += self._drop(state, "connection lost (no heartbeat)", "silent")
            elif state.session is not None and not state.admitted and now - state.joined_at > PENDING_TIMEOUT_S:
                actions.append(SendTo(state.conn, m.Error("not-admitted", "the host did not admit you in time")))
                actions += self._drop(state, "not admitted in time", "not admitted")
            elif state.session is not None and not state.admitted and not state.began \
                    and now - state.joined_at > PAKE_START_S:
                actions.append(SendTo(state.conn, m.Error("no-pake", f"no PAKE within {PAKE_START_S:g} s")))  # may retry
                actions += self._drop(state, "no PAKE in time", "no PAKE in time")
        for session in list(self._sessions.values()):
            actions += self._next_in_line(session, now)
            notice = session.refused.report(now, "joins refused from {source} in the last minute "
                                            "(too many at once from one address, or the line was full)")
            if notice and session.host_conn in self._conns:
                actions.append(SendTo(session.host_conn, m.Notice(notice[: m.MAX_REASON_CHARS])))
        scans = self._unknown.report(now)
        if scans:
            actions.append(Log(scans))
        for session in self._sessions.values():
            for edge_id in [e for e, (_, _, at) in session.edge_claims.items() if now - at > EDGE_CLAIM_TTL_S]:
                del session.edge_claims[edge_id]
        self.relay.expire(now)
        return actions

    # transitions
    def _refuse(self, conn: int, code: str, reason: str, *, fatal: bool = False) -> list[Action]:
        self.rejected += 1
        actions: list[Action] = [SendTo(conn, m.Error(code, reason))]
        if fatal:
            state = self._conns.get(conn)
            if state is not None:
                actions += self._drop(state, reason, reason)
            else:
                actions.append(CloseConn(conn, reason))
        return actions

    def _drop(self, state: _Conn, leave_reason: str, close_reason: str) -> list[Action]:
        """Remove a connection everywhere: registry, its session, the relay; then close it."""
        self._conns.pop(state.conn, None)
        actions = self._leave(state, leave_reason) if state.session is not None else []
        return [*actions, CloseConn(state.conn, close_reason)]

    def _pending(self, state: _Conn, session: _Session, message: m.Message) -> list[Action]:
        """A pending id may only send a few bodies to the host."""
        if not isinstance(message, m.Send):
            return self._refuse(state.conn, "not-admitted",
                                f"{type(message).__name__} before the host admitted you", fatal=True)
        if message.to != 0:
            return self._refuse(state.conn, "forbidden", "members may only send to the host", fatal=True)
        state.pending_bodies += 1
        state.began = True
        state.pending_bytes += len(message.body)
        if state.pending_bodies > PENDING_BODIES_MAX or state.pending_bytes > PENDING_BYTES_MAX:
            return self._refuse(state.conn, "not-admitted", "too much before the host admitted you",
                                fatal=True)
        assert state.rid is not None
        return [SendTo(session.host_conn, m.Deliver(state.rid, message.body))]

    def _open(self, state: _Conn, message: m.Open) -> list[Action]:
        if len(self._sessions) >= self.max_sessions:
            return self._refuse(state.conn, "full", "the rendezvous is full", fatal=True)
        if message.resume_key and len(message.resume_key) != m.RESUME_KEY_BYTES:
            return self._refuse(state.conn, "malformed", "a resume key must be 32 bytes", fatal=True)
        nameplate = self._free_nameplate()
        if not nameplate:
            return self._refuse(state.conn, "full", "no free nameplate", fatal=True)
        session = _Session(nameplate, state.conn, resume_key=message.resume_key)
        self._sessions[nameplate] = session
        token = self._add_member(session, state, 0)
        self._admit_host(state, session, token)
        return [SendTo(state.conn, m.Opened(nameplate, 0, token, self.stun_port2))]

    def _free_nameplate(self, wanted: int = 0) -> int:
        """A nameplate neither a session nor a join alias holds (`wanted` if free); 0: none."""
        tries = [wanted] if wanted else []
        for candidate in itertools.chain(tries, (1 + self._random_below(MAX_NAMEPLATE) for _ in range(100))):
            if candidate not in self._sessions and candidate not in self._aliases:
                return candidate
        return 0

    def _reopen(self, state: _Conn, session: _Session, wanted: int) -> list[Action]:
        """The host's fresh code: joins go to a new nameplate from now on; the old one is closed."""
        if session.join_plate != session.nameplate and wanted == session.join_plate:
            session.open_for_joins = True  # the one it has (the host re-claims it after a resume)
            return [SendTo(state.conn, m.Reopened(wanted))]
        plate = self._free_nameplate(wanted)
        if not plate:
            return self._refuse(state.conn, "full", "no free nameplate")
        self._aliases.pop(session.join_plate, None)
        session.join_plate, session.open_for_joins = plate, True
        if plate != session.nameplate:
            self._aliases[plate] = session.nameplate
        return [SendTo(state.conn, m.Reopened(plate))]

    def _admit_host(self, state: _Conn, session: _Session, token: bytes) -> None:
        state.admitted = True
        state.bucket = TokenBucket(HOST_SIGNAL_FRAMES_PER_S, HOST_SIGNAL_BURST_FRAMES)
        state.byte_bucket = TokenBucket(HOST_SIGNAL_BYTES_PER_S, HOST_SIGNAL_BURST_BYTES)
        self.relay.add_member(token, session.nameplate, 0)

    def _resume(self, state: _Conn, message: m.Resume, now: float) -> list[Action]:
        """A member (or the host) back on a new connection; see the module's docstring."""
        session = self._sessions.get(self._aliases.get(message.nameplate, message.nameplate))
        if self.relay.has_token(message.relay_token) and (
                session is None or session.tokens.get(message.rid) != message.relay_token):
            return self._refuse(state.conn, "bad-resume", "that relay token belongs to someone else", fatal=True)
        if message.rid == 0:
            if session is None:  # a restarted rendezvous: the host re-creates its session
                if len(self._sessions) >= self.max_sessions:
                    return self._refuse(state.conn, "full", "the rendezvous is full", fatal=True)
                session = _Session(message.nameplate, state.conn, resume_key=message.proof,
                                   next_rid=RESUMED_RID_BASE)  # fmt: skip
                self._sessions[message.nameplate] = session
            elif not (session.resume_key and hmac.compare_digest(session.resume_key, message.proof)):
                return self._refuse(state.conn, "bad-resume", f"nameplate {message.nameplate} is another "
                                    "session's now", fatal=True)  # fmt: skip
            closed = self._replace_conn(session, 0, message.relay_token)
            session.host_conn = state.conn
            self._attach(session, state, 0, message.relay_token)
            self._admit_host(state, session, message.relay_token)
            return [*closed, SendTo(state.conn, m.Resumed(self.stun_port2))]
        if session is None:  # the host has not resumed yet (or the session is over): ask again
            return self._refuse(state.conn, "unknown-nameplate",
                                f"no session with nameplate {message.nameplate}", fatal=True)
        expected = m.resume_proof(session.resume_key, session.nameplate, message.rid)
        if not session.resume_key or not hmac.compare_digest(expected, message.proof):
            return self._refuse(state.conn, "bad-resume", "that resume proof is not this session's", fatal=True)
        if message.rid in session.gone:
            return self._refuse(state.conn, "left", "the host was told you left the session", fatal=True)
        if message.rid in session.pending:
            return self._refuse(state.conn, "bad-resume", f"id {message.rid} is another joiner's", fatal=True)
        if len(session.members) >= MAX_MEMBERS_PER_SESSION and message.rid not in session.members:
            return self._refuse(state.conn, "full", "the session is full", fatal=True)
        closed = self._replace_conn(session, message.rid, message.relay_token)
        self._attach(session, state, message.rid, message.relay_token)
        state.admitted = True
        self.relay.add_member(message.relay_token, session.nameplate, message.rid)
        return [*closed, SendTo(state.conn, m.Resumed(self.stun_port2))]

    def _replace_conn(self, session: _Session, rid: int, token: bytes) -> list[Action]:
        """An older connection of a member that just proved it is rid again ends quietly (no
        PeerLeft: the member has not left); its relay binding and edges stay if the token does."""
        old = session.members.pop(rid, None)
        previous = session.tokens.pop(rid, None)
        if previous is not None and previous != token:
            self.relay.remove_member(previous)
        if old is None or self._conns.pop(old, None) is None:
            return []
        return [CloseConn(old, "resumed on another connection")]

    def _attach(self, session: _Session, state: _Conn, rid: int, token: bytes) -> None:
        state.session, state.rid = session.nameplate, rid
        session.members[rid] = state.conn
        session.tokens[rid] = token

    def _edge_resume(self, state: _Conn, session: _Session, message: m.EdgeResume, now: float) -> list[Action]:
        """One end of a relay edge the relay may have lost; the other end's claim allocates it."""
        assert state.rid is not None
        if self.relay.has_edge(message.edge_id) or message.peer == state.rid:
            return []  # the relay still has it (it never restarted), or nonsense: nothing to do
        claim = session.edge_claims.get(message.edge_id)
        if claim is None:
            if len(session.edge_claims) >= MAX_RELAY_EDGES_PER_SESSION:
                return self._refuse(state.conn, "full", "too many relay edges in this session")
            session.edge_claims[message.edge_id] = (state.rid, message.peer, now)
            return []
        rid, peer, _ = claim
        if (rid, peer) != (message.peer, state.rid):
            return self._refuse(state.conn, "no-such-edge", "that edge was not between you two")
        del session.edge_claims[message.edge_id]
        if rid not in session.tokens or self.relay.edges_in(session.nameplate) >= MAX_RELAY_EDGES_PER_SESSION:
            return []
        self.relay.allocate(message.edge_id, session.nameplate, session.tokens[rid], session.tokens[state.rid], now)
        return []

    def _join(self, state: _Conn, message: m.Join, now: float) -> list[Action]:
        if not self._unknown.allowed(state.source, now):  # a scanner: refused whatever it asks
            return self._refuse(state.conn, "rate-limited", "too many joins to nameplates that do not "
                                "exist from your address; wait a minute and check the code", fatal=True)  # fmt: skip
        session = self._sessions.get(self._aliases.get(message.nameplate, message.nameplate))
        if session is None or not session.open_for_joins or session.join_plate != message.nameplate:
            self._unknown.miss(state.source, now)
            return self._refuse(
                state.conn, "unknown-nameplate",
                f"no open session with nameplate {message.nameplate}", fatal=True,
            )
        if len(session.members) >= MAX_MEMBERS_PER_SESSION:
            return self._refuse(state.conn, "full", "the session is full", fatal=True)
        # "busy", not "full": transient (a pending slot frees within seconds), and a joiner's
        # Member.join asks again by itself
        if self._held_by(session, state.source) >= MAX_PENDING_PER_SOURCE or len(session.waiting) >= MAX_WAITING_JOINS:
            session.refused.add(state.source)
            return self._refuse(state.conn, "busy", "too many joins at once; try again in a moment", fatal=True)
        if len(session.pending) >= MAX_PENDING_PER_SESSION or session.waiting:
            state.waiting, state.joined_at = session.nameplate, now  # in line, in arrival order
            session.waiting.append(state.conn)
            return []
        return self._give_slot(session, state, now)

    def _held_by(self, session: _Session, source: str) -> int:  # pending and waiting joins from source
        conns = [session.members[rid] for rid in session.pending if rid in session.members]
        conns += [c for c in session.waiting if c in self._conns]
        return sum(1 for c in conns if self._conns[c].source == source) if source else 0

    def _next_in_line(self, session: _Session, now: float) -> list[Action]:
        """Free pending slots go to the joins waiting longest (those that left are skipped)."""
        actions: list[Action] = []
        while session.waiting and len(session.pending) < MAX_PENDING_PER_SESSION:
            state = self._conns.get(session.waiting.popleft())
            if state is None or state.waiting != session.nameplate:
                continue
            state.waiting = None
            if len(session.members) >= MAX_MEMBERS_PER_SESSION or not session.open_for_joins:
                actions += self._refuse(state.conn, "full", "the session is full or closed", fatal=True)
                continue
            actions += self._give_slot(session, state, now)
        return actions

    def _give_slot(self, session: _Session, state: _Conn, now: float) -> list[Action]:
        rid = session.next_rid
        session.next_rid += 1
        token = self._add_member(session, state, rid)
        session.pending.add(rid)
        state.joined_at = now
        return [SendTo(state.conn, m.Joined(rid, token, self.stun_port2))]

    def _add_member(self, session: _Session, state: _Conn, rid: int) -> bytes:
        """The relay learns the token only on admission (the host: at once)."""
        token = self._random_bytes(m.RELAY_TOKEN_BYTES)
        self._attach(session, state, rid, token)
        return token

    def _edge(self, state: _Conn, session: _Session, peer: int, now: float) -> list[Action]:
        assert state.rid is not None
        target = session.members.get(peer)
        if target is None or peer == state.rid or peer in session.pending:
            return self._refuse(state.conn, "no-such-member", f"no member {peer} for an edge")
        if self.relay.edges_in(session.nameplate) >= MAX_RELAY_EDGES_PER_SESSION:
            return self._refuse(state.conn, "full", "too many relay edges in this session")
        own = session.tokens[state.rid]
        if self.relay.edges_of(session.nameplate, own) >= MAX_RELAY_EDGES_PER_MEMBER:
            return self._refuse(state.conn, "full", "too many relay edges for one member")
        edge_id = self._random_bytes(m.EDGE_ID_BYTES)
        while self.relay.has_edge(edge_id):
            edge_id = self._random_bytes(m.EDGE_ID_BYTES)
        self.relay.allocate(edge_id, session.nameplate, own, session.tokens[peer], now)
        return [
            SendTo(state.conn, m.EdgeAllocated(edge_id, peer, True)),
            SendTo(target, m.EdgeAllocated(edge_id, state.rid, False)),
        ]

    def _leave(self, state: _Conn, reason: str) -> list[Action]:
        session = self._sessions.get(state.session) if state.session is not None else None
        if session is None or state.rid is None or session.members.get(state.rid) != state.conn:
            return []
        session.members.pop(state.rid, None)
        session.pending.discard(state.rid)
        token = session.tokens.pop(state.rid, None)
        if token is not None:
            self.relay.remove_member(token)
        if state.rid != 0:
            session.gone.add(state.rid)
            if session.host_conn in self._conns:
                return [SendTo(session.host_conn, m.PeerLeft(state.rid, reason[:m.MAX_REASON_CHARS]))]
            return []
        # the host left: the session is over
        del self._sessions[session.nameplate]
        self._aliases.pop(session.join_plate, None)
        actions: list[Action] = []
        for rid, conn in session.members.items():
            self._conns.pop(conn, None)
            token = session.tokens.pop(rid, None)
            if token is not None:
                self.relay.remove_member(token)
            actions.append(SendTo(conn, m.SessionClosed("the host left the session")))
            actions.append(CloseConn(conn, "session closed"))
        return actions
