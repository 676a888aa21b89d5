"""Fleet validation: malformed fleets raise PlanInputError with one line naming the problem."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from planner import Nat, PlanInputError, parse_fleet
from tests.test_planner_support import device, fleet

FLEETS = Path(__file__).resolve().parents[1] / "fleets"
GOOD = fleet(device("a", 10, 100.0, rtt_ms=5.0, nat="ordinary"), device("b", 10, 100.0))


def edited(path: list[Any], value: Any = None, delete: bool = False) -> dict:
    data = copy.deepcopy(GOOD)
    target = data
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


def test_good_fleet_parses() -> None:
    parsed = parse_fleet(GOOD)
    assert [d.name for d in parsed.devices] == ["a", "b"]
    assert parsed.devices[0].nat is Nat.ORDINARY and parsed.devices[0].rtt_ms == 5.0
    assert parsed.devices[1].nat is None and parsed.devices[1].tflops is None
    assert parsed.devices[0].memory_bytes == 10e9


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([], "JSON object"),
        (edited(["context"], delete=True), '"context"'),
        (edited(["concurrency"], 0), '"concurrency"'),
        (edited(["anchor"], "zz"), "anchor"),
        (edited(["model"], delete=True), '"model"'),
        (edited(["model", "blocks"], delete=True), '"blocks"'),
        (edited(["model", "block_bytes"], 0), '"block_bytes"'),
        (edited(["devices"], []), "no devices"),
        (edited(["devices"], delete=True), '"devices"'),
        (edited(["devices", 0, "memory_gb"], 0), '"memory_gb"'),
        (edited(["devices", 0, "memory_gb"], -4), '"memory_gb"'),
        (edited(["devices", 0, "memory_gb"], delete=True), '"memory_gb"'),
        (edited(["devices", 1, "bandwidth_gbps"], 0), '"bandwidth_gbps"'),
        (edited(["devices", 1, "bandwidth_gbps"], -1.0), '"bandwidth_gbps"'),
        (edited(["devices", 1, "bandwidth_gbps"], "fast"), '"bandwidth_gbps"'),
        (edited(["devices", 1, "overhead_us"], -1.0), '"overhead_us"'),
        (edited(["devices", 1, "nat"], "cone"), '"nat"'),
        (edited(["devices", 1, "name"], "a"), "twice"),
        (edited(["model", "blocks"], 1), "more devices"),
    ],
)
def test_bad_fleets_raise_one_line(data: Any, words: str) -> None:
    with pytest.raises(PlanInputError) as caught:
        parse_fleet(data)
    message = str(caught.value)
    assert words in message or words.strip('"') in message
    assert "\n" not in message


def test_more_devices_than_blocks_says_so() -> None:
    with pytest.raises(
        PlanInputError, match=r"more devices \(3\) than model 'small' has blocks \(2\)"
    ):
        data = edited(["model", "blocks"], 2)
        data["devices"].append(device("c", 10, 100.0))
        parse_fleet(data)


def test_absent_or_null_measurements_mean_not_measured() -> None:
    parsed = parse_fleet(edited(["devices", 1, "bandwidth_gbps"], None))
    assert parsed.devices[1].bandwidth_gbps is None
    parsed = parse_fleet(edited(["devices", 1, "overhead_us"], delete=True))
    assert parsed.devices[1].overhead_us is None


def test_models_table_needs_a_choice_when_it_has_several() -> None:
    data = json.loads((FLEETS / "lan.json").read_text())
    with pytest.raises(PlanInputError, match="--model"):
        parse_fleet(data)
    with pytest.raises(PlanInputError, match="not in the fleet"):
        parse_fleet(data, "qwen3-70b")
    parsed = parse_fleet(data, "qwen3-14b")
    assert parsed.model.blocks == 40 and parsed.anchor == "l40s"


def test_single_model_name_must_match() -> None:
    with pytest.raises(PlanInputError, match="not 'other'"):
        parse_fleet(GOOD, "other")
    assert parse_fleet(GOOD, "small").model.name == "small"
