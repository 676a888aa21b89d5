"""The head's driver as a state machine without I/O: scheduling, sampling, timing, micro-batches.

Theory of operation. The member that holds the head (embedding, final norm, lm_head) runs one
`HeadCore`. It owns the request scheduler (scheduler.py), one sampler per request that samples
(kafila.sampling.Sampler: each request's seed gives its own stream), the step timing (when each
step left, what each stage took, the trips that choose K), the micro-batch grouping
(microbatch.py) and the bookkeeping of speculation (the drafts each step carries). It touches no
stream, clock, thread or shard: the ring node (ring.py) feeds it what happened, with `now`, and
carries out what it answers:

    event (the driver queue)         core call                      answer
    Submitted(request)               on_request / submit            [Action] / SchedulerError
    Cancelled(req_id)                cancel                         [Action]
    Broken(reason)                   fail_all (after halt)          [Action]
    Pump()                           pump(now)                      [Forward | ForwardRows | SolveDipsd]
    Solved(problem, answer)          dipsd_solved(ev, now)          (the schedule in force)
    (a step leaves)                  starting(req_ids, now)
    (the head's forward ran)         forwarded / forwarded_rows     Activation(s) to send
    (a frame too big to send)        send_failed(req_ids, reason)   [Action]
    Back(acts)                       picks(acts) → pick_tokens on   [Action]
                                     the compute thread → complete
    (the watchdog's tick)            late(now, bound_s)             the bound outlived, or None

SolveDipsd(problem): several requests speculate and the live optimiser (dipsd_live.py) wants a
new schedule; the driver runs `dipsd.solve` off its loop and answers Solved. Until then, and
below two speculating requests, each request's K is choose_k's.

Actions: Send(frame) (tokens for a request asked at another member: to the successor),
Deliver(tokens) (asked here), FreeSlot(slot) (free its KV here, then send Free round the ring),
Ended(req_id) (the request is over: the draft model drops its state). After every event the
driver pumps, so steps that became possible leave at once.

A returning row's token: `picks.Pick`, chosen by `picks.pick_tokens` on the compute thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kafila.sampling import Sampler
from kafila.session.ring.speculation.dipsd_live import LiveDipsd, LiveSchedule, LiveUser, RingFit
from kafila.session.wire.frames import MAX_BATCH_ROWS, Activation, Frame, Limits, Request, Tokens
from kafila.session.ring.microbatch import (ROW_MIN_SHARE, ROW_PRIOR_SLOPE, SHARED_BUSY_SHARE, MicroBatches, best_groups,
                                       prompt_batches)
from kafila.session.ring.chunks import prefill_chunk_tokens
from kafila.session.ring.scheduler import Finished, Scheduler, SchedulerError, SlotFreed, Step, TokenOut
from kafila.session.ring.slots import DEFAULT_MAX_QUEUED
from kafila.session.ring.picks import Pick
from kafila.session.ring.prefix import CACHED_STAT
from kafila.session.ring.speculation.speculate import DRAFT_K, StepCost
from kafila.session.ring.timing import Measured, ema
from planner.dipsd import DipsdProblem, DipsdSchedule

DEPTH_EVERY_S = 1.0  # how often the head re-estimates the micro-batches to keep in flight


# --- events: what the ring node's driver queue carries to the head -------------------------------


@dataclass(frozen=True)
class Submitted:
    """A request reached the head from another member (a Request frame)."""

    request: Request


@dataclass(frozen=True)
class Cancelled:
    """The origin gave up on `req_id`."""

    req_id: str


@dataclass(frozen=True)
class Back:
    """A step, or a micro-batch's rows, came back round the ring through every block."""

    acts: tuple[Activation, ...]


@dataclass(frozen=True)
class Broken:
    """The ring broke: every request fails with `reason`."""

    reason: str


@dataclass(frozen=True)
class Pump:
    """Steps may start (a request was submitted at the head itself)."""


@dataclass(frozen=True)
class Solved:
    """The live optimiser's answer to a SolveDipsd (`answer` None: it raised `error`)."""

    problem: DipsdProblem
    answer: DipsdSchedule | None
    error: str = ""


HeadEvent = Submitted | Cancelled | Back | Broken | Pump | Solved


# --- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """A frame for the successor (tokens of a request asked at another member)."""

    frame: Frame


@dataclass(frozen=True)
class Deliver:
    """Tokens of a request asked at this member."""

    tokens: Tokens


