"""Roster entries and session events, and their validated wire form (inside sealed messages)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

import msgpack

from kafila.net.descriptor import descriptor_problem
from kafila.net.natcheck import NatReport
from rendezvous.errors import ProtocolError

Address = tuple[str, int]
MAX_NAME_CHARS = 64
MAX_CANDIDATES = 8
MAX_DESCRIPTOR_BYTES = 64 * 1024  # a member's descriptor (it rides in the hello, in one piece)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}$")
_FP_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class MemberInfo:
    """One member as the host vouches for it (under the session key)."""

    name: str
    descriptor: dict
    nat: str  # permissive | ordinary | restrictive
    rtt_ms: float  # shortest round trip to the rendezvous
    fingerprint: str  # SHA-256 of its edge certificate, hex
    candidates: tuple[Address, ...]  # addresses to punch: mapped first, then local
    peer_id: int = 0  # its id at the rendezvous (the host is 0)
    report: NatReport | None = field(default=None, compare=False)

    def to_wire(self) -> dict:
        return {
            "name": self.name, "descriptor": self.descriptor, "fp": self.fingerprint,
            "cand": [[ip, port] for ip, port in self.candidates], "rid": self.peer_id,
            "nat": self.report.as_dict() if self.report else
            {"nat": self.nat, "rtt_ms": self.rtt_ms, "mapped": "", "filtering": "", "mapping": ""},
        }

    @classmethod
    def from_wire(cls, data: object) -> MemberInfo:
        """Validate a member entry from a (decrypted) message; raises ProtocolError."""
        _need(isinstance(data, dict), "entry is not a map")
        assert isinstance(data, dict)
        name, descriptor, fp, rid, cands = (data.get(k) for k in ("name", "descriptor", "fp", "rid", "cand"))
        _need(valid_name(name), "bad name")
        _need(isinstance(descriptor, dict), "descriptor is not a map")
        problem = descriptor_problem(descriptor)  # numbers the host plans with: checked at the door
        _need(problem is None, str(problem))
        _need(isinstance(fp, str) and _FP_RE.match(fp) is not None, "bad fingerprint")
        _need(type(rid) is int and rid >= 0, "bad rid")
        _need(isinstance(cands, list) and len(cands) <= MAX_CANDIDATES, "bad candidates")
        candidates = []
        for item in cands:  # type: ignore[union-attr]
            _need(isinstance(item, list) and len(item) == 2, "bad candidate")
            ip, port = item
            _need(isinstance(ip, str) and is_ip(ip), "bad candidate address")
            _need(type(port) is int and 0 < port < 65536, "bad candidate port")
            candidates.append((ip, port))
        try:
            report = NatReport.from_dict(data.get("nat"))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("malformed", "bad member entry (NAT report)") from None
        _need(report.nat in ("permissive", "ordinary", "restrictive"), "bad NAT class")
        return cls(name, descriptor, report.nat, report.rtt_ms, fp, tuple(candidates), rid, report)  # type: ignore[arg-type]


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ProtocolError("malformed", f"bad member entry ({what})")


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def valid_name(name: object) -> bool:
    """Member names: 1-64 of letters, digits and . _ @ + - (starting with a letter or digit)."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def own_entry_problem(name: object, descriptor: object) -> str | None:
    """What is wrong with the name and descriptor this machine would join with, if anything."""
    if not valid_name(name):
        return f"member name {name!r}: use 1-64 letters, digits, . _ @ + -"
    if not isinstance(descriptor, dict):
        return "the member descriptor must be a dict"
    if (problem := descriptor_problem(descriptor)) is not None:
        return f"this machine's {problem}"
    try:
        packed = msgpack.packb(descriptor, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        return f"the member descriptor cannot be sent: {exc}"
    if len(packed) > MAX_DESCRIPTOR_BYTES:
        return "the member descriptor is too large"
    return None


def distinct_name(wanted: str, taken) -> str:
    """`wanted`, or the first of `wanted-2`, `wanted-3`, ... that is not `taken` (cut to fit
    MAX_NAME_CHARS): two machines that both call themselves `raspberrypi` both get in."""
    if wanted not in taken:
        return wanted
    n = 2
    while True:  # ends: `taken` is finite
        suffix = f"-{n}"
        name = wanted[: MAX_NAME_CHARS - len(suffix)] + suffix
        if name not in taken:
            return name
        n += 1


@dataclass(frozen=True)
class MemberJoined:
    info: MemberInfo


@dataclass(frozen=True)
class MemberLeft:
    name: str
    reason: str


@dataclass(frozen=True)
class Message:
    sender: str
    body: object


@dataclass(frozen=True)
class RosterUpdated:
    roster: dict[str, MemberInfo]


SessionEvent = MemberJoined | MemberLeft | Message | RosterUpdated
