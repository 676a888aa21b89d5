"""Ring ordering (§V-B): predicted edge kinds, their price, and the order of the members.

Edge kind (Kafila Table III's rule): an edge is predicted direct iff one end is permissive or
both are ordinary; otherwise it relays through the rendezvous. A member whose NAT class is
unknown counts as restrictive: predicting a relay that turns out direct costs nothing at run
time, the reverse would strand the ring on a path that does not exist.

Edge price, when both ends measured their round trip r to the rendezvous: a relayed edge
costs r_A + r_B (the literal path through the rendezvous), a direct edge |r_A − r_B| (the
triangle-inequality lower bound). An edge with an unmeasured end has no price (None).

Ordering:
- Every member has an RTT: minimise the ring's summed edge price, ties broken by ring
  separation Σ|r_A − r_B|, remaining ties by the first ordering met (members in input
  order). Prices are compared as integer nanoseconds, so ties are exact. Up to
  EXHAUSTIVE_MAX_MEMBERS members the search is exhaustive (depth-first with the anchor
  fixed first and a lower bound that only prunes orderings that cannot win); beyond that a
  heuristic: nearest neighbour from the anchor, then 2-opt moves until none improves.
- Otherwise the counting rule: minimise the number of relayed edges by construction. Restrictive
  members (R) sit in runs separated by segments of the others; a segment next to an R needs a
  permissive (P) end, ordinary members (O) gather in one segment, P…O…P where there are P's
  to spare. This reaches the minimum, r − min(r, p) relays without ordinary members and
  r − min(r, p − 1) with them (r ≥ 1), linear in the membership.
The returned order starts with the anchor; the ring is a cycle, so a later choice of head only
rotates it (see planner.head) and leaves every edge in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from planner.fleet import Device, Nat

__all__ = [
    "EXHAUSTIVE_MAX_MEMBERS",
    "EdgeKind",
    "RingEdge",
    "edge_between",
    "order_ring",
    "predicted_direct",
    "relay_count",
    "ring_edges",
]

EXHAUSTIVE_MAX_MEMBERS = 9
_NS_PER_MS = 1_000_000
_TWO_OPT_MAX_PASSES = 100


class EdgeKind(str, Enum):
    DIRECT = "direct"
    RELAY = "relay"


@dataclass(frozen=True)
class RingEdge:
    """One ring edge from `src` to `dst`, its predicted kind and price (None: unpriced)."""

    src: str
    dst: str
    kind: EdgeKind
    ms: float | None


def predicted_direct(a: Nat | None, b: Nat | None) -> bool:
    """Table III's rule: direct iff one end is permissive or both are ordinary."""
    a = Nat.RESTRICTIVE if a is None else a
    b = Nat.RESTRICTIVE if b is None else b
    return Nat.PERMISSIVE in (a, b) or (a is Nat.ORDINARY and b is Nat.ORDINARY)


def edge_between(a: Device, b: Device) -> RingEdge:
    direct = predicted_direct(a.nat, b.nat)
    kind = EdgeKind.DIRECT if direct else EdgeKind.RELAY
    if a.rtt_ms is None or b.rtt_ms is None:
        return RingEdge(a.name, b.name, kind, None)
    ms = abs(a.rtt_ms - b.rtt_ms) if direct else a.rtt_ms + b.rtt_ms
    return RingEdge(a.name, b.name, kind, ms)


def ring_edges(order: Sequence[Device]) -> tuple[RingEdge, ...]:
    """The edges of the cycle order[0] → order[1] → … → order[0] (none for one member)."""
    m = len(order)
    if m < 2:
        return ()
    return tuple(edge_between(order[i], order[(i + 1) % m]) for i in range(m))


def relay_count(order: Sequence[Device]) -> int:
    return sum(edge.kind is EdgeKind.RELAY for edge in ring_edges(order))


def order_ring(devices: Sequence[Device], anchor: str) -> tuple[Device, ...]:
    """The ring order of `devices`, starting with the member named `anchor`."""
    names = [d.name for d in devices]
    if anchor not in names:
        raise ValueError(f"anchor {anchor!r} is not a member")
    start = names.index(anchor)
    members = [devices[start]] + [d for i, d in enumerate(devices) if i != start]
    if len(members) <= 2:
        return tuple(members)
    if all(d.rtt_ms is not None for d in members):
        weights = _priced_weights(members)
        if len(members) <= EXHAUSTIVE_MAX_MEMBERS:
            path = _exhaustive(weights)
        else:
            path = _two_opt(weights, _nearest_neighbour(weights))
        return tuple(members[i] for i in path)
    path = _counting_order(members)
    return tuple(members[i] for i in path)


