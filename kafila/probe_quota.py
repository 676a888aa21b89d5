"""The probe under a CPU quota (a cgroup's cpu.max / cfs_quota_us): what kafila/probe.py adds
where the member computes in the quota's periods (`kafila demo --throttle`, a container's limit).

- `sustained_clock(cpus)`: the clock its runs are timed on, CPU time over the quota;
- `measure_burst(step, period_s, threads)`: how many times faster than sustained it computes
  while the quota lets it run (`cpu_burst`);
- `measure_quota_run(period_s)`: the CPU ms it runs after a rest before the quota stalls it
  (`cpu_run_ms`).

planner.cost.quota_alone_ms prices one request's stage from them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

BURST_PERIODS = 20  # quota periods the burst probe spans (10 ms periods: 0.2 s; 100 ms: 2 s)
BURST_MIN_STEPS = 8
BURST_WARM_PERIODS = 3
BURST_ALONE_STEPS = 9
QUOTA_RUNS = 9
QUOTA_GAP_S = 0.0008  # a stall, not the loop's own pace (µs) nor a timer tick's work


def sustained_clock(cpus: float) -> Callable[[], float]:
    """Seconds as a CPU quota of `cpus` CPUs paces this process: its CPU time over `cpus`. The
    quota grants that many CPU-seconds a second to a process that wants them, so work of C
    CPU-seconds takes C/cpus seconds sustained. Wall time over short runs reads the quota's
    stalls by chance of where they fall: at a quarter CPU, one thread's block ran 5-7x slower by
    it than while let run, where the quota takes 4x. (Other load on the machine that leaves the
    process less than its quota is not seen.)"""
    return lambda: time.process_time() / cpus


def measure_burst(step: Callable[[], object], period_s: float, threads: int) -> float:
    """Under a CPU quota, how many times faster than its sustained rate a stage computes while
    the quota lets it run: `step` (a block's decode step, kafila.probe's wide one) run back to back over BURST_PERIODS of
    the quota's periods (wall time a step, the stalls included: the sustained cost) over the same
    step alone after a period idle, as a token reaching a quiet ring finds the quota refilled
    (the median of BURST_ALONE_STEPS; a step the quota still stalls counts its CPU time over the
    `threads` it computes on). Mean over fastest of the back-to-back steps read 1 where a step
    is near the period's budget, every step straddling a stall (CI read 1.48 where the quota
    allows 4); and a step that straddles one costs more CPU (a wide block's three: 1.55x).
    1 where nothing stalls."""
    warm_end = time.perf_counter() + BURST_WARM_PERIODS * period_s
    while time.perf_counter() < warm_end:  # a fresh graph's first steps fault in pages
        step()
    steps, start = 0, time.perf_counter()
    end = start + BURST_PERIODS * period_s
    while time.perf_counter() < end or steps < BURST_MIN_STEPS:
        step()
        steps += 1
    sustained = (time.perf_counter() - start) / steps
    alone = []
    for _ in range(BURST_ALONE_STEPS):
        time.sleep(period_s)
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        alone.append(min(time.perf_counter() - wall, (time.process_time() - cpu) / threads))
    return max(1.0, sustained / statistics.median(alone))


def measure_quota_run(period_s: float) -> list[float]:
    """Under a CPU quota, the CPU ms one thread computes after a rest before the quota stalls it
    (QUOTA_RUNS runs: a busy loop until its clock jumps by over QUOTA_GAP_S). The quota grants
    its share of each period, but the kernel only sees it spent at its next tick or switch: at
    250 Hz a quarter of a 10 ms period ran 2.7-5.8 ms, so a step of 3 ms mostly runs whole
    (planner.cost.quota_alone_ms). Each run rests two periods first: the debt of an overrun is
    repaid from the periods after it, as a quiet ring's member repays it between tokens."""
    runs = []
    for _ in range(QUOTA_RUNS):
        time.sleep(2 * period_s)
        start = last = time.perf_counter()
        while (now := time.perf_counter()) - last < QUOTA_GAP_S and now - start < period_s:
            last = now
        runs.append((last - start) * 1e3)
    return runs


__all__ = ["measure_burst", "measure_quota_run", "sustained_clock"]
