"""This process's cgroup limits (v1 or v2): the memory room left and the CPU quota, which the
probe (kafila/probe.py) reports so the planner sees a limited member as it is, and the threads
a backend computes on under that quota (`quota_threads`)."""

from __future__ import annotations

import math
import os
from pathlib import Path


def _cgroup_dirs(controller: str, root: Path, membership: Path) -> list[tuple[Path, bool]]:
    """Where this process's `controller` files may be, nearest first: (directory, is v2)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return []
    out: list[tuple[Path, bool]] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # cgroup v2
            out += [(root / relative, True), (root, True)]
        elif controller in controllers.split(","):
            name = ",".join(sorted(controllers.split(","), key=lambda c: c != controller))  # e.g. cpu,cpuacct
            for top in dict.fromkeys((controller, name, controllers)):
                out += [(root / top / relative, False), (root / top, False)]
    return out


def cgroup_memory_room_bytes(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> float | None:
    """limit − usage of this process's memory cgroup (v2 or v1), None when unlimited."""
    for base, v2 in _cgroup_dirs("memory", root, membership):
        limit_name, usage_name = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        try:
            limit_text = (base / limit_name).read_text().strip()
            usage = float((base / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        limit = float(limit_text)
        if limit >= 1 << 60:  # v1 writes "unlimited" as a huge number
            return None
        return max(0.0, limit - usage)
    return None


def cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> tuple[float, float] | None:
    """(CPUs, period in s) of this process's cgroup CPU quota (CFS quota ÷ period, v2 or v1):
    0.25 CPUs is a quarter of one CPU's time each period, however many threads share it; None
    when unlimited."""
    for base, v2 in _cgroup_dirs("cpu", root, membership):
        try:
            if v2:
                quota_text, _, period_text = (base / "cpu.max").read_text().strip().partition(" ")
                if quota_text == "max":
                    return None
            else:
                quota_text = (base / "cpu.cfs_quota_us").read_text().strip()
                period_text = (base / "cpu.cfs_period_us").read_text().strip()
            quota, period = float(quota_text), float(period_text or "100000")
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else (quota / period, period / 1e6)  # v1: -1 is no limit
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def quota_threads() -> int | None:
    """Threads to compute on under this process's CPU quota: the CPUs it allows, rounded up,
    when fewer than the CPUs it may run on; None without such a quota. More threads than the
    quota only spend it faster: the OpenVINO plugin's idle workers spin after each inference, so
    at a quarter of a CPU two threads spent several times the CPU of one a step, and sustained
    fewer steps (tests/test_probe.py runs a member under such a quota)."""
    quota = cgroup_cpu_quota()
    if quota is None or quota[0] >= usable_cpus():
        return None
    return max(1, math.ceil(quota[0]))


__all__ = ["cgroup_cpu_quota", "cgroup_memory_room_bytes", "quota_threads", "usable_cpus"]
