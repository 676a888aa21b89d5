"""Sans-I/O demultiplexing of the member socket's datagrams onto edges.

One UDP socket carries every edge: relay DATA frames (from the rendezvous, by edge id), punch
probes (from a peer's address, by edge id) and QUIC packets once an edge went direct (by
connection id). The table decides which edge a datagram is for, and keeps, for a short while,
datagrams for an edge whose allocation has not arrived yet (UDP can beat the TCP signaling that
announces it). It is fed `now` and does no I/O: delivering is a call on the edge
(`datagram`, `punch_frame`), which the edge turns into QUIC input.

    relay(edge_id, payload, now)  -> edge.datagram(payload) | kept early
    punch(edge_id, data, src, now) -> edge.punch_frame(data, src) | kept early (direct allowed)
    quic(cid, initial, data, src) -> edge.datagram(data) if src is an address that edge punched
    add(edge, now)                 -> the edge, with the datagrams kept for it replayed
"""

from __future__ import annotations

from typing import Any, Protocol

Address = tuple[str, int]
RELAY, PUNCH = "relay", "punch"
EARLY_EDGES_MAX = 16  # edges with datagrams waiting for their allocation
EARLY_DATAGRAMS_PER_EDGE_MAX = 32
EARLY_DATAGRAM_TTL_S = 5.0


class Routable(Protocol):
    """What the table needs of an edge (kafila.net.edge.Edge)."""

    edge_id: bytes
    closed: bool
    awaiting_initial: bool
    puncher: Any  # .direct: Address | None, .candidates: list[Address]

    def datagram(self, data: bytes) -> None: ...
    def punch_frame(self, data: bytes, src: Address) -> None: ...


class EdgeTable:
    def __init__(self, allow_direct: bool = True) -> None:
        self.allow_direct = allow_direct  # False: every edge stays on the relay (tests, diagnostics)
        self.edges: dict[bytes, Routable] = {}
        self._cids: dict[bytes, Routable] = {}
        self._early: dict[bytes, list[tuple[float, str, bytes, Address | None]]] = {}

    # edges
    def add(self, edge: Routable, now: float) -> None:
        """A new edge; datagrams that came for it before are delivered now (fresh ones only)."""
        self.edges[edge.edge_id] = edge
        for stamp, kind, data, src in self._early.pop(edge.edge_id, []):
            if now - stamp > EARLY_DATAGRAM_TTL_S or edge.closed:
                continue
            if kind == RELAY:
                edge.datagram(data)
            elif self.allow_direct and src is not None:
                edge.punch_frame(data, src)

    def remove(self, edge: Routable) -> None:
        self.edges.pop(edge.edge_id, None)

    def register_cid(self, cid: bytes, edge: Routable | None) -> None:
        """A QUIC connection id an edge issued (edge), or retired (None)."""
        if edge is None:
            self._cids.pop(cid, None)
        else:
            self._cids[cid] = edge

    # datagrams
    def relay(self, edge_id: bytes, payload: bytes, now: float) -> None:
        edge = self.edges.get(edge_id)
        if edge is None:
            if payload:
                self._keep(edge_id, RELAY, payload, None, now)
        elif payload:
            edge.datagram(payload)

    def punch(self, edge_id: bytes, data: bytes, src: Address, now: float) -> None:
        if not self.allow_direct:
            return
        edge = self.edges.get(edge_id)
        if edge is not None:
            edge.punch_frame(data, src)
        else:
            self._keep(edge_id, PUNCH, data, src, now)

    def quic(self, cid: bytes, initial: bool, data: bytes, src: Address) -> bool:
        """Deliver a direct QUIC packet; False when it is nobody's (dropped)."""
        edge = self._cids.get(cid)
        if edge is None and initial:
            # a retransmitted Initial that took the direct path before we saw the first one:
            # the server edge waiting for its connection, punched from this address
            edge = next((e for e in self.edges.values() if e.awaiting_initial
                         and (src == e.puncher.direct or src in e.puncher.candidates)), None)  # fmt: skip
        if edge is None or (src != edge.puncher.direct and src not in edge.puncher.candidates):
            return False  # QUIC from an address this edge never punched: not ours to accept
        edge.datagram(data)
        return True

    def _keep(self, edge_id: bytes, kind: str, data: bytes, src: Address | None, now: float) -> None:
        """Hold a datagram for an edge we have not heard of yet (its allocation may be late)."""
        for key in [k for k, v in self._early.items() if now - v[-1][0] > EARLY_DATAGRAM_TTL_S]:
            del self._early[key]
        queue = self._early.get(edge_id)
        if queue is None:
            if len(self._early) >= EARLY_EDGES_MAX:
                return
            queue = self._early[edge_id] = []
        if len(queue) < EARLY_DATAGRAMS_PER_EDGE_MAX:
            queue.append((now, kind, data, src))

    @property
    def early_edges(self) -> int:
        return len(self._early)
