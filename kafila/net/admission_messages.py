"""Admission's sealed messages, host ↔ joiner/member: typed, frozen, bounded, and the states of
admission's machines as enums with their transition tables.

They ride inside the sealed signaling channel (handshake.SealedChannel: msgpack maps, the kind
in "t"), under the PAKE's key:

    hello    joiner → host    member: its roster entry (roster.MemberInfo.from_wire checks it)
    welcome  host → joiner    key, name, members, resume, embedded, session
    refuse   host → joiner    reason: its hello was not taken
    roster   host → member    members: the roster's entries
    app      either way       body: one application message (a control message)
    part     either way       i, n, size, data: one piece of a larger one (pieces.py)

`encode(msg) -> dict` and `decode(obj) -> message` are the only ways across; decode returns a
valid message or raises ProtocolError("malformed", one line). A field an older peer does not send
takes the default the receiver used before (a welcome without `session`: the code's nameplate).
What a field means beyond its type and bound is checked where it is used (a roster entry by
MemberInfo.from_wire, pieces by pieces.Assembler). No I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, ClassVar

from rendezvous.errors import ProtocolError
from rendezvous.limits import MAX_MEMBERS_PER_SESSION, MAX_NAMEPLATE

GROUP_KEY_BYTES = 32
RESUME_PROOF_BYTES = 32  # rendezvous.messages.RESUME_KEY_BYTES
MAX_NAME_CHARS = 64  # roster.MAX_NAME_CHARS
MAX_REASON_CHARS = 500
MAX_ROSTER = MAX_MEMBERS_PER_SESSION * 2  # entries in one roster (the rendezvous admits fewer)
MAX_PIECES = 1 << 12
MAX_PIECED_BYTES = 1 << 26


class Admission(str, Enum):
    """HostAdmission's PAKE gate (admission.py's theory of operation)."""

    OPEN = "open"  # no PAKE unconfirmed: the next joiner's starts
    BUSY = "busy"  # one PAKE answered, its hello awaited (others queue)
    CLOSED = "closed"  # a wrong guess: this code answers no PAKE again


class Membership(str, Enum):
    """An id as HostSession sees it."""

    JOINING = "joining"
    MEMBER = "member"
    DEPARTED = "departed"
    UNKNOWN = "unknown"


class Joining(str, Enum):
    """The joiner's side (joining.py)."""

    PAKE = "pake"
    HELLO = "hello"
    JOINED = "joined"
    FAILED = "failed"
    LEFT = "left"


TRANSITIONS: dict[Enum, frozenset[Enum]] = {
    Admission.OPEN: frozenset({Admission.BUSY}),
    Admission.BUSY: frozenset({Admission.OPEN, Admission.CLOSED}),
    Admission.CLOSED: frozenset(),  # a fresh code is a fresh HostAdmission
    Joining.PAKE: frozenset({Joining.HELLO, Joining.FAILED}),
    Joining.HELLO: frozenset({Joining.JOINED, Joining.FAILED}),
    Joining.JOINED: frozenset({Joining.LEFT}),
    Joining.FAILED: frozenset(),
    Joining.LEFT: frozenset(),
}


def step(current: Enum, to: Enum) -> Enum:
    """`to`, if the table allows it from `current` (staying put is always allowed)."""
    if to is not current and to not in TRANSITIONS[current]:
        raise AssertionError(f"admission: {current.value} → {to.value} is not a transition")
    return to


def _int(v: object, name: str, low: int, high: int) -> int:
    if type(v) is not int or not low <= v <= high:
        raise ProtocolError("malformed", f"{name} must be an integer in {low}..{high}")
    return v


def _bytes(v: object, name: str, sizes: tuple[int, ...] | int) -> bytes:
    ok = type(v) is bytes and (len(v) in sizes if isinstance(sizes, tuple) else len(v) <= sizes)
    if not ok:
        raise ProtocolError("malformed", f"{name} must be bytes of {sizes} bytes")
    return v  # type: ignore[return-value]


