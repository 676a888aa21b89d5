"""Sans-I/O host admission: one unconfirmed PAKE at a time, none after a failed one; then the roster.

Theory of operation. Every joiner is a guess at the code until it proves otherwise: it sends a
SPAKE2 message, the host answers with its own, and the joiner's first sealed message (the hello)
either opens under the shared key (the joiner knew the words: *confirmed*) or does not (a wrong
guess). An online attacker, a stranger who knows the nameplate or a malicious rendezvous, learns
whether one guess was right per PAKE the host answers, so the host:

  * answers one PAKE at a time: the next joiner waits in a short queue until the one before it
    confirmed, failed, or ran out of PAKE_TIMEOUT_S (a timeout is not a guess: nothing sealed
    under the key left the host, so the stalled id learned nothing and is only dropped);
  * stops answering after the first failed confirmation (state CLOSED): every queued and later
    PAKE is refused, and joining needs a new code, as magic-wormhole does. With 3 words (24 bits)
    that is one 1-in-16-million guess per code; `--words 4` makes it 1 in 4 billion;
  * drops, without closing anything, ids that send junk instead of a PAKE message (a body that
    is no SPAKE2 element tests no password), a second PAKE, or anything else before confirming.

Two machines. `HostAdmission` is that PAKE gate alone: `receive(rid, body, now)`, `left(rid)`,
`tick(now)` return `SendBody(rid, body)`, `Drop(rid, reason)` (Kick at the rendezvous),
`CloseNameplate()` and `Confirmed(rid, channel, hello)`.

    OPEN --PAKE, nobody unconfirmed--> BUSY(rid) --hello opens--> OPEN (Confirmed)
    BUSY --PAKE from another id--> BUSY (queued; beyond QUEUE_MAX: Drop)
    BUSY --timeout / second PAKE / junk--> OPEN (Drop, next queued starts)
    BUSY --hello fails to open--> CLOSED (reject, Drop, CloseNameplate; queue refused)
    CLOSED --PAKE--> CLOSED (reject, Drop)

`HostSession` is the host's whole side of membership. It runs a HostAdmission and, for each id,
moves it through

    JOINING (in admission) --Confirmed, valid hello--> MEMBER --PeerLeft / kick--> DEPARTED
    JOINING --Confirmed, bad hello--> (sealed refuse, Kick; back to admission's hands)

A valid hello gets a distinct name (`vm-2` when `vm` is taken), `Admit(rid)` (before the welcome:
the member may open edges once welcomed), the sealed welcome (group key, its name, the roster,
its resume proof), a roster to every other member and `MemberJoined`. A member's sealed bodies
become `Message`s (whole, or reassembled from pieces); one that fails to open or breaks the
piece rules is kicked (`reject`, `Kick`, roster to the rest, `MemberLeft`). A DEPARTED id that
speaks again (it resumed into a restarted rendezvous) is only dropped. Session events
(roster.MemberJoined, MemberLeft, Message, RosterUpdated) are actions too: the caller queues them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass

from kafila.net.admission_messages import (
    MAX_REASON_CHARS,
    Admission,
    AdmissionMessage,
    App,
    Hello,
    Membership,
    Part,
    Refuse,
    Roster,
    Welcome,
    decode,
    encode,
    step,
)
from kafila.net.handshake import PAKE, SEALED, Pake, SealedChannel, reject
from kafila.net.pieces import MAX_MEMBER_MESSAGE_BYTES, PIECE_BYTES, Assembler, split, unpack
from kafila.net.roster import MemberInfo, MemberJoined, MemberLeft, Message, SessionEvent, distinct_name
from rendezvous.errors import ProtocolError
from rendezvous.messages import resume_proof

log = logging.getLogger("kafila.net")

PAKE_TIMEOUT_S = 10.0  # from our PAKE answer to the joiner's hello (one round trip, normally)
QUEUE_MAX = 8  # joiners waiting for their turn (the rendezvous lets 4 be pending at once)
OPEN, BUSY, CLOSED = Admission.OPEN, Admission.BUSY, Admission.CLOSED
CLOSED_REASON = ("someone tried a wrong code for this session; the host accepts no more joins "
                 "with this code: ask the host for a new one")  # fmt: skip


@dataclass(frozen=True)
class SendBody:
    """A body for rid through the rendezvous (messages.Send)."""

    rid: int
    body: bytes


@dataclass(frozen=True)
class Drop:
    """A joiner that is not a member: Kick it at the rendezvous (quietly: strangers are normal)."""

    rid: int
    reason: str


@dataclass(frozen=True)
class Kick:
    """A member, or a joiner that knew the code, removed: Kick it, and say why (a warning)."""

    rid: int
    reason: str


@dataclass(frozen=True)
class CloseNameplate:
    reason: str


@dataclass(frozen=True)
class Admit:
    """rid confirmed the PAKE and its hello is good: the rendezvous may let it open edges."""

    rid: int


@dataclass(frozen=True)
class Confirmed:
    """HostAdmission's: rid's hello opened under the key (HostSession validates the hello)."""

    rid: int
    channel: SealedChannel
    hello: dict


Action = SendBody | Drop | Kick | CloseNameplate | Admit | Confirmed | SessionEvent


@dataclass
class _Current:
    rid: int
    channel: SealedChannel
    deadline: float


class HostAdmission:
    def __init__(self, code: str, nameplate: int, *, pake_timeout_s: float = PAKE_TIMEOUT_S,
                 queue_max: int = QUEUE_MAX) -> None:
        self._code = code
        self._nameplate = nameplate
        self.pake_timeout_s = pake_timeout_s
        self.queue_max = queue_max
        self.state = Admission.OPEN
        self._current: _Current | None = None
        self._queue: collections.deque[tuple[int, bytes]] = collections.deque()
        self.answered = 0  # PAKEs this host answered (each at most one guess)
        self.failed_confirmations = 0
        self.dropped = 0

    @property
    def current(self) -> int | None:
        return self._current.rid if self._current else None

    def is_waiting(self, rid: int) -> bool:
        """Whether rid is in admission (running its PAKE, or queued for it)."""
        return self.current == rid or any(r == rid for r, _ in self._queue)

    def waiting_ids(self) -> list[int]:
        """Every id in admission: the one running its PAKE, then the queue."""
        return ([self._current.rid] if self._current else []) + [r for r, _ in self._queue]

    def next_deadline(self) -> float | None:
        return self._current.deadline if self._current else None

    # inputs
    def receive(self, rid: int, body: bytes, now: float) -> list[Action]:
        """A body from an id that is not (yet) a confirmed member."""
        current = self._current
        if current is not None and rid == current.rid:
            if body[:1] == SEALED:
                return self._confirm(current, body, now)
            return self._drop(rid, "a second PAKE message" if body[:1] == PAKE else
                              "expected the sealed hello", now)  # fmt: skip
        if self.is_waiting(rid):
            self._queue = collections.deque((r, b) for r, b in self._queue if r != rid)
            return self._drop(rid, "a second message before its turn", now)
        if body[:1] != PAKE:
            return self._drop(rid, "expected a PAKE message", now)
        if self.state == CLOSED:
            self.dropped += 1
            return [SendBody(rid, reject(CLOSED_REASON)), Drop(rid, "the code was already guessed at")]
        if current is not None:
            if len(self._queue) >= self.queue_max:
                return self._drop(rid, "too many joins at once", now)
            self._queue.append((rid, body))
            return []
        return self._start(rid, body, now)

    def left(self, rid: int, now: float) -> list[Action]:
        """rid's connection ended (PeerLeft): forget it; the next queued joiner may start."""
        self._queue = collections.deque((r, b) for r, b in self._queue if r != rid)
        if self._current is not None and self._current.rid == rid:
            self._current = None
            return self._next(now)
        return []

    def tick(self, now: float) -> list[Action]:
        current = self._current
        if current is not None and now >= current.deadline:
            return self._drop(current.rid, f"no PAKE confirmation within {self.pake_timeout_s:g} s", now)
        return []

    # transitions
    def _start(self, rid: int, body: bytes, now: float) -> list[Action]:
        pake = Pake(self._code)
        answer = pake.start()
        try:
            key = pake.finish(body)  # before answering: junk gets nothing from us
        except ProtocolError as exc:
            return self._drop(rid, exc.reason, now)
        channel = SealedChannel(key, is_host=True, nameplate=self._nameplate, rid=rid)
        self._current = _Current(rid, channel, now + self.pake_timeout_s)
        self.state = step(self.state, BUSY)
        self.answered += 1
        return [SendBody(rid, answer)]

    def _confirm(self, current: _Current, body: bytes, now: float) -> list[Action]:
        self._current = None
        try:
            hello = current.channel.open(body)
        except ProtocolError as exc:
            if current.channel.opened:  # it decrypted: the right code, a malformed message
                return [Drop(current.rid, f"a bad hello ({exc.reason})"), *self._next(now)]
            # a wrong guess (or a rendezvous that altered the hello): no more PAKEs for this code
            self.state = step(self.state, CLOSED)
            self.failed_confirmations += 1
            actions: list[Action] = [
                SendBody(current.rid, reject("the host could not verify your code; the nameplate is now closed")),
                Drop(current.rid, "failed PAKE confirmation (wrong code)"),
                CloseNameplate(CLOSED_REASON),
            ]
            for rid, _ in self._queue:
                actions += [SendBody(rid, reject(CLOSED_REASON)), Drop(rid, "the code was guessed at")]
            self.dropped += len(self._queue) + 1
            self._queue.clear()
            return actions
        self.state = step(self.state, OPEN)
        return [Confirmed(current.rid, current.channel, hello), *self._next(now)]

    def _drop(self, rid: int, reason: str, now: float) -> list[Action]:
        self.dropped += 1
        actions: list[Action] = [Drop(rid, reason)]
        if self._current is not None and self._current.rid == rid:
            self._current = None
            actions += self._next(now)
        return actions

    def _next(self, now: float) -> list[Action]:
        if self.state == CLOSED:
            return []
        self.state = step(self.state, OPEN)
        actions: list[Action] = []
        while self._queue and self._current is None:  # a junk one is dropped: on to the next
            rid, body = self._queue.popleft()
            actions += self._start(rid, body, now)
        return actions


