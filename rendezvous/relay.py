"""Sans-I/O datagram relay: per-member UDP bindings and per-edge allocations with rate limits.

A member registers its UDP address by sending BIND with the relay token the registry gave it on
the signaling channel (the registry hands the token to the relay only once the host admitted
the member). A BIND from an address the token is not bound to is answered with a
BIND_CHALLENGE to that address, carrying a nonce (a keyed MAC of token and address, so the relay
keeps no state per challenge); only a BIND that echoes it binds the address: the return
routability check that stops a spoofed BIND from pointing an edge's traffic at a third party.
An edge allocation joins two bound members of one session; DATA frames from one end are
forwarded unchanged (ciphertext) to the other end's bound address, within RELAY_EDGE_BYTES_PER_S
per edge, RELAY_SESSION_BYTES_PER_S per session and RELAY_GLOBAL_BYTES_PER_S in all, and the
allocation expires after RELAY_EDGE_IDLE_S without traffic.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from rendezvous import frames
from rendezvous.errors import ProtocolError
from rendezvous.limits import (
    RELAY_BIND_IDLE_S,
    RELAY_EDGE_BURST_BYTES,
    RELAY_EDGE_BYTES_PER_S,
    RELAY_EDGE_IDLE_S,
    RELAY_GLOBAL_BURST_BYTES,
    RELAY_GLOBAL_BYTES_PER_S,
    RELAY_SESSION_BURST_BYTES,
    RELAY_SESSION_BYTES_PER_S,
)

Address = tuple[str, int]


@dataclass
class TokenBucket:
    """Bytes per second with a burst; `take` says whether n bytes may pass now."""

    rate_per_s: float
    burst: float
    level: float = 0.0
    stamp: float | None = None

    def take(self, n: int, now: float) -> bool:
        if self.stamp is None:
            self.level, self.stamp = self.burst, now
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate_per_s)
        self.stamp = now
        if self.level < n:
            return False
        self.level -= n
        return True

    def peek(self, now: float) -> float:
        """The level now, without taking anything (a bucket never used is full)."""
        if self.stamp is None:
            return self.burst
        return min(self.burst, self.level + (now - self.stamp) * self.rate_per_s)


@dataclass
class _Binding:
    token: bytes
    session: int
    rid: int
    addr: Address | None = None
    seen: float = 0.0


@dataclass
class _Allocation:
    edge_id: bytes
    session: int
    ends: tuple[bytes, bytes]  # relay tokens of the two members
    bucket: TokenBucket
    last_used: float
    forwarded_bytes: int = 0


@dataclass
class RelayStats:
    forwarded_frames: int = 0
    forwarded_bytes: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1


class RelayTable:
    def __init__(
        self,
        *,
        edge_bytes_per_s: float = RELAY_EDGE_BYTES_PER_S,
        edge_burst_bytes: float = RELAY_EDGE_BURST_BYTES,
        session_bytes_per_s: float = RELAY_SESSION_BYTES_PER_S,
        session_burst_bytes: float = RELAY_SESSION_BURST_BYTES,
        global_bytes_per_s: float = RELAY_GLOBAL_BYTES_PER_S,
        global_burst_bytes: float = RELAY_GLOBAL_BURST_BYTES,
        secret: bytes | None = None,
    ) -> None:
        self.edge_bytes_per_s = edge_bytes_per_s
        self.edge_burst_bytes = edge_burst_bytes
        self.session_bytes_per_s = session_bytes_per_s
        self.session_burst_bytes = session_burst_bytes
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self._bindings: dict[bytes, _Binding] = {}
        self._by_addr: dict[Address, bytes] = {}
        self._edges: dict[bytes, _Allocation] = {}
        self._session_edges: dict[int, set[bytes]] = {}
        self._session_buckets: dict[int, TokenBucket] = {}
        self._global_bucket = TokenBucket(global_bytes_per_s, global_burst_bytes)
        self.stats = RelayStats()

    # membership (driven by the registry)
    def add_member(self, token: bytes, session: int, rid: int) -> None:
        binding = self._bindings.get(token)
        if binding is None or (binding.session, binding.rid) != (session, rid):  # a resume keeps its address
            self._bindings[token] = _Binding(token, session, rid)

    def remove_member(self, token: bytes) -> None:
        binding = self._bindings.pop(token, None)
        if binding is not None and binding.addr is not None:
            self._by_addr.pop(binding.addr, None)
        if binding is None:
            return
        for edge_id in [e for e in self._session_edges.get(binding.session, ()) if token in self._edges[e].ends]:
            self._drop_edge(edge_id)

    def allocate(self, edge_id: bytes, session: int, a: bytes, b: bytes, now: float) -> None:
        bucket = TokenBucket(self.edge_bytes_per_s, self.edge_burst_bytes)
        self._edges[edge_id] = _Allocation(edge_id, session, (a, b), bucket, now)
        self._session_edges.setdefault(session, set()).add(edge_id)
        if session not in self._session_buckets:
            self._session_buckets[session] = TokenBucket(self.session_bytes_per_s, self.session_burst_bytes)

    def _drop_edge(self, edge_id: bytes) -> None:
        edge = self._edges.pop(edge_id)
        ids = self._session_edges.get(edge.session)
        if ids is not None:
            ids.discard(edge_id)
            if not ids:
                del self._session_edges[edge.session]
                self._session_buckets.pop(edge.session, None)

    def edges_in(self, session: int) -> int:
        return len(self._session_edges.get(session, ()))

    def edges_of(self, session: int, token: bytes) -> int:
        """Edges of this session that member `token` asked for (it is their first end)."""
        return sum(1 for e in self._session_edges.get(session, ()) if self._edges[e].ends[0] == token)

    def bind_nonce(self, token: bytes, src: Address) -> bytes:
        """The nonce a BIND from src must echo: a MAC of token and address under our secret."""
        message = token + f"{src[0]}|{src[1]}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).digest()[: frames.BIND_NONCE_BYTES]

    def has_token(self, token: bytes) -> bool:
        return token in self._bindings

    def has_edge(self, edge_id: bytes) -> bool:
        return edge_id in self._edges

    # datagrams
    def receive(self, datagram: bytes, src: Address, now: float) -> tuple[bytes, Address] | None:
        """A BIND or DATA datagram from src -> the datagram to send and where, or None (drop)."""
        try:
            if datagram[:1] == bytes([frames.BIND]):
                token, nonce = frames.decode_bind_request(datagram)
                return self._bind(token, nonce, src, now)
            if datagram[:1] == bytes([frames.DATA]):
                edge_id, _ = frames.decode_data(datagram)
                return self._forward(edge_id, datagram, src, now)
            self.stats.drop("not-relay")
        except ProtocolError:
            self.stats.drop("malformed")
        return None

    def _bind(self, token: bytes, nonce: bytes, src: Address, now: float) -> tuple[bytes, Address] | None:
        binding = self._bindings.get(token)
        if binding is None:
            self.stats.drop("unknown-token")
            return None
        if binding.addr != src:
            expected = self.bind_nonce(token, src)
            if not hmac.compare_digest(nonce, expected):
                if nonce != frames.NO_NONCE:
                    self.stats.drop("bad-nonce")
                return frames.encode_challenge(token, expected), src
            if binding.addr is not None:
                self._by_addr.pop(binding.addr, None)
            previous = self._by_addr.get(src)
            if previous is not None and previous != token:
                self._bindings[previous].addr = None
            binding.addr = src
            self._by_addr[src] = token
        binding.seen = now
        return frames.encode_bind(token, ack=True), src

    def _forward(
        self, edge_id: bytes, datagram: bytes, src: Address, now: float
    ) -> tuple[bytes, Address] | None:
        edge = self._edges.get(edge_id)
        token = self._by_addr.get(src)
        if edge is None:
            self.stats.drop("unknown-edge")
            return None
        if token not in edge.ends:
            self.stats.drop("not-an-end")
            return None
        other = self._bindings.get(edge.ends[1] if token == edge.ends[0] else edge.ends[0])
        if other is None or other.addr is None:
            self.stats.drop("peer-unbound")
            return None
        if not edge.bucket.take(len(datagram), now):
            self.stats.drop("rate-limited")
            return None
        if not self._session_buckets[edge.session].take(len(datagram), now):
            self.stats.drop("session-rate-limited")
            return None
        if not self._global_bucket.take(len(datagram), now):
            self.stats.drop("global-rate-limited")
            return None
        edge.last_used = now
        edge.forwarded_bytes += len(datagram)
        self.stats.forwarded_frames += 1
        self.stats.forwarded_bytes += len(datagram)
        return datagram, other.addr

    def expire(self, now: float) -> None:
        for edge_id in [e.edge_id for e in self._edges.values()
                        if now - e.last_used > RELAY_EDGE_IDLE_S]:
            self._drop_edge(edge_id)
        for binding in self._bindings.values():
            if binding.addr is not None and now - binding.seen > RELAY_BIND_IDLE_S:
                self._by_addr.pop(binding.addr, None)
                binding.addr = None
