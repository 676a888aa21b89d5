"""Signaling messages between a member and the rendezvous: typed, frozen, bounded.

Wire format on the member's outbound TCP connection: a 4-byte big-endian length, then a msgpack
array `[tag, field, field, ...]`. `decode()` is the only way in: it returns one of the dataclasses
below or raises `ProtocolError`. Bodies between members (`Send`/`Deliver`) are opaque to the
rendezvous: sealed by the members' session key (see kafila.net.handshake).

Why TCP for signaling (and UDP for everything else): signaling needs reliable, ordered delivery
(the sealed channel numbers its messages and rejects gaps), and a TCP connection that drops tells
the rendezvous at once that a member has gone. STUN, relay frames, punch probes and QUIC share the
member's single UDP socket, where the NAT mappings that matter live.

Roles: a host sends `Open` and gets `Opened`; a member sends `Join` and gets `Joined`. Ids (`rid`)
are assigned by the rendezvous per session; the host is always rid 0. Members may `Send` only to
the host; the host may `Send` to anyone. A joined id is *pending* until the host sends `Admit`
for it (after a confirmed PAKE): a pending id may send only a few small bodies to the host.

Resume (signaling that survives a rendezvous restart or a dropped connection): the host's `Open`
carries a resume key it drew itself; the host hands each admitted member, inside the sealed
welcome, `resume_proof(key, nameplate, rid)`. A member whose connection ended sends `Resume` on a
new one (the host proves itself with the key), and a rendezvous that restarted and knows nothing
re-creates the session from the host's `Resume` and checks each member's proof against that key,
so only members the host admitted get back in. `EdgeResume` from both ends re-allocates a relay
edge the restarted relay lost.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, fields
from typing import ClassVar

import msgpack

from rendezvous.errors import ProtocolError
from rendezvous.limits import MAX_NAMEPLATE, MAX_SIGNAL_BODY_BYTES, MAX_SIGNAL_FRAME_BYTES

LENGTH_PREFIX = struct.Struct("!I")
MAX_RID = 1_000_000
EDGE_ID_BYTES = 8
RELAY_TOKEN_BYTES = 16
MAX_REASON_CHARS = 200
PROTOCOL_VERSION = 1
RESUME_KEY_BYTES = 32


@dataclass(frozen=True)
class Open:
    """host -> rendezvous: create a session and give me a nameplate."""

    TAG: ClassVar[int] = 1
    version: int = PROTOCOL_VERSION
    resume_key: bytes = b""  # RESUME_KEY_BYTES the host drew; empty: the session cannot resume


@dataclass(frozen=True)
class Opened:
    """rendezvous -> host: the session exists. rid is 0; relay_token binds my UDP address."""

    TAG: ClassVar[int] = 2
    nameplate: int
    rid: int
    relay_token: bytes
    stun_port2: int


@dataclass(frozen=True)
class Join:
    """member -> rendezvous: join the session behind this nameplate."""

    TAG: ClassVar[int] = 3
    nameplate: int
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Joined:
    """rendezvous -> member: you are rid in the session; the host is rid 0."""

    TAG: ClassVar[int] = 4
    rid: int
    relay_token: bytes
    stun_port2: int


@dataclass(frozen=True)
class Send:
    """member -> rendezvous: forward an opaque body to member `to` of my session."""

    TAG: ClassVar[int] = 5
    to: int
    body: bytes


@dataclass(frozen=True)
class Deliver:
    """rendezvous -> member: an opaque body from member `sender`."""

    TAG: ClassVar[int] = 6
    sender: int
    body: bytes


@dataclass(frozen=True)
class PeerLeft:
    """rendezvous -> host: member rid's signaling connection ended (reason: bye/lost/kicked)."""

    TAG: ClassVar[int] = 7
    rid: int
    reason: str


@dataclass(frozen=True)
class EdgeRequest:
    """member -> rendezvous: allocate a relay edge between me and member `peer`."""

    TAG: ClassVar[int] = 8
    peer: int


@dataclass(frozen=True)
class EdgeAllocated:
    """rendezvous -> both ends: edge_id routes relay frames; the initiator is the QUIC client."""

    TAG: ClassVar[int] = 9
    edge_id: bytes
    peer: int
    initiator: bool


