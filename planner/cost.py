"""Eq. 2 of the Kafila paper: what a stage costs per token, and what a device can hold.

    c_i = o_i + n_i·β_block/b̄_i + [i = head]·β_head/b̄_i

split as Algorithm 1 states it into fixed(i) = o_i (+ β_head/b̄_i for the head) and
per(i) = β_block/b̄_i, so that a stage costs `fixed + n·per` for n blocks.

What a token reads is not always what a block holds: an MoE block reads its dense part and k of
its E experts (`Model.block_read_bytes`), and the head reads its lm_head and one embedding row
(`Model.head_read`): β above is those read bytes; memory (below) counts every byte held. Small
models are not bandwidth-bound: each block also pays its ops' dispatch, a fixed cost the probe
measures on the device (`Device.block_us`), and the head its own (`Device.head_us`: the
embedding, lm_head and pick), so in the full tier

    fixed(i) = o_i + s + [i = head]·(h_i + e + β_head/r_i),  per(i) = (u_i + β_block/r_i)·g

with u_i, h_i = 0 where the device did not measure them, and r_i the rate weights stream at
through the backend's quantized matmuls (`Device.block_gbps`), b̄_i where not measured. g, s, e
are the model's own (`Model.block_scale`, `stage_us`, `embed_us`): its real blocks timed on the host
against the host's probe (kafila/session/control/calibrate.py), 1, 0, 0 where not measured. A
member that shares its machine with others also pays `Model.shared_us` more a stage and
`Model.shared_scale` times a block: the others' forwards run between its own (unless it runs
under a CPU quota, `Device.cpu_quota`: its probe's sustained runs already hold the quota's
stalls, and caches refill while it stalls). That sustained cost is what the ring full gets of
a quota'd member; one request's stage runs in a burst the quota lets through, priced by
`quota_alone_ms` from the member's figures at its burst speed (`at_burst`) and the quota's
period (planner.plan's `Plan.alone_ms`).

Units: bandwidth in GB/s (1e9 bytes/s), overhead in µs, every cost returned in ms.
Bytes / (GB/s) = bytes / (b·1e9) s = bytes / (b·1e6) ms.

The throughput tier (§V-D) prices a block by arithmetic instead: two floating-point
operations per weight, counting one weight per byte, at the reported TFLOP/s, with no
overhead and no head term: per(i) = 2·β_block / (tflops·1e12) s. Its numbers are only
meaningful relative to each other (they rank devices, they do not predict ms).

    lim(i) = floor((memory_i − f_i) / (ρ_block + kv·context·concurrency)),
    f_i = π + [i = anchor]·α + [i = head]·ρ_head

and, for a division already chosen (n_i blocks each), the slots its memory leaves room for:

    slots(i) = floor((memory_i − f_i − n_i·ρ_block) / (n_i·kv·context))

Memory is priced in what a member really holds, not the file's bytes (issue 10): π is the
model's `process_bytes` (a member's fixed runtime: interpreter, backend plugin, tokenizer, QUIC,
API), α its `anchor_bytes` (the host's extra),
ρ_block / ρ_head its weights in the serving backend's forms (`Model.block_memory`,
`Model.head_memory`; β_block / β_head when a fleet does not give them, and π = 0). Costs per
token keep β (the bytes a token streams from the file's layout). `member_bytes` is the one
formula of a member's resident bytes; the bench and /status compare it with RSS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

from planner.fleet import Device, Fleet, Model

__all__ = [
    "StageCost",
    "Tier",
    "block_limit",
    "bytes_per_block",
    "member_bytes",
    "head_kv_bytes",
    "at_burst",
    "pick_ms",
    "quota_alone_ms",
    "shared_cost",
    "sharers",
    "short_bytes",
    "slots_that_fit",
    "stage_cost",
]

_MS_PER_US = 1e-3
QUOTA_PHASES = 64  # arrival phases within a quota period that quota_alone_ms averages over
_BYTES_PER_GB_MS = 1e6  # bytes moved in one ms at 1 GB/s
_FLOP_PER_TFLOP_MS = 1e9  # floating-point operations in one ms at 1 TFLOP/s
FLOP_PER_WEIGHT_BYTE = 2.0


class Tier(str, Enum):
    """How well the session is measured, best first (§V-D)."""

    FULL = "full"  # every member has bandwidth and overhead: eq. 2
    THROUGHPUT = "throughput"  # every member has TFLOP/s: per(i) from arithmetic, no head term
    MEMORY = "memory"  # nothing to price with: divide by memory


@dataclass(frozen=True)
class StageCost:
    """A stage's per-token cost, affine in the blocks it holds: fixed_ms + n·per_ms."""

    fixed_ms: float
    per_ms: float

    def at(self, blocks: int) -> float:
        """The stage's cost in ms with `blocks` blocks (the one formula every caller uses)."""
        return self.fixed_ms + blocks * self.per_ms


