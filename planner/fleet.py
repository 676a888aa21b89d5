"""The fleet: typed, frozen, validated descriptions of a session's model and members.

`parse_fleet(data, model=None)` turns the fleet contract (a JSON object, see the planner
issue and `fleets/*.json`) into a `Fleet`, or raises `PlanInputError` with one line.

Units follow the contract: GB means 10**9 bytes, bandwidth is GB/s, overhead µs, RTT ms.

Required: `context`, `concurrency`, `anchor`, the model's five fields, and each device's
`name` and `memory_gb`. Optional model fields for memory (planner.cost): `process_bytes` (a
member's fixed bytes), `anchor_bytes` (the anchor's extra), `block_resident_bytes` and
`head_resident_bytes` (weights in the serving backend's forms; absent: `block_bytes` and
`head_bytes`). A measurement (`bandwidth_gbps`, `overhead_us`, `tflops`, `rtt_ms`, `nat`) that
is absent or `null` means the device could not measure it: that is what moves a session down an
admission tier (see `planner.admission`), so it is not an input error. A measurement that is
present must be valid (bandwidth and TFLOP/s > 0, overhead and RTT >= 0).
Unknown keys (`site`, `source`, ...) are ignored.

Every number is bounded, not only typed (issue 38: a member's descriptor is an input): finite, not
negative, and under a ceiling far above any real machine (`MAX_*` below), so that 1e308 GB of
memory, NaN bandwidth or "lots" is a `PlanInputError` naming the field, never an OverflowError
deep in the cost model.

Mixture-of-experts blocks (issue 34) keep two figures: `block_bytes` is every weight of a block
(memory, admission), and a token reads only the dense part and `experts_used` of `expert_count`
experts of `expert_bytes` each (`Model.block_read_bytes`; B rows read the expected union,
`Model.read_bytes`). `head_read_bytes` is what the head reads a token (the lm_head matrix and one
embedding row; absent: `head_bytes`). Per device, besides bandwidth and overhead, the probe
may give `block_us` (a block's fixed compute beyond its bytes: the backend's dispatch of its
ops, measured), `block_gbps` (the rate weights stream at through the backend's quantized
matrix-vector products, which a token's bytes pay instead of the plain read `bandwidth_gbps`
measures), `head_us` (the head's, likewise), `machine` (an identity members on one
computer share: they compute one at a time, planner.plan prices them so), `cpu_quota` (the
CPUs a cgroup quota allows the member), `cpu_period_ms` (the quota's period), `cpu_burst`
(how many times faster than its sustained rate the member computes while the quota lets it
run) and `cpu_run_ms` (the CPU ms it computes after a rest before the quota stalls it: more
than its share of a period, the kernel seeing it spent at a tick): the other figures are
sustained rates, and planner.cost prices one request's stage as the burst the quota lets
through, with the stalls it meets when a stage needs more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from planner.errors import PlanInputError

__all__ = ["BYTES_PER_GB", "Device", "Fleet", "Model", "Nat", "parse_fleet"]

BYTES_PER_GB = 1e9
# Ceilings on a fleet's numbers: far above any household machine, low enough that products of
# them (bytes × tokens × requests) stay finite floats.
MAX_MEMORY_GB = 1e6
MAX_BANDWIDTH_GBPS = 1e6
MAX_OVERHEAD_US = 1e8  # 100 s a step
MAX_TFLOPS = 1e6
MAX_RTT_MS = 1e6
MAX_CPUS = 1e5
MAX_PERIOD_MS = 1e4  # a CFS period (the kernel allows 1 ms .. 1 s)
MAX_SCALE = 1e3  # a calibration ratio (Model.block_scale, shared_scale)
MAX_BYTES = 1e15  # one block's or the head's bytes
MAX_BLOCKS = 100_000
MAX_PARKED = 1024  # finished requests a head keeps state for
MAX_CONTEXT_TOKENS = 1 << 24
MAX_CONCURRENCY = 1 << 16
MAX_EXPERTS = 1 << 16
MAX_DEVICES = 256
MAX_NAME_CHARS = 256


class Nat(str, Enum):
    """A member's NAT behaviour class (RFC 4787, as Kafila §V-B groups it)."""

    PERMISSIVE = "permissive"
    ORDINARY = "ordinary"
    RESTRICTIVE = "restrictive"


