"""The longest context a session's members can hold: `largest_context(fleet, most, policy)`.

A session's context is the model's own by default (as llama-server takes it), capped by memory:
every member holds KV for context × concurrency positions on each of its blocks (cost.py), so a
longer context can leave a member short. Feasibility only grows as the context shrinks (less KV
in every member, the same weights), so a binary search over [1, most] finds the longest context
whose plan fits, planned exactly as the session would be (`make_plan` under `policy`).
"""

from __future__ import annotations

from dataclasses import replace

from planner.fleet import Fleet
from planner.plan import Policy, make_plan

__all__ = ["largest_context"]


def largest_context(fleet: Fleet, most: int, policy: Policy | str = Policy.KAFILA) -> int:
    """The longest context in 1..`most` at which `fleet` (at its declared concurrency) has a
    feasible plan; 0 when none fits even one position."""
    if most < 1:
        raise ValueError("most must be at least 1")

    def fits(context: int) -> bool:
        return make_plan(replace(fleet, context=context), policy).feasible

    if fits(most):
        return most
    lo, hi = 0, most  # fits(lo) (or lo == 0), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
