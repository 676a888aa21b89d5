"""DiP-SD offline (planner.dipsd): the model, the MILP against brute force and the baselines,
Dinkelbach's convergence, the time-limit fallback and input validation. No sockets, no model."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from planner import PlanInputError
from planner.dipsd import (
    METHODS,
    DipsdProblem,
    DraftUser,
    SolveLimits,
    Verifier,
    check_schedule,
    compare_dipsd,
    evaluate,
    expected_accepted,
    greedy,
    optimise,
    parse_dipsd,
    solve_baseline,
)

pytest.importorskip("pyscipopt")  # a declared dependency (pyproject.toml); the MILP path needs it

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "fleets" / "dipsd-users.json"
REL = 1e-6


def user(
    uid: str, alpha: float, per_token: float, network: float = 0.0, overhead: float = 0.0
) -> DraftUser:
    return DraftUser(uid, alpha, per_token, network, overhead)


def partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every set partition of `items`."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]


def brute_force(problem: DipsdProblem) -> float:
    """The best tokens/s over every partition (within the cap) and every length vector."""
    best = 0.0
    cap = problem.target.max_batch_users or len(problem.users)
    for part in partitions(list(range(len(problem.users)))):
        if any(len(b) > cap for b in part):
            continue
        for lengths in itertools.product(problem.draft_lengths, repeat=len(problem.users)):
            tokens, span = evaluate(problem, part, lengths)
            best = max(best, 1000.0 * tokens / span)
    return best


users_strategy = st.builds(
    lambda a, g, n, o: (a, g, n, o),
    st.floats(0.0, 0.95),
    st.floats(0.5, 80.0),
    st.floats(0.0, 30.0),
    st.floats(0.0, 6.0),
)


def build(
    raw: list[tuple[float, float, float, float]],
    c: float,
    beta: float,
    max_draft: int,
    min_draft: int = 0,
    padded: bool = False,
    cap: int | None = None,
) -> DipsdProblem:
    users = tuple(user(f"u{i}", *r) for i, r in enumerate(raw))
    return DipsdProblem(users, Verifier(c, beta, cap, padded), max_draft, min_draft)


# -- the model -------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("length", [0, 1, 2, 7, 16])
def test_expected_accepted_is_the_geometric_sum(alpha: float, length: int) -> None:
    assert expected_accepted(length, alpha) == pytest.approx(
        sum(alpha**i for i in range(length + 1))
    )


def test_span_is_busy_time_or_the_slowest_cycle() -> None:
    problem = DipsdProblem(
        (user("a", 0.5, 10.0, network=5.0), user("b", 0.5, 40.0)), Verifier(50.0, 2.0), 8
    )
    # one batch: a draft cycle of max(5+30, 120) then one pass over (3+1)+(3+1) positions
    tokens, span = evaluate(problem, [[0, 1]], [3, 3])
    assert span == pytest.approx(120.0 + 50.0 + 2.0 * 8)
    assert tokens == pytest.approx(2 * (1 + 0.5 + 0.25 + 0.125))
    # two batches: the target is busy 2·(50 + 8) = 116; b's cycle 120 + 58 = 178 is longer
    _, span = evaluate(problem, [[0], [1]], [3, 3])
    assert span == pytest.approx(178.0)
    # padded: the batch runs 2 · (max l + 1) positions
    padded = DipsdProblem(problem.users, Verifier(50.0, 2.0, padded=True), 8)
    _, span = evaluate(padded, [[0, 1]], [1, 3])
    assert span == pytest.approx(120.0 + 50.0 + 2.0 * 8)


# -- the optimiser against brute force and the baselines ----------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=st.lists(users_strategy, min_size=1, max_size=3),
    c=st.floats(20.0, 150.0),
    beta=st.floats(0.0, 10.0),
    max_draft=st.integers(1, 8),
    min_draft=st.integers(0, 1),
    padded=st.booleans(),
)
# a slope of 1e-9 ms a position once made SCIP call a one-user model infeasible (CI, 2026-12-02)
@example(raw=[(0.0, 1.0, 0.0, 0.0)], c=20.0, beta=1e-9, max_draft=3, min_draft=1, padded=True)
def test_milp_equals_brute_force_on_small_instances(
    raw, c, beta, max_draft, min_draft, padded
) -> None:
    problem = build(raw, c, beta, max_draft, min_draft, padded)
    result = optimise(problem)
    assert result.optimal and result.fallback is None and result.method == "dinkelbach-milp"
    assert result.tokens_per_s == pytest.approx(brute_force(problem), rel=REL)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=st.lists(st.tuples(users_strategy, st.booleans()), min_size=1, max_size=3),
    c=st.floats(20.0, 150.0),
    beta=st.floats(0.0, 10.0),
    max_draft=st.integers(1, 8),
    padded=st.booleans(),
)
def test_milp_equals_brute_force_with_drafters_on_the_verifiers_machine(raw, c, beta, max_draft, padded) -> None:
    users = tuple(dataclasses.replace(user(f"u{i}", *r), serial=serial) for i, (r, serial) in enumerate(raw))
    problem = DipsdProblem(users, Verifier(c, beta, None, padded), max_draft)
    result = optimise(problem)
    assert result.optimal and result.tokens_per_s == pytest.approx(brute_force(problem), rel=REL)


def test_a_drafter_on_the_verifiers_machine_drafts_in_its_serial_time() -> None:
    apart = DipsdProblem((user("a", 0.8, 5.0), user("b", 0.8, 5.0, network=4.0)), Verifier(10.0, 2.0), 6)
    shared = dataclasses.replace(apart, users=tuple(dataclasses.replace(u, serial=True) for u in apart.users))
    # apart: verification waits for the slower draft (4 + 3·5 ms), then 10 + 2·8 ms; on the
    # verifier's machine both drafts are its time (2 × 15 ms) and only b's network comes before
    assert evaluate(apart, [[0, 1]], [3, 3])[1] == pytest.approx(19.0 + 26.0)
    assert evaluate(shared, [[0, 1]], [3, 3])[1] == pytest.approx(max(26.0 + 30.0, 4.0 + 56.0))
    # drafting that costs the verifier's own time is worth fewer drafts
    assert sum(optimise(shared).draft_lengths[i][1] for i in range(2)) < sum(
        optimise(apart).draft_lengths[i][1] for i in range(2))


def test_milp_equals_brute_force_with_a_batch_cap() -> None:
    raw = [
        (0.8, 12.0, 4.0, 1.0),
        (0.6, 30.0, 8.0, 2.0),
        (0.9, 5.0, 1.0, 0.0),
        (0.7, 20.0, 3.0, 0.5),
    ]
    problem = build(raw, 60.0, 4.0, 5, cap=2)
    result = optimise(problem)
    assert result.optimal
    assert max(len(b) for b in result.batches) <= 2
    assert result.tokens_per_s == pytest.approx(brute_force(problem), rel=REL)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=st.lists(users_strategy, min_size=2, max_size=6),
    c=st.floats(60.0, 150.0),
    beta=st.floats(2.0, 10.0),
    min_draft=st.integers(0, 1),
)
def test_optimum_is_at_least_every_baseline_and_the_greedy(raw, c, beta, min_draft) -> None:
    problem = build(raw, c, beta, 10, min_draft)
    results = compare_dipsd(problem)
    assert list(results) == list(METHODS)
    best = results["dipsd"]
    assert best is not None and best.optimal
    for name, other in results.items():
        assert other is not None
        if min_draft == 1 and name in ("ad", "ad-greedy-batching"):
            continue  # l = 0 is outside the paper's l >= 1: AD may win when drafting is slow
        assert best.tokens_per_s >= other.tokens_per_s * (1 - REL), name
    ids = {u.id: i for i, u in enumerate(problem.users)}
    for schedule in (results["greedy"], best):
        batches = [[ids[u] for u in b] for b in schedule.batches]
        check_schedule(
            problem, batches, [dict(schedule.draft_lengths)[u.id] for u in problem.users]
        )


def test_a_case_that_once_hit_the_milp_time_limit_is_solved() -> None:
    # Hypothesis found it: SCIP's default root cut rounds took > 5 s on this 4-user MILP.
    raw = [
        (0.95, 44.39, 0.0, 0.0),
        (0.525, 8.83, 0.0, 0.0),
        (0.929, 26.1, 0.0, 0.0),
        (0.225, 24.35, 0.0, 0.0),
    ]
    problem = build(raw, 60.0, 2.0, 10)
    result = optimise(problem, SolveLimits(milp_s=2.0, total_s=10.0))
    assert result.optimal, result.fallback
    assert result.tokens_per_s >= greedy(problem).tokens_per_s


def test_baselines_keep_their_constraints() -> None:
    problem = parse_dipsd(json.loads(EXAMPLE.read_text()))
    results = compare_dipsd(problem)
    count = len(problem.users)
    assert results["no-batching"].n_batches == count
    assert results["single-batch"].n_batches == 1
    assert {l for _, l in results["fixed-l7"].draft_lengths} == {7}
    assert {l for _, l in results["ad"].draft_lengths} == {0} and results["ad"].n_batches == count
    ad = results["ad-greedy-batching"]
    assert ad.n_batches == 1 and ad.tokens_per_round == count
    assert ad.span_ms == pytest.approx(problem.target.c_ms + problem.target.beta_ms * count)
    assert results["dipsd"].optimal and results["dipsd"].n_batches >= 2  # the example pipelines


def test_ad_greedy_batching_packs_to_the_cap() -> None:
    raw = [(0.7, 10.0, 0.0, 0.0)] * 5
    problem = build(raw, 80.0, 5.0, 6, cap=2)
    ad = solve_baseline(problem, "ad-greedy-batching")
    assert ad is not None and [len(b) for b in ad.batches] == [2, 2, 1]
    assert ad.span_ms == pytest.approx(3 * 80.0 + 5.0 * 5)
    assert solve_baseline(problem, "single-batch") is None  # 5 users cannot share one batch of 2


def test_dinkelbach_is_monotone_and_ends_at_the_answer() -> None:
    problem = parse_dipsd(json.loads(EXAMPLE.read_text()))
    result = optimise(problem)
    trace = result.trace
    assert len(trace) >= 1 and result.milps >= len(trace)
    assert all(b > a for a, b in itertools.pairwise(trace))  # λ strictly increases
    assert trace[-1] == pytest.approx(result.tokens_per_s, rel=1e-9)
    assert trace[0] == pytest.approx(greedy(problem).tokens_per_s, rel=1e-9)  # it starts at greedy


def test_a_tiny_time_limit_falls_back_to_greedy() -> None:
    problem = parse_dipsd(json.loads(EXAMPLE.read_text()))
    limits = SolveLimits(milp_s=1e-6, total_s=1e-6)
    ticks = iter(float(i) for i in range(1000))  # a clock that moves 1 s per reading
    result = optimise(problem, limits, clock=lambda: next(ticks))
    assert not result.optimal and result.fallback is not None
    assert "time limit" in result.fallback
    assert result.method in ("greedy-fallback", "dinkelbach-milp-unproven")
    assert result.tokens_per_s >= greedy(problem).tokens_per_s * (1 - 1e-12)
    assert result.solve_s is not None and result.solve_s > 0


def test_a_tiny_milp_limit_without_a_clock_also_falls_back() -> None:
    raw = [(0.5 + 0.05 * i, 10.0 + 7 * i, 2.0 * i, 1.0) for i in range(8)]
    problem = build(raw, 70.0, 3.0, 16)
    result = optimise(problem, SolveLimits(milp_s=1e-3, total_s=1e-3))
    assert not result.optimal and "time limit" in (result.fallback or "")


def test_without_pyscipopt_it_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def no_scip(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name.startswith("pyscipopt"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_scip)
    problem = parse_dipsd(json.loads(EXAMPLE.read_text()))
    result = optimise(problem)
    assert result.method == "greedy-fallback" and "pyscipopt" in (result.fallback or "")
    assert result.tokens_per_s == pytest.approx(greedy(problem).tokens_per_s)


def test_schedule_json_is_stable() -> None:
    problem = parse_dipsd(json.loads(EXAMPLE.read_text()))
    out = optimise(problem).to_json()
    assert list(out) == [
        "method",
        "optimal",
        "fallback",
        "n_batches",
        "batches",
        "draft_lengths",
        "tokens_per_round",
        "span_ms",
        "tokens_per_s",
        "solve_s",
        "milps",
        "dinkelbach_tokens_per_s",
    ]
    assert sorted(out["draft_lengths"]) == sorted(u.id for u in problem.users)
    json.dumps(out)


# -- validation ------------------------------------------------------------------------------

GOOD = {
    "target": {"c_ms": 90, "beta_ms": 4},
    "users": [{"id": "a", "alpha": 0.8, "draft_ms_per_token": 10, "network_ms": 5}],
}


def _edit(path: tuple, value: object) -> dict:
    data = json.loads(json.dumps(GOOD))
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([], "must be a JSON object"),
        (_edit(("target",), KeyError), 'missing "target"'),
        (_edit(("target", "c_ms"), KeyError), 'target is missing "c_ms"'),
        (_edit(("target", "c_ms"), 0), '"c_ms" must be a number > 0'),
        (_edit(("target", "beta_ms"), -1), '"beta_ms" must be a number >= 0'),
        (_edit(("target", "max_batch_users"), 0), '"max_batch_users" must be an integer >= 1'),
        (_edit(("target", "padded"), "yes"), '"padded" must be true or false'),
        (_edit(("users",), KeyError), 'missing "users"'),
        (_edit(("users",), []), "no users"),
        (
            _edit(
                ("users",),
                [{"id": f"u{i}", "alpha": 0.5, "draft_ms_per_token": 1} for i in range(65)],
            ),
            "more than the 64",
        ),
        (_edit(("users", 0, "alpha"), 1.0), '"alpha" must be a number in [0, 1)'),
        (_edit(("users", 0, "alpha"), -0.1), '"alpha" must be a number in [0, 1)'),
        (_edit(("users", 0, "alpha"), True), '"alpha"'),
        (_edit(("users", 0, "alpha"), KeyError), "user 'a' is missing \"alpha\""),
        (
            _edit(("users", 0, "draft_ms_per_token"), -3),
            '"draft_ms_per_token" must be a number >= 0',
        ),
        (_edit(("users", 0, "network_ms"), -1), '"network_ms" must be a number >= 0'),
        (_edit(("users", 0, "network_ms"), float("nan")), '"network_ms"'),
        (_edit(("users", 0, "id"), ""), '"id" must be a non-empty string'),
        (_edit(("users", 0), "a"), "user #1 must be an object"),
        (_edit(("users",), [GOOD["users"][0], GOOD["users"][0]]), "appears twice"),
        (_edit(("max_draft",), 0), '"max_draft" must be an integer in 1..32'),
        (_edit(("max_draft",), 33), '"max_draft" must be an integer in 1..32'),
        (_edit(("min_draft",), 2), '"min_draft" must be 0 or 1'),
    ],
)
def test_bad_input_is_one_plan_input_error(data: object, words: str) -> None:
    with pytest.raises(PlanInputError) as caught:
        parse_dipsd(data)
    message = str(caught.value)
    assert words in message and "\n" not in message


def test_the_example_file_parses() -> None:
    problem = parse_dipsd(json.loads(EXAMPLE.read_text()))
    assert 4 <= len(problem.users) <= 8
    assert all(0.5 <= u.alpha <= 0.9 for u in problem.users)
    assert 60 <= problem.target.c_ms <= 150 and 2 <= problem.target.beta_ms <= 10


def test_limits_are_validated() -> None:
    with pytest.raises(PlanInputError):
        SolveLimits(milp_s=0)
    with pytest.raises(PlanInputError):
        SolveLimits(max_iterations=0)


@pytest.mark.parametrize("ring_ms", [0.0, 25.0, 120.0])
def test_a_ring_delay_is_overlapped_by_other_batches_and_the_milp_agrees(ring_ms: float) -> None:
    """`ring_ms` (Kafila's hops: a batch's delay outside the serial target) adds to each batch's
    cycle, not to the target's busy time, so batches hide it behind each other's verification."""
    raw = [(0.6, 0.0, 0.0, 0.0), (0.5, 0.0, 0.0, 0.0), (0.7, 0.0, 0.0, 0.0), (0.55, 0.0, 0.0, 0.0)]
    users = tuple(user(f"u{i}", *r) for i, r in enumerate(raw))
    problem = DipsdProblem(users, Verifier(20.0, 1.0, ring_ms=ring_ms), max_draft=4)
    tokens, span = evaluate(problem, [[0, 1], [2, 3]], [2, 2, 2, 2])
    assert span == pytest.approx(max(2 * (20 + 6), ring_ms + 20 + 6))
    result = optimise(problem)
    assert result.optimal and result.tokens_per_s == pytest.approx(brute_force(problem), rel=REL)
    if ring_ms >= 120:
        assert result.n_batches >= 3  # a long ring delay: more batches in flight
    with pytest.raises(PlanInputError, match="ring_ms"):
        Verifier(20.0, 1.0, ring_ms=-1.0)
