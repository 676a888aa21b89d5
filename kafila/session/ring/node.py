"""The ring data plane: activations, requests and tokens over one stream per ring edge.

Theory of operation. Members form a ring in the plan's order, head first; each member writes
frames to its successor on one long-lived stream and reads frames from its predecessor on
another. Everything travels in the ring's direction:

- Activation: the head embeds a step's tokens and runs its blocks; every member runs its blocks
  on what arrives and forwards the result; when an activation reaches the head again it has been
  through every block, and the head samples the next token (final norm + lm_head).
- Request (dst = head): a prompt typed at any member hops forward until it reaches the head.
- Tokens (dst = origin): each new token hops forward from the head to the member that asked.
- Cancel (dst = head), Free (ring slot released: every stage drops its KV, the head ends it).

So a ring needs no reverse streams, a request from the head's predecessor takes one hop and one
from its successor takes n−1 hops (tokens the other way round). Frames on a stream are handled
in order by one task, and each member runs its shard on one worker thread, so a stage's KV slots
never see two calls at once and the asyncio loop never blocks on compute.

`RingNode` is the glue: routing frames, the read loop, the hand-off to the compute thread, the
streams. The head's decisions (scheduling, sampling, timing, micro-batches, speculation) are
`head.HeadCore`, which does no I/O; a single driver task owns it (head_driver.py), fed by a
queue of typed events (head.Submitted, Cancelled, Back, Broken, Pump) and carrying out what it
answers. The shard's slots are local_slots.py's; the origin's draft model runs in origin_worker.py.
A broken edge, a malformed frame or a member gone (told by the host) make the node *degraded*:
every request in flight fails with an error naming the cause, and new ones are refused. A frame
of our own over a bound (frames.EncodeError, a LocalProtocolError) is not a broken ring: nothing
was written, so only the request that made it fails (HTTP 500 with the reason) and the next one
is served as usual. Long prompts never make one: the head feeds them in chunks that fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from kafila.session.ring.cores import MAX_WAIT_S, NoLock, core_lock
from kafila.session.ring.head import Back, Broken, Cancelled, HeadCore, HeadEvent, Pump, Submitted, check_prompt
from kafila.session.ring.head_driver import HeadDriver
from kafila.session.ring.local_slots import LocalSlots
from kafila.session.ring.origin_worker import OriginWorker
from kafila.session.ring.picks import pick_tokens
from kafila.session.ring.scheduler import SchedulerError
from kafila.session.ring.slots import DEFAULT_MAX_QUEUED
from kafila.session.ring.speculation.origin import MODEL_DRAFT, OriginDrafts
from kafila.session.ring.speculation.speculate import DRAFT_K
from kafila.session.ring.timing import Measured
from kafila.session.ring.watchdog import STAGE_HANG_S, StageHung, hang_bound_s
from kafila.session.wire.fields import MAX_DRAFT_US, MAX_ORIGIN_DRAFT
from kafila.session.wire.frames import Activation, Cancel, EncodeError, Frame, FrameError, Free, Limits, Request, Tokens
from kafila.session.wire.streams import FrameWriter, StreamClosed, read_frame
from planner import ring_neighbour

log = logging.getLogger(__name__)


@dataclass
class Waiter:
    """What the member that asked keeps for one of its requests."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # int tokens, then a Tokens(done)
    started: float = field(default_factory=time.monotonic)


