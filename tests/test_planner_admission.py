"""Admission: the three tiers, the memory check, and refusals that name who is short."""

from __future__ import annotations

import pytest

from planner import Policy, Tier, block_limit, make_plan, parse_fleet
from tests.test_planner_support import GB, device, fleet

# SMALL_MODEL: 10 blocks of 1 GB, a 2 GB head, no KV: lim = memory_gb (− 2 on the head).


def test_full_tier_when_everyone_measured_bandwidth_and_overhead() -> None:
    plan = make_plan(parse_fleet(fleet(device("a", 20, 300.0), device("b", 20, 100.0))))
    assert plan.tier is Tier.FULL
    assert plan.feasible
    # eq. 2 by hand: a (head) = 20 µs + 2 GB/300 GB/s + n·1 GB/300 GB/s
    assert plan.blocks == (7, 3)
    stage_a = 0.020 + 2e9 / 300e6 + 7 * 1e9 / 300e6
    stage_b = 0.020 + 3 * 1e9 / 100e6
    assert plan.stage_ms == pytest.approx((stage_a, stage_b))
    assert plan.bottleneck_ms == pytest.approx(max(stage_a, stage_b))


def test_throughput_tier_when_a_bandwidth_is_missing_but_everyone_has_tflops() -> None:
    data = fleet(
        device("a", 20, None, tflops=3.0),
        device("b", 20, 100.0, tflops=1.0),
        device("c", 20, 100.0, overhead_us=None, tflops=1.0),
    )
    plan = make_plan(parse_fleet(data))
    assert plan.tier is Tier.THROUGHPUT
    assert plan.head == "a"  # no head term: the anchor keeps it
    assert dict(zip(plan.ring, plan.blocks)) == {"a": 6, "b": 2, "c": 2}
    # per(i) = 2 FLOP per weight byte at the reported TFLOP/s, no overhead
    per_a = 2 * 1e9 / (3.0e12) * 1e3
    assert dict(zip(plan.ring, plan.stage_ms or ()))["a"] == pytest.approx(6 * per_a)


def test_memory_tier_when_nothing_is_measured() -> None:
    data = fleet(device("a", 30, None, overhead_us=None), device("b", 10, None, overhead_us=None))
    plan = make_plan(parse_fleet(data))
    assert plan.tier is Tier.MEMORY
    assert plan.blocks == (8, 2)  # largest remainder of 7.5 / 2.5, tie to the head
    assert plan.stage_ms is None
    out = plan.to_json()
    assert out["tier"] == "memory"
    assert out["stage_ms"] == {"a": None, "b": None}
    assert out["bottleneck_ms"] is None


def test_memory_tier_when_only_some_are_measured_and_tflops_are_incomplete() -> None:
    data = fleet(device("a", 10, 100.0, tflops=1.0), device("b", 10, None, overhead_us=None))
    assert make_plan(parse_fleet(data)).tier is Tier.MEMORY


def test_lim_follows_the_issue_formula() -> None:
    model = {
        "name": "m",
        "blocks": 40,
        "block_bytes": 0.5 * GB,
        "head_bytes": 1.5 * GB,
        "kv_bytes_per_token_per_block": 1000,
    }
    data = fleet(device("a", 12, 100.0), device("b", 12, 100.0), model=model)
    data["context"], data["concurrency"] = 2000, 5
    parsed = parse_fleet(data)
    per_block = 0.5e9 + 1000 * 2000 * 5  # 0.51 GB
    assert block_limit(parsed.devices[0], parsed, is_head=False) == int(12e9 // per_block)
    assert block_limit(parsed.devices[0], parsed, is_head=True) == int((12e9 - 1.5e9) // per_block)


UNIFORM_FAILS = fleet(device("a", 9, 100.0), device("b", 3, 100.0))  # lim: a 7 as head, b 3


def test_no_uniform_split_fits_but_the_planners_division_does() -> None:
    parsed = parse_fleet(UNIFORM_FAILS)
    kafila = make_plan(parsed, Policy.KAFILA)
    assert kafila.feasible and kafila.refused == ()
    assert kafila.blocks == (7, 3)  # the optimum 5/5 does not fit b; the planner shifts blocks
    uniform = make_plan(parsed, Policy.UNIFORM)
    assert not uniform.feasible
    assert [(r.device, r.short_bytes) for r in uniform.refused] == [("b", 2_000_000_000)]
    memory = make_plan(parsed, Policy.MEMORY)  # 8/2: the head's 2 GB was not counted
    assert [(r.device, r.short_bytes) for r in memory.refused] == [("a", 1_000_000_000)]


def test_nothing_fits_names_every_short_device() -> None:
    plan = make_plan(parse_fleet(fleet(device("a", 5, 100.0), device("b", 3, 100.0))))
    assert not plan.feasible
    # shown division: the cost-optimal one with memory ignored; the head pays for its
    # 2 GB read, so a (head) 20 µs + 20 ms + 4·10 ms = b 20 µs + 6·10 ms
    assert (plan.head, plan.blocks) == ("a", (4, 6))
    assert sorted((r.device, r.short_bytes) for r in plan.refused) == [
        ("a", 1_000_000_000),  # 4 blocks + 2 GB head − 5 GB
        ("b", 3_000_000_000),  # 6 blocks − 3 GB
    ]
    out = plan.to_json()
    assert out["feasible"] is False
    assert out["refused"] == [
        {"device": r.device, "short_bytes": r.short_bytes} for r in plan.refused
    ]


def test_refusal_in_the_memory_tier() -> None:
    data = fleet(device("a", 3, None, overhead_us=None), device("b", 3, None, overhead_us=None))
    plan = make_plan(parse_fleet(data))
    assert plan.tier is Tier.MEMORY and not plan.feasible
    assert {r.device for r in plan.refused} == {"a", "b"}


def test_throughput_tier_respects_memory() -> None:
    data = fleet(device("a", 9, None, tflops=100.0), device("b", 20, None, tflops=1.0))
    plan = make_plan(parse_fleet(data))
    assert plan.tier is Tier.THROUGHPUT and plan.feasible
    assert plan.blocks == (7, 3)  # a is fastest but holds only 7 beside the head


def test_absent_measurements_lower_the_tier_like_nulls() -> None:
    # as a session host builds the fleet: keys left out where a probe failed
    data = fleet(device("a", 30, 100.0, tflops=2.0), device("b", 10, 100.0, tflops=1.0))
    del data["devices"][1]["bandwidth_gbps"]
    assert make_plan(parse_fleet(data)).tier is Tier.THROUGHPUT
    del data["devices"][1]["tflops"]
    assert make_plan(parse_fleet(data)).tier is Tier.MEMORY
