"""Kafila's planner: measured devices in; ring order, head, division and admission out.

Pure functions of explicit inputs: no I/O, no clocks, no sockets, no globals. See
`planner.plan` for the order of work and each module's docstring for its part of §V:
`cost` (eq. 2, lim), `partition` (Algorithm 1), `head` (rotation with margin µ),
`ring` (ordering), `admission` (tiers and the memory check), `baselines` (GPipe, exo).
"""

from planner.admission import Refusal, choose_tier, refusals
from planner.baselines import memory_proportional_counts, uniform_counts
from planner.cost import StageCost, Tier, block_limit, bytes_per_block, short_bytes, stage_cost
from planner.errors import PlanInputError
from planner.fleet import BYTES_PER_GB, Device, Fleet, Model, Nat, parse_fleet
from planner.head import HEAD_MARGIN, HeadChoice, partition_with_head, place_head
from planner.partition import Division, feasible, partition
from planner.plan import Plan, Policy, compare, make_plan, plan_fleet
from planner.ring import (
    EXHAUSTIVE_MAX_MEMBERS,
    Edge,
    EdgeKind,
    edge_between,
    order_ring,
    predicted_direct,
    relay_count,
    ring_edges,
)

__all__ = [
    "BYTES_PER_GB",
    "EXHAUSTIVE_MAX_MEMBERS",
    "HEAD_MARGIN",
    "Device",
    "Division",
    "Edge",
    "EdgeKind",
    "Fleet",
    "HeadChoice",
    "Model",
    "Nat",
    "Plan",
    "PlanInputError",
    "Policy",
    "Refusal",
    "StageCost",
    "Tier",
    "block_limit",
    "bytes_per_block",
    "choose_tier",
    "compare",
    "edge_between",
    "feasible",
    "make_plan",
    "memory_proportional_counts",
    "order_ring",
    "parse_fleet",
    "partition",
    "partition_with_head",
    "place_head",
    "plan_fleet",
    "predicted_direct",
    "refusals",
    "relay_count",
    "ring_edges",
    "short_bytes",
    "stage_cost",
    "uniform_counts",
]
