"""Speculation (issue 12) without a model: how many drafts a trip carries (choose_k, fed the
ring's measured trip times and each request's running acceptance), and speculative sampling's
output distribution against the target's, exactly computable on a tiny Markov "model"."""

import numpy as np
import pytest

from kafila.sampling import token_probs
from kafila.session.ring.scheduler import Finished, Scheduler, TokenOut
from kafila.session.ring.speculation.speculate import Acceptance, StepCost, choose_k, expected_tokens, verify

# --- choosing K -------------------------------------------------------------------------------


def _cost(c: float, beta: float, ns=(1, 5, 9)) -> StepCost:
    cost = StepCost()
    for _ in range(10):
        for n in ns:
            cost.observe(n, c + beta * n)
    return cost


def test_step_cost_fits_the_affine_trip_time():
    c, beta = _cost(150.0, 2.0).fit()
    assert c == pytest.approx(150.0) and beta == pytest.approx(2.0)
    one = StepCost()
    one.observe(1, 100.0)  # one position count seen: the prior slope
    assert one.predict(1) == pytest.approx(100.0) and one.predict(2) > 100.0
    assert StepCost().predict(3) > StepCost().predict(1) > 0


def test_step_cost_keeps_a_least_slope_where_asked():
    """Trips of 2 and 4 rows measured alike on a shared machine (each group's compute holding the
    other groups' interference) fit a row at nothing; a least share keeps its cost, and a fit above
    it is the data's own."""
    cost, bare = StepCost(min_share=0.1), StepCost()
    for _ in range(16):
        for c in (cost, bare):
            c.observe(2, 29.0)
            c.observe(4, 29.5)
    assert bare.fit()[1] == pytest.approx(0.25)
    c, beta = cost.fit()
    assert beta == pytest.approx(0.1 * (c + beta)) and c + 3 * beta == pytest.approx(29.25)
    steep = StepCost(min_share=0.1)
    for n in (1, 8):
        steep.observe(n, 17.0 + 3.0 * n)
    assert steep.fit() == pytest.approx((17.0, 3.0))


def test_k_is_large_on_a_slow_network_and_zero_where_drafts_do_not_pay():
    network_bound = _cost(150.0, 1.0)  # 3 hops × 50 ms; a position costs 1 ms of compute
    compute_bound = _cost(2.0, 10.0)  # loopback, compute-bound: a position costs most of a trip
    assert choose_k(0.9, network_bound, 8) == 8
    assert 2 <= choose_k(0.5, network_bound, 8) <= 7
    assert choose_k(0.02, network_bound, 8) == 0  # a low-acceptance stretch
    assert choose_k(0.5, compute_bound, 8) == 0
    assert choose_k(0.99, network_bound, 3) == 3  # bounded
    # whatever it picks is the best of all K under the model
    for alpha in (0.1, 0.4, 0.7, 0.95):
        for cost in (network_bound, compute_bound, _cost(20.0, 1.0)):
            k = choose_k(alpha, cost, 8)
            rates = [expected_tokens(j, alpha) / cost.predict(j + 1) for j in range(9)]
            if k:
                assert rates[k] == pytest.approx(max(rates)) and rates[k] >= 1.03 * rates[0]
            else:
                assert max(rates) < 1.03 * rates[0]


def test_acceptance_follows_recent_trips_and_recovers():
    a = Acceptance()
    assert a.rate == 0.5
    for _ in range(10):
        a.add(drafted=6, accepted=0)
    low = a.rate
    assert low < 0.15
    for _ in range(20):
        a.idle()  # trips without drafts age the evidence: drafting gets tried again
    assert a.rate > 0.4
    b = Acceptance()
    for _ in range(10):
        b.add(drafted=6, accepted=6)  # every draft accepted, no rejection
    assert b.rate > 0.95