def stage_cost(device: Device, fleet: Fleet, tier: Tier, is_head: bool) -> StageCost:
    """fixed(i) and per(i) for `device` under `tier` (not defined for the memory tier)."""
    model = fleet.model
    if tier is Tier.FULL:
        if device.bandwidth_gbps is None or device.overhead_us is None:
            raise ValueError(f"device {device.name!r} is not measured for the full tier")
        per_byte_ms = 1.0 / (_rate(device) * _BYTES_PER_GB_MS)
        head = model.embed_us * _MS_PER_US + pick_ms(device, fleet)
        fixed = (device.overhead_us + model.stage_us) * _MS_PER_US + (head if is_head else 0.0)
        per_block = (device.block_us or 0.0) * _MS_PER_US + model.block_read_bytes * per_byte_ms
        if device.block_us is not None:  # probed the block graph: the model's own blocks scale it
            per_block *= model.block_scale
        # the others' work runs between its forwards (cold caches); not priced for a member under a
        # CPU quota: its probe's sustained runs already hold the quota's stalls, which caches
        # refill during
        if sharers(device, fleet) > 1 and device.cpu_quota is None:
            fixed += model.shared_us * _MS_PER_US
            per_block *= model.shared_scale
        return StageCost(fixed, per_block)
    if tier is Tier.THROUGHPUT:
        if device.tflops is None:
            raise ValueError(f"device {device.name!r} has no TFLOP/s for the throughput tier")
        flops = FLOP_PER_WEIGHT_BYTE * model.block_read_bytes
        return StageCost(0.0, flops / (device.tflops * _FLOP_PER_TFLOP_MS))
    raise ValueError("the memory tier prices nothing")


def pick_ms(device: Device, fleet: Fleet) -> float:
    """The head's token pick in the full tier: its fixed cost and the lm_head's bytes (part of
    the head's stage cost; the head times it apart from its stage's forward)."""
    return (device.head_us or 0.0) * _MS_PER_US + fleet.model.head_read / (_rate(device) * _BYTES_PER_GB_MS)


def at_burst(device: Device) -> Device:
    """`device` as it computes while its CPU quota lets it run: its probe's sustained figures at
    `cpu_burst`× the speed (times over it, rates times it), and no quota."""
    s = device.cpu_burst or 1.0

    def faster(v: float | None) -> float | None:
        return None if v is None else v * s

    def shorter(v: float | None) -> float | None:
        return None if v is None else v / s

    return replace(device, bandwidth_gbps=faster(device.bandwidth_gbps), block_gbps=faster(device.block_gbps),
                   tflops=faster(device.tflops), overhead_us=shorter(device.overhead_us),
                   block_us=shorter(device.block_us), head_us=shorter(device.head_us), cpu_quota=None,
                   cpu_burst=None)  # fmt: skip


