"""Algorithm 1 (PARTITION): exact chain-on-chain block placement for a fixed device order.

Device i costs `fixed(i) + n·per(i)` for n blocks and holds at most lim(i). The bottleneck of
any feasible division is one of those affine values, so the optimum is found by sorting the
O(k·m) candidates (line 1) and binary-searching for the smallest one FEASIBLE accepts
(line 2). FEASIBLE is one left-to-right greedy pass: each device takes the most blocks it can
within the bound, capped by lim(i) and by one block reserved for every later device.
Generating and sorting the candidates dominates: O(km log km).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import StageCost

__all__ = ["Division", "feasible", "partition"]


@dataclass(frozen=True)
class Division:
    """Block counts in device order and their bottleneck τ* (ms)."""

    counts: tuple[int, ...]
    bottleneck_ms: float


def _most_blocks(cost: StageCost, tau: float, cap: int) -> int:
    """⌊(τ − fixed)/per⌋, clamped to [0, cap], exact with respect to `cost.at`."""
    if cost.per_ms <= 0.0:
        return cap
    n = min(cap, max(0, math.floor((tau - cost.fixed_ms) / cost.per_ms)))
    # float division can land one off; settle against the very formula the candidates use
    while n < cap and cost.at(n + 1) <= tau:
        n += 1
    while n > 0 and cost.at(n) > tau:
        n -= 1
    return n


def feasible(
    blocks: int, costs: Sequence[StageCost], limits: Sequence[int], tau: float
) -> tuple[int, ...] | None:
    """FEASIBLE(k, τ): the greedy division whose every stage is within τ, or None."""
    m = len(costs)
    left = blocks
    counts: list[int] = []
    for i, (cost, limit) in enumerate(zip(costs, limits, strict=True)):
        if cost.fixed_ms > tau:
            return None
        later = m - 1 - i  # one block reserved for each device still to come
        n = min(_most_blocks(cost, tau, blocks), limit, left - later)
        if n < 1:
            return None
        counts.append(n)
        left -= n
    if left != 0:
        return None
    return tuple(counts)


def partition(blocks: int, costs: Sequence[StageCost], limits: Sequence[int]) -> Division | None:
    """PARTITION: the division of `blocks` minimising the bottleneck, or None if none fits."""
    if len(costs) != len(limits):
        raise ValueError("costs and limits must describe the same devices")
    # line 1: every value a bottleneck can take, sorted ascending
    candidates = sorted(
        {cost.at(n) for cost, limit in zip(costs, limits) for n in range(1, min(blocks, limit) + 1)}
    )
    if not candidates or feasible(blocks, costs, limits, candidates[-1]) is None:
        return None
    # line 2: the smallest feasible candidate (feasibility is monotone in τ)
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(blocks, costs, limits, candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    tau = candidates[lo]
    counts = feasible(blocks, costs, limits, tau)
    assert counts is not None
    return Division(counts, tau)