@dataclass(frozen=True)
class FreeSlot:
    """A ring slot is free: drop its KV here, then send Free round the ring. `keep`: its KV
    stays for a prompt that starts the same way (prompt caching): only let it out of any
    micro-batch it rides in."""

    slot: int
    keep: bool = False


@dataclass(frozen=True)
class Ended:
    """Request `req_id` is over (the head's draft model drops what it keeps of it)."""

    req_id: str


Action = Send | Deliver | FreeSlot | Ended


@dataclass(frozen=True)
class Forward:
    """Run one step through the head's stage (after the drafter, when `step.want_draft`)."""

    step: Step


@dataclass(frozen=True)
class ForwardRows:
    """Run a micro-batch's decode steps, or a batch of prefill steps, through the head's stage as
    one forward."""

    steps: tuple[Step, ...]


@dataclass(frozen=True)
class SolveDipsd:
    """Run `HeadCore.dipsd.solve(problem, clock)` (off the event loop: tens of ms), then Solved."""

    problem: DipsdProblem


Work = Forward | ForwardRows | SolveDipsd


def check_prompt(prompt: Sequence[int], limits: Limits) -> None:
    """Refuse (400) a prompt the ring cannot carry: over the context, or ids outside the vocabulary."""
    if len(prompt) >= limits.context:  # (a Request frame carries at most the context)
        raise SchedulerError(f"the prompt has {len(prompt)} tokens; this session's context is "
                             f"{limits.context} (prompt and answer together): shorten it", 400)  # fmt: skip
    if len(prompt) and not 0 <= min(prompt) <= max(prompt) < limits.vocab:
        raise SchedulerError(f"prompt token ids must lie in 0..{limits.vocab - 1}", 400)


def batchable(step: Step) -> bool:
    """A decode step (its last token, and drafts to verify if any; not a prefill, not a step
    still waiting for a drafter): it may share a forward with others."""
    return step.cache_len > 0 and len(step.tokens) == 1 + step.drafted and not step.want_draft