def _priced_weights(members: Sequence[Device]) -> list[list[int]]:
    """Edge weights as one integer: price·M + separation, so that sums compare lexicographically."""
    rtt_ns = [round((d.rtt_ms or 0.0) * _NS_PER_MS) for d in members]
    m = len(members)
    price = [[0] * m for _ in range(m)]
    sep = [[0] * m for _ in range(m)]
    for i in range(m):
        for j in range(m):
            if i != j:
                sep[i][j] = abs(rtt_ns[i] - rtt_ns[j])
                direct = predicted_direct(members[i].nat, members[j].nat)
                price[i][j] = sep[i][j] if direct else rtt_ns[i] + rtt_ns[j]
    scale = m * max(max(row) for row in sep) + 1  # > any ring's total separation
    return [[price[i][j] * scale + sep[i][j] for j in range(m)] for i in range(m)]


def _exhaustive(w: list[list[int]]) -> list[int]:
    """The cheapest cycle through every index, index 0 first (first found among ties)."""
    m = len(w)
    min_out = [min(w[i][j] for j in range(m) if j != i) for i in range(m)]
    best_cost: int | None = None
    best_path: list[int] = []
    path = [0]
    used = [False] * m
    used[0] = True

    def visit(cost: int, unvisited_bound: int) -> None:
        nonlocal best_cost, best_path
        last = path[-1]
        if len(path) == m:
            total = cost + w[last][0]
            if best_cost is None or total < best_cost:
                best_cost, best_path = total, list(path)
            return
        for j in range(1, m):
            if used[j]:
                continue
            step = cost + w[last][j]
            rest = unvisited_bound - min_out[j]
            # every remaining member, and j itself, still has to be left by one edge
            if best_cost is not None and step + min_out[j] + rest >= best_cost:
                continue
            used[j] = True
            path.append(j)
            visit(step, rest)
            path.pop()
            used[j] = False

    visit(0, sum(min_out[1:]))
    return best_path


def _nearest_neighbour(w: list[list[int]]) -> list[int]:
    m = len(w)
    path = [0]
    left = set(range(1, m))
    while left:
        last = path[-1]
        nxt = min(left, key=lambda j: (w[last][j], j))
        path.append(nxt)
        left.remove(nxt)
    return path


def _two_opt(w: list[list[int]], path: list[int]) -> list[int]:
    """Reverse segments path[i..j] (never moving the anchor at 0) while the cycle gets cheaper.

    Weights are symmetric, so a reversal changes only the two edges at its ends.
    """
    m = len(path)
    path = list(path)
    for _ in range(_TWO_OPT_MAX_PASSES):
        improved = False
        for i in range(1, m - 1):
            for j in range(i + 1, m):
                a, b = path[i - 1], path[i]
                c, d = path[j], path[(j + 1) % m]
                if w[a][c] + w[b][d] < w[a][b] + w[c][d]:
                    path[i : j + 1] = path[i : j + 1][::-1]
                    improved = True
        if not improved:
            break
    return path


def _counting_order(members: Sequence[Device]) -> list[int]:
    """The counting rule: fewest relayed edges by construction; index 0 (the anchor) first."""
    p_idx = [i for i, d in enumerate(members) if d.nat is Nat.PERMISSIVE]
    o_idx = [i for i, d in enumerate(members) if d.nat is Nat.ORDINARY]
    r_idx = [i for i, d in enumerate(members) if d.nat not in (Nat.PERMISSIVE, Nat.ORDINARY)]
    r, p, o = len(r_idx), len(p_idx), len(o_idx)
    if r == 0:
        cycle = list(range(len(members)))
    elif p == 0:
        cycle = r_idx + o_idx  # one run of R, one segment of O: the fewest boundaries
    else:
        runs = min(r, p) if o == 0 else max(1, min(r, p - 1))
        cycle = []
        for k in range(runs - 1):  # runs − 1 single R's, each followed by a single P
            cycle += [r_idx[k], p_idx[k]]
        cycle += r_idx[runs - 1 :]  # the last run holds the remaining R's
        cycle += p_idx[runs - 1 : runs] + o_idx + p_idx[runs:]  # P, then O's, then spare P's
    start = cycle.index(0)
    return cycle[start:] + cycle[:start]
