"""`kafila demo --json`: a whole session in separate processes, one answer, nothing left behind."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from tests.default_model import needs_default_model

pytestmark = [
    pytest.mark.session, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(300),
    needs_default_model,
]


def leftovers(marker):
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with __import__("contextlib").suppress(psutil.Error):
            if any(marker in a for a in p.info["cmdline"] or []):
                out.append(p.info["pid"])
    return out


def test_demo_json_two_members(tmp_path):
    cache = str(tmp_path / "demo-cache")
    r = subprocess.run([sys.executable, "-m", "kafila", "demo", "--members", "2", "--max-tokens", "12",
                        "--prompt", "Name three colors.", "--json", "--cache-dir", cache],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == {"text", "tokens", "tok_s", "ttft_ms", "plan"}
    assert out["text"] and 1 <= out["tokens"] <= 12
    assert out["ttft_ms"] > 0 and (out["tokens"] == 1 or out["tok_s"] > 0)
    plan = out["plan"]
    assert plan["feasible"] and sorted(plan["ring"]) == ["m1", "m2"] and sum(plan["blocks"].values()) == 30
    assert set(plan) >= {"feasible", "tier", "policy", "head", "ring", "blocks", "stage_ms",
                         "bottleneck_ms", "edges", "refused"}
    assert leftovers(cache) == []
    assert sorted(os.listdir(cache)) == ["m2"]  # only the member fetched weights (the host has the file)


def test_demo_with_a_bad_model_starts_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kafila", "demo", "--model", str(tmp_path / "none.gguf")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
