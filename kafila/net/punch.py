"""Sans-I/O hole-punch scheduler for one edge (DCUtR/Tailscale-disco style).

Theory of operation. Both ends learn each other's candidates (local and mapped addresses, from
the authenticated roster) and start at once when the rendezvous allocates the edge. Each end
sprays small PROBEs to every candidate at jittered 10-200 ms intervals for PUNCH_ROUND_S, up to
PUNCH_ROUNDS rounds, then retries a round every UPGRADE_RETRY_S. A PROBE is answered with a PONG
to the address it came from, carrying that observed address; a probe from an address we did not
know is adopted as a new candidate (this is what lets a permissive side reach a restrictive one:
it must answer the observed source, not the advertised one). The first valid PONG proves a path
both ways: the edge's route becomes direct to the PONG's source, we send a few more probes so the
other side also sees PONGs, then keep the path alive with a probe every KEEPALIVE_S (< 25 s, the
NAT's unreplied-UDP timeout is ~30 s). If no PONG arrives for DIRECT_TRUST_S the route falls back
to the relay and punching starts again.

Frames (first byte 0x20/0x21, see rendezvous.frames), all tagged with HMAC-SHA256 (truncated to
16 bytes) under a key only the two members can derive, so nobody else can elicit a PONG or
fake a path:
    PROBE [0x20][edge id 8][txid 8][tag 16]
    PONG  [0x21][edge id 8][txid 8][family 1][ip 4|16][port 2][tag 16]
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import random
import struct

from rendezvous.errors import ProtocolError
from rendezvous.frames import PONG, PROBE
from rendezvous.messages import EDGE_ID_BYTES

Address = tuple[str, int]

PROBE_MIN_GAP_S = 0.010
PROBE_MAX_GAP_S = 0.200
PUNCH_ROUND_S = 5.0
PUNCH_ROUNDS = 3
UPGRADE_RETRY_S = 60.0
PROBES_AFTER_SUCCESS = 3
KEEPALIVE_S = 10.0
DIRECT_TRUST_S = 25.0
TAG_BYTES = 16
MAX_CANDIDATES = 16
MAX_OUTSTANDING_TXIDS = 256

PUNCHING, DIRECT, WAITING = "punching", "direct", "waiting"


def _tag(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()[:TAG_BYTES]


def _pack_addr(addr: Address) -> bytes:
    ip = ipaddress.ip_address(addr[0])
    return bytes([ip.version]) + ip.packed + struct.pack("!H", addr[1])


def _unpack_addr(data: bytes) -> tuple[Address, int]:
    if not data:
        raise ProtocolError("malformed", "empty address")
    size = {4: 4, 6: 16}.get(data[0])
    if size is None or len(data) < 1 + size + 2:
        raise ProtocolError("malformed", "bad address in pong")
    ip = ipaddress.ip_address(data[1 : 1 + size])
    (port,) = struct.unpack_from("!H", data, 1 + size)
    return (str(ip), port), 1 + size + 2


def encode_probe(key: bytes, edge_id: bytes, txid: bytes) -> bytes:
    head = bytes([PROBE]) + edge_id + txid
    return head + _tag(key, head)


def encode_pong(key: bytes, edge_id: bytes, txid: bytes, observed: Address) -> bytes:
    head = bytes([PONG]) + edge_id + txid + _pack_addr(observed)
    return head + _tag(key, head)


def edge_id_of(frame: bytes) -> bytes:
    """The edge a punch frame belongs to (to find its Puncher), or ProtocolError."""
    if len(frame) < 1 + EDGE_ID_BYTES + 8 + TAG_BYTES or frame[0] not in (PROBE, PONG):
        raise ProtocolError("malformed", "bad punch frame")
    return bytes(frame[1 : 1 + EDGE_ID_BYTES])


def decode(key: bytes, frame: bytes) -> tuple[int, bytes, bytes, Address | None]:
    """-> (kind, edge id, txid, observed address for a PONG). Raises ProtocolError."""
    edge_id = edge_id_of(frame)
    head, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
    if not hmac.compare_digest(_tag(key, head), tag):
        raise ProtocolError("auth-failed", "punch frame with a bad tag")
    txid = bytes(frame[1 + EDGE_ID_BYTES : 1 + EDGE_ID_BYTES + 8])
    rest = head[1 + EDGE_ID_BYTES + 8 :]
    if frame[0] == PROBE:
        if rest:
            raise ProtocolError("malformed", "probe with trailing bytes")
        return PROBE, edge_id, txid, None
    observed, used = _unpack_addr(rest)
    if used != len(rest):
        raise ProtocolError("malformed", "pong with trailing bytes")
    return PONG, edge_id, txid, observed


class Puncher:
    """Which route an edge should use, and which punch frames to send when."""

    def __init__(
        self,
        edge_id: bytes,
        key: bytes,
        candidates: list[Address],
        now: float,
        rng: random.Random,
        *,
        rounds: int = PUNCH_ROUNDS,
    ) -> None:
        self.edge_id = edge_id
        self.key = key
        self.candidates: list[Address] = []
        for addr in candidates:
            self.add_candidate(addr)
        self.rng = rng
        self.rounds = rounds
        self.state = PUNCHING
        self.round = 1
        self.round_started = now
        self.next_probe_at = now
        self.direct: Address | None = None
        self.observed_self: Address | None = None  # how the peer sees us (from its pongs)
        self.last_pong: float | None = None
        self.extra_probes = 0
        self.direct_since: float | None = None
        self.rtt_s: float | None = None  # round trip of the latest probe/pong on this path
        self._sent_txids: dict[bytes, float] = {}
        if rounds <= 0:  # punching disabled: stay on the relay, answer nothing
            self.state, self.next_probe_at = WAITING, float("inf")

    def add_candidate(self, addr: Address) -> None:
        if addr not in self.candidates and len(self.candidates) < MAX_CANDIDATES:
            self.candidates.append(addr)

    def _probe(self, dest: Address, now: float) -> tuple[bytes, Address]:
        txid = self.rng.randbytes(8)
        if len(self._sent_txids) >= MAX_OUTSTANDING_TXIDS:
            self._sent_txids.pop(next(iter(self._sent_txids)))
        self._sent_txids[txid] = now
        return encode_probe(self.key, self.edge_id, txid), dest

    def get_timer(self) -> float:
        return self.next_probe_at

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        """Probes due now (call when the timer fires, or any time)."""
        if now < self.next_probe_at:
            return []
        out: list[tuple[bytes, Address]] = []
        if self.state == DIRECT:
            assert self.direct is not None
            if self.last_pong is not None and now - self.last_pong > DIRECT_TRUST_S:
                self._fall_back(now)
                return self.datagrams_to_send(now)
            out.append(self._probe(self.direct, now))
            if self.extra_probes > 0:
                self.extra_probes -= 1
                self.next_probe_at = now + self.rng.uniform(PROBE_MIN_GAP_S, PROBE_MAX_GAP_S)
            else:
                self.next_probe_at = now + KEEPALIVE_S
            return out
        if self.state == WAITING:
            if self.rounds <= 0:
                self.next_probe_at = float("inf")
                return out
            self.state, self.round, self.round_started = PUNCHING, 1, now
        if now - self.round_started >= PUNCH_ROUND_S:
            if self.round >= self.rounds:
                self.state = WAITING
                self.next_probe_at = now + UPGRADE_RETRY_S
                return out
            self.round += 1
            self.round_started = now
        out.extend(self._probe(addr, now) for addr in self.candidates)
        self.next_probe_at = now + self.rng.uniform(PROBE_MIN_GAP_S, PROBE_MAX_GAP_S)
        return out

    def _fall_back(self, now: float) -> None:
        self.state, self.direct, self.direct_since = PUNCHING, None, None
        self.round, self.round_started, self.next_probe_at = 1, now, now

    def receive(self, frame: bytes, src: Address, now: float) -> list[tuple[bytes, Address]]:
        """A PROBE or PONG from src -> replies to send. Raises ProtocolError on a bad frame."""
        kind, edge_id, txid, observed = decode(self.key, frame)
        if edge_id != self.edge_id:
            raise ProtocolError("malformed", "punch frame for another edge")
        if kind == PROBE:
            self.add_candidate(src)  # adopt the peer-observed address
            return [(encode_pong(self.key, self.edge_id, txid, src), src)]
        sent = self._sent_txids.pop(txid, None)
        if sent is None:
            return []  # a pong we did not ask for (late duplicate or replay): ignore
        self.rtt_s = now - sent
        self.observed_self = observed
        self.last_pong = now
        if self.state != DIRECT or self.direct != src:
            self.state, self.direct, self.direct_since = DIRECT, src, now
            self.extra_probes = PROBES_AFTER_SUCCESS
            self.next_probe_at = now
        return []