def quota_alone_ms(device: Device, burst_ms: float, stage_ms: float, circuit_ms: float) -> float:
    """One request's stage time on a member under a CPU quota whose stage takes `burst_ms` while
    the quota lets it run (its cost `at_burst`) and `stage_ms` at its sustained rate, with a
    token coming round every `circuit_ms`.

    The quota lets it run b = P/s ms of every period P (s: `cpu_burst`), then stalls it to the
    period's end; b × r where the member measured its run after a rest (`cpu_run_ms`) r times
    the quota's share q·P (the kernel sees the share spent at its next tick). Where the
    k = max(1, P/circuit) tokens of a period fit in b, the stage runs whole at burst speed. Where one token's stage needs more than b, it runs until the budget
    is spent, waits for the next period, and so on: the mean over the phase of the period it
    arrives at (`_quota_wait_ms`). Where several tokens a period overflow it, the quota paces
    the ring: the sustained time."""
    s, period = device.cpu_burst, device.cpu_period_ms
    if device.cpu_quota is None or s is None or period is None or s <= 1.0:
        return stage_ms
    budget = period / s
    if device.cpu_run_ms is not None:
        budget *= max(1.0, device.cpu_run_ms / (device.cpu_quota * period))
    k = max(1.0, period / circuit_ms) if circuit_ms > 0 else 1.0
    if k * burst_ms <= budget:
        return burst_ms
    if k > 1.0:
        return stage_ms
    phases = [period * (i + 0.5) / QUOTA_PHASES for i in range(QUOTA_PHASES)]
    return min(stage_ms, sum(_quota_wait_ms(burst_ms, budget, period, p) for p in phases) / QUOTA_PHASES)


def _quota_wait_ms(work: float, budget: float, period: float, phase: float) -> float:
    """Wall ms for `work` ms of burst arriving `phase` ms into a quota period with its `budget`
    unspent: it runs until the budget or the period ends; a spent budget waits for the next."""
    elapsed, t, left = 0.0, phase, budget
    while True:
        run = min(work, left, period - t)
        work, left, t, elapsed = work - run, left - run, t + run, elapsed + run
        if work <= 1e-12:
            return elapsed
        elapsed += period - t  # the budget is spent or the period over: the next one refills it
        t, left = 0.0, budget


def _rate(device: Device) -> float:
    """GB/s weights stream at: through the backend's quantized matmuls where the probe measured
    it, else the plain read."""
    rate = device.block_gbps if device.block_gbps is not None else device.bandwidth_gbps
    if rate is None:
        raise ValueError(f"device {device.name!r} is not measured for the full tier")
    return rate


def sharers(device: Device, fleet: Fleet) -> int:
    """How many of the fleet's members run on `device`'s machine (itself included): 1 when it
    gave no machine identity."""
    if device.machine is None:
        return 1
    return sum(1 for d in fleet.devices if d.machine == device.machine)


def shared_cost(device: Device, fleet: Fleet, tier: Tier, is_head: bool) -> StageCost:
    """What PARTITION balances: a stage's cost times the members sharing its machine. Members of
    one machine compute one at a time (kafila/session/ring/cores.py), so with the ring full a
    machine is busy for the sum of its stages; pricing each of its s stages at s× its own time
    makes the bottleneck a machine's sum when they hold alike (and leaves a ring all on one
    machine divided as before: every stage scaled the same)."""
    cost = stage_cost(device, fleet, tier, is_head)
    s = sharers(device, fleet)
    return cost if s == 1 else StageCost(cost.fixed_ms * s, cost.per_ms * s)


def bytes_per_block(fleet: Fleet) -> float:
    """Resident bytes one block needs: its weights (backend's form), KV and (hybrid models) the
    requests' recurrent state at the declared load."""
    model = fleet.model
    kv = model.kv_bytes_per_token_per_block * fleet.context * fleet.concurrency
    return model.block_memory + kv + model.state_bytes_per_request_per_block * fleet.concurrency


