"""make_plan end to end: the --json contract and the paper's fleets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner import Plan, Policy, compare, make_plan, parse_fleet
from tests.test_planner_support import device, fleet

FLEETS = Path(__file__).resolve().parents[1] / "fleets"
CONTRACT_KEYS = [
    "feasible",
    "tier",
    "policy",
    "head",
    "ring",
    "blocks",
    "stage_ms",
    "bottleneck_ms",
    "edges",
    "refused",
]


def paper_fleet(name: str, model: str):
    return parse_fleet(json.loads((FLEETS / f"{name}.json").read_text()), model)


def test_json_contract_shape() -> None:
    data = fleet(
        device("a", 20, 300.0, rtt_ms=10.0, nat="ordinary"),
        device("b", 20, 100.0, rtt_ms=30.0, nat="restrictive"),
        device("c", 20, 200.0, rtt_ms=20.0, nat="permissive"),
    )
    plan = make_plan(parse_fleet(data))
    out = plan.to_json()
    # the contract's keys in order; after them "head_ms" (the head's pick, priced) and, where
    # members share a machine, "machines"
    assert list(out)[: len(CONTRACT_KEYS)] == CONTRACT_KEYS
    assert list(out)[len(CONTRACT_KEYS):] == ["head_ms"]
    json.dumps(out)  # serialisable as is
    assert out["ring"][0] == out["head"]
    assert list(out["blocks"]) == out["ring"] == list(out["stage_ms"])
    assert sum(out["blocks"].values()) == 10
    assert out["bottleneck_ms"] == max(out["stage_ms"].values())
    assert len(out["edges"]) == 3
    for edge, (src, dst) in zip(out["edges"], zip(out["ring"], out["ring"][1:] + out["ring"][:1])):
        assert list(edge) == ["from", "to", "kind", "ms"]
        assert (edge["from"], edge["to"]) == (src, dst)
        assert edge["kind"] in ("direct", "relay")
    # restrictive b sits next to permissive c on both sides? only one P: one relay at least
    assert out["refused"] == []
    assert out["policy"] == "kafila" and out["tier"] == "full"


def test_block_ranges_are_contiguous_in_ring_order() -> None:
    plan = make_plan(parse_fleet(fleet(device("a", 20, 300.0), device("b", 20, 100.0))))
    assert plan.block_ranges() == {"a": (0, 7), "b": (7, 10)}


def is_rotation(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return len(a) == len(b) and any(b == a[i:] + a[:i] for i in range(len(a)))


def why_it_loses(kafila: Plan, other: Plan) -> str | None:
    """None when `kafila` is at least as good as `other` on the same ring, else the reason."""
    if not is_rotation(kafila.ring, other.ring):
        return f"not the same ring: {kafila.ring} vs {other.ring}"  # only the head may move
    if not kafila.feasible:
        return "infeasible"
    if kafila.bottleneck_ms is None or other.bottleneck_ms is None:
        return "no bottleneck to compare"
    if kafila.bottleneck_ms > other.bottleneck_ms * (1 + 1e-9):
        return f"bottleneck {kafila.bottleneck_ms:.3f} ms > {other.bottleneck_ms:.3f} ms"
    return None


@pytest.mark.parametrize("fleet_name", ["lan", "us-central", "intercontinental"])
@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-14b", "qwen3-32b"])
def test_planner_never_loses_to_the_baselines_on_the_paper_fleets(
    fleet_name: str, model: str
) -> None:
    plans: dict[Policy, Plan] = compare(paper_fleet(fleet_name, model))
    for policy in (Policy.UNIFORM, Policy.MEMORY):
        assert why_it_loses(plans[Policy.KAFILA], plans[policy]) is None, policy


def test_losing_is_detected() -> None:
    """The check above can fail: each baseline loses to the planner on the LAN fleet."""
    plans = compare(paper_fleet("lan", "qwen3-8b"))
    for policy in (Policy.UNIFORM, Policy.MEMORY):
        assert "bottleneck" in (why_it_loses(plans[policy], plans[Policy.KAFILA]) or "")
    lan_32b = compare(paper_fleet("lan", "qwen3-32b"))  # the baselines do not fit in memory
    assert why_it_loses(lan_32b[Policy.UNIFORM], lan_32b[Policy.KAFILA]) == "infeasible"
    kafila = plans[Policy.KAFILA]
    swapped = dataclasses.replace(kafila, ring=(kafila.ring[1], kafila.ring[0], *kafila.ring[2:]))
    assert "not the same ring" in (why_it_loses(swapped, plans[Policy.UNIFORM]) or "")


def test_lan_qwen3_8b_matches_the_papers_bottleneck() -> None:
    # the paper's Table IV (../shared/seeds): 11.3 ms measured; eq. 2 on Table II's bandwidth midpoints
    plan = make_plan(paper_fleet("lan", "qwen3-8b"))
    assert plan.bottleneck_ms == pytest.approx(11.3, rel=0.05)