@dataclass(frozen=True)
class Model:
    """The byte sizes the cost model needs; identical for every device."""

    name: str
    blocks: int  # transformer blocks k
    block_bytes: float  # β_block, bytes of one block's weights
    head_bytes: float  # β_head, embedding + unembedding bytes
    kv_bytes_per_token_per_block: float  # KV cache bytes per token per block
    # Memory in the serving backend's forms (optional; absent: the file's bytes, no fixed term).
    process_bytes: float = 0.0  # what a member process holds before any weight (runtime, API)
    block_resident_bytes: float | None = None  # one block's weights as the backend holds them
    head_resident_bytes: float | None = None  # the head's (embedding, lm_head, sampler) likewise
    anchor_bytes: float = 0.0  # the anchor's extra: it hosts the session (serves weights, digests)
    # Mixture of experts: E experts of `expert_bytes` each in a block, k read per token (0: dense).
    expert_count: int = 0
    experts_used: int = 0
    expert_bytes: float = 0.0
    head_read_bytes: float | None = None  # what a token reads at the head (absent: head_bytes)
    # Hybrid (recurrent) models: a request's fixed state per block (a mean over the blocks: the
    # delta-net layers' conv and matrix states), held per request whatever its length (0: none).
    state_bytes_per_request_per_block: float = 0.0
    # What the head holds per position of each request beside its blocks (0: nothing): a draft
    # head's own KV and the rows it keeps (--speculate mtp), for every request and for
    # `head_parked` finished ones kept for their conversations' next turns.
    head_bytes_per_token: float = 0.0
    head_parked: int = 0
    # the model's own blocks timed on the host against its probe (kafila/session/control/calibrate.py):
    block_scale: float = 1.0  # a block's time over what the probe's figures predict for its bytes
    stage_us: float = 0.0  # a stage's fixed time beyond the probe's dispatch overhead, µs
    embed_us: float = 0.0  # the head stage's token embedding, µs
    shared_scale: float = 1.0  # a block's time, members sharing a machine, over its time alone
    shared_us: float = 0.0  # the fixed time members sharing a machine add, µs

    @property
    def head_read(self) -> float:
        """Bytes the head reads for one token (the lm_head matrix, one embedding row)."""
        return self.head_bytes if self.head_read_bytes is None else self.head_read_bytes

    @property
    def block_read_bytes(self) -> float:
        """Bytes one token reads of one block: every weight of a dense block; of an MoE block the
        dense part and k of its E experts."""
        return self.read_bytes(1)

    def read_bytes(self, rows: int) -> float:
        """Bytes a step of `rows` rows (users, drafts) reads of one block: the dense part and the
        expected union of the experts the rows choose, E·(1 − (1 − k/E)^rows)·expert_bytes
        (each row picks k of E; the union is read once)."""
        if self.expert_count <= 0:
            return self.block_bytes
        e, k = self.expert_count, self.experts_used
        dense = self.block_bytes - e * self.expert_bytes
        return dense + e * (1.0 - (1.0 - k / e) ** max(1, rows)) * self.expert_bytes

    @property
    def block_memory(self) -> float:
        """Resident bytes of one block's weights (β_block when the backend's form is not given)."""
        return self.block_bytes if self.block_resident_bytes is None else self.block_resident_bytes

    @property
    def head_memory(self) -> float:
        """Resident bytes of the head (β_head when the backend's form is not given)."""
        return self.head_bytes if self.head_resident_bytes is None else self.head_resident_bytes


