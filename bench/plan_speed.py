"""How fast the planner plans: 128 blocks on 16 devices (< 20 ms), ring ordering of 9 (< 1 s).

    .venv/bin/python -m bench.plan_speed [--fleets N]

Times `make_plan` end to end (tier, ring order, one PARTITION per rotation, admission) on
seeded random fleets, and `order_ring` alone on 9 members with measured RTTs (exhaustive
search). Prints the median and worst time and their ratio to each target.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

from planner import Device, Fleet, Model, Nat, make_plan, order_ring

PLAN_TARGET_MS = 20.0
RING_TARGET_MS = 1000.0
REPEATS = 5


def random_fleet(rng: random.Random, members: int, blocks: int) -> Fleet:
    devices = tuple(
        Device(
            name=f"d{i}",
            memory_gb=rng.choice([8, 12, 16, 24, 32, 48, 80]),
            bandwidth_gbps=rng.uniform(80, 1400),
            overhead_us=rng.uniform(10, 60),
            rtt_ms=float(rng.randint(5, 300)),
            nat=rng.choice(list(Nat)),
        )
        for i in range(members)
    )
    model = Model("bench", blocks, 0.5e9, 1.5e9, 4096)
    return Fleet(4096, 2, "d0", model, devices)


def time_ms(work: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` wall and CPU ms for one call (timeit's convention on a shared host)."""
    wall, cpu = [], []
    for _ in range(repeats):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        work()
        wall.append((time.perf_counter() - start_wall) * 1000.0)
        cpu.append((time.process_time() - start_cpu) * 1000.0)
    return min(wall), min(cpu)


def report(label: str, samples: list[tuple[float, float]], target_ms: float) -> None:
    wall = [w for w, _ in samples]
    cpu = [c for _, c in samples]
    median, worst = statistics.median(wall), max(wall)
    print(
        f"{label}: wall median {median:.2f} ms, worst {worst:.2f} ms "
        f"(CPU median {statistics.median(cpu):.2f} ms) over {len(samples)} fleets, best of "
        f"{REPEATS} each; target < {target_ms:.0f} ms: median {median / target_ms:.2f}×, "
        f"worst {worst / target_ms:.2f}× the target ({'met' if worst < target_ms else 'MISSED'})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", type=int, default=30)
    args = parser.parse_args()
    rng = random.Random(1)

    fleets = [random_fleet(rng, 16, 128) for _ in range(args.fleets)]
    feasible = sum(make_plan(f).feasible for f in fleets)
    times = [time_ms(partial(make_plan, f), REPEATS) for f in fleets]
    report("make_plan, 128 blocks on 16 devices (16 rotations)", times, PLAN_TARGET_MS)
    print(f"  ({feasible} of {len(fleets)} random fleets feasible)")

    rings = [random_fleet(rng, 9, 64) for _ in range(args.fleets)]
    times = [time_ms(partial(order_ring, f.devices, "d0"), REPEATS) for f in rings]
    report("order_ring, 9 members with RTTs (exhaustive)", times, RING_TARGET_MS)
    # the hardest case for the bound: every edge costs the same, every order ties
    same = Fleet(
        4096,
        2,
        "d0",
        Model("bench", 64, 0.5e9, 1.5e9, 4096),
        tuple(Device(f"d{i}", 24, 500.0, 20.0, rtt_ms=50.0, nat=Nat.RESTRICTIVE) for i in range(9)),
    )
    report(
        "order_ring, 9 members, all ties",
        [time_ms(partial(order_ring, same.devices, "d0"), REPEATS)],
        RING_TARGET_MS,
    )
    times = [time_ms(partial(make_plan, f), REPEATS) for f in rings]
    report("make_plan, 64 blocks on 9 members (ring + 9 rotations)", times, RING_TARGET_MS)


if __name__ == "__main__":
    main()