class RingNode(HeadDriver):
    """One member's part of the ring (the head's when `head` is its own name)."""

    def __init__(self, name: str, head: str, ring: list[str], shard, limits: Limits,
                 eos_ids: frozenset[int] = frozenset(),
                 on_degraded: Callable[[str], None] | None = None,
                 prefill_chunk: int | None = None, speculate: str = "off",
                 draft_k: int = DRAFT_K, adaptive_k: bool = True, drafter=None,
                 stage_hang_s: float = STAGE_HANG_S, max_queued: int = DEFAULT_MAX_QUEUED,
                 batch_rows: bool = True, machines: dict[str, str] | None = None,
                 edge_rtts: Callable[[], dict] | None = None, dipsd: bool = True,
                 padded_rows: bool = True, prompt_cache: bool = True, origin_drafter=None) -> None:  # fmt: skip
        """`prefill_chunk`: positions per prefill step; None (every session) derives it from the
        hidden size and the frame limit (chunks.prefill_chunk_tokens). A larger value makes
        frames over the limit: only tests set it, to exercise the per-request error.
        `speculate`: "off", "ngram" (the head's drafter, speculate.py) or "origin" (every member
        drafts for the requests typed at it, origin.py; the same on every member), at most `draft_k`
        drafts a trip (chosen online unless `adaptive_k` is False: see Scheduler). `drafter`:
        the head's draft model (draft.ModelDrafter) for speculate="draft"; `origin_drafter`: this
        member's (any member's) draft model for speculate="origin": it drafts the requests typed
        here on a thread of its own while the ring works (origin.py). `stage_hang_s`: the
        watchdog's bound on one step of this stage (twice it for a trip round the ring).
        `max_queued`: the head's requests that may wait for a slot (one more: 429).
        `batch_rows`: the head sends the decode steps that are ready together as one micro-batch,
        which every stage runs as one forward (the shard's forward_batch: weights read once for
        all rows); off, every step travels alone. How many micro-batches to keep in flight comes
        from `machines` (ring member → the machine it runs on: stages of one machine share its
        cores) and `edge_rtts()` (ring member → its successor edge's RTT in ms); see
        HeadCore.pipeline_depth. `dipsd`: the live DiP-SD optimiser chooses the draft lengths and
        micro-batches of several speculating requests (HeadCore, dipsd_live.py); it solves on a
        thread of its own, never on the loop or the stage's worker. `prompt_cache`: a finished
        request's slot keeps its KV on every stage for a prompt that starts the same way
        (prefix.py)."""
        self.name = name
        self.head = head
        self.ring = ring
        self.is_head = name == head
        self.shard = shard
        self.limits = limits
        self.slots = LocalSlots(shard)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage-{name}")
        # held around each forward and token pick when other members share this machine (cores.py)
        self.cores = core_lock(name, machines)
        self.out: FrameWriter | None = None  # to the successor (None: a ring of one)
        self.waiters: dict[str, Waiter] = {}
        self.degraded: str | None = None
        self.on_degraded = on_degraded
        self.measured = Measured()
        self.speculate = speculate
        # --speculate origin: this member drafts for the requests typed at it (origin.py); its
        # drafts ride on their activations as they pass its stage (the head: handed over directly)
        model = origin_drafter is not None
        self.origin_drafts = (OriginDrafts(min(2 * draft_k + 1, MODEL_DRAFT if model else MAX_ORIGIN_DRAFT), model,
                                           ahead=isinstance(self.cores, NoLock))
                              if speculate == "origin" and draft_k > 0 else None)  # fmt: skip
        # the origin's draft model, on a thread of its own (origin_worker.py)
        self.origin_worker = (OriginWorker(name, origin_drafter, self.origin_drafts, machines,
                                           on_draft=self._offer_draft if self.is_head else None)
                              if origin_drafter is not None and self.origin_drafts is not None else None)  # fmt: skip
        # micro-batches need every stage's forward_batch; a draft model's steps go alone (the
        # drafter runs between the scheduler's step and its send), n-gram drafts ride in rows
        self.batch = batch_rows and hasattr(shard, "forward_batch") and speculate != "draft"
        self.core = (HeadCore(name, ring, limits, eos_ids=eos_ids, prefill_chunk=prefill_chunk,
                              speculate=speculate, draft_k=draft_k, adaptive_k=adaptive_k,
                              max_queued=max_queued, batch=self.batch, machines=machines,
                              measured=self.measured, dipsd=dipsd, padded_rows=padded_rows,
                              prompt_cache=prompt_cache, recurrent=_recurrent(shard))
                     if self.is_head else None)  # fmt: skip
        self._events: asyncio.Queue[HeadEvent] = asyncio.Queue()
        # this stage's own load (/status): rows in its last forward and forwards run
        self.batch_rows = 0
        self.forwards = 0
        self._tasks: list[asyncio.Task] = []
        self._counter = 0
        self.drafter = drafter
        self._ahead: dict = {}  # req_id → its drafts made while its verifying step is out (head_driver)
        self._draft_tok_ms: float | None = None  # the head's draft model, ms a token (EMA)
        self._away_ms: float | None = None  # a verifying step's time out of the head (EMA)
        self.drafts_ahead_used = 0  # steps whose drafts were made while the step before was out
        self.stage_hang_s = stage_hang_s
        self.edge_rtts = edge_rtts
        self._rows_in: list[Activation] = []  # a micro-batch arriving, row by row
        # a member's stage work in arrival order (activations and the Free frames between them):
        # run by _stage_loop, so that frames only routed through (a prompt for the head, tokens
        # for a user here or further on) never wait behind this stage's compute
        self._staged: asyncio.Queue[list[Activation] | Free] = asyncio.Queue()
        self._solver: ThreadPoolExecutor | None = None  # the live optimiser's thread (made at first use)
        self._solving: asyncio.Future | None = None  # its solve out, if one is

    @property
    def draft_us_per_token(self) -> float:
        """The origin draft model's measured cost a token (0: none, or not measured yet)."""
        return self.origin_worker.us_per_token if self.origin_worker is not None else 0.0

    @property
    def scheduler(self):
        """The head's request scheduler (None on any other member)."""
        return self.core.scheduler if self.core is not None else None

    # --- wiring ------------------------------------------------------------------------------

    def start(self, reader=None, writer=None) -> None:
        """Run with the predecessor's stream `reader` and the successor's `writer` (None, None:
        a ring of one member)."""
        if writer is not None:
            self.out = FrameWriter(writer, self.limits)
        if reader is not None:
            self._tasks.append(asyncio.create_task(self._read_loop(reader), name=f"ring-read-{self.name}"))
            if not self.is_head:
                self._tasks.append(asyncio.create_task(self._stage_loop(), name=f"ring-stage-{self.name}"))
        if self.origin_worker is not None:
            self._tasks.append(self.origin_worker.start())
        if self.is_head:
            self._tasks.append(asyncio.create_task(self._drive(), name=f"ring-head-{self.name}"))
            if self.out is not None:
                self._tasks.append(asyncio.create_task(self._watch_trips(), name=f"ring-watch-{self.name}"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for t in self._tasks:
            if not t.cancelled() and t.exception() is not None:  # each was logged as it failed, too
                log.debug("ring %s: %s had failed: %r", self.name, t.get_name(), t.exception())
        self._tasks.clear()
        self._fail_waiters(self.degraded or "the session is closing")
        if self._solving is not None:
            self._solving.cancel()
        if self._solver is not None:
            self._solver.shutdown(wait=True)  # a solve out ends within its bound
        if self.out is not None:
            self.out.close()
        await asyncio.get_running_loop().run_in_executor(self.executor, self.slots.free_all)
        if self.drafter is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.drafter.close)
        self.executor.shutdown(wait=True)
        if self.origin_worker is not None:
            await self.origin_worker.close()
        self.cores.close()

    def degrade(self, reason: str) -> None:
        """The ring is broken: fail everything in flight with `reason` (idempotent)."""
        if self.degraded is not None:
            return
        self.degraded = reason
        log.warning("session degraded: %s", reason)
        if self.core is not None:
            self.core.halt(reason)
            self._events.put_nowait(Broken(reason))
        self._fail_waiters(reason)
        if self.on_degraded:
            self.on_degraded(reason)

    def _fail_waiters(self, reason: str) -> None:
        for req_id, w in list(self.waiters.items()):
            w.queue.put_nowait(Tokens(req_id, self.name, (), True, "error", reason[:500], 503))
        if self.origin_drafts is not None:
            self.origin_drafts.clear()

    async def _compute(self, fn, *args, rows: int = 1):
        """fn(*args) on the stage's worker thread, watched: past hang_bound_s(stage_hang_s, rows)
        (`rows`: the positions the step feeds) the ring degrades naming this member (a hung
        thread cannot be stopped, but nobody waits on it for ever)."""
        fut = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        bound = hang_bound_s(self.stage_hang_s, rows)
        start, timeout, waited = time.monotonic(), bound, 0.0
        while True:
            # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow a cancellation that
            # arrives as the work finishes (then close() waited for ever on a task that went on)
            done, _ = await asyncio.wait({fut}, timeout=timeout)
            if done:
                break
            # time spent behind other members of this machine (cores.py) is not this stage's
            waited = min(self.cores.wait_s(), MAX_WAIT_S)
            timeout = start + bound + waited - time.monotonic()
            if timeout <= 0:
                break
        if not done:
            reason = (f"member {self.name}'s stage did not finish a step within {bound:.0f} s "
                      "(its compute hangs)" if waited < MAX_WAIT_S else
                      f"member {self.name}'s stage waited over {waited:.0f} s for another Kafila process's "
                      "compute on this machine (KAFILA_CORE_LOCK=0 lets them compute side by side)")  # fmt: skip
            self.degrade(reason)
            raise StageHung(reason)
        return fut.result()

    async def _watch_trips(self) -> None:
        """The head's watchdog over whole trips: a step not back round the ring within twice a
        stage's bound means a member that cannot even report its own hang (frozen, asleep)."""
        tick = min(1.0, self.stage_hang_s / 2)
        while self.degraded is None:
            await asyncio.sleep(tick)
            bound = self.core.late(time.perf_counter(), lambda rows: 2 * hang_bound_s(self.stage_hang_s, rows))
            if bound is not None:
                others = [n for n in self.ring if n != self.name]
                self.degrade(f"a step did not come back round the ring within {bound:.0f} s: one of "
                             f"{', '.join(others)} is not answering (frozen or asleep?)")  # fmt: skip

    # --- prompt entry (any member) -------------------------------------------------------------

    async def submit(self, prompt: list[int], max_new: int, stop_at_eos: bool = True,
                     temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                     speculate: bool = True, keep_at: int = 0) -> tuple[str, Waiter]:  # fmt: skip
        if self.degraded:
            raise SchedulerError(f"the session is degraded: {self.degraded}", 503)
        check_prompt(prompt, self.limits)
        self._counter += 1
        req_id = f"{self.name}:{self._counter}"
        req = Request(req_id, self.name, self.head, max_new, stop_at_eos, np.asarray(prompt, dtype=np.int32),
                      float(temperature), float(top_p), -1 if seed is None else int(seed), bool(speculate),
                      keep_at=keep_at if 0 < keep_at < len(prompt) else 0)  # fmt: skip
        waiter = self.waiters[req_id] = Waiter()
        if self.origin_drafts is not None and speculate:
            self.origin_drafts.start(req_id, prompt)
            self._wake_drafter()
        try:
            if self.core is not None:
                self.core.submit(req)
                self._offer_draft(req_id)
                self._events.put_nowait(Pump())
            else:
                await self._send(req)
        except SchedulerError:
            self._forget(req_id)
            raise
        except EncodeError as exc:
            self._forget(req_id)
            raise SchedulerError(f"this request cannot travel to the head: {exc}", 400) from None
        return req_id, waiter

    def _forget(self, req_id: str) -> None:
        self.waiters.pop(req_id, None)
        if self.origin_drafts is not None:
            self.origin_drafts.end(req_id)
        if self.origin_worker is not None:
            self.origin_worker.release(req_id)

    def _offer_draft(self, req_id: str) -> None:
        """At the head: the latest draft of a request typed here goes to its scheduler directly."""
        d = self.origin_drafts.draft(req_id) if self.origin_drafts is not None else None
        if d is not None and self.core is not None:
            self.core.offer_draft(req_id, *d, draft_ms=self.draft_us_per_token / 1000)

    def _wake_drafter(self) -> None:
        """The origin's draft model has new work (none without one: the head drafts n-grams)."""
        if self.origin_worker is not None:
            self.origin_worker.wake.set()

    async def cancel(self, req_id: str) -> None:
        self._forget(req_id)
        if self.degraded:
            return
        if self.is_head:
            self._events.put_nowait(Cancelled(req_id))
        else:
            with contextlib.suppress(StreamClosed):
                await self._send(Cancel(req_id, self.head))

    # --- frames from the predecessor -------------------------------------------------------------

    async def _read_loop(self, reader) -> None:
        try:
            while True:
                frame = await read_frame(reader, self.limits)
                await self._on_frame(frame)
        except StreamClosed:
            pred = ring_neighbour(self.ring, self.name, -1)
            self.degrade(f"the ring edge from member {pred} closed (member {pred} is gone)")
        except Exception as exc:
            self._failed(exc)

    async def _stage_loop(self) -> None:
        """A member's stage work, in the order it arrived (the read loop queues it)."""
        try:
            while True:
                work = await self._staged.get()
                if isinstance(work, Free):
                    await self._compute(self.slots.settle, work.slot, work.keep)
                    await self._send(work)
                else:
                    await self._stage(work)
        except StreamClosed:
            succ = ring_neighbour(self.ring, self.name, 1)
            self.degrade(f"the ring edge to member {succ} closed (member {succ} is gone)")
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """The ring cannot go on after `exc` from the read loop or the stage's: say whose it is."""
        if isinstance(exc, EncodeError):  # ours, not the predecessor's (a stage's output is its input's size)
            log.error("ring stage made a frame it cannot send", exc_info=exc)
            self.degrade(f"member {self.name} could not send its stage's output: {exc}")
        elif isinstance(exc, FrameError):  # the predecessor's (a RemoteProtocolError)
            pred = ring_neighbour(self.ring, self.name, -1)
            self.degrade(f"member {pred} sent a malformed frame ({exc}); its edge was closed")
        elif not isinstance(exc, StageHung):  # (hung: degraded already, naming this stage)
            log.error("ring stage failed", exc_info=exc)  # a shard that failed: the ring cannot go on
            self.degrade(f"member {self.name}'s stage failed: {type(exc).__name__}: {exc}")

    misaddressed = 0  # frames for a name not in the ring: dropped, or they would circle for ever
    overhopped = 0  # routed frames passed on more than len(ring) + 1 times: dropped (frames.py)

    async def _on_frame(self, frame: Frame) -> None:
        if isinstance(frame, (Request, Tokens, Cancel)):
            if frame.dst not in self.ring:
                self.misaddressed += 1
                log.debug("a %s for %r, who is not in the ring: dropped", type(frame).__name__, frame.dst)
            elif frame.hops > len(self.ring) + 1:
                self.overhopped += 1
                log.debug("a %s for %r after %d hops: dropped", type(frame).__name__, frame.dst, frame.hops)
            elif frame.dst != self.name:
                await self._send(replace(frame, hops=frame.hops + 1))
            elif isinstance(frame, Tokens):
                self._deliver(frame)
            elif self.is_head:
                self._events.put_nowait(Submitted(frame) if isinstance(frame, Request) else Cancelled(frame.req_id))
        elif isinstance(frame, Activation):
            rows = self._collect(frame)
            if rows is None:
                return  # more rows of its micro-batch follow
            if self.is_head:
                self._events.put_nowait(Back(tuple(rows)))
            else:
                self._staged.put_nowait(rows)
        elif isinstance(frame, Free):
            if not self.is_head:  # back at the head it is over (the head freed its own at once)
                self._staged.put_nowait(frame)

    def _collect(self, act: Activation) -> list[Activation] | None:
        """A micro-batch's rows come back to back: the whole batch once its last row is in."""
        if act.rows == 1 and not self._rows_in:
            return [act]
        if act.row != len(self._rows_in) or (self._rows_in and act.rows != self._rows_in[0].rows):
            raise FrameError(f"row {act.row} of a micro-batch of {act.rows} arrived after "
                             f"{len(self._rows_in)} rows")  # fmt: skip
        self._rows_in.append(act)
        if len(self._rows_in) < act.rows:
            return None
        rows, self._rows_in = self._rows_in, []
        return rows

    async def _stage(self, acts: list[Activation]) -> None:
        """Run this stage on a step, or on a micro-batch (decode steps, or prompts) as one forward,
        and pass it on as it came."""
        if len(acts) > 1 and len({a.slot for a in acts}) != len(acts):
            raise FrameError("a micro-batch must hold distinct slots' steps")
        xs = [a.hidden for a in acts]
        hiddens, us = await self._compute(self._forward, [(a.slot, a.cache_len, a.keep) for a in acts], xs,
                                          [a.positions() for a in acts], [a.mask() for a in acts],
                                          rows=sum(a.n for a in acts))  # fmt: skip
        if all(a.cache_len for a in acts) and (len(acts) > 1 or acts[0].n == 1):  # decode steps only:
            # a prefill's cost grows with the prompt
            self.measured.stage(self.name, us)
        await self._send(*(self._passed(a, h, us) for a, h in zip(acts, hiddens)))

    def _passed(self, act: Activation, hidden: np.ndarray, us: int) -> Activation:
        """`act` leaving this stage: its output, this stage's µs, and this member's latest draft
        when the request was typed here (--speculate origin), else the draft it came with."""
        d = self.origin_drafts.draft(act.req_id) if self.origin_drafts is not None else None
        if d is None:
            draft, dbase, dus = act.draft, act.dbase, act.dus
        else:
            draft, dbase, dus = d[1], d[0], min(int(self.draft_us_per_token), MAX_DRAFT_US)
        return replace(act, hidden=hidden, trace=act.trace + ((self.name, us),), draft=draft, dbase=dbase,
                       dus=dus)  # fmt: skip

    def _forward(self, where: list[tuple[int, int, bool]], xs, positions, masks) -> tuple[list[np.ndarray], int]:
        """This stage's forward on the worker thread (the head's too: xs are token ids there): one
        slot alone (`forward`) or several as one (`forward_batch`), a fresh step resetting its slot;
        the hidden states and the µs it took. `where`: (ring slot, cache_len, keep) per row; keep:
        the slot's recurrent state after the step is kept (Activation.keep)."""
        with self.cores:
            t0 = time.perf_counter()
            if len(where) == 1:
                (ring_slot, cache_len, _), = where
                hs = [self.shard.forward(self.slots.get(ring_slot, cache_len, len(positions[0])), xs[0], positions[0], masks[0])]
            else:
                hs = self.shard.forward_batch([self.slots.get(s, c, len(p)) for (s, c, _), p in zip(where, positions)],
                                              xs, positions, masks)  # fmt: skip
            for ring_slot, _, keep in where:
                if keep:
                    self.slots.checkpoint(ring_slot)
        self.batch_rows = len(where)
        self.forwards += 1
        return hs, int((time.perf_counter() - t0) * 1e6)

    def _pick(self, picks) -> tuple[list, int]:
        """The tokens of a returning step's rows, and the µs it took (the head machine's compute)."""
        with self.cores:
            t0 = time.perf_counter()
            return pick_tokens(self.shard, picks), int((time.perf_counter() - t0) * 1e6)

    async def _send(self, *frames: Frame) -> None:
        """Frames to the successor, written back to back (a micro-batch's rows stay together)."""
        if self.out is None:
            raise StreamClosed("this member has no successor")
        await self.out.send(*frames)

    def _deliver(self, frame: Tokens) -> None:
        if frame.stats:
            self.measured.update_from(frame.stats)
        w = self.waiters.get(frame.req_id)
        if w is None:
            return  # a request its origin already gave up on
        for t in frame.ids:
            w.queue.put_nowait(t)
        if frame.done:
            w.queue.put_nowait(frame)
            self._forget(frame.req_id)
        elif self.origin_drafts is not None and frame.ids:
            self.origin_drafts.add(frame.req_id, frame.ids, frame.want)  # drafting ahead of the next activation
            self._offer_draft(frame.req_id)
            self._wake_drafter()

    # --- load, for /status -----------------------------------------------------------------------

    def stage_load(self) -> dict:
        """This member's stage: requests holding a KV slot here, rows in its last forward, forwards run."""
        return {"active": self.slots.active, "batch_rows": self.batch_rows, "steps": self.forwards}

    def head_load(self, most: int) -> dict | None:
        """The head's queue and the requests it holds (at most `most`, oldest first), each with
        its decode rate so far; None on any other member."""
        return None if self.core is None else self.core.load(most)


def _recurrent(shard) -> bool:
    """Whether the model keeps a recurrent state (a hybrid; the head's shard tells for every
    stage): the scheduler then cuts rejected drafts off and continues whole histories only."""
    return getattr(getattr(getattr(shard, "index", None), "hparams", None), "hybrid", None) is not None