@dataclass(frozen=True)
class Device:
    """One member as it reported itself; None means "not measured"."""

    name: str
    memory_gb: float  # room for weights and KV cache, GB (1e9 bytes)
    bandwidth_gbps: float | None  # measured memory bandwidth b̄_i, GB/s
    overhead_us: float | None  # per-token dispatch overhead o_i, µs
    rtt_ms: float | None = None  # round trip to the rendezvous, ms
    nat: Nat | None = None  # NAT behaviour class
    tflops: float | None = None  # arithmetic throughput, TFLOP/s
    block_us: float | None = None  # a block's fixed compute beyond its bytes (dispatch), µs
    block_gbps: float | None = None  # the rate a block's weights stream at in its matmuls, GB/s
    head_us: float | None = None  # the head's fixed compute (embedding, lm_head, pick), µs
    machine: str | None = None  # members on one machine share its cores (one computes at a time)
    cpu_quota: float | None = None  # CPUs a quota (cgroup) allows this member; None: none set
    cpu_period_ms: float | None = None  # the quota's period (CFS), ms
    cpu_burst: float | None = None  # its speed while the quota lets it run over its sustained speed
    cpu_run_ms: float | None = None  # CPU ms it computes after a rest before the quota stalls it

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * BYTES_PER_GB


@dataclass(frozen=True)
class Fleet:
    """A session to plan: its members (in the order given), anchor, model and load."""

    context: int  # declared context length, tokens
    concurrency: int  # declared concurrent requests
    anchor: str  # the member that opened the session
    model: Model
    devices: tuple[Device, ...]

    def device(self, name: str) -> Device:
        for device in self.devices:
            if device.name == name:
                return device
        raise KeyError(name)


def parse_fleet(data: Any, model: str | None = None) -> Fleet:
    """Validate a fleet object (already decoded from JSON) and pick its model.

    `model` names an entry of `"models"`; it may be omitted when the fleet has a single
    `"model"` or a `"models"` table with one entry.
    """
    if not isinstance(data, Mapping):
        raise PlanInputError(f"fleet must be a JSON object, not {_kind(data)}")
    context = _integer(data, "context", "fleet", 1, MAX_CONTEXT_TOKENS)
    concurrency = _integer(data, "concurrency", "fleet", 1, MAX_CONCURRENCY)
    chosen = _choose_model(data, model)
    devices = _devices(data)
    anchor = _string(data, "anchor", "fleet")
    names = [device.name for device in devices]
    if anchor not in names:
        raise PlanInputError(
            f"fleet anchor {anchor!r} is not one of its devices ({', '.join(names)})"
        )
    if len(devices) > chosen.blocks:
        raise PlanInputError(
            f"fleet has more devices ({len(devices)}) than model {chosen.name!r} has blocks "
            f"({chosen.blocks}); every device needs at least one block"
        )
    return Fleet(context, concurrency, anchor, chosen, devices)


def _choose_model(data: Mapping[str, Any], name: str | None) -> Model:
    if "model" in data and "models" in data:
        raise PlanInputError('fleet has both "model" and "models"; keep one')
    if "model" in data:
        parsed = _model(data["model"], None)
        if name is not None and name != parsed.name:
            raise PlanInputError(f"fleet describes model {parsed.name!r}, not {name!r}")
        return parsed
    if "models" not in data:
        raise PlanInputError('fleet is missing "model" (or a "models" table)')
    table = data["models"]
    if not isinstance(table, Mapping) or not table:
        raise PlanInputError('fleet "models" must be a non-empty object of name: model')
    if name is None:
        if len(table) > 1:
            raise PlanInputError(
                f"fleet has several models ({', '.join(map(str, table))}); choose one with --model"
            )
        name = str(next(iter(table)))
    if name not in table:
        raise PlanInputError(
            f"model {name!r} is not in the fleet (have: {', '.join(map(str, table))})"
        )
    return _model(table[name], name)


