"""DiP-SD's MILP and Dinkelbach's method over it (the paper's Algorithm 1, x and l jointly).

For a fixed batch count N, max U(l) / S(x, l) is fractional. Dinkelbach: with λ the best ratio
found so far, solve F(λ) = max U − λ·S (a MILP); if F(λ) <= tolerance, λ is the optimum;
otherwise the MILP's solution has a larger ratio, λ becomes it, repeat. λ only grows, so the
scan over N carries it: an N whose F(λ) <= tolerance at the first step cannot beat the best
found so far and costs one MILP.

The MILP for N batches (users m, batches k, draft lengths j = min_draft..L). The paper's x[m,k]
(user m in batch k) and its binary length selectors y[m,j] are merged into one binary
z[m,k,j] = x[m,k]·y[m,j] ("m drafts j tokens in batch k"): with it every batch quantity is
linear without big-M constants, and the LP relaxation is tight enough that an N that cannot
beat λ is pruned at the root (the x/y form with big-M epigraphs took seconds on 4 users).
  Σ_{k,j} z[m,k,j] = 1;  x[m,k] = Σ_j z[m,k,j];  1 <= Σ_m x[m,k] (<= cap, the memory bound);
  z[m,k,·] = 0 for k > m (batches ordered by their first user: breaks the N! symmetry);
  U = Σ u_m(j)·z[m,k,j]  (the paper's lookup utility);
  D[k] >= Σ_j d_m(j)·z[m,k,j] for each m                       (draft completion, epigraph);
  ragged: T[k] = Σ_{m,j} (j+1)·z[m,k,j];
  padded: Lk[k] >= Σ_j j·z[m,k,j], q[m,k] >= Lk[k] + 1 − (L+1)·(1 − x[m,k]), T[k] = Σ_m q[m,k];
  v[k] = c + β·T[k] (+ the serial users' drafting, DraftUser.serial: D[k] then holds only
  their network);  S >= Σ_k v[k];  S >= D[k] + ring + v[k];  maximise U − λ·S.
Every auxiliary is bounded below only; minimising S makes the bounds tight, so the MILP's value
is the model's (`planner.dipsd.evaluate` recomputes U and S of every solution anyway).

pyscipopt is imported inside `dinkelbach` only: importing the planner never loads SCIP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planner.dipsd import (
    Clock,
    DipsdProblem,
    SolveLimits,
    check_schedule,
    evaluate,
    expected_accepted,
)

MIN_BETA_MS = 1e-6  # a verifier slope below this (ms a position) is modelled as 0

__all__ = ["DinkelbachOutcome", "dinkelbach"]


@dataclass(frozen=True)
class DinkelbachOutcome:
    batches: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]
    trace: tuple[float, ...]  # λ (tokens/ms): the start, then after every improving step
    milps: int
    scip_s: float  # SCIP's own solving time, all MILPs
    fallback: str | None  # None: converged for every N scanned (the optimum)
    from_milp: bool  # the answer is a MILP's solution (not the greedy start)


def dinkelbach(
    problem: DipsdProblem,
    limits: SolveLimits,
    start: tuple[Sequence[Sequence[int]], Sequence[int]],
    fixed_batches: Sequence[Sequence[int]] | None = None,
    fixed_lengths: Sequence[int] | None = None,
    clock: Clock | None = None,
) -> DinkelbachOutcome:
    """Scan N (or only len(fixed_batches)), Dinkelbach for each, from `start` (a feasible
    schedule under the same constraints, e.g. the greedy rule's). Past `limits`, or without
    pyscipopt, it stops and returns the best schedule known, with the reason in `fallback`."""
    best_batches = tuple(tuple(b) for b in start[0])
    best_lengths = tuple(start[1])
    check_schedule(problem, best_batches, best_lengths)
    tokens, span = evaluate(problem, best_batches, best_lengths)
    lam = tokens / span
    trace, milps, scip_s, from_milp = [lam], 0, 0.0, False
    began = None if clock is None else clock()

    def outcome(fallback: str | None) -> DinkelbachOutcome:
        return DinkelbachOutcome(
            best_batches, best_lengths, tuple(trace), milps, scip_s, fallback, from_milp
        )

    try:
        import pyscipopt  # noqa: F401
    except ImportError:
        return outcome("pyscipopt is not installed (pip install pyscipopt)")

    if fixed_batches is not None:
        counts = [len(fixed_batches)]
    else:  # nearest the start's N first: the likeliest best, so later N are pruned at once
        here = len(best_batches)
        counts = sorted(
            range(problem.min_batches, len(problem.users) + 1), key=lambda n: (abs(n - here), n)
        )
    for n in counts:
        milp = _Milp(problem, n, fixed_batches, fixed_lengths)
        for _ in range(limits.max_iterations):
            elapsed = scip_s if began is None or clock is None else clock() - began
            left = limits.total_s - elapsed
            if left <= 0:
                return outcome(f"overall MILP time limit ({limits.total_s:g} s) reached at N={n}")
            status, solve_s, solution = milp.solve(lam, min(limits.milp_s, left))
            milps += 1
            scip_s += solve_s
            if status != "optimal" or solution is None:
                limit = (
                    f"its time limit ({min(limits.milp_s, left):g} s)"
                    if status == "timelimit"
                    else f"status {status}"
                )
                return outcome(f"a MILP stopped at {limit} at N={n}")
            batches, lengths = solution
            check_schedule(problem, batches, lengths)
            tokens, span = evaluate(problem, batches, lengths)
            if tokens - lam * span <= limits.tolerance or tokens / span <= lam:
                break  # F(λ) <= tolerance: nothing with N batches beats λ
            lam = tokens / span
            trace.append(lam)
            best_batches, best_lengths, from_milp = batches, lengths, True
        else:
            return outcome(f"Dinkelbach did not converge in {limits.max_iterations} steps at N={n}")
    return outcome(None)


class _Milp:
    """The MILP for N batches; only λ (S's objective coefficient) changes between solves."""

    def __init__(
        self,
        problem: DipsdProblem,
        n: int,
        fixed_batches: Sequence[Sequence[int]] | None,
        fixed_lengths: Sequence[int] | None,
    ) -> None:
        from pyscipopt import Model, quicksum

        users, target, top = problem.users, problem.target, problem.max_draft
        if 0 < target.beta_ms < MIN_BETA_MS:
            # a slope this small adds nothing measurable, but next to the big-M terms it sits
            # under SCIP's feasibility tolerance and made a one-user model "infeasible"
            target = dataclasses.replace(target, beta_ms=0.0)
        count = len(users)
        model = Model("dipsd")
        model.hideOutput()
        # These models are small and solved at the root; SCIP's default cut rounds there took
        # seconds on 4 users (one node), without them milliseconds (measured, tests/test_dipsd.py).
        from pyscipopt import SCIP_PARAMSETTING

        model.setSeparating(SCIP_PARAMSETTING.OFF)
        model.setPresolve(SCIP_PARAMSETTING.FAST)
        self.model, self.n, self.count = model, n, count
        where = {m: k for k, b in enumerate(fixed_batches or ()) for m in b}
        z: dict[tuple[int, int, int], Any] = {}
        for m in range(count):
            slots = [where[m]] if fixed_batches is not None else range(min(m, n - 1) + 1)
            lengths = [fixed_lengths[m]] if fixed_lengths is not None else problem.draft_lengths
            for k in slots:
                for j in lengths:
                    z[m, k, j] = model.addVar(vtype="B", name=f"z{m}_{k}_{j}")
            model.addCons(quicksum(z[m, k, j] for k in slots for j in lengths) == 1)
        self.z = z
        in_batch: dict[tuple[int, int], Any] = {}
        for (m, k, j), var in z.items():
            in_batch.setdefault((m, k), []).append(var)
        x = {key: quicksum(vs) for key, vs in in_batch.items()}
        for k in range(n):
            members = [x[m, k] for m in range(count) if (m, k) in x]
            model.addCons(quicksum(members) >= 1)
            if target.max_batch_users is not None:
                model.addCons(quicksum(members) <= target.max_batch_users)

        span = model.addVar(vtype="C", name="S", lb=0.0)
        verify_total = []
        for k in range(n):
            done = model.addVar(vtype="C", name=f"D{k}", lb=0.0)
            mine = {
                m: [(j, var) for (mm, kk, j), var in z.items() if mm == m and kk == k]
                for m in range(count)
                if (m, k) in x
            }
            serial = []  # drafting on the verifier's machine: its time, not before it (DraftUser.serial)
            for m, pairs in mine.items():
                model.addCons(done >= quicksum(users[m].before_verify_ms(j) * var for j, var in pairs))
                if users[m].serial:
                    serial += [users[m].compute_ms(j) * var for j, var in pairs]
            if target.padded:
                longest = model.addVar(vtype="C", name=f"L{k}", lb=0.0, ub=float(top))
                positions = []
                for m, pairs in mine.items():
                    model.addCons(longest >= quicksum(j * var for j, var in pairs))
                    q = model.addVar(vtype="C", name=f"q{m}_{k}", lb=0.0)
                    model.addCons(q >= longest + 1 - (top + 1) * (1 - x[m, k]))
                    positions.append(q)
                total = quicksum(positions)
            else:
                total = quicksum((j + 1) * var for pairs in mine.values() for j, var in pairs)
            verify = target.c_ms + target.beta_ms * total + quicksum(serial)
            model.addCons(span >= done + target.ring_ms + verify)
            verify_total.append(verify)
        model.addCons(span >= quicksum(verify_total))
        if target.padded:  # every user's positions count at least once (tightens the big-M)
            model.addCons(
                quicksum(verify_total)
                >= n * target.c_ms
                + target.beta_ms * quicksum((j + 1) * var for (_, _, j), var in z.items())
            )
        for m, user in enumerate(users):  # its own cycle fits in the span (a valid cut)
            own = [(j, var) for (mm, _, j), var in z.items() if mm == m]
            cycle = [user.draft_ms(j) + target.ring_ms + target.c_ms + target.beta_ms * (j + 1)
                     for j, _ in own]
            model.addCons(span >= quicksum(t * var for t, (_, var) in zip(cycle, own)))
        self.span = span
        self.tokens = quicksum(
            expected_accepted(j, users[m].alpha) * var for (m, _, j), var in z.items()
        )

    def solve(
        self, lam: float, time_s: float
    ) -> tuple[str, float, tuple[tuple[tuple[int, ...], ...], tuple[int, ...]] | None]:
        """(status, SCIP's seconds, (batches, lengths) or None) of max U − λ·S."""
        model = self.model
        model.freeTransform()
        model.setObjective(self.tokens - lam * self.span, sense="maximize")
        model.setParam("limits/time", max(time_s, 1e-3))
        model.optimize()
        status = model.getStatus()
        took = model.getSolvingTime()
        if status != "optimal" or model.getNSols() == 0:
            return status, took, None
        sol = model.getBestSol()
        batches: list[list[int]] = [[] for _ in range(self.n)]
        lengths = [0] * self.count
        for (m, k, j), var in self.z.items():
            if model.getSolVal(sol, var) > 0.5:
                batches[k].append(m)
                lengths[m] = j
        return status, took, (tuple(tuple(b) for b in batches), tuple(lengths))
