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

The head's scheduling is `scheduler.Scheduler`; a single driver task owns it, fed by a queue.
A broken edge, a malformed frame or a member gone (told by the host) make the node *degraded*:
every request in flight fails with an error naming the cause, and new ones are refused. A frame
of our own over a bound (frames.EncodeError) is not a broken ring: nothing was written, so only
the request that made it fails (HTTP 500 with the reason) and the next one is served as usual.
Long prompts never make one: the head feeds them in chunks that fit (scheduler.prefill_chunk_tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from kafila.session.frames import (
    MAX_BATCH_ROWS,
    Activation,
    Cancel,
    EncodeError,
    Frame,
    FrameError,
    Free,
    Limits,
    Request,
    Tokens,
)  # fmt: skip
from kafila.session.microbatch import MicroBatches
from kafila.session.scheduler import (
    Finished,
    Scheduler,
    SchedulerError,
    SlotFreed,
    Step,
    TokenOut,
    prefill_chunk_tokens,
)  # fmt: skip
from kafila.sampling import sample_token
from kafila.session.slots import DEFAULT_MAX_QUEUED
from kafila.session.speculate import DRAFT_K, verify
from kafila.session.streams import FrameWriter, StreamClosed, read_frame

log = logging.getLogger(__name__)
EMA = 0.2  # weight of the newest measurement in the moving averages
DEPTH_EVERY_S = 1.0  # how often the head re-estimates the micro-batches to keep in flight
# The watchdog: a stage whose compute has not finished one step of up to HANG_ROWS positions in
# STAGE_HANG_S hangs; a step that has not come back round the ring in twice its bound is lost (a
# member frozen whole: its own watchdog cannot fire). A longer step (a prefill chunk: 512
# positions at hidden 4096) computes for proportionally longer, so its bound grows with the
# positions it feeds: the 8B shape's chunk takes minutes on a slow CPU (issue 10), not a hang.
STAGE_HANG_S = 120.0
HANG_ROWS = 32


def hang_bound_s(stage_hang_s: float, rows: int) -> float:
    """The watchdog's bound on one step of `rows` positions on one stage (a trip: twice it)."""
    return stage_hang_s * max(1.0, rows / HANG_ROWS)


class StageHung(Exception):
    """This member's stage did not finish a step within its bound."""


class LocalSlots:
    """Ring slot ids (the head's) → this shard's slot ids; a fresh step resets its slot."""

    def __init__(self, shard) -> None:
        self.shard = shard
        self.slots: dict[int, int] = {}

    def get(self, ring_slot: int, fresh: bool) -> int:
        if fresh:
            self.free(ring_slot)
        if ring_slot not in self.slots:
            self.slots[ring_slot] = self.shard.open_slot()
        return self.slots[ring_slot]

    def free(self, ring_slot: int) -> None:
        local = self.slots.pop(ring_slot, None)
        if local is not None:
            self.shard.close_slot(local)

    def free_all(self) -> None:
        for s in list(self.slots):
            self.free(s)


def greedy(shard, hidden: np.ndarray) -> int:
    if hasattr(shard, "greedy"):
        return int(shard.greedy(hidden))
    return int(np.argmax(shard.logits(hidden[-1:])[-1]))


def greedy_rows(shard, hiddens: list[np.ndarray]) -> list[int]:
    """The top-1 token after each hidden's last row, from one lm_head over all of them."""
    if not hiddens:
        return []
    if len(hiddens) == 1:
        return [greedy(shard, hiddens[0])]
    logits = shard.logits(np.concatenate([h[-1:] for h in hiddens]))
    return [int(t) for t in np.argmax(logits, axis=-1)]


def verify_rows(shard, hidden: np.ndarray, draft: tuple[int, ...], sampling) -> tuple[int, ...]:
    """The tokens a verifying step yields from its rows (speculate.verify)."""
    return verify(draft, shard.logits(hidden), sampling)


def sample(shard, hidden: np.ndarray, temperature: float, top_p: float, rng) -> int:
    """A token from softmax(logits / temperature) within the top_p nucleus (as LocalEngine)."""
    return sample_token(shard.logits(hidden[-1:])[-1], temperature, top_p, rng)


@dataclass
class Waiter:
    """What the member that asked keeps for one of its requests."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # int tokens, then a Tokens(done)
    started: float = field(default_factory=time.monotonic)


@dataclass
class Measured:
    stage_ms: dict[str, float] = field(default_factory=dict)
    step_ms: float | None = None  # head: one decode step round the ring
    network_ms: float | None = None  # step_ms minus every stage's compute
    tok_s: float | None = None  # the latest finished request's decode rate

    def as_pairs(self) -> tuple[tuple[str, float], ...]:
        out = [("stage:" + k, round(v, 3)) for k, v in self.stage_ms.items()]
        for k in ("step_ms", "network_ms", "tok_s"):
            if (v := getattr(self, k)) is not None:
                out.append((k, round(v, 3)))
        return tuple(out)

    def update_from(self, pairs) -> None:
        for k, v in pairs:
            if k.startswith("stage:"):
                self.stage_ms[k[6:]] = float(v)
            elif k in ("step_ms", "network_ms", "tok_s"):
                setattr(self, k, float(v))


class RingNode:
    """One member's part of the ring (the head's when `head` is its own name)."""

    def __init__(self, name: str, head: str, ring: list[str], shard, limits: Limits,
                 eos_ids: frozenset[int] = frozenset(),
                 on_degraded: Callable[[str], None] | None = None,
                 prefill_chunk: int | None = None, speculate: str = "off",
                 draft_k: int = DRAFT_K, adaptive_k: bool = True, drafter=None,
                 stage_hang_s: float = STAGE_HANG_S, max_queued: int = DEFAULT_MAX_QUEUED,
                 batch_rows: bool = True, machines: dict[str, str] | None = None,
                 edge_rtts: Callable[[], dict] | None = None) -> None:  # fmt: skip
        """`prefill_chunk`: positions per prefill step; None (every session) derives it from the
        hidden size and the frame limit (scheduler.prefill_chunk_tokens). A larger value makes
        frames over the limit: only tests set it, to exercise the per-request error.
        `speculate`: "off" or "ngram" (the head's drafter, speculate.py), at most `draft_k`
        drafts a trip (chosen online unless `adaptive_k` is False: see Scheduler). `drafter`:
        the head's draft model (draft.ModelDrafter) for speculate="draft". `stage_hang_s`: the
        watchdog's bound on one step of this stage (twice it for a trip round the ring).
        `max_queued`: the head's requests that may wait for a slot (one more: 429).
        `batch_rows`: the head sends the decode steps that are ready together as one micro-batch,
        which every stage runs as one forward (the shard's forward_batch: weights read once for
        all rows); off, every step travels alone. How many micro-batches to keep in flight comes
        from `machines` (ring member → the machine it runs on: stages of one machine share its
        cores) and `edge_rtts()` (ring member → its successor edge's RTT in ms); see
        _pipeline_depth."""
        self.name = name
        self.head = head
        self.ring = ring
        self.is_head = name == head
        self.shard = shard
        self.limits = limits
        self.slots = LocalSlots(shard)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage-{name}")
        self.out: FrameWriter | None = None  # to the successor (None: a ring of one)
        self.waiters: dict[str, Waiter] = {}
        self.degraded: str | None = None
        self.on_degraded = on_degraded
        self.measured = Measured()
        chunk = prefill_chunk or prefill_chunk_tokens(limits.hidden, limits.frame_bytes)
        self.speculate = speculate
        self.scheduler = (Scheduler(limits.slots, limits.context, eos_ids, max_queue=max_queued,
                                    chunk_tokens=chunk, speculate=speculate, draft_k=draft_k,
                                    adaptive_k=adaptive_k)
                          if self.is_head else None)  # fmt: skip
        self._events: asyncio.Queue = asyncio.Queue()
        self._step_started: dict[str, float] = {}
        self._step_rows: dict[str, int] = {}  # head: rid → positions its step in flight feeds (the trip's bound)
        self._pace: dict[str, tuple[float, float, int]] = {}  # head: rid → (first token, last token, tokens)
        # this stage's own load (/status): rows in its last forward (one request's step each, for
        # now: batched decode rows will put several requests' rows in one) and forwards run
        self.batch_rows = 0
        self.forwards = 0
        self._tasks: list[asyncio.Task] = []
        self._counter = 0
        self._sampling: dict[str, tuple] = {}  # head: rid → (temperature, top_p, rng) when not greedy
        self.drafter = drafter
        self.stage_hang_s = stage_hang_s
        # micro-batches need every stage's forward_batch; a draft model's steps go alone (the
        # drafter runs between the scheduler's step and its send), n-gram drafts ride in rows
        self.batch = batch_rows and hasattr(shard, "forward_batch") and speculate != "draft"
        self.machines = machines or {n: n for n in ring}
        self.edge_rtts = edge_rtts
        self._batches = MicroBatches(groups=len(set(self.machines.values())), max_rows=MAX_BATCH_ROWS)
        self._depth_at = 0.0  # when the micro-batches in flight were last re-estimated
        self._rows_in: list[Activation] = []  # a micro-batch arriving, row by row

    # --- wiring ------------------------------------------------------------------------------

    def start(self, reader=None, writer=None) -> None:
        """Run with the predecessor's stream `reader` and the successor's `writer` (None, None:
        a ring of one member)."""
        if writer is not None:
            self.out = FrameWriter(writer, self.limits)
        if reader is not None:
            self._tasks.append(asyncio.create_task(self._read_loop(reader), name=f"ring-read-{self.name}"))
        if self.is_head:
            self._tasks.append(asyncio.create_task(self._drive(), name=f"ring-head-{self.name}"))
            if self.out is not None:
                self._tasks.append(asyncio.create_task(self._watch_trips(), name=f"ring-watch-{self.name}"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self._fail_waiters(self.degraded or "the session is closing")
        if self.out is not None:
            self.out.close()
        await asyncio.get_running_loop().run_in_executor(self.executor, self.slots.free_all)
        if self.drafter is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.drafter.close)
        self.executor.shutdown(wait=True)

    def degrade(self, reason: str) -> None:
        """The ring is broken: fail everything in flight with `reason` (idempotent)."""
        if self.degraded is not None:
            return
        self.degraded = reason
        log.warning("session degraded: %s", reason)
        if self.is_head:
            self._events.put_nowait(("fail", reason))
        self._fail_waiters(reason)
        if self.on_degraded:
            self.on_degraded(reason)

    def _fail_waiters(self, reason: str) -> None:
        for rid, w in list(self.waiters.items()):
            w.queue.put_nowait(Tokens(rid, self.name, (), True, "error", reason[:500], 503))

    async def _compute(self, fn, *args, rows: int = 1):
        """fn(*args) on the stage's worker thread, watched: past hang_bound_s(stage_hang_s, rows)
        (`rows`: the positions the step feeds) the ring degrades naming this member (a hung
        thread cannot be stopped, but nobody waits on it for ever)."""
        fut = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        bound = hang_bound_s(self.stage_hang_s, rows)
        # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow a cancellation that
        # arrives as the work finishes (then close() waited for ever on a task that went on)
        done, _ = await asyncio.wait({fut}, timeout=bound)
        if not done:
            reason = (f"member {self.name}'s stage did not finish a step within {bound:.0f} s "
                      "(its compute hangs)")  # fmt: skip
            self.degrade(reason)
            raise StageHung(reason)
        return fut.result()

    async def _watch_trips(self) -> None:
        """The head's watchdog over whole trips: a step not back round the ring within twice a
        stage's bound means a member that cannot even report its own hang (frozen, asleep)."""
        bound = 2 * self.stage_hang_s
        while self.degraded is None:
            await asyncio.sleep(min(1.0, bound / 4))
            now = time.perf_counter()
            late = [rid for rid, t0 in self._step_started.items()
                    if now - t0 > 2 * hang_bound_s(self.stage_hang_s, self._step_rows.get(rid, 1))]  # fmt: skip
            if late:
                bound = 2 * hang_bound_s(self.stage_hang_s, max(self._step_rows.get(r, 1) for r in late))
                others = [n for n in self.ring if n != self.name]
                self.degrade(f"a step did not come back round the ring within {bound:.0f} s: one of "
                             f"{', '.join(others)} is not answering (frozen or asleep?)")  # fmt: skip

    # --- prompt entry (any member) -------------------------------------------------------------

    async def submit(self, prompt: list[int], max_new: int, stop_at_eos: bool = True,
                     temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                     speculate: bool = True) -> tuple[str, Waiter]:  # fmt: skip
        if self.degraded:
            raise SchedulerError(f"the session is degraded: {self.degraded}", 503)
        self._check_ids(prompt)
        self._counter += 1
        rid = f"{self.name}:{self._counter}"
        waiter = self.waiters[rid] = Waiter()
        if self.is_head:
            try:
                self.scheduler.submit(rid, self.name, prompt, max_new, stop_at_eos, speculate)
            except SchedulerError:
                del self.waiters[rid]
                raise
            self._set_sampling(rid, temperature, top_p, -1 if seed is None else seed)
            self._events.put_nowait(("pump",))
        else:
            try:
                await self._send(Request(rid, self.name, self.head, max_new, stop_at_eos,
                                         np.asarray(prompt, dtype=np.int32), float(temperature),
                                         float(top_p), -1 if seed is None else int(seed),
                                         bool(speculate)))  # fmt: skip
            except EncodeError as exc:
                del self.waiters[rid]
                raise SchedulerError(f"this request cannot travel to the head: {exc}", 400) from None
        return rid, waiter

    def _set_sampling(self, rid: str, temperature: float, top_p: float, seed: int) -> None:
        if temperature > 0:
            self._sampling[rid] = (temperature, top_p, np.random.default_rng(None if seed < 0 else seed))

    def _check_ids(self, prompt) -> None:
        if len(prompt) >= self.limits.context:  # (a Request frame carries at most the context)
            raise SchedulerError(f"the prompt has {len(prompt)} tokens; this session's context is "
                                 f"{self.limits.context} (prompt and answer together): shorten it", 400)  # fmt: skip
        if prompt and not 0 <= min(prompt) <= max(prompt) < self.limits.vocab:
            raise SchedulerError(f"prompt token ids must lie in 0..{self.limits.vocab - 1}", 400)

    async def cancel(self, rid: str) -> None:
        self.waiters.pop(rid, None)
        if self.degraded:
            return
        if self.is_head:
            self._events.put_nowait(("cancel", rid))
        else:
            with contextlib.suppress(StreamClosed):
                await self._send(Cancel(rid, self.head))

    # --- frames from the predecessor -------------------------------------------------------------

    async def _read_loop(self, reader) -> None:
        pred = self.ring[(self.ring.index(self.name) - 1) % len(self.ring)]
        try:
            while True:
                frame = await read_frame(reader, self.limits)
                await self._on_frame(frame)
        except StreamClosed:
            self.degrade(f"the ring edge from member {pred} closed (member {pred} is gone)")
        except EncodeError as exc:  # ours, not the predecessor's (a stage's output is its input's size)
            log.exception("ring stage made a frame it cannot send")
            self.degrade(f"member {self.name} could not send its stage's output: {exc}")
        except FrameError as exc:
            self.degrade(f"member {pred} sent a malformed frame ({exc}); its edge was closed")
        except StageHung:
            pass  # degraded already, naming this stage
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a shard that failed: the ring cannot go on
            log.exception("ring stage failed")
            self.degrade(f"member {self.name}'s stage failed: {type(exc).__name__}: {exc}")

    misaddressed = 0  # frames for a name not in the ring: dropped, or they would circle for ever
    overhopped = 0  # routed frames passed on more than len(ring) + 1 times: dropped (frames.py)

    async def _on_frame(self, frame: Frame) -> None:
        if isinstance(frame, (Request, Tokens, Cancel)) and frame.dst not in self.ring:
            self.misaddressed += 1
            log.debug("a %s for %r, who is not in the ring: dropped", type(frame).__name__, frame.dst)
            return
        if isinstance(frame, (Request, Tokens, Cancel)) and frame.hops > len(self.ring) + 1:
            self.overhopped += 1
            log.debug("a %s for %r after %d hops: dropped", type(frame).__name__, frame.dst, frame.hops)
            return
        if isinstance(frame, Activation):
            rows = self._collect(frame)
            if rows is None:
                return  # more rows of its micro-batch follow
            if self.is_head:
                self._events.put_nowait(("back", rows))
            elif len(rows) == 1:
                await self._stage(rows[0])
            else:
                await self._stage_rows(rows)
        elif isinstance(frame, Free):
            if not self.is_head:  # back at the head it is over (the head freed its own at once)
                await self._compute(self.slots.free, frame.slot)
                await self._send(frame)
        elif isinstance(frame, Request):
            if frame.dst != self.name:
                await self._send(replace(frame, hops=frame.hops + 1))
            elif self.is_head:
                self._events.put_nowait(("request", frame))
        elif isinstance(frame, Tokens):
            if frame.dst != self.name:
                await self._send(replace(frame, hops=frame.hops + 1))
            else:
                self._deliver(frame)
        elif isinstance(frame, Cancel):
            if frame.dst != self.name:
                await self._send(replace(frame, hops=frame.hops + 1))
            elif self.is_head:
                self._events.put_nowait(("cancel", frame.rid))

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

    async def _stage_rows(self, acts: list[Activation]) -> None:
        """Run a micro-batch as one forward and pass it on as one."""
        def run():
            t0 = time.perf_counter()
            slots = [self.slots.get(a.slot, False) for a in acts]
            hs = self.shard.forward_batch(slots, [a.hidden for a in acts], [a.positions() for a in acts],
                                          [a.mask() for a in acts])  # fmt: skip
            self._ran(len(acts))
            return hs, int((time.perf_counter() - t0) * 1e6)

        if len({a.slot for a in acts}) != len(acts) or any(a.cache_len == 0 for a in acts):
            raise FrameError("a micro-batch must hold distinct slots' decode steps")
        hiddens, us = await self._compute(run)
        self._measure(self.name, us)
        await self._send(*(replace(a, hidden=h, trace=a.trace + ((self.name, us),)) for a, h in zip(acts, hiddens)))

    async def _stage(self, act: Activation) -> None:
        def run():
            t0 = time.perf_counter()
            slot = self.slots.get(act.slot, act.cache_len == 0)
            h = self.shard.forward(slot, act.hidden, act.positions(), act.mask())
            self._ran(1)
            return h, int((time.perf_counter() - t0) * 1e6)

        hidden, us = await self._compute(run, rows=act.n)
        if act.n == 1:  # decode steps only: a prefill's cost grows with the prompt
            self._measure(self.name, us)
        await self._send(Activation(act.rid, act.slot, act.cache_len, act.pos0, act.zeros, hidden,
                                    act.trace + ((self.name, us),)))  # fmt: skip

    async def _send(self, *frames: Frame) -> None:
        """Frames to the successor, written back to back (a micro-batch's rows stay together)."""
        if self.out is None:
            raise StreamClosed("this member has no successor")
        await self.out.send(*frames)

    def _deliver(self, frame: Tokens) -> None:
        if frame.stats:
            self.measured.update_from(frame.stats)
        w = self.waiters.get(frame.rid)
        if w is None:
            return  # a request its origin already gave up on
        for t in frame.ids:
            w.queue.put_nowait(t)
        if frame.done:
            w.queue.put_nowait(frame)
            self.waiters.pop(frame.rid, None)

    def _measure(self, stage: str, us: int) -> None:
        ms = us / 1000
        old = self.measured.stage_ms.get(stage)
        self.measured.stage_ms[stage] = ms if old is None else old + EMA * (ms - old)

    # --- the head's driver -------------------------------------------------------------------------

    async def _drive(self) -> None:
        sched = self.scheduler
        while True:
            ev = await self._events.get()
            kind = ev[0]
            try:
                if kind == "fail":
                    await self._emit(sched.fail_all(ev[1], 503))
                    continue
                if kind == "request":
                    req: Request = ev[1]
                    try:
                        if self.degraded:
                            raise SchedulerError(f"the session is degraded: {self.degraded}", 503)
                        self._check_ids(req.prompt.tolist())
                        sched.submit(req.rid, req.origin, req.prompt.tolist(), req.max_new, req.stop_at_eos,
                                     req.speculate)
                        self._set_sampling(req.rid, req.temperature, req.top_p, req.seed)
                    except SchedulerError as exc:
                        await self._to_origin(Tokens(req.rid, req.origin, (), True, "error", str(exc)[:500], exc.status))
                elif kind == "cancel":
                    await self._emit(sched.cancel(ev[1]))
                elif kind == "back":  # one step, or a micro-batch's rows: all done before the next pump
                    acts = ev[1]
                    plain = [a for a in acts if sched.wants_token(a.rid) and not sched.draft_of(a.rid)
                             and a.rid not in self._sampling] if len(acts) > 1 else []  # fmt: skip
                    tokens = dict(zip((a.rid for a in plain),
                                      await self._compute(greedy_rows, self.shard, [a.hidden for a in plain])))
                    for act in acts:
                        sampling = self._sampling.get(act.rid)
                        if act.rid in tokens:  # a micro-batch's greedy rows: one lm_head for all
                            token = tokens[act.rid]
                        elif not sched.wants_token(act.rid):  # a prefill chunk before the prompt's last
                            token = None
                        elif draft := sched.draft_of(act.rid):  # a verifying step: a row per position
                            token = await self._compute(verify_rows, self.shard, act.hidden, draft, sampling)
                        elif sampling is None:
                            token = await self._compute(greedy, self.shard, act.hidden)
                        else:
                            token = await self._compute(sample, self.shard, act.hidden, *sampling)
                        self._account(act)
                        await self._emit(sched.complete(act.rid, token))
                    if time.perf_counter() - self._depth_at > DEPTH_EVERY_S:  # not every trip: it reads edge stats
                        self._depth_at = time.perf_counter()
                        self._batches.groups = self._pipeline_depth()
                await self._pump()
            except StreamClosed as exc:
                self.degrade(f"the ring edge to the next member closed ({exc})")
            except StageHung:
                pass  # degraded already, naming this stage
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("head driver failed")
                self.degrade(f"the head {self.name} failed: {type(exc).__name__}: {exc}")

    async def _pump(self) -> None:
        if self.degraded:
            return
        steps = self.scheduler.steps()
        if self.batch:  # plain decode steps wait for their micro-batch; the rest go as they come
            for step in steps:
                if self._batchable(step):
                    self._batches.ready(step)
                else:
                    self._batches.leave(step.rid)
            steps = [s for s in steps if not self._batchable(s)]
            for group in self._batches.due():
                if len(group) == 1:
                    steps.append(group[0])
                else:
                    await self._send_rows(group)
        for step in steps:
            self._step_started[step.rid] = time.perf_counter()  # drafting is part of a trip's cost
            self._step_rows[step.rid] = len(step.tokens)
            if step.want_draft:
                step = self.scheduler.attach_draft(step.rid, await self._propose(step))
                if step is None:
                    continue
            hidden, us = await self._compute(self._head_forward, step, rows=len(step.tokens))
            if len(step.tokens) == 1:
                self._measure(self.name, us)
            act = Activation(step.rid, step.slot, step.cache_len, step.pos0, step.zeros, hidden,
                             ((self.name, us),))  # fmt: skip
            if self.out is None:  # a ring of one: the activation is back at once
                self._events.put_nowait(("back", [act]))
                continue
            try:
                await self._send(act)
            except EncodeError as exc:  # nothing was written: this request alone fails
                log.warning("request %s failed: %s", step.rid, exc)
                await self._emit(self.scheduler.fail(
                    step.rid, f"this request's activations cannot be sent round the ring: {exc}", 500))

    def _pipeline_depth(self) -> int:
        """Micro-batches worth keeping in flight: a trip's time over the busiest machine's share
        of it (three stages on three machines and a fast network: 3; the same three on one
        machine: 1, since they cannot run side by side; 20 ms a hop adds as many as fill it)."""
        stage_ms = self.measured.stage_ms
        if not all(stage_ms.get(n) for n in self.ring):
            return self._batches.groups  # not measured yet: one per machine
        busy: dict[str, float] = {}
        for n in self.ring:
            machine = self.machines.get(n, n)
            busy[machine] = busy.get(machine, 0.0) + stage_ms[n]
        rtts = self.edge_rtts() if self.edge_rtts is not None else {}
        net = sum(float(rtts.get(n) or 0.0) / 2 for n in self.ring) if len(self.ring) > 1 else 0.0
        trip = sum(stage_ms[n] for n in self.ring) + net
        # rounded up once past a quarter: a group too few leaves a machine idle for a whole share
        return max(1, min(MAX_BATCH_ROWS, math.ceil(trip / max(busy.values()) - 0.25)))

    @staticmethod
    def _batchable(step: Step) -> bool:
        """A decode step (its last token, and drafts to verify if any; not a prefill, not a step
        still waiting for a drafter): it may share a forward with others."""
        return step.cache_len > 0 and len(step.tokens) == 1 + step.drafted and not step.want_draft

    async def _send_rows(self, steps: list[Step]) -> None:
        """The ready decode steps as one micro-batch: one forward here, one trip round the ring."""
        now = time.perf_counter()
        for step in steps:
            self._step_started[step.rid] = now
            self._step_rows[step.rid] = 1
        hiddens, us = await self._compute(self._head_forward_rows, steps)
        self._measure(self.name, us)
        acts = [Activation(st.rid, st.slot, st.cache_len, st.pos0, st.zeros, h, ((self.name, us),), len(steps), i)
                for i, (st, h) in enumerate(zip(steps, hiddens))]  # fmt: skip
        if self.out is None:  # a ring of one: back at once
            self._events.put_nowait(("back", acts))
            return
        try:
            await self._send(*acts)
        except EncodeError as exc:  # nothing was written: these requests alone fail
            for st in steps:
                await self._emit(self.scheduler.fail(
                    st.rid, f"this request's activations cannot be sent round the ring: {exc}", 500))

    def _head_forward_rows(self, steps: list[Step]):
        t0 = time.perf_counter()
        slots = [self.slots.get(st.slot, False) for st in steps]
        hs = self.shard.forward_batch(slots, [st.tokens for st in steps], [st.positions() for st in steps],
                                      [st.mask() for st in steps])  # fmt: skip
        self._ran(len(steps))
        return hs, int((time.perf_counter() - t0) * 1e6)

    async def _propose(self, step: Step) -> tuple[int, ...]:
        """The draft model's proposals for `step` (none without a drafter or when it fails: a
        drafter is an optimisation, never a reason to fail a request)."""
        if self.drafter is None:
            return ()
        history = self.scheduler.history(step.rid)
        try:
            return await self._compute(self.drafter.propose, step.rid, history, step.want_draft)
        except Exception as exc:
            log.warning("the draft model failed (%s: %s): this step goes without drafts", type(exc).__name__, exc)
            return ()

    def _head_forward(self, step: Step):
        t0 = time.perf_counter()
        slot = self.slots.get(step.slot, step.cache_len == 0)
        h = self.shard.forward(slot, step.tokens, step.positions(), step.mask())
        self._ran(1)
        return h, int((time.perf_counter() - t0) * 1e6)

    def _ran(self, rows: int) -> None:
        """A forward of `rows` requests' steps finished on this stage (its worker thread)."""
        self.batch_rows = rows
        self.forwards += 1

    # --- load, for /status -----------------------------------------------------------------------

    def stage_load(self) -> dict:
        """This member's stage: requests holding a KV slot here, rows in its last forward, forwards run."""
        return {"active": len(self.slots.slots), "batch_rows": self.batch_rows, "steps": self.forwards}

    def head_load(self, most: int) -> dict | None:
        """The head's queue and the requests it holds (at most `most`, oldest first), each with
        its decode rate so far; None on any other member."""
        sched = self.scheduler
        if sched is None:
            return None
        requests = []
        for v in sched.views()[:most]:
            first, last, n = self._pace.get(v.rid, (0.0, 0.0, 0))
            tok_s = round((n - 1) / (last - first), 2) if n >= 2 and last > first else None
            requests.append({"id": v.rid, "origin": v.origin, "state": v.state, "prompt_tokens": v.prompt_tokens,
                             "tokens": v.generated, "max_tokens": v.max_new, "tok_s": tok_s})  # fmt: skip
        return {"slots": sched.slots, "active": sched.active, "queued": sched.queued,
                "max_queued": sched.max_queue, "requests": requests,
                "micro_batches": self._batches.sizes if self.batch else []}  # fmt: skip

    def _account(self, act: Activation) -> None:
        started = self._step_started.pop(act.rid, None)
        self._step_rows.pop(act.rid, None)
        if started is None:
            return
        step_ms = (time.perf_counter() - started) * 1000
        self.scheduler.observe_step(act.rid, act.n, step_ms)  # what choosing K is fed
        if act.n != 1:
            return  # the figures below are of 1-position decode steps: a prefill's cost grows
        compute = sum(us for _, us in act.trace) / 1000
        for stage, us in act.trace[1:]:
            self._measure(stage, us)
        m = self.measured
        m.step_ms = step_ms if m.step_ms is None else m.step_ms + EMA * (step_ms - m.step_ms)
        net = max(0.0, step_ms - compute)
        m.network_ms = net if m.network_ms is None else m.network_ms + EMA * (net - m.network_ms)

    async def _emit(self, events) -> None:
        for ev in events:
            if isinstance(ev, TokenOut):
                now = time.perf_counter()
                first, _, n = self._pace.get(ev.rid, (now, now, 0))
                self._pace[ev.rid] = (first, now, n + 1)
                await self._to_origin(Tokens(ev.rid, ev.origin, (ev.token,)))
            elif isinstance(ev, Finished):
                self._batches.leave(ev.rid)
                self._step_started.pop(ev.rid, None)
                self._step_rows.pop(ev.rid, None)
                self._sampling.pop(ev.rid, None)
                self._pace.pop(ev.rid, None)
                if self.drafter is not None:
                    self.drafter.release(ev.rid)
                if ev.finish == "cancelled":
                    continue
                finish = ev.finish
                stats = self.measured.as_pairs() + (ev.spec.as_pairs() if ev.spec else ())
                frame = Tokens(ev.rid, ev.origin, (), True, finish, ev.error[:500], ev.status, stats)
                await self._to_origin(frame)
            elif isinstance(ev, SlotFreed):
                await self._compute(self.slots.free, ev.slot)
                if self.out is not None and not self.degraded:
                    await self._send(Free(ev.slot))

    async def _to_origin(self, frame: Tokens) -> None:
        if frame.dst == self.name:
            self._deliver(frame)
        elif not self.degraded:
            await self._send(frame)
        else:  # a broken ring may still carry it part of the way; the host tells the rest
            with contextlib.suppress(StreamClosed):
                await self._send(frame)
