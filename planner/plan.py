"""`make_plan(fleet, policy) -> Plan`: ordering, head, division and admission in one call.

Order of work: pick the tier from what was measured; order the ring (anchor first); divide the
blocks by the policy — `kafila` runs PARTITION per rotation (full tier) or at the anchor
(throughput tier) and falls back to memory-proportional shares in the memory tier, `uniform`
and `memory` are the baselines with the head at the anchor; then the memory check.

When no division fits anywhere (PARTITION is infeasible for every rotation), the plan shows the
division the cost model would choose with memory ignored, and names each member that cannot
hold its share there and by how many bytes (`feasible` false).

The plan's `ring` starts with the head and the cycle closes back to it; `blocks` are
contiguous in ring order: the head holds blocks [0, n_head), the next member the following
n, and so on (see `Plan.block_ranges`). Stage costs are ms per token; in the memory tier
nothing is priced and `stage_ms`/`bottleneck_ms` are null. An edge with an unmeasured end
has `ms` null.

`Plan.from_json` reads `to_json`'s object back (what the host sends each member), checked and
bounded, raising `PlanInputError`; the placement (ring, head, blocks) must be there, the fields
that only describe the plan (feasible, tier, policy, stage_ms, edges, refused) may be absent.
Block ranges, a member's successor and predecessor and the predicted tok/s are derived here and
nowhere else (`ring_ranges`, `ring_neighbour`, `Plan.predicted_tok_s`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from planner.admission import Refusal, choose_tier, refusals
from planner.baselines import memory_proportional_counts, uniform_counts
from planner.cost import Tier, at_burst, pick_ms, quota_alone_ms, stage_cost
from planner.errors import PlanInputError
from planner.fleet import Device, Fleet, parse_fleet
from planner.head import place_head
from planner.ring import EdgeKind, RingEdge, order_ring, ring_edges

__all__ = ["Plan", "Policy", "compare", "make_plan", "plan_fleet", "ring_neighbour", "ring_ranges"]

_JSON_DIGITS = 6
MAX_PLAN_MEMBERS = 256  # members in one plan read back (a session is far smaller)
MAX_PLAN_NAME_CHARS = 64  # as a roster name (kafila.net.roster.MAX_NAME_CHARS)
MAX_PLAN_BLOCKS = 100_000  # blocks in all
MAX_STAGE_MS = 1e9
MAX_SHORT_BYTES = 1 << 62
ALONE_ROUNDS = 8  # rounds of the quota'd stages' fixed point (planner.plan._alone_ms)


def ring_ranges(
    ring: tuple[str, ...] | list[str], counts: tuple[int, ...] | list[int]
) -> dict[str, tuple[int, int]]:
    """Each member's half-open block range [start, end), contiguous in ring order from ring[0]."""
    ranges: dict[str, tuple[int, int]] = {}
    start = 0
    for name, n in zip(ring, counts, strict=True):
        ranges[name] = (start, start + n)
        start += n
    return ranges


def ring_neighbour(ring: tuple[str, ...] | list[str], name: str, step: int = 1) -> str:
    """The member `step` places after `name` around the ring (1: its successor, -1: its
    predecessor); the ring closes back to ring[0]. ValueError when `name` is not in it."""
    return ring[(list(ring).index(name) + step) % len(ring)]


class Policy(str, Enum):
    KAFILA = "kafila"  # the planner
    UNIFORM = "uniform"  # GPipe
    MEMORY = "memory"  # exo's memory-proportional


