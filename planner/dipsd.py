"""DiP-SD offline: how many verification batches, which user in which, how many drafts each.

Pure: explicit inputs in, a schedule out; no clocks (pass `clock`, e.g. `time.perf_counter`, to
have solve times measured), no I/O. The MILP path is in `planner.dipsd_milp` (pyscipopt, imported
there lazily, only when a MILP is solved).

System model (the DiP-SD paper, seed 003): M users, each drafting on its own device, one target
that verifies. One speculation round of user m: draft l_m tokens serially on its device, send
them to the target (per-round network delay τ_m), the target verifies m's batch in one forward
pass, the accepted tokens and the bonus token come back, drafting resumes. Users are grouped
into N batches verified one after another (pipeline stages); while the target verifies batch n
the other batches draft, so drafting hides behind verification.

Latency model, all in ms (the units of `kafila.session.ring.speculation.speculate.StepCost.fit`):
- drafting, user m: d_m(l) = draft_overhead_ms + network_ms + draft_ms_per_token · l
  (the paper's l_m · G_m plus τ_m^c; a drafter's StepCost fit (c, β) decoding one token per
  step gives draft_ms_per_token = c + β);
- verifying batch n: v_n = c_ms + beta_ms · T_n (`StepCost`'s t(n) = c + β·n), where T_n counts
  the positions the target runs: Σ_{m∈n} (l_m + 1) (each user feeds its last token and its l_m
  drafts, as Kafila's scheduler does, `ragged`), or b_n · (max_{m∈n} l_m + 1) when the batch is
  padded to its longest draft (the paper's padding, `padded: true`);
- batch n's draft completion D_n = max_{m∈n} d_m(l_m) + ring_ms (the paper's epigraph t_n^d;
  `ring_ms`, 0 in the paper, is a fixed delay every batch spends away from the target's serial
  part, which other batches overlap: Kafila's ring hops, where the verifier is a pipeline of
  stages and only the busiest machine's compute is serial — kafila.session.ring.speculation.dipsd_live);
- the pipeline span (one full round of all N batches, the paper's S):
      S = max(Σ_n v_n, max_n (D_n + v_n)),
  i.e. the target is busy Σ v_n per round and batch n's cycle (verify, return, draft) must fit
  in the span (the paper's precedence constraint S ≥ t_n^d + t_n^v; S = Σ T_n with T_n ≥ v_n,
  the difference being pipeline bubbles).

Expected accepted tokens of one round for user m with draft length l and acceptance α (the
paper's eq. 1, geometric acceptance, each draft accepted independently with probability α, and
the bonus token always produced):
      u_m(l) = Σ_{i=0..l} α^i = (1 − α^(l+1)) / (1 − α)      (u = l + 1 at α → 1; u = 1 at α = 0)
Objective (the paper's throughput R, eq. 22): R = U / S with U = Σ_m u_m(l_m), reported as
tokens/s (1000 · U / S with S in ms).

Methods (`compare_dipsd` runs them all on the same inputs):
- `dipsd`: the paper's joint solver. Scan N; for each N, Dinkelbach's method on max U/S, each
  step a MILP (x, l jointly) solved by SCIP; keep the best N. Bounded by `SolveLimits`; past a
  limit (or without pyscipopt) it falls back to the greedy rule and says so (`fallback`).
- `greedy`: a fast heuristic (and the fallback): for each N, users sorted by drafting time split
  into N contiguous batches, then coordinate ascent on each user's l and single-user moves.
- baselines from the paper: `no-batching` (N = M, one user per batch, only l optimised),
  `fixed-l7` (l_m = 7, only the batching optimised), `ad` (autoregressive decoding at the
  target, no drafts, one user per forward pass) and `ad-greedy-batching` (AD with the users
  packed greedily into memory-feasible batches of at most `max_batch_users`); and
  `single-batch` (N = 1: all users verified together, l optimised; no pipelining).

Decisions the paper leaves open, taken here:
- N is scanned over 1..M (the paper scans 2..M; N = 1 only adds a candidate). With
  `max_batch_users` (the paper's memory bound, as a count of requests) N starts at ⌈M / cap⌉.
- The paper alternates an x-step and an l-step; here each Dinkelbach step solves x and l in one
  MILP (the sizes a home ring has keep it small), so the result is the optimum of the model,
  not a local one. Prefix lengths i_m are left out: their effect is a constant per user, folded
  into the fitted latencies.
- Draft lengths are min_draft..max_draft (the paper's L_ub; Kafila's MAX_DRAFT_K bounds it at
  32). min_draft defaults to 0, where the paper has l_m >= 1: l = 0 means the user is not
  speculated this horizon (plain decoding at the target, d_m(0) = 0: nothing to wait for, one
  position, one token), as Kafila's choose_k picks K = 0 when drafting does not pay. It puts
  both AD baselines inside the search space, so the optimiser is never worse than them; set
  "min_draft": 1 for the paper's constraint exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.errors import PlanInputError

__all__ = [
    "FIXED_DRAFT_LENGTH",
    "MAX_DRAFT_LENGTH",
    "MAX_USERS",
    "METHODS",
    "Clock",
    "DipsdProblem",
    "DipsdSchedule",
    "DraftUser",
    "SolveLimits",
    "Verifier",
    "compare_dipsd",
    "evaluate",
    "expected_accepted",
    "greedy",
    "optimise",
    "parse_dipsd",
    "solve_baseline",
]

MAX_USERS = 64  # more than a home ring serves at once; bounds the MILP
MAX_DRAFT_LENGTH = 32  # Kafila's MAX_DRAFT_K
DEFAULT_MAX_DRAFT = 16  # the paper: optimal draft lengths fall in 5–15
FIXED_DRAFT_LENGTH = 7  # the paper's fixed-length baseline
GREEDY_PATIENCE = 3  # greedy stops scanning N after this many N without improvement
GREEDY_ROUNDS = 4  # length sweeps + move passes per N

Clock = Callable[[], float]  # seconds, monotonic (time.perf_counter); passed in, never read here

METHODS = ("dipsd", "greedy", "no-batching", "single-batch", "fixed-l7", "ad", "ad-greedy-batching")


# ---------------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class DraftUser:
    """One user (request) drafting on its own device."""

    id: str
    alpha: float  # per-draft acceptance rate α in [0, 1) (speculate.Acceptance.rate)
    draft_ms_per_token: float  # drafter time per draft token, ms (>= 0)
    network_ms: float = 0.0  # per-round device ↔ target delay τ_m, ms (>= 0)
    draft_overhead_ms: float = 0.0  # fixed drafting cost per round, ms (>= 0)
    # its drafter computes on the machine whose compute is the verifier's serial part (members of
    # one machine compute one at a time): its drafting adds to that machine's time, overlapping
    # no other batch's verification (only its network_ms stays before its batch's verification)
    serial: bool = False

    def __post_init__(self) -> None:
        where = f"user {self.id!r}"
        if not isinstance(self.serial, bool):
            raise PlanInputError(f'{where}: "serial" must be true or false, not {self.serial!r}')
        if not isinstance(self.id, str) or not self.id:
            raise PlanInputError(f'user "id" must be a non-empty string, not {self.id!r}')
        if not _is_number(self.alpha) or not 0 <= self.alpha < 1:
            raise PlanInputError(f'{where}: "alpha" must be a number in [0, 1), not {self.alpha!r}')
        for key in ("draft_ms_per_token", "network_ms", "draft_overhead_ms"):
            value = getattr(self, key)
            if not _is_number(value) or value < 0:
                raise PlanInputError(f'{where}: "{key}" must be a number >= 0, not {value!r}')

    def draft_ms(self, length: int) -> float:
        """d_m(l): from the bonus token's arrival to l drafts at the target, ms (0: no drafts,
        nothing to wait for)."""
        return 0.0 if length == 0 else self.network_ms + self.compute_ms(length)

    def compute_ms(self, length: int) -> float:
        """What its drafter computes for l drafts, ms (draft_ms less the network)."""
        return 0.0 if length == 0 else self.draft_overhead_ms + self.draft_ms_per_token * length

    def before_verify_ms(self, length: int) -> float:
        """What its batch's verification waits for: d_m(l), or a serial drafter's network alone
        (its compute is the verifier machine's, `compute_ms`)."""
        if not self.serial:
            return self.draft_ms(length)
        return 0.0 if length == 0 else self.network_ms


@dataclass(frozen=True)
class Verifier:
    """The target's verification fit: a batch running n positions costs c_ms + beta_ms · n."""

    c_ms: float  # fixed cost of one verification pass, ms (> 0)
    beta_ms: float  # cost per position, ms (>= 0)
    max_batch_users: int | None = None  # memory bound: requests per batch (None: no bound)
    padded: bool = False  # positions = b · (max l + 1) instead of Σ (l + 1)
    ring_ms: float = 0.0  # a pass's delay outside the serial target, overlapped by other batches

    def __post_init__(self) -> None:
        if not _is_number(self.c_ms) or self.c_ms <= 0:
            raise PlanInputError(f'target: "c_ms" must be a number > 0, not {self.c_ms!r}')
        if not _is_number(self.beta_ms) or self.beta_ms < 0:
            raise PlanInputError(f'target: "beta_ms" must be a number >= 0, not {self.beta_ms!r}')
        cap = self.max_batch_users
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise PlanInputError(
                f'target: "max_batch_users" must be an integer >= 1 or null, not {cap!r}'
            )
        if not isinstance(self.padded, bool):
            raise PlanInputError(f'target: "padded" must be true or false, not {self.padded!r}')
        if not _is_number(self.ring_ms) or self.ring_ms < 0:
            raise PlanInputError(f'target: "ring_ms" must be a number >= 0, not {self.ring_ms!r}')

    def positions(self, lengths: Sequence[int]) -> int:
        """T_n: positions a batch with these draft lengths makes the target run."""
        if self.padded:
            return len(lengths) * (max(lengths) + 1)
        return sum(lengths) + len(lengths)

    def verify_ms(self, lengths: Sequence[int]) -> float:
        return self.c_ms + self.beta_ms * self.positions(lengths)


@dataclass(frozen=True)
class DipsdProblem:
    """What the optimiser plans: the users, the target's fit and the draft-length bound."""

    users: tuple[DraftUser, ...]
    target: Verifier
    max_draft: int = DEFAULT_MAX_DRAFT  # L_ub: draft lengths are min_draft..max_draft
    min_draft: int = 0  # 0: a user may go unspeculated; 1: the paper's l_m >= 1

    def __post_init__(self) -> None:
        if not self.users:
            raise PlanInputError("no users; DiP-SD plans at least one")
        if len(self.users) > MAX_USERS:
            raise PlanInputError(
                f"{len(self.users)} users is more than the {MAX_USERS} this planner takes; "
                "plan a subset"
            )
        ids = [u.id for u in self.users]
        for uid in ids:
            if ids.count(uid) > 1:
                raise PlanInputError(f"user id {uid!r} appears twice; ids must be unique")
        m = self.max_draft
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_DRAFT_LENGTH:
            raise PlanInputError(
                f'"max_draft" must be an integer in 1..{MAX_DRAFT_LENGTH}, not {m!r}'
            )
        lo = self.min_draft
        if isinstance(lo, bool) or lo not in (0, 1):
            raise PlanInputError(f'"min_draft" must be 0 or 1, not {lo!r}')

    @property
    def draft_lengths(self) -> range:
        return range(self.min_draft, self.max_draft + 1)

    @property
    def min_batches(self) -> int:
        cap = self.target.max_batch_users
        return 1 if cap is None else -(-len(self.users) // cap)


@dataclass(frozen=True)
class SolveLimits:
    """Bounds on the MILP path; past any of them the optimiser falls back to the greedy rule."""

    milp_s: float = 5.0  # one MILP
    total_s: float = 30.0  # all MILPs of one method together
    max_iterations: int = 40  # Dinkelbach steps per N
    tolerance: float = 1e-7  # Dinkelbach stops when max U − λS <= tolerance (tokens)

    def __post_init__(self) -> None:
        for key in ("milp_s", "total_s", "tolerance"):
            value = getattr(self, key)
            if not _is_number(value) or value <= 0:
                raise PlanInputError(f"solve limit {key} must be a number > 0, not {value!r}")
        if (
            isinstance(self.max_iterations, bool)
            or not isinstance(self.max_iterations, int)
            or (self.max_iterations < 1)
        ):
            raise PlanInputError(
                f"max_iterations must be an integer >= 1, not {self.max_iterations!r}"
            )


# ---------------------------------------------------------------------------------------------
# outputs


@dataclass(frozen=True)
class DipsdSchedule:
    """One method's answer: batches (in verification order) of user ids, l per user, and R."""

    name: str  # the row: one of METHODS
    method: str  # how it was found: "dinkelbach-milp", "greedy", "greedy-fallback", "closed-form"
    batches: tuple[tuple[str, ...], ...]
    draft_lengths: tuple[tuple[str, int], ...]  # (user id, l) in the problem's user order
    tokens_per_round: float  # U, expected accepted tokens of one round of all users
    span_ms: float  # S
    solve_s: float | None  # None: no clock was given and nothing else measured it
    optimal: bool = False  # proven optimal (MILP converged) within its constraints
    fallback: str | None = None  # why the MILP path was left, if it was
    milps: int = 0  # MILPs solved
    trace: tuple[float, ...] = field(default=())  # Dinkelbach λ per step, tokens/s

    @property
    def n_batches(self) -> int:
        return len(self.batches)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens_per_round / self.span_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "optimal": self.optimal,
            "fallback": self.fallback,
            "n_batches": self.n_batches,
            "batches": [list(b) for b in self.batches],
            "draft_lengths": dict(self.draft_lengths),
            "tokens_per_round": round(self.tokens_per_round, 6),
            "span_ms": round(self.span_ms, 6),
            "tokens_per_s": round(self.tokens_per_s, 6),
            "solve_s": None if self.solve_s is None else round(self.solve_s, 6),
            "milps": self.milps,
            "dinkelbach_tokens_per_s": [round(x, 6) for x in self.trace],
        }


# ---------------------------------------------------------------------------------------------
# the model


def expected_accepted(length: int, alpha: float) -> float:
    """u(l) = (1 − α^(l+1)) / (1 − α): expected tokens one round with l drafts yields."""
    if alpha == 0:
        return 1.0
    return (1.0 - alpha ** (length + 1)) / (1.0 - alpha)


Assignment = Sequence[Sequence[int]]  # batches of user indices


def evaluate(
    problem: DipsdProblem, batches: Assignment, lengths: Sequence[int]
) -> tuple[float, float]:
    """(U, S): expected tokens per round and the pipeline span (ms) of a schedule."""
    users = problem.users
    tokens = sum(expected_accepted(lengths[m], users[m].alpha) for m in range(len(users)))
    return tokens, _span(_batch_times(problem, b, lengths) for b in batches)


def _batch_times(
    problem: DipsdProblem, batch: Sequence[int], lengths: Sequence[int]
) -> tuple[float, float]:
    """(D_n, v_n) of one batch (D_n with the target's ring delay; v_n with its serial users'
    drafting, DraftUser.serial)."""
    users = problem.users
    draft = max(users[m].before_verify_ms(lengths[m]) for m in batch) + problem.target.ring_ms
    serial = sum(users[m].compute_ms(lengths[m]) for m in batch if users[m].serial)
    return draft, problem.target.verify_ms([lengths[m] for m in batch]) + serial


def _span(times: Any) -> float:
    total, worst = 0.0, 0.0
    for draft, verify in times:
        total += verify
        worst = max(worst, draft + verify)
    return max(total, worst)


def check_schedule(problem: DipsdProblem, batches: Assignment, lengths: Sequence[int]) -> None:
    """Raise ValueError unless every user is in exactly one non-empty, cap-respecting batch and
    every length is in min_draft..max_draft (what every method returns; the tests call it)."""
    seen = sorted(m for b in batches for m in b)
    if seen != list(range(len(problem.users))) or any(not b for b in batches):
        raise ValueError(f"not a partition of the users: {batches}")
    cap = problem.target.max_batch_users
    if cap is not None and any(len(b) > cap for b in batches):
        raise ValueError(f"a batch exceeds max_batch_users={cap}: {batches}")
    if len(lengths) != len(problem.users) or any(l not in problem.draft_lengths for l in lengths):
        raise ValueError(f"draft lengths out of {problem.draft_lengths}: {lengths}")


def make_schedule(
    problem: DipsdProblem,
    name: str,
    method: str,
    batches: Assignment,
    lengths: Sequence[int],
    solve_s: float | None,
    **extra: Any,
) -> DipsdSchedule:
    check_schedule(problem, batches, lengths)
    tokens, span = evaluate(problem, batches, lengths)
    ids = [u.id for u in problem.users]
    ordered = sorted((sorted(b) for b in batches), key=lambda b: b[0])
    return DipsdSchedule(
        name=name,
        method=method,
        batches=tuple(tuple(ids[m] for m in b) for b in ordered),
        draft_lengths=tuple(zip(ids, (int(l) for l in lengths), strict=True)),
        tokens_per_round=tokens,
        span_ms=span,
        solve_s=solve_s,
        **extra,
    )


# ---------------------------------------------------------------------------------------------
# the greedy rule


@dataclass
class _State:
    """A schedule under local search: batches, lengths and each batch's (D_n, v_n)."""

    problem: DipsdProblem
    batches: list[list[int]]
    lengths: list[int]
    times: list[tuple[float, float]]

    @classmethod
    def of(cls, problem: DipsdProblem, batches: Assignment, lengths: Sequence[int]) -> _State:
        bs = [list(b) for b in batches]
        ls = list(lengths)
        return cls(problem, bs, ls, [_batch_times(problem, b, ls) for b in bs])

    def ratio(self) -> float:
        tokens = sum(
            expected_accepted(l, u.alpha) for l, u in zip(self.lengths, self.problem.users)
        )
        return tokens / _span(self.times)


def _ratio_with(state: _State, changed: dict[int, tuple[float, float]], tokens: float) -> float:
    return tokens / _span(changed.get(n, t) for n, t in enumerate(state.times))


def _improve_lengths(state: _State) -> bool:
    """One sweep of coordinate ascent on each user's l; True if anything changed."""
    problem, users = state.problem, state.problem.users
    where = {m: n for n, b in enumerate(state.batches) for m in b}
    changed_any = False
    for m in range(len(users)):
        n = where[m]
        base = sum(expected_accepted(l, u.alpha) for l, u in zip(state.lengths, users))
        base -= expected_accepted(state.lengths[m], users[m].alpha)
        best_l, best_r = state.lengths[m], state.ratio()
        for l in problem.draft_lengths:
            if l == state.lengths[m]:
                continue
            state.lengths[m], keep = l, state.lengths[m]
            r = _ratio_with(
                state,
                {n: _batch_times(problem, state.batches[n], state.lengths)},
                base + expected_accepted(l, users[m].alpha),
            )
            state.lengths[m] = keep
            if r > best_r * (1 + 1e-12):
                best_l, best_r = l, r
        if best_l != state.lengths[m]:
            state.lengths[m] = best_l
            state.times[n] = _batch_times(problem, state.batches[n], state.lengths)
            changed_any = True
    return changed_any


def _improve_deadlines(state: _State) -> bool:
    """For each batch, the best common drafting deadline: every member drafts the most tokens
    that are ready by it (a joint move that one user's l at a time cannot make: the batch waits
    for its slowest member, so shortening one long draft alone gains nothing)."""
    problem, users = state.problem, state.problem.users
    changed_any = False
    for n, batch in enumerate(state.batches):
        deadlines = sorted({users[m].draft_ms(l) for m in batch for l in problem.draft_lengths})
        best_r, best_ls = state.ratio(), [state.lengths[m] for m in batch]
        keep = list(best_ls)
        for deadline in deadlines:
            for m in batch:
                fits = [l for l in problem.draft_lengths if users[m].draft_ms(l) <= deadline]
                state.lengths[m] = fits[-1] if fits else problem.min_draft
            tokens = sum(expected_accepted(l, u.alpha) for l, u in zip(state.lengths, users))
            r = _ratio_with(state, {n: _batch_times(problem, batch, state.lengths)}, tokens)
            if r > best_r * (1 + 1e-12):
                best_r, best_ls = r, [state.lengths[m] for m in batch]
        for m, l in zip(batch, best_ls):
            state.lengths[m] = l
        state.times[n] = _batch_times(problem, batch, state.lengths)
        changed_any |= best_ls != keep
    return changed_any


def _improve_batches(state: _State) -> bool:
    """One pass of single-user moves between batches (none emptied, the cap kept)."""
    problem = state.problem
    cap = problem.target.max_batch_users
    tokens = sum(expected_accepted(l, u.alpha) for l, u in zip(state.lengths, problem.users))
    changed_any = False
    for m in range(len(problem.users)):
        src = next(n for n, b in enumerate(state.batches) if m in b)
        if len(state.batches[src]) == 1:
            continue
        best_dst, best_r = src, state.ratio()
        rest = [k for k in state.batches[src] if k != m]
        src_times = _batch_times(problem, rest, state.lengths)
        for dst, batch in enumerate(state.batches):
            if dst == src or (cap is not None and len(batch) >= cap):
                continue
            dst_times = _batch_times(problem, [*batch, m], state.lengths)
            r = _ratio_with(state, {src: src_times, dst: dst_times}, tokens)
            if r > best_r * (1 + 1e-12):
                best_dst, best_r = dst, r
        if best_dst != src:
            state.batches[src].remove(m)
            state.batches[best_dst].append(m)
            for n in (src, best_dst):
                state.times[n] = _batch_times(problem, state.batches[n], state.lengths)
            changed_any = True
    return changed_any


def _split(order: Sequence[int], n: int) -> list[list[int]]:
    """`order` cut into n contiguous, near-equal batches."""
    size, extra = divmod(len(order), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(list(order[start:end]))
        start = end
    return out


def greedy_search(
    problem: DipsdProblem,
    batch_counts: Sequence[int] | None = None,
    fixed_batches: Assignment | None = None,
    fixed_lengths: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """The greedy rule's best (batches, lengths), optionally with the batches or the lengths
    fixed (the baselines). Scans N ascending, stopping after GREEDY_PATIENCE worse N."""
    users = problem.users
    start_l = min(4, problem.max_draft)
    if fixed_batches is not None:
        candidates: list[list[list[int]]] = [[list(b) for b in fixed_batches]]
    else:
        counts = batch_counts or range(problem.min_batches, len(users) + 1)
        reference = fixed_lengths or [start_l] * len(users)
        order = sorted(range(len(users)), key=lambda m: (-users[m].draft_ms(reference[m]), m))
        candidates = [_split(order, n) for n in counts]
    best: _State | None = None
    best_r, worse = -1.0, 0
    for batches in candidates:
        state = _State.of(problem, batches, fixed_lengths or [start_l] * len(users))
        for _ in range(GREEDY_ROUNDS):
            moved = False
            if fixed_lengths is None:
                moved |= _improve_deadlines(state)
                moved |= _improve_lengths(state)
            if fixed_batches is None:
                moved |= _improve_batches(state)
            if not moved:
                break
        r = state.ratio()
        if r > best_r * (1 + 1e-12):
            best, best_r, worse = state, r, 0
        else:
            worse += 1
            if worse >= GREEDY_PATIENCE:
                break
    assert best is not None
    return [b for b in best.batches if b], best.lengths


def _timed(clock: Clock | None, fn: Callable[[], Any]) -> tuple[Any, float | None]:
    if clock is None:
        return fn(), None
    start = clock()
    out = fn()
    return out, clock() - start


def greedy(problem: DipsdProblem, clock: Clock | None = None) -> DipsdSchedule:
    """The greedy rule alone (fast; the fallback of every MILP-based method)."""
    (batches, lengths), took = _timed(clock, lambda: greedy_search(problem))
    return make_schedule(problem, "greedy", "greedy", batches, lengths, took)


# ---------------------------------------------------------------------------------------------
# the optimiser and the baselines


def optimise(
    problem: DipsdProblem, limits: SolveLimits | None = None, clock: Clock | None = None
) -> DipsdSchedule:
    """DiP-SD's joint solver: scan N, Dinkelbach over a MILP for each (see the module doc)."""
    return _milp_method(problem, "dipsd", limits or SolveLimits(), clock)


def solve_baseline(
    problem: DipsdProblem, name: str, limits: SolveLimits | None = None, clock: Clock | None = None
) -> DipsdSchedule | None:
    """One of METHODS on `problem`; None when its constraints cannot hold (single-batch with
    more users than max_batch_users)."""
    limits = limits or SolveLimits()
    if name == "dipsd":
        return optimise(problem, limits, clock)
    if name == "greedy":
        return greedy(problem, clock)
    if name in ("ad", "ad-greedy-batching"):
        return _autoregressive(problem, name, clock)
    if name == "single-batch" and problem.min_batches > 1:
        return None
    if name in ("no-batching", "single-batch", "fixed-l7"):
        return _milp_method(problem, name, limits, clock)
    raise ValueError(f"unknown DiP-SD method {name!r} (have: {', '.join(METHODS)})")


def compare_dipsd(
    problem: DipsdProblem, limits: SolveLimits | None = None, clock: Clock | None = None
) -> dict[str, DipsdSchedule | None]:
    """Every method of METHODS on the same inputs, in that order."""
    return {name: solve_baseline(problem, name, limits, clock) for name in METHODS}


def _constraints(
    problem: DipsdProblem, name: str
) -> tuple[list[list[int]] | None, list[int] | None]:
    """(fixed batches, fixed lengths) of a MILP-based method."""
    every = list(range(len(problem.users)))
    if name == "no-batching":
        return [[m] for m in every], None
    if name == "single-batch":
        return [every], None
    if name == "fixed-l7":
        return None, [min(FIXED_DRAFT_LENGTH, problem.max_draft)] * len(every)
    return None, None


def _milp_method(
    problem: DipsdProblem, name: str, limits: SolveLimits, clock: Clock | None
) -> DipsdSchedule:
    from planner.dipsd_milp import dinkelbach

    start = None if clock is None else clock()
    fixed_batches, fixed_lengths = _constraints(problem, name)
    batches, lengths = greedy_search(
        problem, fixed_batches=fixed_batches, fixed_lengths=fixed_lengths
    )
    outcome = dinkelbach(problem, limits, (batches, lengths), fixed_batches, fixed_lengths, clock)
    solve_s = outcome.scip_s if start is None or clock is None else clock() - start
    if outcome.fallback is None:
        method = "dinkelbach-milp"
    else:  # the best schedule known when the MILP path stopped: a MILP's or the greedy start
        method = "dinkelbach-milp-unproven" if outcome.from_milp else "greedy-fallback"
    return make_schedule(
        problem,
        name,
        method,
        outcome.batches,
        outcome.lengths,
        solve_s,
        optimal=outcome.fallback is None,
        fallback=outcome.fallback,
        milps=outcome.milps,
        trace=tuple(1000.0 * x for x in outcome.trace),
    )


def _autoregressive(problem: DipsdProblem, name: str, clock: Clock | None) -> DipsdSchedule:
    """AD: no drafts; each round the target decodes one token per user. `ad` runs one user per
    forward pass; `ad-greedy-batching` packs users in input order (the paper sorts by prefix
    length, which this model does not have) into batches of max_batch_users (all, unbounded).
    Rows report l = 0 and a span of Σ_n (c + β · b_n) (no drafting on the critical path)."""
    start = None if clock is None else clock()
    users, target = problem.users, problem.target
    every = list(range(len(users)))
    if name == "ad":
        batches = [[m] for m in every]
    else:
        cap = target.max_batch_users or len(users)
        batches = [every[i : i + cap] for i in range(0, len(every), cap)]
    tokens, span = evaluate(problem, batches, [0] * len(users))  # = Σ_n (c + β·b_n)
    ids = [u.id for u in users]
    took = None if start is None or clock is None else clock() - start
    return DipsdSchedule(
        name=name,
        method="closed-form",
        batches=tuple(tuple(ids[m] for m in b) for b in batches),
        draft_lengths=tuple((uid, 0) for uid in ids),
        tokens_per_round=tokens,
        span_ms=span,
        solve_s=took,
        optimal=True,
    )


# ---------------------------------------------------------------------------------------------
# the users file


def parse_dipsd(data: Any) -> DipsdProblem:
    """Validate a users object (decoded from JSON; format in fleets/dipsd-users.json):

        {"target": {"c_ms": 90, "beta_ms": 4, "max_batch_users": null, "padded": false},
         "max_draft": 16, "min_draft": 0,
         "users": [{"id": "laptop", "alpha": 0.8, "draft_ms_per_token": 12,
                    "network_ms": 6, "draft_overhead_ms": 0}, ...]}

    `max_draft`, `min_draft`, `max_batch_users`, `padded`, `ring_ms`, `network_ms` and
    `draft_overhead_ms` may be omitted (16, 0, null, false, 0, 0, 0). Unknown keys (`note`,
    `device`, ...) are ignored."""
    if not isinstance(data, Mapping):
        raise PlanInputError(f"users file must be a JSON object, not {_kind(data)}")
    if "target" not in data:
        raise PlanInputError('missing "target" (the verifier\'s {"c_ms", "beta_ms"} fit)')
    raw_target = data["target"]
    if not isinstance(raw_target, Mapping):
        raise PlanInputError(f'"target" must be an object, not {_kind(raw_target)}')
    target = Verifier(
        c_ms=_required(raw_target, "c_ms", "target"),
        beta_ms=_required(raw_target, "beta_ms", "target"),
        max_batch_users=_integral(raw_target.get("max_batch_users")),
        padded=raw_target.get("padded", False),
        ring_ms=raw_target.get("ring_ms", 0.0),
    )
    if "users" not in data:
        raise PlanInputError('missing "users" (a list of {"id", "alpha", "draft_ms_per_token"})')
    raw_users = data["users"]
    if not isinstance(raw_users, list):
        raise PlanInputError(f'"users" must be a list, not {_kind(raw_users)}')
    if not raw_users:
        raise PlanInputError("no users; DiP-SD plans at least one")
    if len(raw_users) > MAX_USERS:
        raise PlanInputError(
            f"{len(raw_users)} users is more than the {MAX_USERS} this planner takes; plan a subset"
        )
    users = []
    for index, entry in enumerate(raw_users):
        where = f"user #{index + 1}"
        if not isinstance(entry, Mapping):
            raise PlanInputError(f"{where} must be an object, not {_kind(entry)}")
        if "id" not in entry:
            raise PlanInputError(f'{where} is missing "id"')
        where = f"user {entry['id']!r}"
        users.append(
            DraftUser(
                id=entry["id"],
                alpha=_required(entry, "alpha", where),
                draft_ms_per_token=_required(entry, "draft_ms_per_token", where),
                network_ms=entry.get("network_ms", 0.0),
                draft_overhead_ms=entry.get("draft_overhead_ms", 0.0),
                serial=entry.get("serial", False),
            )
        )
    max_draft = _integral(data.get("max_draft", DEFAULT_MAX_DRAFT))
    min_draft = _integral(data.get("min_draft", 0))
    return DipsdProblem(tuple(users), target, max_draft, min_draft)


def _required(raw: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise PlanInputError(f'{where} is missing "{key}"')
    return raw[key]


def _integral(value: Any) -> Any:
    """JSON's 8.0 as 8; anything else unchanged (the dataclass says what is wrong with it)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
