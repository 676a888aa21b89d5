"""Sans-I/O host admission: one unconfirmed PAKE at a time, and none after a failed one.

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

Inputs: `receive(rid, body, now)`, `left(rid)`, `tick(now)`; each returns actions for the
asyncio layer: `SendBody(rid, body)`, `Drop(rid, reason)` (Kick at the rendezvous),
`CloseNameplate()`, and `Confirmed(rid, channel, hello)` (the caller validates the hello, then
admits the id at the rendezvous). Ids that were confirmed are none of this machine's business.

    OPEN --PAKE, nobody unconfirmed--> BUSY(rid) --hello opens--> OPEN (Confirmed)
    BUSY --PAKE from another id--> BUSY (queued; beyond QUEUE_MAX: Drop)
    BUSY --timeout / second PAKE / junk--> OPEN (Drop, next queued starts)
    BUSY --hello fails to open--> CLOSED (reject, Drop, CloseNameplate; queue refused)
    CLOSED --PAKE--> CLOSED (reject, Drop)
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kafila.net.handshake import PAKE, SEALED, Pake, SealedChannel, reject
from rendezvous.errors import ProtocolError

PAKE_TIMEOUT_S = 10.0  # from our PAKE answer to the joiner's hello (one round trip, normally)
QUEUE_MAX = 8  # joiners waiting for their turn (the rendezvous lets 4 be pending at once)
OPEN, BUSY, CLOSED = "open", "busy", "closed"
CLOSED_REASON = ("someone tried a wrong code for this session; the host accepts no more joins "
                 "with this code: ask the host for a new one")  # fmt: skip


@dataclass(frozen=True)
class SendBody:
    rid: int
    body: bytes


@dataclass(frozen=True)
class Drop:
    rid: int
    reason: str


@dataclass(frozen=True)
class CloseNameplate:
    reason: str


@dataclass(frozen=True)
class Confirmed:
    rid: int
    channel: SealedChannel
    hello: dict


Action = SendBody | Drop | CloseNameplate | Confirmed


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
        self.state = OPEN
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
        self.state = BUSY
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
            self.state = CLOSED
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
        self.state = OPEN
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
        self.state = OPEN
        actions: list[Action] = []
        while self._queue and self._current is None:  # a junk one is dropped: on to the next
            rid, body = self._queue.popleft()
            actions += self._start(rid, body, now)
        return actions
