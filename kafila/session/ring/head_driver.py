"""The head's driver: HeadCore's events in, its actions out (the head member's part of RingNode).

A mixin of RingNode (node.py), apart only to keep each module small: its methods use the node's
core, event queue, compute thread (`_compute`, `_forward`, `_pick`), `_send`, `_deliver`,
`degrade` and slots. A single task (`_drive`) owns the HeadCore, so the core needs no locks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kafila.session.ring.head import (
    Action,
    Back,
    Broken,
    Cancelled,
    Deliver,
    Ended,
    Forward,
    FreeSlot,
    HeadEvent,
    Send,
    SolveDipsd,
    Solved,
    Submitted,
    Work,
)  # fmt: skip
from kafila.session.ring.scheduler import Step
from kafila.session.ring.speculation.draft import ahead_drafts
from kafila.session.ring.timing import ema
from kafila.session.ring.watchdog import StageHung
from kafila.session.wire.frames import EncodeError, Frame, Free
from kafila.session.wire.streams import StreamClosed

log = logging.getLogger("kafila.session.ring.node")  # its messages stay the ring node's


AFTER_MISS = 2  # drafts a step takes after a rejection while the rest is drafted ahead meanwhile


@dataclass
class _Ahead:
    """Drafts made while a verifying step is out (speculation/draft.py, "Drafting ahead")."""

    req_id: str
    base: tuple[int, ...]  # the history with the drafts the step sent
    most: int  # tokens to draft at most: the target's next token's guess, then the continuation
    sent: float  # when the step left (perf_counter)
    tokens: list[int] = field(default_factory=list)  # appended on the compute thread
    stop: bool = False  # the step is back: the compute thread is wanted for its pick
    task: asyncio.Future | None = None


class HeadDriver:
    """RingNode's methods that drive its HeadCore (the head member only)."""

    async def _drive(self) -> None:
        core = self.core
        while True:
            ev = await self._events.get()
            try:
                # every event that came while the head computed, then one pump: prompts that
                # arrived together leave as one batch (they went one a pump, a forward each)
                await self._handle(ev)
                while not self._events.empty():
                    await self._handle(self._events.get_nowait())
                for work in core.pump(time.perf_counter()):
                    await self._run(work)
            except StreamClosed as exc:
                self.degrade(f"the ring edge to the next member closed ({exc})")
            except StageHung:
                pass  # degraded already, naming this stage
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("head driver failed")
                self.degrade(f"the head {self.name} failed: {type(exc).__name__}: {exc}")

    async def _handle(self, ev: HeadEvent) -> None:
        """One event of the head's driver, before its next pump."""
        core = self.core
        if isinstance(ev, Broken):
            await self._carry_out(core.fail_all(ev.reason))
        elif isinstance(ev, Submitted):
            await self._carry_out(core.on_request(ev.request))
        elif isinstance(ev, Cancelled):
            await self._carry_out(core.cancel(ev.req_id))
        elif isinstance(ev, Solved):
            core.dipsd_solved(ev, time.perf_counter())
        elif isinstance(ev, Back):  # one step, or a micro-batch's rows: all done before the next pump
            for act in ev.acts:
                if (ahead := self._ahead.get(act.req_id)) is not None:
                    ahead.stop = True
                    self._away_ms = ema(self._away_ms, (time.perf_counter() - ahead.sent) * 1000)
            if (observe := getattr(self.drafter, "observe", None)) is not None:  # the MTP drafter: the
                for act in ev.acts:  # model's final hidden of every position back (speculation/mtp.py)
                    observe(act.req_id, act.pos0, act.hidden)
            tokens, pick_us = await self._compute(self._pick, core.picks(ev.acts))
            await self._carry_out(core.complete(ev.acts, tokens, time.perf_counter(), pick_us / 1000))
            if core.depth_due(time.perf_counter()):
                core.batches.groups = self._pipeline_depth()

    async def _run(self, work: Work) -> None:
        """One step (or micro-batch) of the head's: through its stage, then round the ring."""
        core = self.core
        if isinstance(work, SolveDipsd):
            self._solve(work)
            return
        if isinstance(work, Forward):
            step: Step | None = work.step
            core.starting([step.req_id], time.perf_counter(), [len(step.tokens)])  # drafting is part of a trip's cost
            if step.want_draft:
                step = core.attach_draft(step.req_id, await self._propose(step))
                if step is None:
                    return
            steps = [step]
        else:
            steps = list(work.steps)
            core.starting([st.req_id for st in steps], time.perf_counter(), [len(st.tokens) for st in steps])
        hiddens, us = await self._compute(self._forward, [(st.slot, st.cache_len, st.keep) for st in steps],
                                          [st.tokens for st in steps], [st.positions() for st in steps],
                                          [st.mask() for st in steps],
                                          rows=sum(len(st.tokens) for st in steps))  # fmt: skip
        if isinstance(work, Forward):
            acts = [core.forwarded(steps[0], hiddens[0], us)]
        else:
            acts = core.forwarded_rows(steps, hiddens, us)
        if self.out is None:  # a ring of one: the activations are back at once
            self._events.put_nowait(Back(tuple(acts)))
            return
        try:
            await self._send(*acts)
        except EncodeError as exc:  # nothing was written: these requests alone fail
            log.warning("request(s) %s failed: %s", ", ".join(st.req_id for st in steps), exc)
            await self._carry_out(core.send_failed([st.req_id for st in steps], str(exc)))
            return
        if isinstance(work, Forward) and steps[0].drafted and self._ahead_pays():
            self._draft_ahead(steps[0])

    def _ahead_pays(self) -> bool:
        """Whether to draft ahead while a verifying step is out: the head's draft model drafts, one
        request is in flight (its compute thread is otherwise idle), and a step has been out long
        enough for two draft tokens (the draft stops when the step is back, so a short trip
        costs at most the token being drafted)."""
        tok = self._draft_tok_ms
        return (self.drafter is not None and getattr(self.drafter, "ahead", True) and self.core.scheduler.active == 1
                and tok is not None
                and (self._away_ms is None or self._away_ms >= 2 * tok))  # fmt: skip

    def _draft_ahead(self, step: Step) -> None:
        base = self.core.history(step.req_id) + tuple(int(t) for t in step.tokens[1:])
        most = max(step.drafted, self.core.scheduler.draft_k) + 1  # the guess, then a full step's drafts
        ahead = self._ahead[step.req_id] = _Ahead(step.req_id, base, most, time.perf_counter())

        def run() -> None:  # on the compute thread: a token at a time, each under the machine's lock
            while len(ahead.tokens) < ahead.most and not ahead.stop:
                got, _ = self._draft(ahead.req_id, ahead.base + tuple(ahead.tokens), 1)
                if not got:
                    return
                ahead.tokens.append(got[0])

        ahead.task = asyncio.ensure_future(self._compute(run))
        ahead.task.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failed draft is no draft

    def _draft(self, req_id: str, history: tuple[int, ...], k: int) -> tuple[tuple[int, ...], float]:
        """The head's draft model's k proposals after `history` (the compute thread), under the
        machine's compute lock as a stage's forward, and the ms it took."""
        with self.cores:
            t0 = time.perf_counter()
            return self.drafter.propose(req_id, history, k), (time.perf_counter() - t0) * 1000

    def _solve(self, work: SolveDipsd) -> None:
        """The live optimiser's solve on its own thread (a MILP takes tens of ms, SCIP's import
        hundreds the first time); its answer comes back to the driver as Solved."""
        if self._solver is None:
            self._solver = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dipsd-{self.name}")
        fut = asyncio.get_running_loop().run_in_executor(self._solver, self.core.dipsd.solve, work.problem,
                                                         time.perf_counter)  # fmt: skip
        self._solving = fut

        def done(f: asyncio.Future) -> None:
            self._solving = None
            if f.cancelled():
                return
            exc = f.exception()
            if exc is not None:
                log.warning("the live DiP-SD solve failed (%s: %s): choose_k decides meanwhile", type(exc).__name__, exc)
            self._events.put_nowait(Solved(work.problem, None if exc else f.result(),
                                           "" if exc is None else f"{type(exc).__name__}: {exc}"))  # fmt: skip

        fut.add_done_callback(done)

    async def _propose(self, step: Step) -> tuple[int, ...]:
        """The draft model's proposals for `step` (none without a drafter or when it fails: a
        drafter is an optimisation, never a reason to fail a request)."""
        if self.drafter is None:
            return ()
        history, k = self.core.history(step.req_id), step.want_draft
        got: tuple[int, ...] = ()
        try:
            if (ahead := self._ahead.pop(step.req_id, None)) is not None:
                try:
                    await ahead.task
                except Exception as exc:  # noqa: BLE001 - what it drafted before failing still holds
                    log.debug("drafting ahead for %s stopped: %s", step.req_id, exc)
                got = ahead_drafts(ahead.base, ahead.tokens, history)[:k]
                self.drafts_ahead_used += bool(got)
                if not got and self._ahead_pays():
                    # a draft was rejected: a short step leaves now and the rest is drafted ahead
                    # while it is out, rather than every token before it leaves
                    k = min(k, AFTER_MISS)
            if len(got) < k:
                more, ms = await self._compute(self._draft, step.req_id, history + got, k - len(got))
                self._draft_tok_ms = ema(self._draft_tok_ms, ms / (k - len(got)))
                got += more
        except Exception as exc:
            log.warning("the draft model failed (%s: %s): this step goes without drafts", type(exc).__name__, exc)
        return got

    async def _carry_out(self, actions: list[Action]) -> None:
        tokens: list[Frame] = []  # tokens for other members, in order: one write for a batch's rows
        for a in actions:
            if isinstance(a, Deliver):
                self._deliver(a.tokens)
            elif isinstance(a, Send):
                tokens.append(a.frame)
            elif isinstance(a, FreeSlot):
                await self._send_tokens(tokens)
                tokens = []
                await self._compute(self.slots.settle, a.slot, a.keep)
                if self.out is not None and not self.degraded:
                    await self._send(Free(a.slot, a.keep))
            elif isinstance(a, Ended) and self.drafter is not None:
                ahead = self._ahead.pop(a.req_id, None)
                if ahead is not None and ahead.task is not None and not ahead.task.done():
                    ahead.stop = True  # its cursor is freed once the draft ahead is off the thread
                    ahead.task.add_done_callback(lambda _, req_id=a.req_id: self.drafter.release(req_id))
                else:
                    self.drafter.release(a.req_id)
        await self._send_tokens(tokens)

    async def _send_tokens(self, frames: list[Frame]) -> None:
        if not frames:
            return
        if not self.degraded:
            await self._send(*frames)
        else:  # a broken ring may still carry them part of the way; the host tells the rest
            with contextlib.suppress(StreamClosed):
                await self._send(*frames)

    def _pipeline_depth(self) -> int:
        """Micro-batches worth keeping in flight (HeadCore.pipeline_depth over this node's edges)."""
        return self.core.pipeline_depth(self.edge_rtts() if self.edge_rtts is not None else {})
