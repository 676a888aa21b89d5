"""Sans-I/O joiner: PAKE with the host, the hello, the welcome, then the host's sealed messages.

Theory of operation. The joiner already has its rendezvous id (messages.Joined) and its own
roster entry (NAT class, candidates, certificate fingerprint). `start(now)` sends the SPAKE2
message; every body the host sends comes back in through `receive(rid, body, now)`:

    S_PAKE   --the host's PAKE answer-->        S_HELLO  (sealed hello sent: it confirms our key)
    S_PAKE   --a reject / junk-->               FAILED   ("the host refused" / "handshake failed")
    S_HELLO  --the sealed welcome-->            JOINED   (Welcomed: our name, group key, roster)
    S_HELLO  --a reject-->                      FAILED   ("wrong code: ..."; the host closed)
    S_HELLO  --a sealed refuse / bad welcome--> FAILED
    JOINED   --roster / app / part-->           JOINED   (RosterUpdated / Message)
    JOINED   --a reject-->                      LEFT     (MemberLeft "removed: ...")
    JOINED   --a body that fails to open-->     LEFT     (MemberLeft, Close: the channel is dead)

`Failed(reason)` ends joining (the caller raises Refused with the reason as it stands); a body
from anyone but the host while joining is a failure too (the rendezvous misrouted it), and one
once joined is ignored (members hear only from the host). `now` is taken for the same shape as
the host's machine: the replies the joiner waits for are bounded by the signaling layer's
timeouts, which can name the rendezvous they waited on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kafila.net.admission import SendBody, app_messages
from kafila.net.admission_messages import Hello, Joining, Refuse, Roster, Welcome, decode, encode, step
from kafila.net.handshake import Pake, SealedChannel, rejection_reason
from kafila.net.pieces import MAX_HOST_MESSAGE_BYTES, Assembler
from kafila.net.roster import MemberInfo, MemberLeft, Message, RosterUpdated, valid_name
from rendezvous.errors import ProtocolError

log = logging.getLogger("kafila.net")
S_PAKE, S_HELLO, JOINED, FAILED, LEFT = Joining.PAKE, Joining.HELLO, Joining.JOINED, Joining.FAILED, Joining.LEFT
HOST_RID = 0


@dataclass(frozen=True)
class Welcomed:
    """The host admitted us: the name it gave us (ours, or `ours-2`), the key of every edge, the
    proof that lets us resume signaling, and whether the rendezvous lives in its process."""

    name: str
    group_key: bytes
    resume_proof: bytes
    embedded: bool
    session: int  # the session's nameplate (its id at the rendezvous, for resume): the code's, or
    # the one the host opened first when this code is a fresh one


@dataclass(frozen=True)
class Failed:
    """Joining failed; `reason` is the one line the person sees."""

    reason: str


@dataclass(frozen=True)
class Close:
    """The channel to the host broke after joining: end our signaling (after MemberLeft)."""

    reason: str


Action = SendBody | Welcomed | Failed | Close | Message | MemberLeft | RosterUpdated


class Joiner:
    def __init__(self, code: str, nameplate: int, rid: int, own: MemberInfo) -> None:
        self._pake = Pake(code)
        self._nameplate, self._rid, self._own = nameplate, rid, own
        self.name = own.name  # until the welcome says which name the host gave us
        self.state = S_PAKE
        self.channel: SealedChannel | None = None
        self.channels: dict[int, SealedChannel] = {}  # the host's, once the PAKE is answered
        self.group_key = b""
        self.roster: dict[str, MemberInfo] = {}
        self.names: dict[int, str] = {}  # rid -> name
        self._pieces = Assembler(MAX_HOST_MESSAGE_BYTES)  # the host sends plans and manifests

    @property
    def host_name(self) -> str:
        return self.names.get(HOST_RID, "host")

    # inputs
    def start(self, now: float) -> list[Action]:
        return [SendBody(HOST_RID, self._pake.start())]

    def receive(self, rid: int, body: bytes, now: float) -> list[Action]:
        if self.state in (FAILED, LEFT):
            return []
        if rid != HOST_RID:
            if self.state == JOINED:
                return []
            return self._fail("the rendezvous delivered a message that is not from the host")
        if self.state == S_PAKE:
            return self._answer(body)
        if self.state == S_HELLO:
            return self._welcome(body)
        return self._joined(body)

    # transitions
    def _fail(self, reason: str) -> list[Action]:
        self.state = step(self.state, FAILED)
        return [Failed(reason)]

    def _answer(self, body: bytes) -> list[Action]:
        reason = rejection_reason(body)
        if reason is not None:
            return self._fail(f"the host refused: {reason}")
        try:
            key = self._pake.finish(body)
        except ProtocolError as exc:
            return self._fail(f"session handshake failed: {exc.reason}")
        channel = SealedChannel(key, is_host=False, nameplate=self._nameplate, rid=self._rid)
        self.channel = self.channels[HOST_RID] = channel
        self.state = step(self.state, S_HELLO)
        return [SendBody(HOST_RID, channel.seal(encode(Hello(self._own.to_wire()))))]

    def _welcome(self, body: bytes) -> list[Action]:
        assert self.channel is not None
        reason = rejection_reason(body)
        if reason is not None:  # the host could not open our hello: a different key
            return self._fail(f"wrong code: {reason}")
        try:
            welcome = decode(self.channel.open(body))
            if isinstance(welcome, Refuse):
                return self._fail(f"the host refused: {welcome.reason}")
            if not isinstance(welcome, Welcome):
                raise ProtocolError("malformed", "expected the host's welcome")
            name = welcome.name  # ours, or `ours-2` when another has ours
            if not valid_name(name):
                raise ProtocolError("malformed", "bad name in the welcome")
            self._set_roster(welcome.members)
        except ProtocolError as exc:
            return self._fail(f"the host's reply failed authentication ({exc.reason}): wrong code, "
                              "or the rendezvous tampered with it")  # fmt: skip
        self.name, self.group_key = name, welcome.key
        self.state = step(self.state, JOINED)
        return [Welcomed(name, self.group_key, welcome.resume, welcome.embedded, welcome.session or self._nameplate)]

    def _joined(self, body: bytes) -> list[Action]:
        assert self.channel is not None
        refusal = rejection_reason(body)
        if refusal is not None:
            log.error("%s: the host removed us: %s", self.name, refusal)
            self.state = step(self.state, LEFT)
            return [MemberLeft(self.host_name, f"removed: {refusal}")]
        try:
            sealed = decode(self.channel.open(body))
            if isinstance(sealed, Roster):
                self._set_roster(sealed.members)
                return [RosterUpdated(dict(self.roster))]
            return list(app_messages(self._pieces, self.names.get(HOST_RID, str(HOST_RID)), sealed))
        except ProtocolError as exc:
            self.state = step(self.state, LEFT)
            return [MemberLeft(self.host_name, f"authentication failure: {exc.reason}"), Close(exc.reason)]

    def _set_roster(self, members: list) -> None:
        roster = {}
        for item in members:
            info = MemberInfo.from_wire(item)
            roster[info.name] = info
        self.roster = roster
        self.names = {info.peer_id: info.name for info in roster.values()}
