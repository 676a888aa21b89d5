"""The planner refuses non-finite, negative, absurd or mistyped fleet numbers with its own error
(PlanInputError: one line naming the field), never a crash deep in the cost model (issue 38)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from planner import PlanInputError, largest_context, make_plan, parse_fleet, plan_fleet
from tests.test_planner_support import device, fleet

GOOD = fleet(device("a", 10, 100.0, rtt_ms=5.0), device("b", 10, 100.0, rtt_ms=5.0))


def edited(path: list[Any], value: Any) -> dict:
    data = copy.deepcopy(GOOD)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


BAD_NUMBERS = [1e308, math.inf, -math.inf, math.nan, -1.0, "lots", "10", True, None, [], {}]


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize("field", ["memory_gb", "bandwidth_gbps", "overhead_us", "tflops", "rtt_ms",
                                   "block_us", "block_gbps", "head_us"])  # fmt: skip
def test_device_numbers_are_bounded(field: str, value: Any) -> None:
    data = edited(["devices", 1, field], value)
    if value is None and field != "memory_gb":
        make_plan(parse_fleet(data))  # null: "not measured", planned in a lower tier
        return
    with pytest.raises(PlanInputError) as caught:
        plan_fleet(data)
    message = str(caught.value)
    assert f'"{field}"' in message and "device 'b'" in message and "\n" not in message
    assert len(message) < 200  # whatever was sent, the line stays short


@pytest.mark.parametrize("field", ["block_bytes", "head_bytes", "kv_bytes_per_token_per_block", "process_bytes",
                                   "block_resident_bytes", "head_resident_bytes", "head_read_bytes"])  # fmt: skip
@pytest.mark.parametrize("value", [1e300, math.nan, -5, "big"], ids=repr)
def test_model_numbers_are_bounded(field: str, value: Any) -> None:
    with pytest.raises(PlanInputError, match=f'"{field}"'):
        plan_fleet(edited(["model", field], value))


@pytest.mark.parametrize(("path", "value"), [
    (["context"], 10**400), (["context"], 1e308), (["concurrency"], 10**12), (["model", "blocks"], 10**9),
    (["devices", 0, "name"], "x" * 10_000), (["devices", 0, "machine"], 7), (["devices", 0, "nat"], ["cone"]),
])  # fmt: skip
def test_absurd_sizes_and_types_are_refused(path: list, value: Any) -> None:
    with pytest.raises(PlanInputError) as caught:
        plan_fleet(edited(path, value))
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


def test_the_largest_plausible_fleet_still_plans() -> None:
    """At the ceilings the arithmetic stays finite: a plan, not an OverflowError."""
    data = edited(["devices", 0, "memory_gb"], 1e6)
    data["devices"][1]["memory_gb"] = 1e6
    data["context"], data["concurrency"] = 1 << 24, 1 << 16
    data["model"].update(block_bytes=1e15, kv_bytes_per_token_per_block=1e15)
    plan = plan_fleet(data)
    assert not plan.feasible and all(r.short_bytes > 0 for r in plan.refused)
    assert largest_context(parse_fleet(data), 1 << 24) == 0


def test_moe_fields_come_together_and_fit_the_block() -> None:
    with pytest.raises(PlanInputError, match="gives all of"):
        plan_fleet(edited(["model", "expert_count"], 8))
    data = edited(["model", "expert_count"], 8)
    data["model"].update(experts_used=2, expert_bytes=0.2e9)  # 8 × 0.2 GB > the block's 1 GB
    with pytest.raises(PlanInputError, match="exceed the block"):
        plan_fleet(data)
    data["model"].update(experts_used=9, expert_bytes=0.1e9)
    with pytest.raises(PlanInputError, match='"experts_used"'):
        plan_fleet(data)
