"""The live DiP-SD optimiser at the head, sans I/O: each speculating request's draft length and
micro-batch, re-solved as requests come and go.

Theory of operation. With several requests speculating at once, choosing each one's K alone
(`speculate.choose_k`) ignores that they share trips: a micro-batch's trip runs every member's
drafts, and the ring can keep several micro-batches in flight. DiP-SD (planner/dipsd.py, the
seed's optimiser) chooses jointly: the number of batches N, which request rides in which, and
each one's draft length l, maximising expected accepted tokens per unit time. Here it is fed the
live figures:

- the verifier: a trip splits into a serial part and a ring delay. Only the busiest machine's
  compute is serial (stages on other machines, and the hops, work on other batches meanwhile:
  the same reading as `HeadCore.pipeline_depth`): v(T) = c + β·T is that machine's compute for a
  decode trip whose rows feed T positions in all (`speculate.StepCost` over the stage times each
  trip's trace carries: `HeadCore.serial_cost`), and `Verifier.ring_ms` the rest of a trip (the
  ring edges' RTT/2 each, the other machines' compute), which other batches overlap. (A whole
  trip's time would not do: with several batches in flight it holds the wait behind the others'
  compute, which the model counts itself; nor the scheduler's per-request fit, which with rows
  batched holds the other rows' cost in its slope);
- each request's acceptance α (`speculate.Acceptance.rate`), its drafting cost per token (the
  head's n-gram: ~0 ms) and per-round network delay (0 at the head; the fields an origin-side
  drafter fills in), and the rows a micro-batch holds (`Verifier.max_batch_users`). A drafter on
  the busiest machine (its origin member's machine, `LiveUser.machine`, is `RingFit.machine`)
  computes one at a time with that machine's stages: its drafting is serial time, not hidden
  behind other batches' verification (DraftUser.serial).

`due(now, users, fit)` says when to solve: the set of speculating requests changed, or a
request's α moved by more than `alpha_drift` since the last solve, and not within `every_s` of
the last one, and not while a solve is out. It answers the DipsdProblem; the caller runs
`solve` (planner.dipsd.optimise under `limits`, past them the greedy rule, which `fallback`
names; `method="greedy"`: the greedy rule alone) wherever it likes (the ring node: on a thread of
its own, off the event loop) and hands the answer to `solved`. Below two requests there is no
schedule: choose_k decides alone, as without the optimiser.

The schedule's batches carry stable labels (a new schedule's batch takes the label of the old
batch it shares most requests with), and a new partition of the same requests into the same N
is adopted only if it promises MOVE_GAIN more than keeping the old one with the new lengths:
moving a request to another micro-batch costs a copy of its KV on every stage (microbatch.py).
No I/O, no clocks: `now` is passed in, `solve` takes the caller's clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.dipsd import (
    DipsdProblem,
    DipsdSchedule,
    DraftUser,
    SolveLimits,
    Verifier,
    evaluate,
    greedy,
    optimise,
)  # fmt: skip

MIN_USERS = 2  # one request alone: choose_k (the same model, without the batching)
SOLVE_EVERY_S = 1.0  # at most one solve a second (α moves every trip; a solve costs ~50 ms)
ALPHA_DRIFT = 0.1  # re-solve when a request's α moved this much since the last solve
SOLVE_MS = 50.0  # the MILP path's bound; past it the greedy rule's answer is kept
MOVE_GAIN = 1.03  # a new partition must promise 3% more than the old one to move requests
MIN_SERIAL_MS = 0.01  # Verifier.c_ms must be > 0
MAX_ALPHA = 0.999  # DraftUser.alpha is in [0, 1)
METHODS = ("milp", "greedy")


@dataclass(frozen=True)
class LiveUser:
    """One speculating request, as the optimiser sees it."""

    req_id: str
    alpha: float  # Acceptance.rate
    draft_ms_per_token: float = 0.0  # the head's n-gram: ~0; a drafter's measured ms per token
    network_ms: float = 0.0  # per-round delay between the drafter and the head (0 at the head)
    draft_overhead_ms: float = 0.0  # fixed drafting cost per round
    machine: str | None = None  # the machine its drafter computes on (its origin member's)


@dataclass(frozen=True)
class RingFit:
    """The ring's figures: the serial compute fit, the ring delay, the row limit."""

    c_ms: float  # the busiest machine computes a trip whose rows feed T positions in c + β·T ms
    beta_ms: float
    ring_ms: float  # the rest of a trip: hops, the other machines' compute
    max_rows: int  # rows a micro-batch may hold
    padded: bool = False  # a stage pads a batch's rows to its longest (OpenVINO; MLX's are ragged)
    machine: str | None = None  # the busiest machine, whose compute c + β·T is: drafters there are serial

    def verifier(self) -> Verifier:
        return Verifier(c_ms=max(self.c_ms, MIN_SERIAL_MS), beta_ms=max(self.beta_ms, 0.0),
                        max_batch_users=max(1, self.max_rows), padded=self.padded,
                        ring_ms=max(0.0, self.ring_ms))  # fmt: skip


