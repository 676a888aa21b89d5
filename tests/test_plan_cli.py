"""`kafila plan` as a person or a script runs it: a subprocess, its exit code and its output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_planner_support import device, fleet

ROOT = Path(__file__).resolve().parents[1]
FLEETS = ROOT / "fleets"


def kafila_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafila", "plan", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write(tmp_path: Path, data: Any, name: str = "fleet.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


GOOD = fleet(device("a", 9, 100.0), device("b", 3, 100.0))  # uniform does not fit, kafila does


def _without(data: dict, *path: Any) -> dict:
    data = json.loads(json.dumps(data))
    target = data
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return data


def _with(data: dict, value: Any, *path: Any) -> dict:
    data = json.loads(json.dumps(data))
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('{"context": 1024, "devices": [', "not valid JSON"),
        (_without(GOOD, "context"), 'missing "context"'),
        (_without(GOOD, "devices", 0, "memory_gb"), 'missing "memory_gb"'),
        (_without(GOOD, "model", "block_bytes"), 'missing "block_bytes"'),
        (_with(GOOD, 0, "devices", 1, "bandwidth_gbps"), '"bandwidth_gbps" must be a number > 0'),
        (_with(GOOD, -2.5, "devices", 1, "bandwidth_gbps"), '"bandwidth_gbps"'),
        (_with(GOOD, 0, "devices", 0, "memory_gb"), '"memory_gb" must be a number > 0'),
        (_with(GOOD, -8, "devices", 0, "memory_gb"), '"memory_gb"'),
        (_with(GOOD, [], "devices"), "no devices"),
        (_with(GOOD, 1, "model", "blocks"), "more devices (2) than model"),
    ],
    ids=[
        "malformed-json",
        "missing-context",
        "missing-memory",
        "missing-block-bytes",
        "zero-bandwidth",
        "negative-bandwidth",
        "zero-memory",
        "negative-memory",
        "no-devices",
        "more-devices-than-blocks",
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, content: Any, words: str) -> None:
    result = kafila_plan("--fleet", str(write(tmp_path, content)))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kafila plan: ")
    assert words in lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_missing_file_is_bad_input(tmp_path: Path) -> None:
    result = kafila_plan("--fleet", str(tmp_path / "nope.json"))
    assert result.returncode == 2
    assert "cannot read fleet file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_model_is_bad_input() -> None:
    result = kafila_plan("--fleet", str(FLEETS / "lan.json"), "--model", "qwen3-70b")
    assert result.returncode == 2
    assert "qwen3-70b" in result.stderr


def test_feasible_plan_json_exit_0(tmp_path: Path) -> None:
    result = kafila_plan("--fleet", str(write(tmp_path, GOOD)), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["feasible"] is True and out["blocks"] == {"a": 7, "b": 3}
    assert out["refused"] == [] and out["head"] == "a" and out["ring"] == ["a", "b"]


def test_refused_plan_prints_the_plan_and_exits_3(tmp_path: Path) -> None:
    result = kafila_plan("--fleet", str(write(tmp_path, GOOD)), "--policy", "uniform", "--json")
    assert result.returncode == 3
    out = json.loads(result.stdout)
    assert out["feasible"] is False
    assert out["refused"] == [{"device": "b", "short_bytes": 2_000_000_000}]
    assert "b is short by 2000000000 bytes" in result.stderr


def test_nothing_fits_exits_3_in_every_policy(tmp_path: Path) -> None:
    path = write(tmp_path, fleet(device("a", 5, 100.0), device("b", 3, 100.0)))
    for policy in ("kafila", "uniform", "memory"):
        result = kafila_plan("--fleet", str(path), "--policy", policy)
        assert result.returncode == 3, (policy, result.stderr)
        assert "refused" in result.stderr


def test_compare_table_and_json() -> None:
    fleet_file = str(FLEETS / "intercontinental.json")
    table = kafila_plan("--fleet", fleet_file, "--model", "qwen3-8b", "--compare")
    assert table.returncode == 0, table.stderr
    for words in ("Kafila", "Uniform (GPipe)", "Mem-prop. (exo)", "bneck ms", "tok/s", "util."):
        assert words in table.stdout
    assert "shorter by" in table.stdout
    result = kafila_plan("--fleet", fleet_file, "--model", "qwen3-8b", "--compare", "--json")
    plans = json.loads(result.stdout)
    assert list(plans) == ["kafila", "uniform", "memory"]
    assert plans["kafila"]["bottleneck_ms"] < plans["uniform"]["bottleneck_ms"]
    assert plans["kafila"]["bottleneck_ms"] < plans["memory"]["bottleneck_ms"]