@dataclass(frozen=True)
class Plan:
    """A session plan; the per-member tuples follow `ring` (head first)."""

    feasible: bool
    tier: Tier
    policy: Policy
    head: str
    ring: tuple[str, ...]
    blocks: tuple[int, ...]
    stage_ms: tuple[float, ...] | None  # None in the memory tier
    edges: tuple[RingEdge, ...]
    refused: tuple[Refusal, ...]
    # each member's machine identity (ring order); None: every member counts as its own machine
    machines: tuple[str, ...] | None = None
    # of the head's stage_ms, its token pick (the lm_head's bytes and the pick's fixed cost)
    head_ms: float | None = None
    # one request's stage times where they differ from stage_ms: a member under a CPU quota runs
    # one request's stage in a burst the quota lets through (stage_ms: its sustained time, what
    # the ring full gets); None when no member is under a measured quota
    alone_ms: tuple[float, ...] | None = None

    @property
    def machine_ms(self) -> dict[str, float] | None:
        """Each machine's stages summed (members of one machine compute one at a time)."""
        if self.stage_ms is None:
            return None
        names = self.machines or self.ring
        busy: dict[str, float] = {}
        for machine, ms in zip(names, self.stage_ms, strict=True):
            busy[machine] = busy.get(machine, 0.0) + ms
        return busy

    @property
    def bottleneck_ms(self) -> float | None:
        """The busiest machine's time a token: one stage's, or the sum of a machine's stages."""
        busy = self.machine_ms
        return None if busy is None else max(busy.values())

    @property
    def imbalance(self) -> float | None:
        """Slowest stage over fastest."""
        if self.stage_ms is None or min(self.stage_ms) <= 0:
            return None
        return max(self.stage_ms) / min(self.stage_ms)

    @property
    def utilisation(self) -> float | None:
        """Mean stage over the bottleneck: the share of device-time spent computing."""
        if self.stage_ms is None or max(self.stage_ms) <= 0:
            return None
        return sum(self.stage_ms) / len(self.stage_ms) / max(self.stage_ms)

    @property
    def edges_ms(self) -> float:
        """Summed priced edge latency (unpriced edges count as 0)."""
        return sum(edge.ms for edge in self.edges if edge.ms is not None)

    @property
    def predicted_tok_s(self) -> float | None:
        """1 / (Σ stages + Σ edges), one request at batch size one (its stages: alone_ms)."""
        stages = self.alone_ms or self.stage_ms
        if stages is None:
            return None
        circuit_ms = sum(stages) + self.edges_ms
        return 1000.0 / circuit_ms if circuit_ms > 0 else None

    def block_ranges(self) -> dict[str, tuple[int, int]]:
        """Each member's half-open block range [start, end), contiguous in ring order."""
        return ring_ranges(self.ring, self.blocks)

    def successor(self, name: str) -> str:
        return ring_neighbour(self.ring, name, 1)

    def predecessor(self, name: str) -> str:
        return ring_neighbour(self.ring, name, -1)

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        """`to_json`'s object back as a Plan (PlanInputError, one line, when it is not one)."""
        if not isinstance(data, Mapping):
            raise PlanInputError("a plan must be an object")
        ring = data.get("ring")
        if not isinstance(ring, list | tuple) or not 1 <= len(ring) <= MAX_PLAN_MEMBERS:
            raise PlanInputError(f"plan.ring must list 1..{MAX_PLAN_MEMBERS} members")
        for name in ring:
            if not isinstance(name, str) or not 1 <= len(name) <= MAX_PLAN_NAME_CHARS:
                raise PlanInputError(
                    f"plan.ring: each member is a name of 1..{MAX_PLAN_NAME_CHARS} characters"
                )
        if len(set(ring)) != len(ring):
            raise PlanInputError("plan.ring names a member twice")
        head = data.get("head")
        if head != ring[0]:
            raise PlanInputError("plan.head must be the first member of plan.ring")
        blocks = data.get("blocks")
        if not isinstance(blocks, Mapping) or set(blocks) != set(ring):
            raise PlanInputError("plan.blocks must count blocks for exactly the ring's members")
        counts = tuple(_count(blocks[n], f"plan.blocks[{n!r}]", MAX_PLAN_BLOCKS) for n in ring)
        if sum(counts) > MAX_PLAN_BLOCKS:
            raise PlanInputError(f"plan.blocks: more than {MAX_PLAN_BLOCKS} blocks")
        try:
            tier = Tier(data.get("tier", Tier.MEMORY.value))
            policy = Policy(data.get("policy", Policy.KAFILA.value))
        except ValueError:
            raise PlanInputError("plan.tier or plan.policy is not one the planner knows") from None
        feasible = data.get("feasible", True)
        if not isinstance(feasible, bool):
            raise PlanInputError("plan.feasible must be true or false")
        return cls(
            feasible=feasible,
            tier=tier,
            policy=policy,
            head=head,
            ring=tuple(ring),
            blocks=counts,
            stage_ms=_stage_ms(data.get("stage_ms"), ring),
            edges=_edges(data.get("edges", ()), ring),
            refused=_refused(data.get("refused", ())),
            machines=_machines(data.get("machines"), ring),
            head_ms=_ms(data.get("head_ms"), "plan.head_ms"),
            alone_ms=_stage_ms(data.get("alone_ms"), ring, "alone_ms"),
        )

    def to_json(self) -> dict[str, Any]:
        """The `kafila plan --json` contract."""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value, _JSON_DIGITS)

        stages = self.stage_ms if self.stage_ms is not None else (None,) * len(self.ring)
        out = {
            "feasible": self.feasible,
            "tier": self.tier.value,
            "policy": self.policy.value,
            "head": self.head,
            "ring": list(self.ring),
            "blocks": dict(zip(self.ring, self.blocks, strict=True)),
            "stage_ms": {name: ms(s) for name, s in zip(self.ring, stages, strict=True)},
            "bottleneck_ms": ms(self.bottleneck_ms),
            "edges": [
                {"from": e.src, "to": e.dst, "kind": e.kind.value, "ms": ms(e.ms)}
                for e in self.edges
            ],
            "refused": [{"device": r.device, "short_bytes": r.short_bytes} for r in self.refused],
        }
        if self.machines is not None:  # members that share a machine's cores
            out["machines"] = dict(zip(self.ring, self.machines, strict=True))
        if self.head_ms is not None:
            out["head_ms"] = ms(self.head_ms)
        if self.alone_ms is not None:
            out["alone_ms"] = {name: ms(s) for name, s in zip(self.ring, self.alone_ms, strict=True)}
        return out