def test_the_scheduler_stops_drafting_when_trips_cost_per_position_and_starts_when_they_do_not():
    def run(ms_of) -> int:
        s = Scheduler(slots=1, context=512, speculate="ngram", draft_k=8)
        prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4
        s.submit("a", "o", prompt, max_new=100)
        drafted, events = 0, []
        while not any(isinstance(e, Finished) for e in events):
            (step,) = s.steps()
            s.observe_step("a", len(step.tokens), ms_of(len(step.tokens)))
            drafted += step.drafted
            # the model continues the cycle 1..8, so every draft is right
            last = int(step.tokens[len(step.tokens) - 1 - step.drafted])
            yielded = [(last + i) % 8 + 1 for i in range(step.drafted + 1)]
            events = s.complete("a", yielded if step.drafted else yielded[0])
        return drafted

    assert run(lambda n: 150.0 + 1.0 * n) > 50  # network-bound: drafts every trip
    assert run(lambda n: 1.0 + 10.0 * n) <= 16  # compute-bound: the first trips measure it, then none


# --- speculative sampling's distribution -----------------------------------------------------

V = 5
_RNG = np.random.default_rng(1234)
# the next token's logits given the last: a Markov "model" that mostly follows 0 1 2 3 0 …, so the
# n-gram drafter's proposals are often right and often wrong
LOGITS = _RNG.normal(0, 1.0, (V, V)) + 2.0 * np.eye(V)[(np.arange(V) + 1) % 4]
TEMPERATURE, TOP_P = 0.8, 0.95


def _exact_joint(first: int, n: int) -> dict[tuple[int, ...], float]:
    """P(the n tokens after `first`) under plain sampling from the model."""
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, p in out.items():
            last = seq[-1] if seq else first
            q = token_probs(LOGITS[last], TEMPERATURE, TOP_P)
            for t in range(V):
                if q[t] > 0:
                    nxt[seq + (t,)] = p * q[t]
        out = nxt
    return out


def _speculative_samples(runs: int, n: int, prompt: list[int], draft_k: int) -> tuple[list, int]:
    """The first n tokens of `runs` requests, speculating through the real scheduler and verify."""
    rng = np.random.default_rng(99)
    samples, drafted = [], 0
    for r in range(runs):
        s = Scheduler(slots=1, context=64, speculate="ngram", draft_k=draft_k, adaptive_k=False)
        s.submit("a", "o", prompt, max_new=n + 1)  # one more: the drafter's room (K ≤ wanted − 1)
        out, events = [], []
        while not any(isinstance(e, Finished) for e in events):
            (step,) = s.steps()
            fed = [int(t) for t in step.tokens]
            rows = LOGITS[fed[-(step.drafted + 1) :]]  # the rows after the last token and each draft
            drafted += step.drafted
            tokens = verify(fed[len(fed) - step.drafted :], rows, (TEMPERATURE, TOP_P, rng))
            events = s.complete("a", tokens if step.drafted else tokens[0])
            out += [e.token for e in events if isinstance(e, TokenOut)]
        samples.append(tuple(out[:n]))
    return samples, drafted


def _chi2_999(dof: int) -> float:
    """The chi-square critical value at p = 0.001 (Wilson–Hilferty; within 1% for dof ≥ 10)."""
    z = 3.0902  # the standard normal's 0.999 quantile
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def _chi_square(samples, exact) -> tuple[float, int]:
    counts: dict = {}
    for x in samples:
        counts[x] = counts.get(x, 0) + 1
    n = len(samples)
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert set(counts) <= set(exact)  # nothing the model cannot produce
    return stat, len(exact) - 1


def test_speculative_sampling_draws_from_the_targets_distribution():
    """The prompt repeats, so the n-gram drafter proposes on most trips: 3-token sequences
    after the prompt are compared with the exact joint distribution (chi-square, fixed seeds;
    the critical value is for p = 0.001, so a correct sampler fails 1 run in 1000 — the seeds
    are fixed, so it either passes always or never)."""
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    samples, drafted = _speculative_samples(12000, 3, prompt, draft_k=3)
    assert drafted > 12000  # drafts on most trips
    stat, dof = _chi_square(samples, _exact_joint(prompt[-1], 3))
    assert stat < _chi2_999(dof), (stat, dof)


