"""Fixtures of the NAT lab: skip with the reason where namespaces cannot be built."""

from __future__ import annotations

import functools

import pytest

from natlab_tests.lab import Lab, lab_namespaces, reap_stale, unavailable_reason

pytest_plugins = ["tests.strict_skips"]  # skips fail where KAFILA_NO_SKIPS is set (.ci/run)


@functools.cache
def _reason() -> str | None:
    reason = unavailable_reason()
    if reason is None:
        reap_stale()
    return reason


@pytest.fixture(scope="module")
def lab():
    """A fresh lab per test module (internet namespace only; tests add members)."""
    if (reason := _reason()) is not None:
        pytest.skip(reason)
    with Lab() as built:
        yield built


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind():
    yield
    if _reason() is not None:
        return
    left = lab_namespaces()
    assert not left, f"lab namespaces left after the tests: {left}"