def sealed_bodies(channel: SealedChannel, message: object, packed: bytes) -> list[bytes]:
    """An application message (`packed`: it, msgpack'd) as sealed bodies: one "app", or its
    pieces when larger than PIECE_BYTES (send them all before anything else: they never
    interleave with another message's, so the receiver needs no message ids)."""
    if len(packed) <= PIECE_BYTES:
        return [channel.seal(encode(App(message)))]
    return [channel.seal(encode(part)) for part in split(packed)]


def app_messages(pieces: Assembler, sender: str, sealed: AdmissionMessage) -> list[Message]:
    """The application message an opened body completes, if any: an App whole, or the last Part
    of one in pieces (pieces.py; raises ProtocolError on a broken sequence)."""
    if isinstance(sealed, App):
        pieces.whole()
        return [Message(sender, sealed.body)]
    if isinstance(sealed, Part):
        packed = pieces.feed(sealed)
        if packed is not None:
            return [Message(sender, unpack(packed, pieces.max_bytes))]
    return []


JOINING, MEMBER, DEPARTED, UNKNOWN = Membership.JOINING, Membership.MEMBER, Membership.DEPARTED, Membership.UNKNOWN


class HostSession:
    """The host's side of membership (see the module's theory of operation). Keys come in as
    arguments (the caller draws them): `group_key` for edges, `resume_key` for resume proofs."""

    def __init__(self, code: str, nameplate: int, own: MemberInfo, *, group_key: bytes,
                 resume_key: bytes, embedded: bool = False, admission: HostAdmission | None = None) -> None:
        self.admission = admission or HostAdmission(code, nameplate)
        self.nameplate = nameplate
        self.group_key = group_key
        self._resume_key = resume_key
        self._embedded = embedded  # the rendezvous runs in our process: members learn it in the welcome
        self.roster: dict[str, MemberInfo] = {own.name: own}
        self.names: dict[int, str] = {own.peer_id: own.name}  # rid -> name
        self.channels: dict[int, SealedChannel] = {}  # rid -> channel, one per admitted member
        self.departed: set[int] = set()
        self._pieces: dict[int, Assembler] = {}  # rid -> its message in pieces

    def state_of(self, rid: int) -> Membership:
        if rid in self.departed:
            return DEPARTED
        if rid in self.channels:
            return MEMBER
        return JOINING if self.admission.is_waiting(rid) else UNKNOWN

    # inputs
    def receive(self, rid: int, body: bytes, now: float) -> list[Action]:
        """A body from rid (messages.Deliver)."""
        if rid in self.departed:
            return [Drop(rid, "it left; an id that resumed after that is not taken back")]
        channel = self.channels.get(rid)
        if channel is None:  # not admitted: a PAKE, or its hello
            return self._admitted(self.admission.receive(rid, body, now))
        try:
            sealed = channel.open(body)
            if rid not in self._pieces:  # members send little: a few small messages, bounded
                self._pieces[rid] = Assembler(MAX_MEMBER_MESSAGE_BYTES)
            return list(app_messages(self._pieces[rid], self.names.get(rid, str(rid)), decode(sealed)))
        except ProtocolError as exc:
            return self.kick(rid, f"authentication failure: {exc.reason}")

    def left(self, rid: int, reason: str, now: float) -> list[Action]:
        """rid's signaling connection ended (messages.PeerLeft)."""
        return [*self._admitted(self.admission.left(rid, now)), *self._gone(rid, reason)]

    def tick(self, now: float) -> list[Action]:
        return self._admitted(self.admission.tick(now))

    def reopen(self, code: str, nameplate: int) -> list[Action]:
        """A fresh code (joins use `nameplate` now: after a wrong guess, or the host asked): a new
        admission with its own one guess; ids in the old one are dropped, members stay."""
        old = self.admission
        self.admission = HostAdmission(code, nameplate, pake_timeout_s=old.pake_timeout_s, queue_max=old.queue_max)
        return [Drop(rid, "the host opened a new code") for rid in old.waiting_ids()]

    def kick(self, rid: int, reason: str) -> list[Action]:
        """Remove member rid: it hears why (plain: its channel may be what failed), the rest get
        the roster without it."""
        self.channels.pop(rid, None)
        return [SendBody(rid, reject(reason)), Kick(rid, reason), *self._gone(rid, reason)]

    # transitions
    def _admitted(self, actions: list[Action]) -> list[Action]:
        """Admission's actions, with each Confirmed replaced by what admitting it takes (in place:
        the welcome goes before the next joiner's PAKE answer, as the machine ordered them)."""
        out: list[Action] = []
        for action in actions:
            out += self._hello(action) if isinstance(action, Confirmed) else [action]
        return out

    def _hello(self, confirmed: Confirmed) -> list[Action]:
        rid, channel, hello = confirmed.rid, confirmed.channel, confirmed.hello
        try:
            message = decode(hello)
            if not isinstance(message, Hello):
                raise ProtocolError("malformed", "expected a hello with a member entry")
            info = MemberInfo.from_wire({**message.member, "rid": rid})
        except ProtocolError as exc:
            refuse = channel.seal(encode(Refuse(f"bad hello: {exc.reason}"[:MAX_REASON_CHARS])))
            return [SendBody(rid, refuse), Kick(rid, f"a bad hello ({exc.reason})")]
        name = distinct_name(info.name, self.roster)
        if name != info.name:
            log.info("member %d: the name %r is taken; it joins as %r", rid, info.name, name)
            info = dataclasses.replace(info, name=name)
        self.channels[rid] = channel
        self.names[rid] = name
        self.roster[name] = info
        welcome = Welcome(self.group_key, name, self._roster_wire(), resume_proof(self._resume_key, self.nameplate, rid),
                          self._embedded, self.nameplate)  # session: resume with it, whichever code it joined by
        return [Admit(rid), SendBody(rid, channel.seal(encode(welcome))), *self._broadcast(exclude=rid),
                MemberJoined(info)]

    def _gone(self, rid: int, reason: str) -> list[Action]:
        self.departed.add(rid)
        self.channels.pop(rid, None)
        self._pieces.pop(rid, None)
        name = self.names.pop(rid, None)
        if name is None:  # a joiner that never got in: nobody to tell
            return []
        self.roster.pop(name, None)
        return [*self._broadcast(), MemberLeft(name, reason)]

    def _roster_wire(self) -> list[dict]:
        return [info.to_wire() for info in self.roster.values()]

    def _broadcast(self, exclude: int | None = None) -> list[Action]:
        members = self._roster_wire()
        return [SendBody(rid, channel.seal(encode(Roster(members))))
                for rid, channel in self.channels.items() if rid != exclude and rid in self.names]
