"""The two divisions Kafila is compared against (§VII), priced by the same cost model.

- uniform (GPipe): every member the same number of blocks; the k mod m left over go one
  each to the first members in ring order (the head first).
- memory-proportional (exo): shares proportional to each member's memory, rounded by largest
  remainder (ties to the earlier member in ring order). A member rounded down to zero takes one
  block from the member holding the most, since every admitted member holds at least one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["memory_proportional_counts", "uniform_counts"]


def uniform_counts(blocks: int, members: int) -> tuple[int, ...]:
    if members < 1 or blocks < members:
        raise ValueError("need at least one block per member")
    base, extra = divmod(blocks, members)
    return tuple(base + (1 if i < extra else 0) for i in range(members))


def memory_proportional_counts(blocks: int, memories: Sequence[float]) -> tuple[int, ...]:
    m = len(memories)
    total = float(sum(memories))
    if m < 1 or blocks < m or total <= 0 or any(x <= 0 for x in memories):
        raise ValueError("need positive memories and at least one block per member")
    quotas = [blocks * x / total for x in memories]
    counts = [math.floor(q) for q in quotas]
    left = blocks - sum(counts)
    by_remainder = sorted(range(m), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    for i in range(m):
        if counts[i] == 0:
            donor = max(range(m), key=lambda j: (counts[j], -j))
            counts[donor] -= 1
            counts[i] = 1
    return tuple(counts)
