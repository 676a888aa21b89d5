"""Admission (§V-D): which tier a session is planned in, and who cannot hold their share.

Tiers, each better informed than the one below, triggered by what the members reported:
- full: every member has `bandwidth_gbps` and `overhead_us` (not null) → eq. 2, head placement
  by rotation;
- throughput: otherwise, when every member has `tflops` → the same search with per(i) from
  arithmetic throughput, no head term, the head stays at the anchor;
- memory: otherwise (nothing, or not everyone, measured) → blocks in proportion to memory,
  head at the anchor, stages unpriced (null).
Then one memory check against lim(i) at the declared context and concurrency: each member
whose share does not fit is named with the bytes it lacks, and the plan is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import Tier, block_limit, short_bytes
from planner.fleet import Device, Fleet

__all__ = ["Refusal", "choose_tier", "refusals"]


@dataclass(frozen=True)
class Refusal:
    """A member that cannot hold its share: how many bytes it is short."""

    device: str
    short_bytes: int


def choose_tier(devices: Sequence[Device]) -> Tier:
    if all(d.bandwidth_gbps is not None and d.overhead_us is not None for d in devices):
        return Tier.FULL
    if all(d.tflops is not None for d in devices):
        return Tier.THROUGHPUT
    return Tier.MEMORY


def refusals(order: Sequence[Device], counts: Sequence[int], fleet: Fleet) -> tuple[Refusal, ...]:
    """The members (order[0] is the head) whose block count exceeds lim(i)."""
    found = []
    for i, (device, n) in enumerate(zip(order, counts, strict=True)):
        is_head = i == 0
        if n > block_limit(device, fleet, is_head):
            found.append(Refusal(device.name, max(1, short_bytes(device, fleet, n, is_head))))
    return tuple(found)
