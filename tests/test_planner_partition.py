"""PARTITION (Algorithm 1) against an independent dynamic-programming optimum."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from planner import StageCost, feasible, partition

FLEETS = 2000


def dp_optimum(blocks: int, costs: list[StageCost], limits: list[int]) -> float:
    """min over divisions (each n_i in [1, lim_i], Σ n_i = k) of max_i cost_i(n_i); inf if none.

    best[j] after device i = the smallest bottleneck placing exactly j blocks on devices 0..i.
    """
    best = np.full(blocks + 1, np.inf)
    best[0] = -np.inf  # no devices, no blocks: nothing to bound
    for cost, limit in zip(costs, limits):
        new = np.full(blocks + 1, np.inf)
        for n in range(1, min(limit, blocks) + 1):
            # (j,) = max(best[j - n], cost(n)) for j >= n
            new[n:] = np.minimum(new[n:], np.maximum(best[: blocks + 1 - n], cost.at(n)))
        best = new
    return float(best[blocks])


def brute_force(blocks: int, costs: list[StageCost], limits: list[int]) -> float:
    best = math.inf
    ranges = [range(1, min(limit, blocks) + 1) for limit in limits]
    for counts in itertools.product(*ranges):
        if sum(counts) == blocks:
            best = min(best, max(c.at(n) for c, n in zip(costs, counts)))
    return best


def random_fleet(rng: random.Random) -> tuple[int, list[StageCost], list[int]]:
    m = rng.randint(2, 8)
    blocks = rng.randint(m, 128) if rng.random() < 0.7 else rng.randint(m, 3 * m)
    integral = rng.random() < 0.3  # integer costs make many candidate ties
    costs = []
    for _ in range(m):
        if integral:
            costs.append(StageCost(float(rng.randint(0, 5)), float(rng.randint(1, 4))))
        else:
            costs.append(StageCost(rng.uniform(0.0, 5.0), rng.uniform(0.01, 3.0)))
    share = blocks / m
    limits = [
        rng.randint(int(0.5 * share), max(1, int(rng.uniform(1.0, 4.0) * share))) for _ in range(m)
    ]
    if rng.random() < 0.2:
        limits = [blocks] * m  # unconstrained
    return blocks, costs, limits


def check(blocks: int, costs: list[StageCost], limits: list[int], optimum: float) -> None:
    result = partition(blocks, costs, limits)
    if math.isinf(optimum):
        assert result is None
        return
    assert result is not None
    assert sum(result.counts) == blocks
    assert all(1 <= n <= lim for n, lim in zip(result.counts, limits))
    achieved = max(c.at(n) for c, n in zip(costs, result.counts))
    assert achieved == result.bottleneck_ms
    assert math.isclose(result.bottleneck_ms, optimum, rel_tol=1e-12, abs_tol=1e-12)


def test_partition_matches_dp_optimum_on_random_fleets() -> None:
    rng = random.Random(20260604)
    feasible_seen = infeasible_seen = 0
    for _ in range(FLEETS):
        blocks, costs, limits = random_fleet(rng)
        optimum = dp_optimum(blocks, costs, limits)
        check(blocks, costs, limits, optimum)
        if math.isinf(optimum):
            infeasible_seen += 1
        else:
            feasible_seen += 1
    # the generator exercises both outcomes
    assert feasible_seen > FLEETS // 2
    assert infeasible_seen > FLEETS // 20


def test_dp_agrees_with_brute_force_on_small_fleets() -> None:
    rng = random.Random(7)
    for _ in range(200):
        m = rng.randint(2, 4)
        blocks = rng.randint(m, 10)
        costs = [StageCost(rng.uniform(0, 3), rng.uniform(0.1, 2)) for _ in range(m)]
        limits = [rng.randint(0, blocks) for _ in range(m)]
        assert dp_optimum(blocks, costs, limits) == brute_force(blocks, costs, limits)
        check(blocks, costs, limits, brute_force(blocks, costs, limits))


def test_feasible_reserves_one_block_for_every_later_device() -> None:
    costs = [StageCost(0.0, 1.0)] * 3
    # a generous bound: the first device may not take blocks the other two need
    assert feasible(5, costs, [5, 5, 5], 100.0) == (3, 1, 1)
    assert feasible(5, costs, [5, 5, 5], 1.0) is None  # 1+1+1 < 5
    assert feasible(5, costs, [1, 1, 5], 100.0) == (1, 1, 3)


def test_feasible_refuses_a_bound_below_a_fixed_cost() -> None:
    costs = [StageCost(2.0, 1.0), StageCost(0.0, 1.0)]
    assert feasible(2, costs, [2, 2], 2.5) is None
    assert feasible(2, costs, [2, 2], 3.0) == (1, 1)


@pytest.mark.parametrize(
    ("blocks", "costs", "limits", "counts", "tau"),
    [
        # a device twice as fast takes twice the blocks
        (9, [StageCost(0, 1.0), StageCost(0, 2.0)], [9, 9], (6, 3), 6.0),
        # the fast device's limit pushes blocks to the slow one
        (9, [StageCost(0, 1.0), StageCost(0, 2.0)], [4, 9], (4, 5), 10.0),
        # nothing fits: limits sum below the block count
        (9, [StageCost(0, 1.0), StageCost(0, 2.0)], [4, 4], None, None),
        # a device with no room at all
        (3, [StageCost(0, 1.0), StageCost(0, 1.0)], [3, 0], None, None),
    ],
)
def test_partition_table(
    blocks: int,
    costs: list[StageCost],
    limits: list[int],
    counts: tuple[int, ...] | None,
    tau: float | None,
) -> None:
    result = partition(blocks, costs, limits)
    if counts is None:
        assert result is None
    else:
        assert result is not None
        assert (result.counts, result.bottleneck_ms) == (counts, tau)