@dataclass(frozen=True)
class LiveSchedule:
    """The schedule in force: per request its draft length and its batch's label."""

    lengths: dict[str, int]
    batches: dict[str, int]  # req_id → label (stable across solves)
    n_batches: int
    tokens_per_s: float  # the model's expected accepted tokens per second
    method: str  # the planner's: "dinkelbach-milp", "greedy-fallback", "greedy", …
    fallback: str | None
    solve_ms: float | None
    at: float  # `now` of the solve
    verifier: tuple[float, float, float] = (0.0, 0.0, 0.0)  # (c_ms, beta_ms, ring_ms) it planned with


class LiveDipsd:
    def __init__(self, max_draft: int, *, method: str = "milp", every_s: float = SOLVE_EVERY_S,
                 alpha_drift: float = ALPHA_DRIFT, limits: SolveLimits | None = None) -> None:  # fmt: skip
        if method not in METHODS:
            raise ValueError(f"the live optimiser's method is one of {', '.join(METHODS)}, not {method!r}")
        if max_draft < 1:
            raise ValueError("the live optimiser needs max_draft >= 1")
        self.max_draft = max_draft
        self.method = method
        self.every_s = every_s
        self.alpha_drift = alpha_drift
        self.limits = limits or SolveLimits(milp_s=SOLVE_MS / 1000, total_s=SOLVE_MS / 1000)
        self.schedule: LiveSchedule | None = None
        self.pending = False  # a solve is out (due answered a problem, solved not called yet)
        self.solves = 0
        self.error: str | None = None  # the last solve's failure, if it failed
        self._alphas: dict[str, float] = {}  # α of each request at the last solve
        self._last_at: float | None = None
        self._gone: set[str] = set()  # requests that left while a solve was out

    # --- when to solve -------------------------------------------------------------------------

    def due(self, now: float, users: Sequence[LiveUser], fit: RingFit | None) -> DipsdProblem | None:
        """The problem to solve now, or None (nothing changed, too soon, one out already, the
        ring not measured yet (`fit` None), or fewer than MIN_USERS requests: then the schedule
        is dropped)."""
        if len(users) < MIN_USERS:
            self.schedule, self._alphas = None, {}
            return None
        if self.pending or fit is None:
            return None
        ids = {u.req_id for u in users}
        changed = ids != set(self._alphas) or any(
            abs(u.alpha - self._alphas[u.req_id]) > self.alpha_drift for u in users)  # fmt: skip
        if not changed or (self._last_at is not None and now - self._last_at < self.every_s):
            return None
        problem = DipsdProblem(tuple(_draft_user(u, fit) for u in users), fit.verifier(), self.max_draft)
        self.pending, self._last_at, self._gone = True, now, set()
        self._alphas = {u.req_id: u.alpha for u in users}
        return problem

    def solve(self, problem: DipsdProblem, clock: Callable[[], float] | None = None) -> DipsdSchedule:
        """The optimiser on `problem` (pure: the ring node runs it on a thread of its own)."""
        if self.method == "greedy":
            return greedy(problem, clock)
        return optimise(problem, self.limits, clock)

    # --- answers ------------------------------------------------------------------------------

    def solved(self, problem: DipsdProblem, answer: DipsdSchedule, now: float) -> LiveSchedule | None:
        """Install the answer to `problem` (requests that left meanwhile dropped); the schedule."""
        self.pending = False
        self.solves += 1
        self.error = None
        ids = [u.id for u in problem.users if u.id not in self._gone]
        if len(ids) < MIN_USERS:
            self.schedule = None
            return None
        lengths = {uid: l for uid, l in answer.draft_lengths if uid not in self._gone}
        new = [[uid for uid in batch if uid not in self._gone] for batch in answer.batches]
        new = [b for b in new if b]
        old = self.schedule
        if old is not None and self._keep_partition(problem, answer, old):
            labels = {uid: old.batches[uid] for uid in ids}
        else:
            labels = _relabel(new, old.batches if old is not None else {})
        solve_ms = None if answer.solve_s is None else answer.solve_s * 1000
        t = problem.target
        self.schedule = LiveSchedule(lengths, labels, len(set(labels.values())), answer.tokens_per_s,
                                     answer.method, answer.fallback, solve_ms, now,
                                     (t.c_ms, t.beta_ms, t.ring_ms))  # fmt: skip
        return self.schedule

    def failed(self, reason: str) -> None:
        """The solve raised (a bug, never a reason to stop serving): choose_k decides meanwhile."""
        self.pending = False
        self.error = reason[:300]
        self.schedule = None

    def drop(self, req_id: str) -> None:
        """The request ended: out of the schedule now (and out of the answer of a solve that is out)."""
        self._gone.add(req_id)
        self._alphas.pop(req_id, None)
        s = self.schedule
        if s is not None and req_id in s.lengths:
            lengths = {k: v for k, v in s.lengths.items() if k != req_id}
            batches = {k: v for k, v in s.batches.items() if k != req_id}
            self.schedule = None if len(lengths) < MIN_USERS else LiveSchedule(
                lengths, batches, len(set(batches.values())), s.tokens_per_s, s.method, s.fallback,
                s.solve_ms, s.at, s.verifier)  # fmt: skip

    def _keep_partition(self, problem: DipsdProblem, answer: DipsdSchedule, old: LiveSchedule) -> bool:
        """Whether the old partition, with the new lengths, is within MOVE_GAIN of the new one."""
        ids = [u.id for u in problem.users]
        if self._gone or set(ids) != set(old.batches):
            return False
        groups: dict[int, list[int]] = {}
        for m, uid in enumerate(ids):
            groups.setdefault(old.batches[uid], []).append(m)
        if len(groups) != answer.n_batches:
            return False
        cap = problem.target.max_batch_users
        if cap is not None and any(len(g) > cap for g in groups.values()):
            return False
        lengths = [dict(answer.draft_lengths)[uid] for uid in ids]
        tokens, span = evaluate(problem, list(groups.values()), lengths)
        return tokens / span * MOVE_GAIN >= answer.tokens_per_round / answer.span_ms

    # --- what the head reads --------------------------------------------------------------------

    def length(self, req_id: str) -> int | None:
        s = self.schedule
        return None if s is None else s.lengths.get(req_id)

    def batch(self, req_id: str) -> int | None:
        s = self.schedule
        return None if s is None else s.batches.get(req_id)

    def status(self) -> dict:
        """For /status `speculation.dipsd`: N, each request's l and batch, what the model expects."""
        s = self.schedule
        out = {"method": self.method, "solves": self.solves, "error": self.error, "active": s is not None}
        if s is None:
            return out
        return {**out, "n_batches": s.n_batches, "tokens_per_s": round(s.tokens_per_s, 2),
                "solved_by": s.method, "fallback": s.fallback,
                "solve_ms": None if s.solve_ms is None else round(s.solve_ms, 2),
                "verifier_ms": dict(zip(("c", "beta", "ring"), (round(x, 3) for x in s.verifier))),
                "requests": [{"id": r, "l": s.lengths[r], "batch": s.batches[r]} for r in s.lengths]}  # fmt: skip