@dataclass(frozen=True)
class Kick:
    """host -> rendezvous: drop member rid from the session (failed PAKE, bad message)."""

    TAG: ClassVar[int] = 10
    rid: int


@dataclass(frozen=True)
class CloseNameplate:
    """host -> rendezvous: accept no more joins (after a failed PAKE, or when full)."""

    TAG: ClassVar[int] = 11


@dataclass(frozen=True)
class Admit:
    """host -> rendezvous: member rid confirmed the PAKE; it may now open edges and use the relay.

    Until then the rid is *pending*: it may send a few small bodies to the host and nothing else."""

    TAG: ClassVar[int] = 16
    rid: int


@dataclass(frozen=True)
class Heartbeat:
    """either way: I am alive (members send one every HEARTBEAT_S)."""

    TAG: ClassVar[int] = 12


@dataclass(frozen=True)
class Bye:
    """member -> rendezvous: I am leaving."""

    TAG: ClassVar[int] = 13


@dataclass(frozen=True)
class Error:
    """rendezvous -> member: a request failed; fatal errors are followed by a close."""

    TAG: ClassVar[int] = 14
    code: str
    reason: str


@dataclass(frozen=True)
class SessionClosed:
    """rendezvous -> members: the host left, the session is over."""

    TAG: ClassVar[int] = 15
    reason: str


@dataclass(frozen=True)
class Resume:
    """member -> rendezvous, on a new connection: I am rid of this session again. proof is the
    host's resume key (rid 0) or resume_proof(key, nameplate, rid); relay_token is the one I had."""

    TAG: ClassVar[int] = 17
    nameplate: int
    rid: int
    proof: bytes
    relay_token: bytes


@dataclass(frozen=True)
class Resumed:
    """rendezvous -> member: you are back in the session (as an admitted member)."""

    TAG: ClassVar[int] = 18
    stun_port2: int


@dataclass(frozen=True)
class EdgeResume:
    """member -> rendezvous, after Resumed: I had relay edge edge_id with member `peer`; when both
    ends say so, a relay that lost the edge allocates it again under the same id."""

    TAG: ClassVar[int] = 19
    edge_id: bytes
    peer: int


@dataclass(frozen=True)
class Reopen:
    """host -> rendezvous: close the nameplate joins use now and open another for this session
    (a fresh code: after a wrong guess, or on the host's command). nameplate 0: any free one; else
    that one if free (the host re-claims its code after the rendezvous restarted)."""

    TAG: ClassVar[int] = 20
    nameplate: int = 0


@dataclass(frozen=True)
class Reopened:
    """rendezvous -> host: joins now go to this nameplate (the session's own one stays its id)."""

    TAG: ClassVar[int] = 21
    nameplate: int


@dataclass(frozen=True)
class Notice:
    """rendezvous -> host: what the host should see about its session (joins refused, and from
    where), at most once per NOTICE_INTERVAL_S."""

    TAG: ClassVar[int] = 22
    reason: str


def resume_proof(key: bytes, nameplate: int, rid: int) -> bytes:
    """What member rid shows to resume: a MAC under the host's key (the host's own proof is the key)."""
    if rid == 0:
        return key
    return hmac.new(key, f"kafila-resume|{nameplate}|{rid}".encode(), hashlib.sha256).digest()


Message = (
    Open | Opened | Join | Joined | Send | Deliver | PeerLeft | EdgeRequest | EdgeAllocated
    | Kick | CloseNameplate | Heartbeat | Bye | Error | SessionClosed | Admit | Resume | Resumed
    | EdgeResume | Reopen | Reopened | Notice
)
_BY_TAG: dict[int, type] = {
    cls.TAG: cls
    for cls in (
        Open, Opened, Join, Joined, Send, Deliver, PeerLeft, EdgeRequest, EdgeAllocated,
        Kick, CloseNameplate, Heartbeat, Bye, Error, SessionClosed, Admit, Resume, Resumed,
        EdgeResume, Reopen, Reopened, Notice,
    )
}