def _no_residual(draft, logits, sampling):
    """A classic bug: after a rejection, draw from p itself instead of the residual."""
    temperature, top_p, rng = sampling
    out = []
    for d, row in zip(draft, logits):
        p = token_probs(row, temperature, top_p)
        if rng.random() < p[int(d)]:
            out.append(int(d))
            continue
        return (*out, int(rng.choice(len(p), p=p)))
    return (*out, int(rng.choice(V, p=token_probs(logits[-1], temperature, top_p))))


@pytest.mark.parametrize("bug", ["acceptance", "residual"])
def test_the_chi_square_catches_a_broken_verifier(bug, monkeypatch):
    """The same check fails on a verifier that accepts with the wrong probability (√p rescaled)
    or skips the residual: the test above can tell such bugs apart from a correct sampler."""
    import kafila.session.ring.speculation.speculate as spec

    if bug == "acceptance":
        real = spec.token_probs
        monkeypatch.setattr(spec, "token_probs", lambda *a: np.sqrt(real(*a)) / np.sqrt(real(*a)).sum())
    else:
        monkeypatch.setitem(globals(), "verify", _no_residual)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    samples, _ = _speculative_samples(12000, 3, prompt, draft_k=3)
    stat, dof = _chi_square(samples, _exact_joint(prompt[-1], 3))
    assert stat > _chi2_999(dof), (stat, dof)


def test_greedy_verify_is_accept_of_the_argmax():
    rows = np.eye(V)[[2, 3, 1]] * 10.0
    assert verify((2, 3), rows) == (2, 3, 1)
    assert verify((2, 4), rows) == (2, 3)
    with pytest.raises(ValueError):
        verify((2,), rows)


# --- speculate="draft": the head's drafter fills the step in -------------------------------------


def test_a_draft_step_asks_the_drafter_then_goes_round_with_its_drafts():
    s = Scheduler(slots=2, context=64, speculate="draft", draft_k=4, adaptive_k=False)
    s.submit("a", "o", [1, 2, 3], max_new=10)
    (step,) = s.steps()
    assert step.want_draft == 0 and len(step.tokens) == 3  # the prefill needs no drafts
    s.complete("a", 7)
    (step,) = s.steps()
    assert step.want_draft == 4 and step.tokens.tolist() == [7] and s.history("a") == (1, 2, 3, 7)
    assert s.steps() == []  # in flight while the drafter works
    step = s.attach_draft("a", (8, 9, 10, 11, 12))  # more than asked: cut to K
    assert step.tokens.tolist() == [7, 8, 9, 10, 11] and step.drafted == 4 and step.want_draft == 0
    events = s.complete("a", (8, 9, 5))  # two accepted, then the model's 5
    assert [e.token for e in events if isinstance(e, TokenOut)] == [8, 9, 5]
    (step,) = s.steps()
    assert s.attach_draft("a", ()).drafted == 0  # no proposal: a plain step
    s.complete("a", 6)
    (step,) = s.steps()
    s.cancel("a")  # cancelled while drafting: its plain step still goes round, then it ends
    step = s.attach_draft("a", (1, 2))
    assert step is not None and step.drafted == 0
    assert any(isinstance(e, Finished) and e.finish == "cancelled" for e in s.complete("a", 3))
    s.submit("b", "o", [1, 2, 3], max_new=10)
    s.steps()
    s.complete("b", 4)
    s.steps()
    s.fail_all("gone")  # failed while drafting: nothing of it may go round
    assert s.attach_draft("b", (5,)) is None


def test_a_new_request_starts_from_the_sessions_acceptance():
    s = Scheduler(slots=1, context=512, speculate="ngram", draft_k=8)
    assert s._requests == {} and s.acceptance.rate == 0.5
    for _ in range(10):
        s.acceptance.add(drafted=6, accepted=0)  # what earlier requests saw
    s.submit("a", "o", [1, 2, 3], max_new=10)
    assert s._requests["a"].acceptance.rate == pytest.approx(s.acceptance.rate) and s.acceptance.rate < 0.15
