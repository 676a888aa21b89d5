"""Kafila's planner: measured devices in; ring order, head, division and admission out.

Pure functions of explicit inputs: no I/O, no clocks, no sockets, no globals. Entry points:
`parse_fleet(dict, model) -> Fleet` (raises `PlanInputError`, one line) and
`make_plan(fleet, policy) -> Plan` (`Plan.to_json()` is the `kafila plan --json` contract).

Decisions the issue leaves open, taken here:
- Tiers are triggered by missing measurements: a device's `bandwidth_gbps`, `overhead_us` or
  `tflops` that is absent or null was not measured (a present value must be valid, so zero or
  negative bandwidth is an input error). full: every device has bandwidth and overhead;
  throughput: otherwise, if every device has `tflops`; memory: otherwise. In the memory tier nothing is priced: `stage_ms` values and
  `bottleneck_ms` are null.
- The ring is a cycle ordered with the anchor fixed first; head placement only rotates it, so
  `ring` lists the members from the head, the edges run ring[i] → ring[i+1] and close back to
  the head, and blocks are contiguous in that order starting at the head.
- A member with no NAT class is treated as restrictive (the safe prediction, a relay); an edge
  with an end that has no RTT is unpriced (`ms` null). Ordering uses RTT pricing only when every
  member has an RTT, and the counting rule otherwise.
- Memory is checked in what a member holds (issue 10): a fleet's model may give a per-process
  term, the anchor's extra and the weights in the serving backend's forms (`process_bytes`,
  `anchor_bytes`, `block_resident_bytes`, `head_resident_bytes`; the host fills them from
  backends/memory.py); without them a block costs its file bytes, as before (`cost.member_bytes`).
- When nothing fits, the plan shows the division the cost model would choose with memory
  ignored, and `refused` names each member short of room in it, with the bytes it lacks.
- Baselines keep the head at the anchor and the planner's ring; exo's memory-proportional
  shares use largest remainder and give every member at least one block.

Modules, one part of §V each: `cost` (eq. 2, lim), `partition` (Algorithm 1), `head`
(rotation with margin µ), `ring` (ordering), `admission` (tiers and the memory check),
`baselines` (GPipe, exo), `plan` (the order of work), `fleet` (input validation), `context`
(the longest context the members' memory holds).

`dipsd` and `dipsd_milp` (import them by name; not re-exported): DiP-SD offline, the number of
verification batches, user-to-batch assignment and draft lengths for distributed speculative
decoding, by Dinkelbach over a MILP (pyscipopt, imported only when solving) with the paper's
baselines (`kafila plan dipsd`).
"""

from planner.admission import Refusal, choose_tier, refusals
from planner.baselines import memory_proportional_counts, uniform_counts
from planner.context import largest_context
from planner.cost import (
    StageCost,
    Tier,
    block_limit,
    bytes_per_block,
    member_bytes,
    short_bytes,
    slots_that_fit,
    stage_cost,
)
from planner.errors import PlanInputError
from planner.fleet import BYTES_PER_GB, Device, Fleet, Model, Nat, parse_fleet
from planner.head import HEAD_MARGIN, HeadChoice, partition_with_head, place_head
from planner.partition import Division, feasible, partition
from planner.plan import Plan, Policy, compare, make_plan, plan_fleet, ring_neighbour, ring_ranges
from planner.ring import (
    EXHAUSTIVE_MAX_MEMBERS,
    EdgeKind,
    RingEdge,
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
    "EdgeKind",
    "Fleet",
    "HeadChoice",
    "Model",
    "Nat",
    "Plan",
    "PlanInputError",
    "Policy",
    "RingEdge",
    "Refusal",
    "StageCost",
    "Tier",
    "block_limit",
    "bytes_per_block",
    "member_bytes",
    "choose_tier",
    "compare",
    "edge_between",
    "feasible",
    "largest_context",
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
    "ring_neighbour",
    "ring_ranges",
    "short_bytes",
    "slots_that_fit",
    "stage_cost",
    "uniform_counts",
]
