"""Ring ordering: Table III's rule, RTT pricing, exhaustive search, and the counting rule."""

from __future__ import annotations

import itertools
import random

import pytest

from planner import (
    EXHAUSTIVE_MAX_MEMBERS,
    Device,
    EdgeKind,
    Nat,
    order_ring,
    predicted_direct,
    relay_count,
    ring_edges,
)

P, O, R = Nat.PERMISSIVE, Nat.ORDINARY, Nat.RESTRICTIVE


def member(name: str, nat: Nat | None = None, rtt_ms: float | None = None) -> Device:
    return Device(name, 10.0, 100.0, 20.0, rtt_ms=rtt_ms, nat=nat)


@pytest.mark.parametrize(
    ("a", "b", "direct"),
    [  # Kafila Table III, "rule predicts"
        (P, P, True),
        (P, O, True),
        (P, R, True),
        (O, P, True),
        (O, O, True),
        (O, R, False),
        (R, P, True),
        (R, O, False),
        (R, R, False),
        (None, O, False),  # unknown counts as restrictive
        (None, P, True),
    ],
)
def test_table_iii_rule(a: Nat | None, b: Nat | None, direct: bool) -> None:
    assert predicted_direct(a, b) is direct


def test_edges_are_priced_from_rtts() -> None:
    a, b, c = member("a", O, 10.0), member("b", O, 30.0), member("c", R, 50.0)
    edges = ring_edges([a, b, c])
    assert [(e.src, e.dst, e.kind, e.ms) for e in edges] == [
        ("a", "b", EdgeKind.DIRECT, 20.0),  # |10 − 30|
        ("b", "c", EdgeKind.RELAY, 80.0),  # 30 + 50
        ("c", "a", EdgeKind.RELAY, 60.0),
    ]
    # an unmeasured end leaves the edge unpriced
    assert ring_edges([a, member("x", O)])[0].ms is None
    assert ring_edges([a]) == ()


def _price(order: tuple[Device, ...]) -> tuple[float, float]:
    edges = ring_edges(order)
    price = sum(e.ms for e in edges if e.ms is not None)
    separation = sum(
        abs((order[i].rtt_ms or 0) - (order[(i + 1) % len(order)].rtt_ms or 0))
        for i in range(len(order))
    )
    return round(price, 6), round(separation, 6)


def _brute_best(members: list[Device]) -> tuple[float, float]:
    first, rest = members[0], members[1:]
    return min(_price((first, *perm)) for perm in itertools.permutations(rest))


def test_priced_search_is_optimal_with_separation_tie_break() -> None:
    rng = random.Random(11)
    for _ in range(150):
        m = rng.randint(3, 7)
        members = [
            member(f"d{i}", rng.choice([P, O, R, None]), float(rng.choice([5, 20, 80, 150, 280])))
            for i in range(m)
        ]
        order = order_ring(members, "d0")
        assert order[0].name == "d0"
        assert sorted(d.name for d in order) == sorted(d.name for d in members)
        assert _price(order) == _brute_best(members)


def test_all_relay_ring_keeps_near_members_together() -> None:
    # every edge relays, so every order costs 2·Σr; separation decides
    members = [
        member("far1", R, 100.0),
        member("near1", R, 10.0),
        member("far2", R, 101.0),
        member("near2", R, 11.0),
    ]
    order = [d.name for d in order_ring(members, "far1")]
    assert order[0] == "far1"
    # the two near members are neighbours, the two far members are neighbours
    pos = {name: i for i, name in enumerate(order)}
    assert abs(pos["near1"] - pos["near2"]) in (1, 3)
    assert abs(pos["far1"] - pos["far2"]) in (1, 3)


def test_nine_members_exhaustive_and_beyond_is_a_valid_ring() -> None:
    assert EXHAUSTIVE_MAX_MEMBERS == 9
    rng = random.Random(3)
    nine = [member(f"d{i}", rng.choice([P, O, R]), float(rng.randint(5, 300))) for i in range(9)]
    assert _price(order_ring(nine, "d4")) == _brute_best([nine[4]] + nine[:4] + nine[5:])
    many = [member(f"d{i}", rng.choice([P, O, R]), float(rng.randint(5, 300))) for i in range(14)]
    order = order_ring(many, "d0")
    assert order[0].name == "d0"
    assert sorted(d.name for d in order) == sorted(d.name for d in many)
    # the heuristic is at least as good as the order given
    assert _price(order) <= _price(tuple(many))


def _min_relays(members: list[Device]) -> int:
    first, rest = members[0], members[1:]
    return min(relay_count((first, *perm)) for perm in itertools.permutations(rest))


def test_counting_rule_reaches_the_fewest_relayed_edges() -> None:
    rng = random.Random(5)
    for _ in range(300):
        m = rng.randint(2, 7)
        members = [member(f"d{i}", rng.choice([P, O, R, None])) for i in range(m)]
        order = order_ring(members, "d0")
        assert order[0].name == "d0"
        assert sorted(d.name for d in order) == sorted(d.name for d in members)
        assert relay_count(order) == _min_relays(members)


@pytest.mark.parametrize(
    ("nats", "relays"),
    [
        ([R, R, P, P], 0),  # alternating around the ring: all direct
        ([R, R, R, P, P], 1),
        ([R, O, P, P], 0),  # P O P around R
        ([R, O, P], 1),  # R needs two permissive neighbours, there is one
        ([O, O, O], 0),
        ([R, R, R], 3),
    ],
)
def test_counting_rule_table(nats: list[Nat], relays: int) -> None:
    members = [member(f"d{i}", nat) for i, nat in enumerate(nats)]
    assert relay_count(order_ring(members, "d0")) == relays
