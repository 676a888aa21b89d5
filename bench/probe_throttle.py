"""Is the probe repeatable, and does it see a slower device?

    .venv/bin/python -m bench.probe_throttle [--quick] [--quota-percent 25] [--backend openvino]

Runs `probe_device(backend=...)` three times, each in a fresh child process: twice normally, and once
inside a cgroup v1 CPU quota (cpu.cfs_period_us = 100000, cpu.cfs_quota_us = 25000: a quarter
of one CPU), created as /sys/fs/cgroup/cpu/kafila-probe-<pid>/ and removed afterwards. Prints
bandwidth and overhead side by side, the two normal runs' difference, and the throttled run's
ratio to them. Needs root and a writable cgroup v1 cpu controller; otherwise says why and
exits 0 having measured only the two normal runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def child_command(quick: bool, backend: str = "openvino") -> list[str]:
    code = (
        "import json; from kafila.probe import probe_device; "
        f"print(json.dumps(probe_device(quick={quick}, backend={backend!r}).to_json()))"
    )
    return [sys.executable, "-c", code]


def run_probe(quick: bool, cgroup: Path | None = None, backend: str = "openvino") -> dict[str, Any]:
    def join_cgroup() -> None:  # runs in the child before exec: the child's own pid
        assert cgroup is not None
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    start = time.perf_counter()
    done = subprocess.run(
        child_command(quick, backend),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        preexec_fn=join_cgroup if cgroup is not None else None,
    )
    if done.returncode != 0:
        raise SystemExit(f"probe child failed: {done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout)
    result["wall_s"] = time.perf_counter() - start
    return result


def make_cgroup(quota_percent: int) -> tuple[Path | None, str]:
    path = CPU_CGROUP / f"kafila-probe-{os.getpid()}"
    try:
        path.mkdir()
    except OSError as exc:
        return None, f"cannot create {path}: {exc.strerror or exc}"
    try:
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(PERIOD_US * quota_percent // 100))
    except OSError as exc:
        path.rmdir()
        return None, f"cannot set the quota in {path}: {exc.strerror or exc}"
    return path, ""


def remove_cgroup(path: Path) -> None:
    for _ in range(50):  # the child has exited; the kernel may take a moment to empty it
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove {path}", file=sys.stderr)


def row(label: str, r: dict[str, Any]) -> str:
    return (
        f"| {label} | {r['bandwidth_gbps']:.2f} ± {r['bandwidth_spread']:.2f} "
        f"| {r['overhead_us']:.1f} ± {r['overhead_spread']:.1f} "
        f"| {r['tflops']:.3f} | {r['memory_gb']:.1f} | {r['wall_s']:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the session-start probe")
    parser.add_argument("--quota-percent", type=int, default=25)
    parser.add_argument("--backend", default="openvino", choices=("openvino", "mlx", "reference"))
    args = parser.parse_args()

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    first = run_probe(args.quick, backend=args.backend)
    second = run_probe(args.quick, backend=args.backend)
    cgroup, why = make_cgroup(args.quota_percent)
    throttled = None
    if cgroup is not None:
        try:
            throttled = run_probe(args.quick, cgroup, args.backend)
        finally:
            remove_cgroup(cgroup)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    mode = "quick" if args.quick else "full"
    print(
        f"\nprobe ({mode}: {first['runs']} runs, {first['buffer_mib']} MiB, {first['threads']} threads, "
        f"{first['backend']})\n"
    )
    print(
        "| run | bandwidth GB/s (± spread) | overhead µs (± spread) | TFLOP/s | free GB | wall s |"
    )
    print("|---|---|---|---|---|---|")
    print(row("normal 1", first))
    print(row("normal 2", second))
    if throttled is not None:
        print(row(f"{args.quota_percent}% CPU quota", throttled))

    b1, b2 = first["bandwidth_gbps"], second["bandwidth_gbps"]
    o1, o2 = first["overhead_us"], second["overhead_us"]
    diff = abs(b1 - b2) / statistics.mean([b1, b2])
    print(
        f"\nrepeatability: bandwidth differs by {100 * diff:.1f}% between the normal runs "
        f"(target within 10% on an idle machine: {'met' if diff <= 0.10 else 'MISSED'}); "
        f"overhead by {100 * abs(o1 - o2) / statistics.mean([o1, o2]):.1f}%"
    )
    if throttled is None:
        print(f"throttled run skipped: {why}")
        return
    b, o = statistics.mean([b1, b2]), statistics.mean([o1, o2])
    print(
        f"under the quota: bandwidth {throttled['bandwidth_gbps'] / b:.2f}× normal "
        f"({b / throttled['bandwidth_gbps']:.1f}× lower), overhead "
        f"{throttled['overhead_us'] / o:.1f}× normal"
    )


if __name__ == "__main__":
    main()
