"""Sans-I/O NAT classification from one UDP socket against the rendezvous (RFC 5780 §4.3-4.4).

Theory of operation. The probe first sends RTT_SAMPLES binding requests to the primary port P1
and, at the same moment, a request asking P1 to answer from its second port P2 (and, where the
rendezvous advertises an alternate IP, one asking for an answer from that IP). These must go
first: a fresh socket has contacted nothing but P1, so an answer from P2 proves the NAT does not
filter by port. Only once the filtering tests are decided (answered, or FILTER_WAIT_S passed)
does it send a binding request to P2 and compare the mapped addresses:

    mapping   same mapped address towards P1 and P2 -> endpoint-independent, else endpoint-dependent
    filtering answer from alternate IP -> endpoint-independent
              answer from P2 only      -> address-dependent (with an alternate IP to test against)
                                          or not-port-dependent (one IP: cannot tell EIF from ADF)
              no answer from P2        -> port-dependent
    nat       endpoint-dependent mapping -> restrictive
              EIM + endpoint-independent (or not-port-dependent) filtering -> permissive
              otherwise -> ordinary                                 (Kafila §V-B, RFC 4787)

`rtt_ms` is the shortest round trip of the P1 binding requests: the path's own time (a stall of
the machine that answers or sends, such as a CPU quota, adds to some samples, not to the path,
and the planner prices the path). Drive it like aioquic:
`datagrams_to_send(now)`, `receive(data, src, now)`, `get_timer()`, `handle_timer(now)`; read
`report()` once `done`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from aioice import stun

from planner.fleet import Nat
from planner.ring import predicted_direct
from rendezvous.errors import ProtocolError
from rendezvous.stun import CHANGE_IP, CHANGE_PORT

Address = tuple[str, int]

RTT_SAMPLES = 3
# the samples leave this far apart: a moment's stall of either machine (a CPU quota's period, a
# busy core) delays samples sent together alike, and the shortest is the path's own time
RTT_SPACING_S = 0.05
RETRANSMIT_S = 0.15
FILTER_WAIT_S = 0.6  # how long an answer from the other port may take before we call it filtered
PROBE_TIMEOUT_S = 3.0  # no answer from P1 at all within this: the rendezvous is unreachable

# The NAT classes are planner.fleet.Nat (one definition); the wire carries their values.
PERMISSIVE, ORDINARY, RESTRICTIVE = Nat.PERMISSIVE.value, Nat.ORDINARY.value, Nat.RESTRICTIVE.value
EIM, EDM, UNKNOWN = "endpoint-independent", "endpoint-dependent", "unknown"
EIF, ADF, PDF, NPDF = "endpoint-independent", "address-dependent", "port-dependent", "not-port-dependent"


@dataclass(frozen=True)
class NatReport:
    """What `kafila netcheck` prints; every member reports it to the host."""

    nat: str  # permissive | ordinary | restrictive
    mapped: str  # "ip:port" as the rendezvous saw this socket
    rtt_ms: float  # shortest round trip to the rendezvous
    filtering: str
    mapping: str

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> NatReport:
        return cls(
            nat=str(data["nat"]), mapped=str(data["mapped"]), rtt_ms=float(data["rtt_ms"]),
            filtering=str(data["filtering"]), mapping=str(data["mapping"]),
        )


def classify(mapping: str, filtering: str) -> str:
    if mapping != EIM:
        return RESTRICTIVE if mapping == EDM else ORDINARY
    return PERMISSIVE if filtering in (EIF, NPDF) else ORDINARY


def predict_edge_kind(a: str, b: str) -> str:
    """Predicted edge kind from two NAT classes, by the planner's rule (planner.ring.predicted_direct:
    an unknown class counts as restrictive)."""
    return "direct" if predicted_direct(_nat(a), _nat(b)) else "relay"


def _nat(value: str) -> Nat | None:
    try:
        return Nat(value)
    except ValueError:
        return None


@dataclass
class _Txn:
    kind: str  # "rtt" | "change-port" | "change-ip" | "p2"
    dest: Address
    change: int
    created: float
    not_before: float = 0.0  # not sent before this time
    last_sent: float | None = None
    answered: float | None = None
    mapped: Address | None = None
    rtt_s: float | None = None


class NatProbe:
    def __init__(self, primary: Address, now: float) -> None:
        self.primary = primary
        self.started = now
        self.port2: int | None = None
        self.alternate = False
        self._txns: dict[bytes, _Txn] = {}
        self._filter_decided_at: float | None = None
        self._p2_created = False
        self.done = False
        self.error: ProtocolError | None = None
        for i in range(RTT_SAMPLES):
            self._new("rtt", primary, 0, now, not_before=now + i * RTT_SPACING_S)
        self._new("change-port", primary, CHANGE_PORT, now)

    def _new(self, kind: str, dest: Address, change: int, now: float, not_before: float = 0.0) -> None:
        self._txns[os.urandom(12)] = _Txn(kind, dest, change, now, not_before)

    def _of(self, kind: str) -> list[_Txn]:
        return [t for t in self._txns.values() if t.kind == kind]

    def _waiting(self, txn: _Txn, now: float) -> bool:
        """Whether a transaction still wants (re)sending."""
        if txn.answered is not None:
            return False
        if txn.kind.startswith("change"):
            return now - txn.created < FILTER_WAIT_S
        return now - self.started < PROBE_TIMEOUT_S + (FILTER_WAIT_S if txn.kind == "p2" else 0)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        out = []
        for txid, txn in self._txns.items():
            if self.done or not self._waiting(txn, now) or now < txn.not_before:
                continue
            if txn.last_sent is None or now - txn.last_sent >= RETRANSMIT_S:
                request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST, transaction_id=txid)
                if txn.change:
                    request.attributes["CHANGE-REQUEST"] = txn.change
                txn.last_sent = now
                out.append((bytes(request), txn.dest))
        return out

    def receive(self, data: bytes, src: Address, now: float) -> bool:
        """Feed a STUN datagram; returns whether it belonged to this probe."""
        try:
            message = stun.parse_message(data)
        except Exception:  # noqa: BLE001 - aioice raises assorted types on garbage
            return False
        txn = self._txns.get(message.transaction_id)
        if txn is None or txn.answered is not None or message.message_class != stun.Class.RESPONSE:
            return False
        mapped = message.attributes.get("XOR-MAPPED-ADDRESS") or message.attributes.get("MAPPED-ADDRESS")
        if not mapped:
            return False
        if txn.kind == "change-port" and src[1] == self.primary[1]:
            return False  # an answer from P1 itself proves nothing about filtering
        if txn.kind == "change-ip" and src[0] == self.primary[0]:
            return False
        txn.answered, txn.mapped = now, (str(mapped[0]), int(mapped[1]))
        txn.rtt_s = now - (txn.last_sent if txn.last_sent is not None else txn.created)
        other = message.attributes.get("OTHER-ADDRESS")
        if txn.kind == "rtt" and self.port2 is None and other:
            self.port2 = int(other[1])
            if other[0] not in ("0.0.0.0", "::") and not self._of("change-ip"):
                self.alternate = True
                self._new("change-ip", self.primary, CHANGE_IP | CHANGE_PORT, now)
        self._advance(now)
        return True

    def get_timer(self) -> float | None:
        if self.done:
            return None
        times = []
        for txn in self._txns.values():
            if txn.answered is None:
                if txn.last_sent is None and txn.not_before > txn.created:
                    times.append(txn.not_before)
                else:
                    times.append((txn.last_sent if txn.last_sent is not None else txn.created) + RETRANSMIT_S)
        return min(times) if times else self.started + PROBE_TIMEOUT_S

    def handle_timer(self, now: float) -> None:
        self._advance(now)

    def _advance(self, now: float) -> None:
        if self.done:
            return
        rtts = self._of("rtt")
        if not any(t.answered for t in rtts):
            if now - self.started >= PROBE_TIMEOUT_S:
                host, port = self.primary
                self.error = ProtocolError(
                    "unreachable",
                    f"no STUN answer from the rendezvous at {host}:{port} within "
                    f"{PROBE_TIMEOUT_S:.0f} s (is it running, and is UDP {port} reachable?)",
                )
                self.done = True
            return
        changes = self._of("change-port") + self._of("change-ip")
        filter_decided = all(t.answered is not None or not self._waiting(t, now) for t in changes)
        if filter_decided and not self._p2_created and self.port2:
            self._p2_created = True
            self._new("p2", (self.primary[0], self.port2), 0, now)
        p2 = self._of("p2")
        rtt_settled = all(t.answered is not None or not self._waiting(t, now) for t in rtts)
        p2_settled = bool(p2) and all(t.answered is not None or not self._waiting(t, now) for t in p2)
        if filter_decided and rtt_settled and (p2_settled or not self.port2):
            self.done = True

    def report(self) -> NatReport:
        if self.error is not None:
            raise self.error
        if not self.done:
            raise ProtocolError("state", "the NAT probe has not finished")
        rtts = [t for t in self._of("rtt") if t.answered is not None]
        first = rtts[0].mapped
        assert first is not None
        p2 = [t for t in self._of("p2") if t.answered is not None]
        if not p2:
            mapping = UNKNOWN
        else:
            mapping = EIM if p2[0].mapped == first else EDM
        port_ok = any(t.answered for t in self._of("change-port"))
        ip_ok = any(t.answered for t in self._of("change-ip"))
        if ip_ok:
            filtering = EIF
        elif port_ok:
            filtering = ADF if self.alternate else NPDF
        else:
            filtering = PDF
        rtt_ms = 1000.0 * min(t.rtt_s for t in rtts if t.rtt_s is not None)
        return NatReport(
            nat=classify(mapping, filtering), mapped=f"{first[0]}:{first[1]}",
            rtt_ms=round(rtt_ms, 3), filtering=filtering, mapping=mapping,
        )