def _model(raw: Any, key: str | None) -> Model:
    if not isinstance(raw, Mapping):
        raise PlanInputError(f"model must be an object, not {_kind(raw)}")
    where = f"model {key!r}" if key else "model"
    name = key if key is not None and "name" not in raw else _string(raw, "name", where)
    where = f"model {name!r}"
    block_bytes = _number(raw, "block_bytes", where, positive=True, high=MAX_BYTES)
    experts = _experts(raw, where, block_bytes)
    return Model(
        name=name,
        blocks=_integer(raw, "blocks", where, 1, MAX_BLOCKS),
        block_bytes=block_bytes,
        head_bytes=_number(raw, "head_bytes", where, positive=False, high=MAX_BYTES),
        kv_bytes_per_token_per_block=_number(
            raw, "kv_bytes_per_token_per_block", where, positive=False, high=MAX_BYTES
        ),
        process_bytes=_optional(raw, "process_bytes", where) or 0.0,
        block_resident_bytes=_optional(raw, "block_resident_bytes", where),
        head_resident_bytes=_optional(raw, "head_resident_bytes", where),
        anchor_bytes=_optional(raw, "anchor_bytes", where) or 0.0,
        expert_count=experts[0],
        experts_used=experts[1],
        expert_bytes=experts[2],
        head_read_bytes=_optional(raw, "head_read_bytes", where),
        state_bytes_per_request_per_block=_optional(raw, "state_bytes_per_request_per_block", where) or 0.0,
        head_bytes_per_token=_optional(raw, "head_bytes_per_token", where) or 0.0,
        head_parked=_integer(raw, "head_parked", where, 0, MAX_PARKED) if "head_parked" in raw else 0,
        block_scale=_calibration(raw, "block_scale", where, 1.0, MAX_SCALE),
        stage_us=_calibration(raw, "stage_us", where, 0.0, MAX_OVERHEAD_US),
        embed_us=_calibration(raw, "embed_us", where, 0.0, MAX_OVERHEAD_US),
        shared_scale=_calibration(raw, "shared_scale", where, 1.0, MAX_SCALE),
        shared_us=_calibration(raw, "shared_us", where, 0.0, MAX_OVERHEAD_US),
    )


def _calibration(raw: Mapping[str, Any], key: str, where: str, default: float, high: float) -> float:
    """A calibration figure of the model: absent or null → `default`, else a number 0..high
    (a scale must be above 0)."""
    if raw.get(key) is None:
        return default
    return _number(raw, key, where, positive=default > 0, high=high)


def _experts(raw: Mapping[str, Any], where: str, block_bytes: float) -> tuple[int, int, float]:
    """(E, k, bytes of one expert) of an MoE block; (0, 0, 0.0) for a dense one."""
    keys = ("expert_count", "experts_used", "expert_bytes")
    present = [k for k in keys if raw.get(k) is not None]
    if not present:
        return 0, 0, 0.0
    if len(present) != len(keys):
        raise PlanInputError(f"{where}: an MoE model gives all of {', '.join(keys)}")
    count = _integer(raw, "expert_count", where, 1, MAX_EXPERTS)
    used = _integer(raw, "experts_used", where, 1, count)
    each = _number(raw, "expert_bytes", where, positive=True, high=MAX_BYTES)
    if count * each > block_bytes:
        raise PlanInputError(
            f"{where}: {count} experts of {each:.0f} bytes exceed the block's "
            f"block_bytes ({block_bytes:.0f}); block_bytes counts every expert"
        )
    return count, used, each


def _optional(raw: Mapping[str, Any], key: str, where: str) -> float | None:
    """An optional byte count: absent or null → None, else a number 0..MAX_BYTES."""
    if raw.get(key) is None:
        return None
    return _number(raw, key, where, positive=False, high=MAX_BYTES)