def _draft_user(u: LiveUser, fit: RingFit) -> DraftUser:
    """The planner's user; a drafter on the busiest machine computes serially with the verifier
    (the machine's members compute one at a time, cores.py): DraftUser.serial."""
    serial = u.machine is not None and u.machine == fit.machine
    return DraftUser(u.req_id, min(max(float(u.alpha), 0.0), MAX_ALPHA), max(0.0, u.draft_ms_per_token),
                     max(0.0, u.network_ms), max(0.0, u.draft_overhead_ms), serial)  # fmt: skip


def _relabel(batches: Sequence[Sequence[str]], old: dict[str, int]) -> dict[str, int]:
    """Labels for `batches`: each takes the old label it shares most requests with (largest
    overlaps first, each label once), the rest the smallest labels unused."""
    overlaps = []
    for i, batch in enumerate(batches):
        counts: dict[int, int] = {}
        for uid in batch:
            if uid in old:
                counts[old[uid]] = counts.get(old[uid], 0) + 1
        overlaps += [(-n, label, i) for label, n in counts.items()]
    taken: dict[int, int] = {}  # batch index → label
    used: set[int] = set()
    for _, label, i in sorted(overlaps):
        if i not in taken and label not in used:
            taken[i], used = label, used | {label}
    fresh = (n for n in range(len(batches) + len(used) + 1) if n not in used)
    out = {}
    for i, batch in enumerate(batches):
        label = taken[i] if i in taken else next(fresh)
        out.update({uid: label for uid in batch})
    return out