class HeadCore:
    def __init__(self, name: str, ring: list[str], limits: Limits, *, eos_ids: frozenset[int] = frozenset(),
                 prefill_chunk: int | None = None, speculate: str = "off", draft_k: int = DRAFT_K,
                 adaptive_k: bool = True, max_queued: int = DEFAULT_MAX_QUEUED, batch: bool = True,
                 machines: dict[str, str] | None = None, measured: Measured | None = None,
                 dipsd: bool = True, dipsd_method: str = "milp", padded_rows: bool = True,
                 prompt_cache: bool | str = True, recurrent: bool = False) -> None:  # fmt: skip
        """See ring.RingNode for the options; `batch`: plain decode steps go as micro-batches
        (every stage has forward_batch); `measured`: the node's figures, which the core adds to;
        `dipsd`: with several requests speculating n-gram drafts, the live DiP-SD optimiser
        chooses their draft lengths and micro-batches (`dipsd_method` "milp" or "greedy"); off,
        with `adaptive_k` False or another drafter, each request's K is choose_k's (or draft_k);
        `padded_rows`: some stage pads a micro-batch's rows to its longest (OpenVINO does);
        `prompt_cache`: finished requests' slots keep their KV for prompts that start the same
        way (prefix.py); `recurrent`: a hybrid model (Scheduler's)."""
        self.name = name
        self.ring = ring
        self.limits = limits
        self.padded_rows = padded_rows
        chunk = prefill_chunk or prefill_chunk_tokens(limits.hidden, limits.frame_bytes)
        self.scheduler = Scheduler(limits.slots, limits.context, eos_ids, max_queue=max_queued,
                                   chunk_tokens=chunk, speculate=speculate, draft_k=draft_k,
                                   adaptive_k=adaptive_k, prompt_cache=prompt_cache,
                                   recurrent=recurrent)  # fmt: skip
        self.batch = batch
        self.machines = machines or {n: n for n in ring}
        self.measured = measured if measured is not None else Measured()
        self.batches = MicroBatches(groups=len(set(self.machines.values())), max_rows=MAX_BATCH_ROWS)
        self.halted: str | None = None  # the ring broke: nothing more leaves (fail_all follows)
        self._samplers: dict[str, Sampler] = {}  # requests that sample, each its own stream
        self._started: dict[str, float] = {}  # req_id → when its step in flight left
        self._rows: dict[str, int] = {}  # req_id → positions its step in flight feeds (its bound)
        self._pace: dict[str, tuple[float, float, int]] = {}  # req_id → (first token, last token, tokens)
        self._draft_ms: dict[str, float] = {}  # req_id → its origin draft model's ms a token (n-grams: none)
        self._depth_at = 0.0  # when the micro-batches in flight were last re-estimated
        # n-gram drafts cost the head ~nothing; a draft model at the head runs on its compute thread,
        # serial with its stage, which the live model leaves out: choose_k's alone there
        use = dipsd and speculate in ("ngram", "origin") and adaptive_k and draft_k >= 1  # n-gram drafts either way
        self.dipsd = LiveDipsd(draft_k, method=dipsd_method) if use else None
        self._schedule: LiveSchedule | None = None  # the schedule the scheduler and batches follow
        self.serial_cost = StepCost(prior_slope=ROW_PRIOR_SLOPE, min_share=ROW_MIN_SHARE)  # a trip's busiest machine
        self._net_ms: float | None = None  # the ring edges' RTT/2 each, together (pipeline_depth's)

    # --- requests ------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Take a request (raises SchedulerError, with its HTTP status, when it is refused)."""
        if self.halted:
            raise SchedulerError(f"the session is degraded: {self.halted}", 503)
        prompt = req.prompt.tolist()
        check_prompt(prompt, self.limits)
        self.scheduler.submit(req.req_id, req.origin, prompt, req.max_new, req.stop_at_eos, req.speculate,
                              req.keep_at)  # fmt: skip
        sampler = Sampler.of(req.temperature, req.top_p, None if req.seed < 0 else req.seed)
        if sampler is not None:
            self._samplers[req.req_id] = sampler

    def on_request(self, req: Request) -> list[Action]:
        """A request from another member: refused ones are answered at once, with the reason."""
        try:
            self.submit(req)
        except SchedulerError as exc:
            return [self._to_origin(Tokens(req.req_id, req.origin, (), True, "error", str(exc)[:500], exc.status))]
        return []

    def cancel(self, req_id: str) -> list[Action]:
        return self._actions(self.scheduler.cancel(req_id))

    def halt(self, reason: str) -> None:
        """The ring broke: no step leaves any more; `fail_all` ends the requests."""
        self.halted = self.halted or reason

    def fail_all(self, reason: str) -> list[Action]:
        return self._actions(self.scheduler.fail_all(reason, 503))

    def send_failed(self, req_ids: Sequence[str], reason: str) -> list[Action]:
        """Our frames of these requests could not be sent (nothing was written): they alone fail."""
        out: list[Action] = []
        for req_id in req_ids:
            why = f"this request's activations cannot be sent round the ring: {reason}"
            out += self._actions(self.scheduler.fail(req_id, why, 500))
        return out

    def history(self, req_id: str) -> tuple[int, ...]:
        return self.scheduler.history(req_id)

    def attach_draft(self, req_id: str, draft: tuple[int, ...]) -> Step | None:
        return self.scheduler.attach_draft(req_id, draft)

    def offer_draft(self, req_id: str, base: int, draft: tuple[int, ...], draft_ms: float = 0.0) -> bool:
        """An origin's draft (typed here: no frame); `draft_ms`: its draft model's ms a token (0: n-grams)."""
        if (kept := self.scheduler.offer_draft(req_id, base, draft)) and draft_ms > 0:
            self._draft_ms[req_id] = draft_ms
        return kept

    # --- steps out -------------------------------------------------------------------------------

    def pump(self, now: float) -> list[Work]:
        """Every step that can leave now: micro-batches first, then the steps that go alone."""
        if self.halted:
            return []
        steps = self.scheduler.steps()
        work: list[Work] = []
        if self.batch:  # plain decode steps wait for their micro-batch; the rest go as they come
            joining = sum(1 for st in steps if batchable(st) and not self.batches.placed(st.req_id))
            if joining and (groups := self._groups_for(self.batches.rows + joining)) is not None:
                self.batches.groups = groups  # sized for everyone decoding, before the newcomers are placed
            for step in steps:
                if batchable(step):
                    self.batches.ready(step)
                else:
                    self.batches.leave(step.req_id)
            steps = [s for s in steps if not batchable(s)]
            groups = self.batches.due()
            prompts = [s for s in steps if not s.want_draft]  # prefill chunks (want_draft: the drafter's first)
            steps = [s for s in steps if s.want_draft]
            groups += prompt_batches(prompts, self.scheduler.chunk_tokens, MAX_BATCH_ROWS)
            for group in groups:
                if len(group) == 1:
                    steps.append(group[0])
                else:
                    work.append(ForwardRows(tuple(group)))
        work += [Forward(s) for s in steps]
        if self.dipsd is not None:
            users = [LiveUser(r, a, self._draft_ms.get(r, 0.0), machine=self.machines.get(o, o))
                     for r, a, o in self.scheduler.speculating()]  # fmt: skip
            problem = self.dipsd.due(now, users, self._ring_fit())
            self._follow()
            if problem is not None:
                work.append(SolveDipsd(problem))
        return work

    # --- the live optimiser (dipsd_live.py) --------------------------------------------------------

    def dipsd_solved(self, ev: Solved, now: float) -> None:
        """The optimiser answered: its schedule decides lengths and batches from the next steps."""
        if self.dipsd is None:
            return
        if ev.answer is None:
            self.dipsd.failed(ev.error or "the solve failed")
        else:
            self.dipsd.solved(ev.problem, ev.answer, now)
        self._follow()

    def dipsd_status(self) -> dict | None:
        """/status `speculation.dipsd`: None when the optimiser is off."""
        return None if self.dipsd is None else self.dipsd.status()

    def _ring_fit(self) -> RingFit | None:
        """The live optimiser's verifier: the serial fit and the ring delay (None: not measured)."""
        stage_ms = self.measured.stage_ms
        if not self.serial_cost.sizes() or not all(stage_ms.get(n) for n in self.ring):
            return None
        busy = self._by_machine((n, stage_ms[n]) for n in self.ring)
        others = sum(busy.values()) - max(busy.values())  # other machines' compute: off the serial part
        c, beta = self.serial_cost.fit()
        return RingFit(c, beta, (self._net_ms or 0.0) + others, min(MAX_BATCH_ROWS, self.limits.slots),
                       self.padded_rows, max(busy, key=busy.get))  # fmt: skip

    def _follow(self) -> None:
        """Hand the schedule in force (if it changed) to the scheduler and the micro-batches."""
        s = self.dipsd.schedule if self.dipsd is not None else None
        if s is self._schedule:
            return
        self._schedule = s
        self.scheduler.planned = dict(s.lengths) if s is not None else {}
        self.batches.plan(s.batches if s is not None and self.batch else {})

    def starting(self, req_ids: Sequence[str], now: float, rows: Sequence[int] | None = None) -> None:
        """These requests' steps, feeding `rows` positions each (default 1), leave now (drafting is
        part of a trip's cost)."""
        for i, req_id in enumerate(req_ids):
            self._started[req_id] = now
            self._rows[req_id] = rows[i] if rows is not None else 1

    def forwarded(self, step: Step, hidden: np.ndarray, us: int) -> Activation:
        """The head's stage ran `step` in `us` µs: the activation to send round the ring."""
        if len(step.tokens) == 1:
            self.measured.stage(self.name, us)
        return Activation(step.req_id, step.slot, step.cache_len, step.pos0, step.zeros, hidden, ((self.name, us),),
                          keep=step.keep)  # fmt: skip

    def forwarded_rows(self, steps: Sequence[Step], hiddens: Sequence[np.ndarray], us: int) -> list[Activation]:
        """The head's stage ran a micro-batch (or a batch of prompts) in `us` µs: its rows, to
        send back to back."""
        if all(batchable(st) for st in steps):  # a prompt batch's cost grows with the prompts
            self.measured.stage(self.name, us)
        return [Activation(st.req_id, st.slot, st.cache_len, st.pos0, st.zeros, h, ((self.name, us),), len(steps), i,
                           keep=st.keep) for i, (st, h) in enumerate(zip(steps, hiddens))]  # fmt: skip

    # --- steps back ------------------------------------------------------------------------------

    def picks(self, acts: Sequence[Activation]) -> list[Pick]:
        """How each returning row's token is chosen (pick_tokens runs them on the compute thread)."""
        sched = self.scheduler
        out = []
        for a in acts:
            wanted, draft, sampler = sched.wants_token(a.req_id), sched.draft_of(a.req_id), self._samplers.get(a.req_id)
            plain = len(acts) > 1 and wanted and not draft and sampler is None
            out.append(Pick(a.hidden, wanted, plain, draft, sampler))
        return out

    def complete(self, acts: Sequence[Activation], tokens: Sequence, now: float, pick_ms: float = 0.0) -> list[Action]:
        """The rows came back and their tokens were picked (in `pick_ms`: the head machine's
        compute too): what follows for each request."""
        out: list[Action] = []
        self._account_batch(acts, pick_ms)
        for act, token in zip(acts, tokens):
            self._account(act, now)
            if act.draft:  # the origin's draft rode along (--speculate origin): for the next step
                self.offer_draft(act.req_id, act.dbase, act.draft, act.dus / 1000)
            out += self._actions(self.scheduler.complete(act.req_id, token), now)
        return out

    def depth_due(self, now: float) -> bool:
        """Whether to re-estimate the micro-batches in flight (not every trip: it reads edge stats)."""
        if now - self._depth_at > DEPTH_EVERY_S:
            self._depth_at = now
            return True
        return False

    def pipeline_depth(self, rtts: dict) -> int:
        """Micro-batches worth keeping in flight: a trip's time over the busiest machine's share
        of it (three stages on three machines and a fast network: 3; the same three on one
        machine: 1, since they cannot run side by side; 20 ms a hop adds as many as fill it).
        `rtts`: ring member → its successor edge's RTT in ms."""
        net = sum(float(rtts.get(n) or 0.0) / 2 for n in self.ring) if len(self.ring) > 1 else 0.0
        self._net_ms = net  # the live optimiser's ring delay reads it too
        stage_ms = self.measured.stage_ms
        if not all(stage_ms.get(n) for n in self.ring):
            return self.batches.groups  # not measured yet: one per machine
        by_rows = self._groups_for(self.batches.rows)
        if by_rows is not None:
            return by_rows
        busy = self._by_machine((n, stage_ms[n]) for n in self.ring)
        trip = sum(stage_ms[n] for n in self.ring) + net
        # rounded up once past a quarter: a group too few leaves a machine idle for a whole share
        return max(1, min(MAX_BATCH_ROWS, math.ceil(self._busy_share(busy) * trip / max(busy.values()) - 0.25)))

    def _groups_for(self, rows: int) -> int | None:
        """microbatch.best_groups for `rows` decode steps on the measured batch cost (None until
        a decode trip and the hops were measured: pipeline_depth's one-row rule then)."""
        if self._net_ms is None or (fit := self._ring_fit()) is None:
            return None
        net = self._net_ms  # ring_ms is the hops and the other machines' compute
        busy = self._by_machine((n, self.measured.stage_ms[n]) for n in self.ring)  # all measured (_ring_fit)
        return best_groups(rows, fit.c_ms, fit.beta_ms, net, max(0.0, fit.ring_ms - net), MAX_BATCH_ROWS,
                           self._busy_share(busy))  # fmt: skip

    def _busy_share(self, busy: dict[str, float]) -> float:
        """microbatch.SHARED_BUSY_SHARE where the busiest machine of `busy` (machine → its stages'
        measured compute, _by_machine) runs more than one stage, else 1."""
        top = max(busy, key=busy.get)
        shared = sum(1 for n in self.ring if self.machines.get(n, n) == top) > 1
        return SHARED_BUSY_SHARE if shared else 1.0

    def late(self, now: float, bound_s: Callable[[int], float]) -> float | None:
        """The watchdog: the bound (seconds) a step in flight has outlived, None if none has. The
        bound is `bound_s(rows)` for all the positions in flight: a prefill chunk computes for
        longer, and the steps in flight wait for each other at a stage (and on a machine whose
        members compute one at a time, cores.py), so a decode step behind a chunk is not late."""
        if not self._started:
            return None
        bound = bound_s(sum(self._rows.get(r, 1) for r in self._started))
        return bound if now - min(self._started.values()) > bound else None

    # --- internals ---------------------------------------------------------------------------------

    def _account_batch(self, acts: Sequence[Activation], pick_ms: float = 0.0) -> None:
        """The busiest machine's compute of a decode trip (from its trace) by the positions of
        all its rows: the live optimiser's verifier, v(T) = c + β·T (dipsd_live.py), and how
        many micro-batches to keep (best_groups)."""
        if not acts or not all(self.scheduler.decoding(a.req_id) for a in acts):
            return
        # one trace for all rows, and the head's token pick for them
        busy = self._by_machine([(stage, us / 1000) for stage, us in acts[0].trace] + [(self.name, pick_ms)])
        if busy:  # the positions computed: every row at the longest's where a stage pads them
            positions = len(acts) * max(a.n for a in acts) if self.padded_rows else sum(a.n for a in acts)
            self.serial_cost.observe(positions, max(busy.values()))

    def _by_machine(self, stage_ms) -> dict[str, float]:
        """(stage, ms) pairs summed by the machine each stage runs on (stages of one machine
        share its cores: their times add up)."""
        busy: dict[str, float] = {}
        for stage, ms in stage_ms:
            machine = self.machines.get(stage, stage)
            busy[machine] = busy.get(machine, 0.0) + ms
        return busy

    def _account(self, act: Activation, now: float) -> None:
        started = self._started.pop(act.req_id, None)
        self._rows.pop(act.req_id, None)
        if started is None:
            return
        step_ms = (now - started) * 1000
        self.scheduler.observe_step(act.req_id, act.n, step_ms)  # what choosing K is fed
        if act.n != 1:
            return  # the figures below are of 1-position decode steps: a prefill's cost grows
        compute = sum(us for _, us in act.trace) / 1000
        for stage, us in act.trace[1:]:
            self.measured.stage(stage, us)
        m = self.measured
        m.step_ms = ema(m.step_ms, step_ms)
        m.network_ms = ema(m.network_ms, max(0.0, step_ms - compute))

    def _actions(self, events, now: float | None = None) -> list[Action]:
        out: list[Action] = []
        for ev in events:
            if isinstance(ev, TokenOut):
                if now is not None:
                    first, _, n = self._pace.get(ev.req_id, (now, now, 0))
                    self._pace[ev.req_id] = (first, now, n + 1)
                want = self.scheduler.planned.get(ev.req_id, -1)  # the live optimiser's l: the origin's budget
                out.append(self._to_origin(Tokens(ev.req_id, ev.origin, (ev.token,), want=want)))
            elif isinstance(ev, Finished):
                self.batches.leave(ev.req_id)
                if self.dipsd is not None:
                    self.dipsd.drop(ev.req_id)
                    self._follow()
                for kept in (self._started, self._rows, self._samplers, self._pace, self._draft_ms):
                    kept.pop(ev.req_id, None)
                out.append(Ended(ev.req_id))
                if ev.finish != "cancelled":
                    stats = (self.measured.as_pairs() + (ev.spec.as_pairs() if ev.spec else ())
                             + ((CACHED_STAT, ev.cached),))  # fmt: skip
                    out.append(self._to_origin(Tokens(ev.req_id, ev.origin, (), True, ev.finish, ev.error[:500],
                                                      ev.status, stats)))  # fmt: skip
            elif isinstance(ev, SlotFreed):
                out.append(FreeSlot(ev.slot, ev.parked))
        return out

    def _to_origin(self, frame: Tokens) -> Action:
        return Deliver(frame) if frame.dst == self.name else Send(frame)

    # --- load, for /status -----------------------------------------------------------------------

    def load(self, most: int) -> dict:
        """The queue and the requests held (at most `most`, oldest first), each with its decode
        rate so far."""
        sched = self.scheduler
        requests = []
        for v in sched.views()[:most]:
            first, last, n = self._pace.get(v.req_id, (0.0, 0.0, 0))
            tok_s = round((n - 1) / (last - first), 2) if n >= 2 and last > first else None
            requests.append({"id": v.req_id, "origin": v.origin, "state": v.state, "prompt_tokens": v.prompt_tokens,
                             "tokens": v.generated, "max_tokens": v.max_new, "tok_s": tok_s})  # fmt: skip
        return {"slots": sched.slots, "active": sched.active, "queued": sched.queued, "parked": sched.parked,
                "max_queued": sched.max_queue, "requests": requests,
                "micro_batches": self.batches.sizes if self.batch else [], "batching": self._batching()}  # fmt: skip

    def _batching(self) -> dict | None:
        """How the head sizes micro-batches (None with batched rows off): the number it keeps in
        flight, and once a decode trip was measured, the busiest machine's compute of a batch,
        c + β·positions, as fitted (microbatch.best_groups' inputs)."""
        if not self.batch:
            return None
        out: dict = {"groups": self.batches.groups}
        if self.serial_cost.sizes():
            c, beta = self.serial_cost.fit()
            out.update(c_ms=round(c, 2), beta_ms=round(beta, 3))
        return out

