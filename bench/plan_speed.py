"""How fast the planner plans: 128 blocks on 16 devices (< 20 ms), ring ordering of 9 (< 1 s).

    .venv/bin/python -m bench.plan_speed [--fleets N]

Times `make_plan` end to end (tier, ring order, one PARTITION per rotation, admission) on
seeded random fleets, and `order_ring` alone: on 9 members with measured RTTs (exhaustive
search) and on 10-32 members (nearest neighbour + 2-opt). Prints the median and worst time and
their ratio to each target.

The hard case for the exhaustive search is not a fleet of ties: with every edge priced the same
the first ordering found meets the lower bound and every other branch is pruned at once. It is a
ring of relayed edges with distinct RTTs (every member restrictive): a relayed edge costs
r_A + r_B, so every ordering costs the same 2·Σr and only the tie-break (ring separation
Σ|r_A − r_B|) tells them apart; the per-member lower bound is then far below the optimum and
prunes little. It was the slowest of the cases tried (all permissive, ordinary and restrictive
alternating, mixed classes, narrow RTT ranges), several times the random fleets' median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

from planner import Device, Fleet, Model, Nat, make_plan, order_ring
from planner.ring import EXHAUSTIVE_MAX_MEMBERS

PLAN_TARGET_MS = 20.0
RING_TARGET_MS = 1000.0
REPEATS = 5


def _fleet(rng: random.Random, members: int, blocks: int, rtt_of, nat_of) -> Fleet:
    """Random devices; rtt_of(i) and nat_of(i) are drawn in each device's turn (keyword
    arguments evaluate in order, so the draws stay those of the runs in docs/BENCHMARKS.md)."""
    devices = tuple(
        Device(
            name=f"d{i}",
            memory_gb=rng.choice([8, 12, 16, 24, 32, 48, 80]),
            bandwidth_gbps=rng.uniform(80, 1400),
            overhead_us=rng.uniform(10, 60),
            rtt_ms=rtt_of(i),
            nat=nat_of(i),
        )
        for i in range(members)
    )
    model = Model("bench", blocks, 0.5e9, 1.5e9, 4096)
    return Fleet(4096, 2, "d0", model, devices)


def random_fleet(rng: random.Random, members: int, blocks: int) -> Fleet:
    return _fleet(rng, members, blocks, lambda i: float(rng.randint(5, 300)), lambda i: rng.choice(list(Nat)))


def distinct_rtt_fleet(
    rng: random.Random, members: int, blocks: int, nats: list[Nat] | None
) -> Fleet:
    """Distinct RTTs (no two equal, to 0.01 ms) and the given NAT classes (None: random ones)."""
    rtts = rng.sample(range(500, 30_000), members)  # 5.00 .. 299.99 ms
    return _fleet(rng, members, blocks, lambda i: rtts[i] / 100.0,
                  lambda i: rng.choice(list(Nat)) if nats is None else nats[i])  # fmt: skip


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
    report("order_ring, 9 members, random NAT classes and RTTs (exhaustive)", times, RING_TARGET_MS)
    members = EXHAUSTIVE_MAX_MEMBERS
    hard = [
        distinct_rtt_fleet(rng, members, 64, [Nat.RESTRICTIVE] * members)
        for _ in range(args.fleets)
    ]
    times = [time_ms(partial(order_ring, f.devices, "d0"), REPEATS) for f in hard]
    report(
        f"order_ring, {members} members, all relayed, distinct RTTs (exhaustive; the hard case)",
        times,
        RING_TARGET_MS,
    )
    mixed = [distinct_rtt_fleet(rng, members, 64, None) for _ in range(args.fleets)]
    times = [time_ms(partial(order_ring, f.devices, "d0"), REPEATS) for f in mixed]
    report(
        f"order_ring, {members} members, mixed NAT classes, distinct RTTs (exhaustive)",
        times,
        RING_TARGET_MS,
    )
    # every edge costs the same: the first ordering meets the bound, the rest prune at once
    same = Fleet(
        4096,
        2,
        "d0",
        Model("bench", 64, 0.5e9, 1.5e9, 4096),
        tuple(Device(f"d{i}", 24, 500.0, 20.0, rtt_ms=50.0, nat=Nat.RESTRICTIVE) for i in range(9)),
    )
    report(
        "order_ring, 9 members, all ties (the easy case: pruned at once)",
        [time_ms(partial(order_ring, same.devices, "d0"), REPEATS)],
        RING_TARGET_MS,
    )
    for n in (EXHAUSTIVE_MAX_MEMBERS + 1, 16, 32):
        for label, nats in (("mixed NAT classes", None), ("all relayed", [Nat.RESTRICTIVE] * n)):
            fleets_n = [distinct_rtt_fleet(rng, n, 64, nats) for _ in range(args.fleets)]
            times = [time_ms(partial(order_ring, f.devices, "d0"), REPEATS) for f in fleets_n]
            title = f"order_ring, {n} members, {label}, distinct RTTs (2-opt)"
            report(title, times, RING_TARGET_MS)
    times = [time_ms(partial(make_plan, f), REPEATS) for f in rings]
    report("make_plan, 64 blocks on 9 members (ring + 9 rotations)", times, RING_TARGET_MS)
    times = [time_ms(partial(make_plan, f), REPEATS) for f in hard]
    report("make_plan, 64 blocks on 9 members, the hard ring", times, RING_TARGET_MS)

if __name__ == "__main__":
    main()
