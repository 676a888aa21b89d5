"""Head placement: one PARTITION per rotation, the anchor kept unless beaten by more than µ."""

from __future__ import annotations

import pytest

from planner import make_plan, parse_fleet
from tests.test_planner_support import GB, device, fleet

# 1 GB blocks and a 1 GB head at 1 GB/s: 1000 ms per block, 1000 ms for the head.
MODEL = {
    "name": "m",
    "blocks": 2,
    "block_bytes": 1 * GB,
    "head_bytes": 1 * GB,
    "kv_bytes_per_token_per_block": 0,
}


def gain_fleet(gain: float) -> dict:
    """Two devices, one block each (forced), where B as head beats A by exactly `gain`.

    Head A: max(o_A + 2000, 1000) = 2000 + o_A ms.  Head B: max(2000, o_A + 1000) = 2000 ms.
    So τ_B / τ_A = 2000 / (2000 + o_A) = 1 − gain  ⇔  o_A = 2000·gain / (1 − gain) ms.
    """
    overhead_ms = 2000.0 * gain / (1.0 - gain)
    return fleet(
        device("A", 100, 1.0, overhead_us=overhead_ms * 1000.0),
        device("B", 100, 1.0, overhead_us=0.0),
        model=MODEL,
    )


@pytest.mark.parametrize(
    ("gain", "head"),
    [(0.0, "A"), (0.01, "A"), (0.049, "A"), (0.051, "B"), (0.2, "B")],
)
def test_anchor_kept_unless_a_rotation_beats_it_by_more_than_the_margin(
    gain: float, head: str
) -> None:
    plan = make_plan(parse_fleet(gain_fleet(gain)))
    assert plan.head == head
    assert plan.ring[0] == head
    assert plan.blocks == (1, 1)
    tau_anchor = 2000.0 + 2000.0 * gain / (1.0 - gain)
    expected = tau_anchor if head == "A" else 2000.0
    assert plan.bottleneck_ms == pytest.approx(expected)


def test_head_moves_when_the_anchor_cannot_hold_it() -> None:
    # the anchor has room for blocks but not for blocks plus the head
    data = fleet(
        device("A", 1, 1.0, overhead_us=0.0),
        device("B", 100, 1.0, overhead_us=0.0),
        model=MODEL,
    )
    plan = make_plan(parse_fleet(data))
    assert plan.feasible
    assert plan.head == "B"
    assert plan.ring == ("B", "A")


def test_best_rotation_among_several_wins() -> None:
    # four equal devices; C has no overhead, the others pay 500 ms: C should head
    model = dict(MODEL, blocks=4)
    data = fleet(
        device("A", 100, 1.0, overhead_us=500_000.0),
        device("B", 100, 1.0, overhead_us=500_000.0),
        device("C", 100, 1.0, overhead_us=0.0),
        device("D", 100, 1.0, overhead_us=500_000.0),
        model=model,
    )
    plan = make_plan(parse_fleet(data))
    assert plan.head == "C"
    assert plan.ring[0] == "C"
    assert set(plan.ring) == {"A", "B", "C", "D"}
    # rotating the ring keeps the cycle: the edges are those of the anchor-first order
    assert [e.src for e in plan.edges] == list(plan.ring)
    assert [e.dst for e in plan.edges] == list(plan.ring[1:]) + [plan.ring[0]]


def test_head_stays_at_the_anchor_in_the_throughput_tier() -> None:
    # without bandwidth the head term is not priced: the anchor keeps the head
    data = fleet(
        device("A", 100, None, overhead_us=None, tflops=1.0),
        device("B", 100, None, overhead_us=None, tflops=50.0),
        model=MODEL,
    )
    plan = make_plan(parse_fleet(data))
    assert plan.tier.value == "throughput"
    assert plan.head == "A"
