"""tests/strict_skips.py: with KAFILA_NO_SKIPS set (as `.ci/run` does), a skip fails the run.

Each case runs pytest in a subprocess on small test files written here, with the plugin loaded."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from tests.strict_skips import MLX_PLATFORMS

ROOT = Path(__file__).resolve().parents[1]

FILES = {
    "test_plain.py": """
import pytest

def test_runs():
    pass

def test_skipped_with_a_reason():
    pytest.skip("OpenVINO is missing")

@pytest.mark.skipif(True, reason="backend mlx is unavailable (ImportError); install with: pip")
def test_mlx():
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False
""",
    "test_module_skip.py": """
import pytest
pytest.importorskip("no_such_module_anywhere", reason="an optional thing is not installed")

def test_never_collected():
    pass
""",
}


def run_pytest(tmp_path: Path, strict: bool, *only: str) -> subprocess.CompletedProcess:
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "KAFILA_NO_SKIPS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if strict:
        env["KAFILA_NO_SKIPS"] = "1"
    args = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "tests.strict_skips",
            "-p", "no:cacheprovider", "--rootdir", str(tmp_path), *(only or FILES)]  # fmt: skip
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_without_the_variable_skips_stay_skips(tmp_path) -> None:
    r = run_pytest(tmp_path, strict=False)
    assert r.returncode == 0, r.stdout
    assert "3 skipped" in r.stdout and "1 xfailed" in r.stdout  # the module counts as one


def test_strict_mode_turns_a_skip_into_a_failure(tmp_path) -> None:
    r = run_pytest(tmp_path, False, "test_plain.py")
    assert r.returncode == 0
    r = run_pytest(tmp_path, True, "test_plain.py")
    assert r.returncode == 1, r.stdout
    assert "FAILED test_plain.py::test_skipped_with_a_reason" in r.stdout
    assert "OpenVINO is missing" in r.stdout
    assert "1 xfailed" in r.stdout  # an expected failure is not a skip


def test_mlx_may_skip_only_where_bootstrap_does_not_install_it(tmp_path) -> None:
    r = run_pytest(tmp_path, True, "test_plain.py")
    here = (sys.platform, platform.machine().lower())
    failed = re.search(r"^(FAILED|ERROR) test_plain.py::test_mlx", r.stdout, re.M) is not None
    assert failed == (here in MLX_PLATFORMS), r.stdout


def test_strict_mode_fails_a_run_with_a_module_skipped_at_import(tmp_path) -> None:
    r = run_pytest(tmp_path, True, "test_module_skip.py")
    assert r.returncode == 1, r.stdout
    assert "modules skipped in strict mode" in r.stdout
    assert "an optional thing is not installed" in r.stdout


def test_the_suite_and_ci_use_it(pytestconfig) -> None:
    assert pytestconfig.pluginmanager.has_plugin("tests.strict_skips")
    from natlab_tests import conftest as natlab_conftest

    assert "tests.strict_skips" in natlab_conftest.pytest_plugins
    assert "export KAFILA_NO_SKIPS=1" in (ROOT / ".ci/run").read_text()