def make_plan(fleet: Fleet, policy: Policy | str = Policy.KAFILA) -> Plan:
    """Plan `fleet` under `policy` (a Policy or its name)."""
    policy = Policy(policy)
    tier = choose_tier(fleet.devices)
    ring = order_ring(fleet.devices, fleet.anchor)  # anchor first
    order, counts = _divide(ring, fleet, tier, policy)
    stages = head_ms = alone = None
    edges = ring_edges(order)
    if tier is not Tier.MEMORY:
        stages = tuple(
            stage_cost(d, fleet, tier, is_head=(i == 0)).at(n)
            for i, (d, n) in enumerate(zip(order, counts, strict=True))
        )
        head_ms = pick_ms(order[0], fleet) if tier is Tier.FULL else 0.0
        if tier is Tier.FULL:
            alone = _alone_ms(order, counts, fleet, stages, sum(e.ms for e in edges if e.ms is not None))
    refused = refusals(order, counts, fleet)
    return Plan(
        feasible=not refused,
        tier=tier,
        policy=policy,
        head=order[0].name,
        ring=tuple(d.name for d in order),
        blocks=counts,
        stage_ms=stages,
        edges=edges,
        refused=refused,
        machines=_machine_names(order),
        head_ms=head_ms,
        alone_ms=alone,
    )


def _alone_ms(order: tuple[Device, ...], counts: tuple[int, ...], fleet: Fleet, stages: tuple[float, ...],
              edges_ms: float) -> tuple[float, ...] | None:
    """One request's stage times where a member's CPU quota lets its stage through in a burst
    (planner.cost.quota_alone_ms), None where no member's is measured. A quota'd stage's time
    depends on the circuit, which depends on it: a few rounds settle it (a longer circuit asks
    less of each period)."""
    if not any(d.cpu_quota is not None and d.cpu_burst for d in order):
        return None
    burst = [stage_cost(at_burst(d), fleet, Tier.FULL, is_head=i == 0).at(n)
             for i, (d, n) in enumerate(zip(order, counts, strict=True))]  # fmt: skip
    alone = stages
    for _ in range(ALONE_ROUNDS):
        circuit = sum(alone) + edges_ms
        alone = tuple(quota_alone_ms(d, b, ms, circuit) for d, b, ms in zip(order, burst, stages, strict=True))
    return alone


def _machine_names(order: tuple[Device, ...]) -> tuple[str, ...] | None:
    """Each member's machine (its own name where it gave none); None when no two share one."""
    names = tuple(d.machine or f"member:{d.name}" for d in order)
    return names if len(set(names)) < len(names) else None


