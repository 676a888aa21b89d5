"""Where KAFILA_NO_SKIPS=1 (`.ci/run` sets it), a skipped test is a failed one.

A skip says "this machine cannot run it"; in CI that must never hide a capability the README
promises. Only the skips in ALLOWED pass, each with the reason it is not such a capability there.
Loaded by tests/conftest.py and natlab_tests/conftest.py (`pytest_plugins`); does nothing unless
the variable is set.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable

import pytest

ENV = "KAFILA_NO_SKIPS"

# scripts/bootstrap.sh installs the mlx extra only where mlx ships wheels
MLX_PLATFORMS = {("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "arm64")}


def _mlx_not_installed_here() -> bool:
    return (sys.platform, platform.machine().lower()) not in MLX_PLATFORMS


# (text the skip reason contains, when that skip is allowed): why each is not a hidden failure
ALLOWED: tuple[tuple[str, Callable[[], bool]], ...] = (
    # MLX has no wheels for this platform: bootstrap does not install it and the README does not
    # promise it here. On Linux x86_64/aarch64 and macOS arm64 its absence fails.
    ("backend mlx is unavailable", _mlx_not_installed_here),
)


def strict() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def skip_reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def allowed(reason: str) -> bool:
    return any(text in reason and when() for text, when in ALLOWED)


def _refused(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The failure text for a skip that strict mode does not allow, else None."""
    if not strict() or not report.skipped or hasattr(report, "wasxfail"):
        return None
    reason = skip_reason(report.longrepr)
    if allowed(reason):
        return None
    return f"skipped while {ENV} is set (tests/strict_skips.py): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if (text := _refused(report)) is not None:
        report.outcome = "failed"
        report.longrepr = text


_COLLECT_SKIPS_KEY = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_COLLECT_SKIPS_KEY] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A whole module skipped at import: recorded, and the run fails at its end (turning the
    collection report into a failure would stop pytest before any test ran)."""
    outcome = yield
    report = outcome.get_result()
    if (text := _refused(report)) is not None:
        collector.config.stash[_COLLECT_SKIPS_KEY].append(f"{report.nodeid}: {text}")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    skipped = config.stash.get(_COLLECT_SKIPS_KEY, [])
    if skipped:
        terminalreporter.section("modules skipped in strict mode", red=True)
        for line in skipped:
            terminalreporter.line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    quiet = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    if session.config.stash.get(_COLLECT_SKIPS_KEY, []) and exitstatus in quiet:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
