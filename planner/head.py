"""Head placement by rotation (§V-C), with the anchor kept unless a rotation clearly wins.

Rotating a ring leaves every edge in place, so choosing the head does not disturb the
ordering: the planner solves PARTITION once per rotation (the head first, paying β_head/b̄
and holding fewer blocks) and keeps the cheapest. Members that share a machine are priced as
sharing it (cost.shared_cost). Overhead measurements are noisy, so the
anchor stays head unless some rotation's bottleneck τ* is below τ_anchor·(1 − µ), µ = 0.05.
Among equally cheap rotations the first one after the anchor in ring order wins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import Tier, block_limit, shared_cost
from planner.fleet import Device, Fleet
from planner.partition import Division, partition

__all__ = ["HEAD_MARGIN", "HeadChoice", "partition_with_head", "place_head"]

HEAD_MARGIN = 0.05  # µ: a rotation must beat the anchor by more than this fraction


@dataclass(frozen=True)
class HeadChoice:
    """The chosen head, the ring rotated to start at it, and its division (same order)."""

    head: str
    order: tuple[str, ...]
    division: Division


def _rotated(ring: Sequence[Device], start: int) -> list[Device]:
    return list(ring[start:]) + list(ring[:start])


def partition_with_head(
    ring: Sequence[Device], fleet: Fleet, tier: Tier, head: int, respect_memory: bool = True
) -> HeadChoice | None:
    """PARTITION for the rotation that starts at ring[head] (the head)."""
    order = _rotated(ring, head)
    costs = [shared_cost(d, fleet, tier, is_head=(i == 0)) for i, d in enumerate(order)]
    blocks = fleet.model.blocks
    if respect_memory:
        limits = [block_limit(d, fleet, is_head=(i == 0)) for i, d in enumerate(order)]
    else:
        limits = [blocks] * len(order)
    division = partition(blocks, costs, limits)
    if division is None:
        return None
    return HeadChoice(order[0].name, tuple(d.name for d in order), division)


def place_head(
    ring: Sequence[Device], fleet: Fleet, tier: Tier, respect_memory: bool = True
) -> HeadChoice | None:
    """Try every rotation of `ring` (which starts at the anchor); None when none fits.

    In the throughput tier arithmetic throughput does not price the head, so the head
    stays at the anchor and only that rotation is solved.
    """
    anchor = partition_with_head(ring, fleet, tier, 0, respect_memory)
    if tier is not Tier.FULL:
        return anchor
    tau_anchor = anchor.division.bottleneck_ms if anchor is not None else math.inf
    best: HeadChoice | None = None
    for start in range(1, len(ring)):
        choice = partition_with_head(ring, fleet, tier, start, respect_memory)
        if choice is None:
            continue
        if best is None or choice.division.bottleneck_ms < best.division.bottleneck_ms:
            best = choice
    if best is not None and best.division.bottleneck_ms < tau_anchor * (1.0 - HEAD_MARGIN):
        return best
    return anchor