# field name -> (python type, bound): ints are [0, bound], bytes/str at most bound long
# (bytes with a negative bound must be exactly -bound long)
_BOUNDS: dict[str, tuple[type, int]] = {
    "version": (int, 1000),
    "nameplate": (int, MAX_NAMEPLATE),
    "rid": (int, MAX_RID),
    "to": (int, MAX_RID),
    "sender": (int, MAX_RID),
    "peer": (int, MAX_RID),
    "stun_port2": (int, 65535),
    "relay_token": (bytes, -RELAY_TOKEN_BYTES),
    "edge_id": (bytes, -EDGE_ID_BYTES),
    "body": (bytes, MAX_SIGNAL_BODY_BYTES),
    "initiator": (bool, 1),
    "reason": (str, MAX_REASON_CHARS),
    "code": (str, 40),
    "resume_key": (bytes, RESUME_KEY_BYTES),
    "proof": (bytes, -RESUME_KEY_BYTES),
}


def _check(name: str, value: object) -> None:
    kind, bound = _BOUNDS[name]
    if kind is int:
        if type(value) is not int or not 0 <= value <= bound:
            raise ProtocolError("malformed", f"field {name} must be an integer in 0..{bound}")
    elif kind is bool:
        if type(value) is not bool:
            raise ProtocolError("malformed", f"field {name} must be a boolean")
    elif kind is bytes:
        if type(value) is not bytes:
            raise ProtocolError("malformed", f"field {name} must be bytes")
        if (bound < 0 and len(value) != -bound) or (bound >= 0 and len(value) > bound):
            raise ProtocolError("too-large", f"field {name} has a bad length ({len(value)})")
    elif kind is str:
        if type(value) is not str or len(value) > bound:
            raise ProtocolError("malformed", f"field {name} must be text of <= {bound} chars")


def validate(message: Message) -> Message:
    """Check every field of a message against its type and bound (raises ProtocolError)."""
    for f in fields(message):
        _check(f.name, getattr(message, f.name))
    return message


def encode(message: Message) -> bytes:
    """One frame: length prefix + msgpack [tag, fields...]. Validates before encoding."""
    validate(message)
    payload = msgpack.packb(
        [message.TAG, *(getattr(message, f.name) for f in fields(message))], use_bin_type=True
    )
    if len(payload) > MAX_SIGNAL_FRAME_BYTES:
        raise ProtocolError("too-large", f"signaling frame of {len(payload)} bytes")
    return LENGTH_PREFIX.pack(len(payload)) + payload


def decode(payload: bytes) -> Message:
    """The msgpack payload of one frame (without its length prefix) -> a valid message."""
    if len(payload) > MAX_SIGNAL_FRAME_BYTES:
        raise ProtocolError("too-large", f"signaling frame of {len(payload)} bytes")
    try:
        items = msgpack.unpackb(
            payload, raw=False, use_list=True, strict_map_key=True
        )
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types for bad input; all mean "malformed"
        raise ProtocolError("malformed", f"undecodable signaling frame ({type(exc).__name__})")
    if not isinstance(items, list) or not items or type(items[0]) is not int:
        raise ProtocolError("malformed", "signaling frame is not [tag, fields...]")
    cls = _BY_TAG.get(items[0])
    if cls is None:
        raise ProtocolError("malformed", f"unknown signaling message tag {items[0]}")
    names = [f.name for f in fields(cls)]
    if len(items) - 1 != len(names):
        raise ProtocolError("malformed", f"{cls.__name__} needs {len(names)} fields")
    for name, value in zip(names, items[1:]):
        _check(name, value)
    return cls(*items[1:])


class FrameReader:
    """Sans-I/O splitter of a TCP byte stream into decoded messages."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        """Append bytes; return every complete message (raises ProtocolError on a bad one)."""
        self._buffer += data
        out: list[Message] = []
        while len(self._buffer) >= LENGTH_PREFIX.size:
            (length,) = LENGTH_PREFIX.unpack_from(self._buffer)
            if length > MAX_SIGNAL_FRAME_BYTES:
                raise ProtocolError("too-large", f"signaling frame of {length} bytes announced")
            if len(self._buffer) < LENGTH_PREFIX.size + length:
                break
            payload = bytes(self._buffer[LENGTH_PREFIX.size : LENGTH_PREFIX.size + length])
            del self._buffer[: LENGTH_PREFIX.size + length]
            out.append(decode(payload))
        return out