def _divide(
    ring: tuple[Device, ...], fleet: Fleet, tier: Tier, policy: Policy
) -> tuple[tuple[Device, ...], tuple[int, ...]]:
    """The ring rotated to start at the head, and the block counts in that order."""
    blocks = fleet.model.blocks
    if policy is Policy.UNIFORM:
        return ring, uniform_counts(blocks, len(ring))
    if policy is Policy.MEMORY or tier is Tier.MEMORY:
        return ring, memory_proportional_counts(blocks, [d.memory_gb for d in ring])
    choice = place_head(ring, fleet, tier)
    if choice is None:  # nothing fits: show the cost-optimal division and who is short
        choice = place_head(ring, fleet, tier, respect_memory=False)
    assert choice is not None  # without memory limits every division with k >= m is feasible
    by_name = {d.name: d for d in ring}
    return tuple(by_name[name] for name in choice.order), choice.division.counts


def plan_fleet(
    data: Mapping[str, Any], model: str | None = None, policy: Policy | str = Policy.KAFILA
) -> Plan:
    """Parse a fleet object (raises PlanInputError) and plan it."""
    return make_plan(parse_fleet(data, model), policy)


def compare(fleet: Fleet) -> dict[Policy, Plan]:
    """The planner's plan and both baselines, for Table IV."""
    return {policy: make_plan(fleet, policy) for policy in Policy}


def _count(value: Any, what: str, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise PlanInputError(f"{what} must be an integer 0..{high}")
    return value


def _ms(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanInputError(f"{what} must be null or a number of ms 0..{MAX_STAGE_MS:g}")
    if not 0 <= value <= MAX_STAGE_MS:
        raise PlanInputError(f"{what} must be null or a number of ms 0..{MAX_STAGE_MS:g}")
    return float(value)


def _stage_ms(value: Any, ring: list[str], key: str = "stage_ms") -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not set(value) <= set(ring):
        raise PlanInputError(f"plan.{key} must map the ring's members to ms")
    stages = [_ms(value.get(n), f"plan.{key}[{n!r}]") for n in ring]
    if all(s is None for s in stages):
        return None  # the memory tier prices nothing
    if any(s is None for s in stages):
        raise PlanInputError(f"plan.{key} prices some members and not others")
    return tuple(s for s in stages if s is not None)


def _edges(value: Any, ring: list[str]) -> tuple[RingEdge, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_PLAN_MEMBERS:
        raise PlanInputError(f"plan.edges must list at most {MAX_PLAN_MEMBERS} edges")
    out = []
    for e in value:
        if not isinstance(e, Mapping) or e.get("from") not in ring or e.get("to") not in ring:
            raise PlanInputError("plan.edges: each edge runs from a ring member to a ring member")
        try:
            kind = EdgeKind(e.get("kind"))
        except ValueError:
            raise PlanInputError("plan.edges: an edge's kind is direct or relay") from None
        out.append(RingEdge(e["from"], e["to"], kind, _ms(e.get("ms"), "plan.edges[].ms")))
    return tuple(out)


def _machines(value: Any, ring: list[str]) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != set(ring):
        raise PlanInputError("plan.machines must name a machine for exactly the ring's members")
    for n in ring:
        if not isinstance(value[n], str) or not 1 <= len(value[n]) <= MAX_PLAN_NAME_CHARS + 8:
            raise PlanInputError(f"plan.machines[{n!r}] must be a short machine name")
    return tuple(value[n] for n in ring)


def _refused(value: Any) -> tuple[Refusal, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_PLAN_MEMBERS:
        raise PlanInputError(f"plan.refused must list at most {MAX_PLAN_MEMBERS} members")
    out = []
    for r in value:
        device = r.get("device") if isinstance(r, Mapping) else None
        if not isinstance(device, str) or len(device) > MAX_PLAN_NAME_CHARS:
            raise PlanInputError("plan.refused: each entry names a device")
        short = _count(r.get("short_bytes"), "plan.refused[].short_bytes", MAX_SHORT_BYTES)
        out.append(Refusal(device, short))
    return tuple(out)
