"""The live DiP-SD optimiser at the head (kafila/session/ring/speculation/dipsd_live.py), sans I/O: when it
re-solves, what it answers past its bound, the lengths' bounds, the schedule on the micro-batches,
requests leaving; and the head with it (fake stages, tests/test_head_core.py's Rig): the same
greedy tokens as plain decoding."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kafila.session.ring.speculation.dipsd_live import LiveDipsd, LiveUser, RingFit, _relabel
from kafila.session.wire.frames import Activation
from kafila.session.ring.head import SolveDipsd
from kafila.session.ring.microbatch import MicroBatches
from kafila.session.ring.scheduler import Scheduler
from kafila.session.ring.speculation.speculate import DRAFT_K
from planner.dipsd import SolveLimits, greedy
from tests.test_head_core import H, PROMPTS, STAGE_US, Rig, solo

# a 20 ms/hop loopback ring: the machine computes a trip of T positions in 20 + 1·T ms, the hops take 60
FIT = RingFit(c_ms=20.0, beta_ms=1.0, ring_ms=60.0, max_rows=32)


def users(*alphas: float, prefix: str = "r") -> list[LiveUser]:
    return [LiveUser(f"{prefix}{i}", a) for i, a in enumerate(alphas)]


def solve(live: LiveDipsd, problem, now: float):
    return live.solved(problem, live.solve(problem), now)


def test_the_verifier_is_the_serial_fit_and_the_ring_delay():
    v = FIT.verifier()
    assert (v.c_ms, v.beta_ms, v.ring_ms, v.max_batch_users) == (20.0, 1.0, 60.0, 32)
    odd = RingFit(-1.0, -0.5, -3.0, 0).verifier()  # a fit gone wrong still makes a valid verifier
    assert odd.c_ms > 0 and odd.beta_ms == 0 and odd.ring_ms == 0 and odd.max_batch_users == 1
    live = LiveDipsd(8)
    assert live.due(0.0, users(0.6, 0.5), None) is None and not live.pending  # the ring not measured yet


def test_the_head_fits_the_serial_part_from_the_traces_and_the_ring_from_the_edges():
    rig = Rig(slots=4, batch=True, speculate="ngram", one_machine=True)
    assert rig.core._ring_fit() is None
    for r in "ab":
        rig.submit(r, PROMPTS[r] * 3, max_new=8, stop_at_eos=False)
    rig.run()
    rig.core.pipeline_depth({n: 40.0 for n in rig.core.ring})  # the glue's once a second
    fit = rig.core._ring_fit()
    assert fit.c_ms + fit.beta_ms == pytest.approx(3 * STAGE_US / 1000, rel=0.5)  # one machine: all three stages
    assert fit.ring_ms == pytest.approx(3 * 20.0)  # each edge's RTT/2; no other machine
    assert fit.machine == rig.core.machines["m1"]  # the busiest: the one machine


def test_a_drafter_on_the_busiest_machine_is_serial_in_the_problem():
    fit = RingFit(c_ms=20.0, beta_ms=1.0, ring_ms=60.0, max_rows=32, machine="box")
    there = LiveUser("a", 0.6, draft_ms_per_token=8.0, machine="box")
    elsewhere = LiveUser("b", 0.6, draft_ms_per_token=8.0, machine="laptop")
    problem = LiveDipsd(8).due(0.0, [there, elsewhere, LiveUser("c", 0.6)], fit)
    assert [u.serial for u in problem.users] == [True, False, False]


def test_padded_rows_make_a_batch_draft_alike():
    """OpenVINO pads a micro-batch's rows to its longest: a shorter draft saves nothing there, so
    the optimiser gives every request of a batch the same length; ragged rows (MLX) need not."""
    assert not FIT.verifier().padded and RingFit(20.0, 1.0, 60.0, 32, padded=True).verifier().padded
    for method in ("greedy", "milp"):
        live = LiveDipsd(8, method=method)
        fit = RingFit(c_ms=20.0, beta_ms=4.0, ring_ms=60.0, max_rows=32, padded=True)
        s = solve(live, live.due(0.0, users(0.9, 0.6, 0.3), fit), 0.0)
        by_batch: dict = {}
        for req_id, length in s.lengths.items():
            by_batch.setdefault(s.batches[req_id], set()).add(length)
        assert all(len(lengths) == 1 for lengths in by_batch.values()), (method, s.lengths, s.batches)


def test_the_head_counts_a_padded_batch_at_its_longest_row():
    rig = Rig(slots=4, batch=True, speculate="ngram", one_machine=True)
    assert rig.core.padded_rows  # the default: OpenVINO stages
    acts = [Activation(r, i, 5, 5, (), np.zeros((n, H), np.float32), (("m1", 1000), ("m2", 1000), ("m3", 1000)))
            for i, (r, n) in enumerate((("a", 1), ("b", 4)))]  # fmt: skip
    for a in acts:
        rig.core.scheduler.submit(a.req_id, "m1", [1, 2, 3, 4, 5], 4, False)
    rig.core.scheduler.steps()
    for req in rig.core.scheduler._requests.values():
        req.cache_len, req.pos, req.in_flight = 5, 5, 1  # decoding
    rig.core._account_batch(acts)
    assert list(rig.core.serial_cost.as_dict()["by_positions"]) == [8]  # 2 rows × 4 positions, not 1 + 4


def test_re_solves_when_the_requests_change_or_alpha_drifts_at_most_every_interval():
    live = LiveDipsd(8, method="greedy", every_s=1.0)
    assert live.due(0.0, users(0.6), FIT) is None  # one request: choose_k's
    problem = live.due(0.0, users(0.6, 0.5), FIT)
    assert problem is not None and [u.id for u in problem.users] == ["r0", "r1"]
    assert live.due(0.1, users(0.6, 0.5, 0.7), FIT) is None  # a solve is out
    s = solve(live, problem, 0.2)
    assert s is not None and set(s.lengths) == {"r0", "r1"} and live.solves == 1
    assert live.due(5.0, users(0.6, 0.5), FIT) is None  # nothing changed
    assert live.due(5.0, users(0.65, 0.55), FIT) is None  # α moved less than the drift
    assert live.due(0.5, users(0.6, 0.5, 0.7), FIT) is None  # a new request, but within the interval
    later = live.due(1.2, users(0.6, 0.5, 0.7), FIT)
    assert later is not None  # ... and after it
    solve(live, later, 1.3)
    assert live.due(3.0, users(0.9, 0.5, 0.7), FIT) is not None  # α drifted by 0.3


def test_fewer_than_two_requests_drop_the_schedule():
    live = LiveDipsd(8, method="greedy")
    solve(live, live.due(0.0, users(0.6, 0.5), FIT), 0.0)
    assert live.schedule is not None
    assert live.due(2.0, users(0.6), FIT) is None and live.schedule is None
    assert live.length("r0") is None and live.batch("r0") is None and not live.status()["active"]


def test_past_its_bound_the_solve_keeps_the_greedy_rule_and_says_so():
    ticks = iter(range(1000))
    clock = lambda: float(next(ticks))  # noqa: E731  every reading one second later: past any bound
    live = LiveDipsd(8, limits=SolveLimits(milp_s=0.05, total_s=0.05))
    problem = live.due(0.0, users(0.8, 0.6, 0.4, 0.7), FIT)
    answer = live.solve(problem, clock)
    assert answer.fallback and "limit" in answer.fallback and answer.method == "greedy-fallback"
    assert answer.draft_lengths == greedy(problem).draft_lengths
    s = live.solved(problem, answer, 0.0)
    assert s.fallback == answer.fallback and live.status()["fallback"] == answer.fallback
    assert live.status()["solve_ms"] is not None


@pytest.mark.parametrize("alphas", [(0.9, 0.9, 0.9, 0.9), (0.1, 0.2, 0.05, 0.3), (0.95, 0.3, 0.6, 0.8, 0.5)])
def test_lengths_stay_within_bounds_and_every_request_has_a_batch(alphas):
    for method in ("milp", "greedy"):
        live = LiveDipsd(5, method=method)
        problem = live.due(0.0, users(*alphas), RingFit(20.0, 1.0, 60.0, max_rows=2))
        s = solve(live, problem, 0.0)
        assert set(s.lengths) == set(s.batches) == {u.id for u in problem.users}
        assert all(0 <= s.lengths[u] <= 5 for u in s.lengths)
        sizes = [list(s.batches.values()).count(b) for b in set(s.batches.values())]
        assert max(sizes) <= 2 and s.n_batches == len(sizes)  # the row limit holds
        assert s.tokens_per_s > 0


def test_the_optimiser_hides_the_ring_delay_behind_other_batches():
    live = LiveDipsd(8, method="milp")
    s = solve(live, live.due(0.0, users(0.6, 0.55, 0.5, 0.65), FIT), 0.0)
    assert s.n_batches >= 2  # 60 ms of hops per trip: batches overlap them (pipelining)
    compute_bound = LiveDipsd(8, method="milp")
    fit = RingFit(c_ms=80.0, beta_ms=1.0, ring_ms=0.0, max_rows=32)  # all serial: one batch
    assert solve(compute_bound, compute_bound.due(0.0, users(0.6, 0.55, 0.5, 0.65), fit), 0.0).n_batches == 1


def test_the_planned_length_is_capped_by_the_room_and_wanted_invariant():
    sched = Scheduler(slots=2, context=16, speculate="ngram")
    sched.submit("a", "m1", [1, 2, 1, 2, 1, 2], max_new=4)
    (step,) = sched.steps()
    sched.complete("a", 1)
    sched.planned["a"] = 8
    req = sched._requests["a"]
    wanted, room = req.max_new - len(req.generated), sched.context - req.cache_len
    assert sched._draft_k(req) == min(8, wanted - 1, room - wanted - 1) == 2
    sched.planned["a"] = 0
    assert sched._draft_k(req) == 0  # the optimiser said: do not draft
    del sched.planned["a"]
    assert sched.speculating() == [("a", req.acceptance.rate, req.origin)]


def test_a_request_leaving_drops_from_the_schedule_even_while_a_solve_is_out():
    live = LiveDipsd(8, method="greedy")
    s = solve(live, live.due(0.0, users(0.6, 0.5, 0.7), FIT), 0.0)
    assert "r1" in s.lengths
    live.drop("r1")
    assert live.length("r1") is None and set(live.schedule.lengths) == {"r0", "r2"}
    problem = live.due(2.0, users(0.6, 0.7, 0.5, prefix="q"), FIT)
    live.drop("q1")  # left while the solve was out
    s = solve(live, problem, 2.1)
    assert set(s.lengths) == {"q0", "q2"} and "q1" not in s.batches
    live.drop("q0")  # one left: no schedule
    assert live.schedule is None


def test_labels_stay_with_the_batch_that_keeps_most_requests():
    assert _relabel([["a", "b"], ["c"]], {}) == {"a": 0, "b": 0, "c": 1}
    assert _relabel([["c", "d"], ["a"], ["b"]], {"a": 0, "b": 0, "c": 1, "d": 1}) == {
        "c": 1, "d": 1, "a": 0, "b": 2}  # fmt: skip


def test_the_schedule_places_requests_in_the_micro_batches_and_moves_them():
    step = lambda rid: SimpleNamespace(req_id=rid)  # noqa: E731
    mb = MicroBatches(groups=1, max_rows=8)
    mb.plan({"a": 0, "b": 1, "c": 0})
    for rid in "abcd":
        mb.ready(step(rid))
    assert mb.group_of("a") == mb.group_of("c") != mb.group_of("b")
    assert mb.group_of("d") == mb.group_of("b")  # not planned: the usual rule (the smallest group)
    assert sorted(len(g) for g in mb.due()) == [2, 2]
    mb.plan({"a": 0, "b": 0, "c": 0})
    for rid in "abcd":
        mb.ready(step(rid))
    assert mb.group_of("a") == mb.group_of("b") == mb.group_of("c")
    mb.leave("b")
    assert mb.group_of("b") is None


def test_the_head_with_the_live_optimiser_gives_every_request_its_plain_tokens():
    prompts = {r: PROMPTS[r] * 3 for r in "abcd"}  # repeats: the n-gram finds drafts
    plain = {r: solo(r, p, max_new=24, stop_at_eos=False) for r, p in prompts.items()}
    for dipsd in (True, False):
        rig = Rig(slots=4, batch=True, speculate="ngram", dipsd=dipsd)
        if dipsd:
            rig.core.dipsd.every_s = 0.005  # a few re-solves within the run
        for r, p in prompts.items():
            rig.submit(r, p, max_new=24, stop_at_eos=False, origin="m2")  # typed at m2: its tokens are sent
        rig.run()
        assert dict(rig.tokens) == plain, dipsd
        # each token frame tells the origin the drafts planned for the request (-1: no plan)
        wants = {t.want for t in rig.sent if t.ids}
        assert (wants - {-1} and wants <= {-1, *range(DRAFT_K + 1)}) if dipsd else wants == {-1}, wants
        drafted = sum(dict(rig.done[r].stats)["spec:drafted"] for r in prompts)
        assert drafted > 0
        if dipsd:
            assert rig.solves and rig.core.dipsd.solves == len(rig.solves)
            assert all(len(p.users) >= 2 and p.max_draft == DRAFT_K for p in rig.solves)
            assert rig.core.dipsd.schedule is None  # every request over
            assert rig.core.scheduler.planned == {}
        else:
            assert rig.solves == [] and rig.core.dipsd_status() is None
    status = Rig(slots=4, batch=True, speculate="ngram").core.dipsd_status()
    assert status == {"method": "milp", "solves": 0, "error": None, "active": False}


def test_the_head_asks_for_a_solve_only_with_several_speculating_requests():
    rig = Rig(slots=4, batch=True, speculate="ngram")
    rig.submit("w", PROMPTS["e"], max_new=4)  # a request alone: the ring gets measured
    rig.run()
    assert rig.solves == [] and rig.core._ring_fit() is not None
    rig.submit("a", PROMPTS["a"] * 3, max_new=6, stop_at_eos=False)
    assert not any(isinstance(w, SolveDipsd) for w in rig.core.pump(rig.now))
    rig.submit("b", PROMPTS["b"] * 3, max_new=6, stop_at_eos=False, speculate=False)
    assert not any(isinstance(w, SolveDipsd) for w in rig.core.pump(rig.now))  # b does not speculate
    rig.submit("c", PROMPTS["c"] * 3, max_new=6, stop_at_eos=False)
    (solve_work,) = [w for w in rig.core.pump(rig.now) if isinstance(w, SolveDipsd)]
    assert {u.id for u in solve_work.problem.users} == {"a", "c"}


@pytest.mark.model
def test_on_three_openvino_stages_the_optimised_requests_get_their_solo_ids(chain_factory, prompt_ids,
                                                                            default_index):  # fmt: skip
    """The real ring (RingNode on three OpenVINO stages at f32, rows batched): four requests
    speculating at once under the live optimiser (solved on its thread), each equal to its plain
    solo run; with it off, the same."""
    import asyncio

    from kafila.session.wire.frames import Limits
    from kafila.session.ring.node import RingNode
    from tests.fake_link import Pipe
    from tests.test_speculate import _generate

    chain = chain_factory("openvino", 3, "f32")
    limits = Limits(hidden=default_index.hparams.hidden, context=1024, slots=4, vocab=default_index.hparams.vocab)
    names = ["m1", "m2", "m3"]

    async def main(dipsd: bool):
        nodes = [RingNode(nm, "m1", names, s, limits, speculate="ngram", dipsd=dipsd)
                 for nm, s in zip(names, chain.shards)]
        pipes = [Pipe() for _ in names]
        for i, node in enumerate(nodes):
            node.start(pipes[i - 1].reader, pipes[i])
        if dipsd:
            nodes[0].core.dipsd.every_s = 0.05  # re-solve often
        try:
            solo = [(await _generate(nodes[1], 1024, ids, 32, False))[0] for ids in prompt_ids[:4]]
            together = await asyncio.gather(*(_generate(nodes[i % 3], 1024, ids, 32, True)
                                              for i, ids in enumerate(prompt_ids[:4])))  # fmt: skip
            return solo, together, nodes[0].core.dipsd_status()
        finally:
            for n in nodes:
                await n.close()

    solo, together, status = asyncio.run(main(True))
    assert [t for t, _ in together] == solo
    assert status["solves"] >= 1 and status["error"] is None, status
    assert sum(st.extra["speculation"]["drafted"] for _, st in together) > 0
    solo_off, together_off, off = asyncio.run(main(False))
    assert off is None and [t for t, _ in together_off] == solo_off == solo