def _devices(data: Mapping[str, Any]) -> tuple[Device, ...]:
    if "devices" not in data:
        raise PlanInputError('fleet is missing "devices"')
    raw = data["devices"]
    if not isinstance(raw, list):
        raise PlanInputError(f'fleet "devices" must be a list, not {_kind(raw)}')
    if not raw:
        raise PlanInputError("fleet has no devices; a session needs at least one")
    if len(raw) > MAX_DEVICES:
        raise PlanInputError(f"fleet has {len(raw)} devices; at most {MAX_DEVICES} are planned")
    devices: list[Device] = []
    seen: set[str] = set()
    for index, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            raise PlanInputError(f"device #{index + 1} must be an object, not {_kind(entry)}")
        name = _string(entry, "name", f"device #{index + 1}")
        if name in seen:
            raise PlanInputError(f"device name {name!r} appears twice; names must be unique")
        seen.add(name)
        where = f"device {name!r}"
        machine = entry.get("machine")
        devices.append(
            Device(
                name=name,
                memory_gb=_number(entry, "memory_gb", where, positive=True, high=MAX_MEMORY_GB),
                bandwidth_gbps=_measured(entry, "bandwidth_gbps", where, MAX_BANDWIDTH_GBPS),
                overhead_us=_measured(entry, "overhead_us", where, MAX_OVERHEAD_US, zero_ok=True),
                rtt_ms=_measured(entry, "rtt_ms", where, MAX_RTT_MS, zero_ok=True),
                nat=_nat(entry, where),
                tflops=_measured(entry, "tflops", where, MAX_TFLOPS),
                block_us=_measured(entry, "block_us", where, MAX_OVERHEAD_US, zero_ok=True),
                block_gbps=_measured(entry, "block_gbps", where, MAX_BANDWIDTH_GBPS),
                head_us=_measured(entry, "head_us", where, MAX_OVERHEAD_US, zero_ok=True),
                machine=None if machine is None else _string(entry, "machine", where),
                cpu_quota=_measured(entry, "cpu_quota", where, MAX_CPUS),
                cpu_period_ms=_measured(entry, "cpu_period_ms", where, MAX_PERIOD_MS),
                cpu_burst=_measured(entry, "cpu_burst", where, MAX_SCALE),
                cpu_run_ms=_measured(entry, "cpu_run_ms", where, MAX_PERIOD_MS),
            )
        )
    return tuple(devices)


def _nat(entry: Mapping[str, Any], where: str) -> Nat | None:
    value = entry.get("nat")
    if value is None:
        return None
    try:
        return Nat(value)
    except (ValueError, TypeError):
        choices = ", ".join(n.value for n in Nat)
        raise PlanInputError(
            f'{where}: "nat" must be one of {choices} or null, not {_shown(value)}'
        ) from None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _shown(value: Any) -> str:
    """A value as an error line quotes it: short, whatever a member sent."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _string(raw: Mapping[str, Any], key: str, where: str) -> str:
    if key not in raw:
        raise PlanInputError(f'{where} is missing "{key}"')
    value = raw[key]
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAME_CHARS:
        raise PlanInputError(
            f'{where}: "{key}" must be a string of 1..{MAX_NAME_CHARS} characters, '
            f"not {_shown(value)}"
        )
    return value


def _integer(raw: Mapping[str, Any], key: str, where: str, minimum: int, maximum: int) -> int:
    if key not in raw:
        raise PlanInputError(f'{where} is missing "{key}"')
    value = raw[key]
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise PlanInputError(
            f'{where}: "{key}" must be an integer {minimum}..{maximum}, not {_shown(value)}'
        )
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(
    raw: Mapping[str, Any], key: str, where: str, positive: bool, high: float
) -> float:
    if key not in raw:
        raise PlanInputError(f'{where} is missing "{key}"')
    value = raw[key]
    if not _is_number(value) or not 0 <= value <= high or (positive and value == 0):
        bound = f"> 0 and <= {high:g}" if positive else f"0..{high:g}"
        raise PlanInputError(f'{where}: "{key}" must be a number {bound}, not {_shown(value)}')
    return float(value)


def _measured(
    raw: Mapping[str, Any], key: str, where: str, high: float, zero_ok: bool = False
) -> float | None:
    value = raw.get(key)
    if value is None:  # absent or null: not measured
        return None
    if not _is_number(value) or not 0 <= value <= high or (not zero_ok and value == 0):
        bound = f"0..{high:g}" if zero_ok else f"> 0 and <= {high:g}"
        raise PlanInputError(
            f'{where}: "{key}" must be a number {bound} or null, not {_shown(value)}'
        )
    return float(value)