def member_bytes(
    model: Model, blocks: int, is_head: bool, kv_tokens: float, is_anchor: bool = False, requests: int = 0
) -> float:
    """What a member holding `blocks` blocks (and the head) is expected to hold resident, with
    `kv_tokens` positions of KV per block (context × concurrency at the declared load) and
    `requests` requests' recurrent state (hybrid models):
    π + [anchor]·α + n·(ρ_block + kv·kv_tokens + σ·requests) + [head]·(ρ_head + head_kv). A member
    with no blocks (and not the head) holds nothing of the model."""
    if blocks <= 0 and not is_head:
        return 0.0
    per_block = (model.block_memory + model.kv_bytes_per_token_per_block * kv_tokens
                 + model.state_bytes_per_request_per_block * requests)  # fmt: skip
    context = kv_tokens / requests if requests > 0 else 0.0
    head = head_kv_bytes(model, context, requests) if is_head else 0.0
    return _fixed(model, is_head, is_anchor) + blocks * per_block + head


def head_kv_bytes(model: Model, context: float, requests: int) -> float:
    """What the head holds per request beside its blocks (`Model.head_bytes_per_token`: a draft
    head's KV and rows) at `context` positions, for `requests` requests and the parked ones."""
    if model.head_bytes_per_token <= 0 or requests <= 0:
        return 0.0
    return model.head_bytes_per_token * context * (requests + model.head_parked)


def _fixed(model: Model, is_head: bool, is_anchor: bool) -> float:
    anchor = model.anchor_bytes if is_anchor else 0.0
    return model.process_bytes + anchor + (model.head_memory if is_head else 0.0)


def block_limit(device: Device, fleet: Fleet, is_head: bool) -> int:
    """lim(i): the most blocks `device` can hold (0 when not even its fixed part fits)."""
    room = device.memory_bytes - _fixed(fleet.model, is_head, device.name == fleet.anchor)
    if is_head:
        room -= head_kv_bytes(fleet.model, fleet.context, fleet.concurrency)
    if room <= 0:
        return 0
    return math.floor(room / bytes_per_block(fleet))


def short_bytes(device: Device, fleet: Fleet, blocks: int, is_head: bool) -> int:
    """Bytes `device` lacks to hold `blocks` blocks (and the head); 0 when it fits."""
    needed = member_bytes(fleet.model, blocks, is_head, fleet.context * fleet.concurrency,
                          device.name == fleet.anchor, fleet.concurrency)
    return max(0, math.ceil(needed - device.memory_bytes))


def slots_that_fit(fleet: Fleet, blocks: Mapping[str, int], head: str, most: int) -> int:
    """The most concurrent requests (KV slots at the declared context, one per request on every
    stage) that every member can hold beside the weights of its `blocks`, capped at `most`:
    min_i slots(i). 0 when some member cannot hold even one. A model without KV bytes (or a
    member with no blocks) costs nothing per slot, so it allows `most`."""
    if most < 1:
        raise ValueError("most must be at least 1")
    model = fleet.model
    fit = most
    for device in fleet.devices:
        n = blocks.get(device.name, 0)
        is_head = device.name == head
        if n <= 0 and not (is_head and model.head_bytes_per_token > 0):
            continue
        fixed = _fixed(model, is_head, device.name == fleet.anchor)
        room = device.memory_bytes - fixed - n * model.block_memory
        per_slot = n * (model.kv_bytes_per_token_per_block * fleet.context + model.state_bytes_per_request_per_block)
        if is_head:  # the head's own per-request bytes: one slot's, and the parked ones' once
            per_slot += model.head_bytes_per_token * fleet.context
            room -= model.head_bytes_per_token * fleet.context * model.head_parked
        if room < per_slot:
            return 0
        if per_slot > 0:
            fit = min(fit, math.floor(room / per_slot))
    return fit