def _text(v: object, name: str, limit: int) -> str:
    if type(v) is not str or len(v) > limit:
        raise ProtocolError("malformed", f"{name} must be text of at most {limit} characters")
    return v


def _entries(v: object) -> list:
    if not isinstance(v, list) or len(v) > MAX_ROSTER:
        raise ProtocolError("malformed", f"members must be a list of at most {MAX_ROSTER} entries")
    return v


@dataclass(frozen=True)
class Hello:
    T: ClassVar[str] = "hello"
    member: dict  # roster.MemberInfo.to_wire()

    @classmethod
    def from_wire(cls, d: Mapping) -> Hello:
        if not isinstance(d.get("member"), dict):
            raise ProtocolError("malformed", "expected a hello with a member entry")
        return cls(d["member"])


@dataclass(frozen=True)
class Welcome:
    T: ClassVar[str] = "welcome"
    key: bytes  # the group key of every edge
    name: str  # ours, or `ours-2` when another member has ours
    members: list  # roster entries
    resume: bytes = b""  # rendezvous.messages.resume_proof for us; empty: we cannot resume
    embedded: bool = False  # the rendezvous runs in the host's process
    session: int = 0  # the session's nameplate (its id at the rendezvous); 0: the code's

    @classmethod
    def from_wire(cls, d: Mapping) -> Welcome:
        return cls(_bytes(d.get("key"), "key", (GROUP_KEY_BYTES,)), _text(d.get("name"), "name", MAX_NAME_CHARS),
                   _entries(d.get("members")), _bytes(d.get("resume", b""), "resume", (0, RESUME_PROOF_BYTES)),
                   d.get("embedded") is True, _int(d.get("session", 0), "session", 0, MAX_NAMEPLATE))  # fmt: skip


@dataclass(frozen=True)
class Refuse:
    T: ClassVar[str] = "refuse"
    reason: str

    @classmethod
    def from_wire(cls, d: Mapping) -> Refuse:
        return cls(_text(d.get("reason"), "reason", MAX_REASON_CHARS))


@dataclass(frozen=True)
class Roster:
    T: ClassVar[str] = "roster"
    members: list

    @classmethod
    def from_wire(cls, d: Mapping) -> Roster:
        return cls(_entries(d.get("members")))


@dataclass(frozen=True)
class App:
    T: ClassVar[str] = "app"
    body: Any  # a control message (kafila.session.control.messages decodes it)

    @classmethod
    def from_wire(cls, d: Mapping) -> App:
        return cls(d.get("body"))


@dataclass(frozen=True)
class Part:
    T: ClassVar[str] = "part"
    i: int
    n: int
    size: int
    data: bytes

    @classmethod
    def from_wire(cls, d: Mapping) -> Part:
        try:
            return cls(_int(d.get("i"), "i", 0, MAX_PIECES), _int(d.get("n"), "n", 1, MAX_PIECES),
                       _int(d.get("size"), "size", 0, MAX_PIECED_BYTES), _bytes(d.get("data"), "data", MAX_PIECED_BYTES))
        except ProtocolError:
            raise ProtocolError("malformed", "a message piece needs integer i, n, size and bytes data") from None


AdmissionMessage = Hello | Welcome | Refuse | Roster | App | Part
KINDS: dict[str, type] = {c.T: c for c in (Hello, Welcome, Refuse, Roster, App, Part)}


def encode(msg: AdmissionMessage) -> dict:
    """The map to seal (SealedChannel.seal)."""
    return {"t": msg.T, **{f.name: getattr(msg, f.name) for f in fields(msg)}}


def decode(obj: object) -> AdmissionMessage:
    """An opened sealed message as its type, or ProtocolError("malformed") saying why not."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("t"), str):
        raise ProtocolError("malformed", "an admission message is a map with its kind in 't'")
    cls = KINDS.get(obj["t"])
    if cls is None:
        raise ProtocolError("malformed", f"unknown admission message {obj['t'][:32]!r}")
    return cls.from_wire(obj)
