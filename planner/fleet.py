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
    context = _integer(data, "context", "fleet", minimum=1)
    concurrency = _integer(data, "concurrency", "fleet", minimum=1)
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
    return Model(
        name=name,
        blocks=_integer(raw, "blocks", where, minimum=1),
        block_bytes=_number(raw, "block_bytes", where, positive=True),
        head_bytes=_number(raw, "head_bytes", where, positive=False),
        kv_bytes_per_token_per_block=_number(
            raw, "kv_bytes_per_token_per_block", where, positive=False
        ),
        process_bytes=_optional(raw, "process_bytes", where) or 0.0,
        block_resident_bytes=_optional(raw, "block_resident_bytes", where),
        head_resident_bytes=_optional(raw, "head_resident_bytes", where),
        anchor_bytes=_optional(raw, "anchor_bytes", where) or 0.0,
    )


def _optional(raw: Mapping[str, Any], key: str, where: str) -> float | None:
    """An optional byte count: absent or null → None, else a number >= 0."""
    return None if raw.get(key) is None else _number(raw, key, where, positive=False)


def _devices(data: Mapping[str, Any]) -> tuple[Device, ...]:
    if "devices" not in data:
        raise PlanInputError('fleet is missing "devices"')
    raw = data["devices"]
    if not isinstance(raw, list):
        raise PlanInputError(f'fleet "devices" must be a list, not {_kind(raw)}')
    if not raw:
        raise PlanInputError("fleet has no devices; a session needs at least one")
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
        devices.append(
            Device(
                name=name,
                memory_gb=_number(entry, "memory_gb", where, positive=True),
                bandwidth_gbps=_measured(entry, "bandwidth_gbps", where),
                overhead_us=_measured(entry, "overhead_us", where, zero_ok=True),
                rtt_ms=_measured(entry, "rtt_ms", where, zero_ok=True),
                nat=_nat(entry, where),
                tflops=_measured(entry, "tflops", where),
            )
        )
    return tuple(devices)


def _nat(entry: Mapping[str, Any], where: str) -> Nat | None:
    value = entry.get("nat")
    if value is None:
        return None
    try:
        return Nat(value)
    except ValueError:
        choices = ", ".join(n.value for n in Nat)
        raise PlanInputError(
            f'{where}: "nat" must be one of {choices} or null, not {value!r}'
        ) from None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _string(raw: Mapping[str, Any], key: str, where: str) -> str:
    if key not in raw:
        raise PlanInputError(f'{where} is missing "{key}"')
    value = raw[key]
    if not isinstance(value, str) or not value:
        raise PlanInputError(f'{where}: "{key}" must be a non-empty string, not {value!r}')
    return value


def _integer(raw: Mapping[str, Any], key: str, where: str, minimum: int) -> int:
    if key not in raw:
        raise PlanInputError(f'{where} is missing "{key}"')
    value = raw[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanInputError(f'{where}: "{key}" must be an integer >= {minimum}, not {value!r}')
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(raw: Mapping[str, Any], key: str, where: str, positive: bool) -> float:
    if key not in raw:
        raise PlanInputError(f'{where} is missing "{key}"')
    value = raw[key]
    if not _is_number(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise PlanInputError(f'{where}: "{key}" must be a number {bound}, not {value!r}')
    return float(value)


def _measured(raw: Mapping[str, Any], key: str, where: str, zero_ok: bool = False) -> float | None:
    value = raw.get(key)
    if value is None:  # absent or null: not measured
        return None
    if not _is_number(value) or value < 0 or (not zero_ok and value == 0):
        bound = ">= 0" if zero_ok else "> 0"
        raise PlanInputError(f'{where}: "{key}" must be a number {bound} or null, not {value!r}')
    return float(value)
