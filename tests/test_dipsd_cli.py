"""`kafila plan dipsd` as a script runs it: a subprocess, its exit code and its output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyscipopt")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "fleets" / "dipsd-users.json"
METHODS = ["dipsd", "greedy", "no-batching", "single-batch", "fixed-l7", "ad", "ad-greedy-batching"]


def kafila(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafila", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "users.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_json_has_every_method_and_the_optimum_wins() -> None:
    result = kafila("plan", "dipsd", "--users", str(EXAMPLE), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert list(out) == ["users", "target", "max_draft", "methods"]
    assert list(out["methods"]) == METHODS
    best = out["methods"]["dipsd"]
    assert best["method"] == "dinkelbach-milp" and best["optimal"] is True
    for name, row in out["methods"].items():
        assert row["tokens_per_s"] <= best["tokens_per_s"] * (1 + 1e-9), name
        assert sorted(u for b in row["batches"] for u in b) == sorted(out["users"])
    assert best["solve_s"] > 0


def test_table_names_the_optimiser_and_the_baselines() -> None:
    result = kafila("plan", "dipsd", "--users", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    for words in (
        "DiP-SD (MILP + Dinkelbach)",
        "greedy rule",
        "w/o batching",
        "fixed l=7",
        "AD w/ greedy batching",
        "tok/s",
        "solve s",
        "optimal",
    ):
        assert words in result.stdout


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('{"users": [', "not valid JSON"),
        ({"target": {"c_ms": 90, "beta_ms": 4}, "users": []}, "no users"),
        (
            {
                "target": {"c_ms": 90, "beta_ms": 4},
                "users": [{"id": "a", "alpha": 1.5, "draft_ms_per_token": 10}],
            },
            '"alpha" must be',
        ),
        (
            {
                "target": {"c_ms": 90, "beta_ms": -4},
                "users": [{"id": "a", "alpha": 0.5, "draft_ms_per_token": 10}],
            },
            '"beta_ms" must be',
        ),
        (
            {
                "target": {"c_ms": 90, "beta_ms": 4},
                "users": [{"id": "a", "alpha": 0.5, "draft_ms_per_token": -1}],
            },
            '"draft_ms_per_token"',
        ),
        (
            {
                "target": {"c_ms": 90, "beta_ms": 4},
                "users": [
                    {"id": f"u{i}", "alpha": 0.5, "draft_ms_per_token": 1} for i in range(65)
                ],
            },
            "more than the 64",
        ),
    ],
    ids=[
        "malformed-json",
        "no-users",
        "alpha-out-of-range",
        "negative-beta",
        "negative-draft",
        "too-many-users",
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, content: Any, words: str) -> None:
    result = kafila("plan", "dipsd", "--users", str(write(tmp_path, content)))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kafila plan: users file ")
    assert words in lines[0] and "fleets/dipsd-users.json" in lines[0]  # what to do
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_missing_file_is_bad_input(tmp_path: Path) -> None:
    result = kafila("plan", "dipsd", "--users", str(tmp_path / "nope.json"))
    assert result.returncode == 2
    assert "cannot read users file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_fleet_options_do_not_mix_with_dipsd() -> None:
    result = kafila("plan", "--fleet", "fleets/lan.json", "dipsd", "--users", str(EXAMPLE))
    assert result.returncode == 2
    assert "takes --users, not the fleet options" in result.stderr


def test_plan_without_fleet_or_dipsd_still_asks_for_fleet() -> None:
    result = kafila("plan")
    assert result.returncode == 2
    assert "the following arguments are required: --fleet" in result.stderr


def test_a_tiny_time_limit_reports_the_fallback() -> None:
    result = kafila("plan", "dipsd", "--users", str(EXAMPLE), "--json", "--time-limit", "1e-9")
    assert result.returncode == 0, result.stderr
    best = json.loads(result.stdout)["methods"]["dipsd"]
    assert best["optimal"] is False and "time limit" in best["fallback"]
