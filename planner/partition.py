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


_Terms = list[tuple[float, float, int]]  # (fixed(i), per(i), lim(i)) in device order


def _greedy(blocks: int, terms: _Terms, tau: float) -> tuple[int, ...] | None:
    """FEASIBLE's left-to-right pass over precomputed terms (the search's inner loop)."""
    m = len(terms)
    left = blocks
    counts = []
    for i, (fixed, per, limit) in enumerate(terms):
        if fixed > tau:  # line 10
            return None
        # line 13: ⌊(τ − fixed(i))/per(i)⌋, capped by lim(i) and the blocks later devices need
        cap = min(limit, left - (m - 1 - i))
        if per <= 0.0:
            n = cap
        else:
            n = min(cap, max(0, math.floor((tau - fixed) / per)))
            # the division can land one off in floating point: settle against the exact
            # candidate formula fixed + n·per (StageCost.at)
            while n < cap and fixed + (n + 1) * per <= tau:
                n += 1
            while n > 0 and fixed + n * per > tau:
                n -= 1
        if n < 1:  # line 14
            return None
        counts.append(n)
        left -= n
    if left != 0:  # line 19
        return None
    return tuple(counts)


def _terms(costs: Sequence[StageCost], limits: Sequence[int]) -> _Terms:
    if len(costs) != len(limits):
        raise ValueError("costs and limits must describe the same devices")
    return [(c.fixed_ms, c.per_ms, limit) for c, limit in zip(costs, limits)]


def feasible(
    blocks: int, costs: Sequence[StageCost], limits: Sequence[int], tau: float
) -> tuple[int, ...] | None:
    """FEASIBLE(k, τ): the greedy division whose every stage is within τ, or None.

    Each device takes the most blocks it can within τ and lim(i), leaving one block for
    every device still to come.
    """
    return _greedy(blocks, _terms(costs, limits), tau)


def partition(blocks: int, costs: Sequence[StageCost], limits: Sequence[int]) -> Division | None:
    """PARTITION: the division of `blocks` minimising the bottleneck, or None if none fits."""
    terms = _terms(costs, limits)
    # line 1: every value a bottleneck can take, sorted ascending
    candidates = sorted(
        {
            fixed + n * per  # = StageCost.at(n)
            for fixed, per, limit in terms
            for n in range(1, min(blocks, limit) + 1)
        }
    )
    if not candidates or _greedy(blocks, terms, candidates[-1]) is None:
        return None  # lines 3-4
    # line 2: the smallest feasible candidate (feasibility is monotone in τ)
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(blocks, terms, candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    tau = candidates[lo]
    counts = _greedy(blocks, terms, tau)  # line 6
    assert counts is not None
    return Division(counts, tau)
