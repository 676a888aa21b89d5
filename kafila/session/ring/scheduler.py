"""The head's request scheduler: which request feeds which positions into which slot, when.

Theory of operation. The head owns `slots` ring slots (the session's concurrency); every stage
keeps one KV state per ring slot. A submitted request waits FIFO for a free slot. Each request
with a slot and no step in flight is given the next Step: first its whole prompt (prefill), then
its last sampled token (decode). Several requests can be in flight round the ring at once, each
in its own slot, so concurrent requests interleave and each gets exactly the tokens it gets
alone. A prompt longer than `chunk_tokens` is fed in several steps: the first of that many
positions, the rest of `chunks.later_chunk_tokens` (chunked prefill: every activation frame fits the
frame limit and no stage runs an unbounded batch; see `chunks.prefill_chunk_tokens`); only the step
with its last position samples a token. When a step returns, `complete(req_id, token)` records the greedy token and says whether the
request is over (EOS, max_new or the context). Positions are logical and the mask is physical
(the OpenVINO paper's mask-based rewind); the bookkeeping (cache_len, pos, zeros) travels in
every activation so stages stay stateless about it.

Speculation (`speculate="ngram"`, see speculate.py): a decode step may carry K draft tokens
after the last one (K+1 positions), K chosen per request and step from the measured trip times
(`observe_step`) and the request's running acceptance; the head verifies the step's rows
(speculate.verify: greedy or speculative sampling) and `complete` takes the tokens it yielded
(the accepted drafts and one more), adding the rejected drafts' physical positions to the
request's `zeros`, so every stage masks them out from the next step on. Drafting keeps enough
physical room that a request never runs out of context earlier than it would without it.
With `speculate="origin"` the drafts come from the member where the request was typed
(`offer_draft`, origin.py) when its latest one is aligned with the history, else from n-grams.

States of a request: QUEUED → ACTIVE (has a slot) ⇄ IN_FLIGHT → DONE; cancel or fail from any.
Fairness: slots go to queued requests in arrival order, and every active request without a step
in flight gets one each time steps() runs, so none waits behind another's whole answer. A
request submitted while `max_queue` others already wait for a slot is refused with status 429
(QUEUE_FULL_STATUS): nothing of it was taken, and the requests admitted before are untouched.
No I/O, no clocks: the caller feeds events and carries out the returned actions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from backends.kept import kept_after
from kafila.session.ring.chunks import next_chunk
from kafila.session.wire.fields import MAX_ORIGIN_DRAFT
from kafila.session.ring.speculation.origin import aligned_draft
from kafila.session.ring.prefix import WHOLE, ParkedSlots
from kafila.session.ring.speculation.speculate import (
    DRAFT_K,
    MAX_DRAFT_K,
    SPECULATE_MODES,
    Acceptance,
    SpecStats,
    StepCost,
    choose_k,
    ngram_draft,
)  # fmt: skip

QUEUE_FULL_STATUS = 429  # the queue is full: the API answers Too Many Requests with Retry-After


class SchedulerError(Exception):
    """A request the head refuses; `status` is the HTTP status the origin answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Step:
    """Feed `tokens` (logical positions pos0..) into `slot` after `cache_len` physical positions."""

    req_id: str
    slot: int
    tokens: np.ndarray  # int64 [n]
    cache_len: int
    pos0: int
    zeros: tuple[int, ...]
    drafted: int = 0  # the last `drafted` tokens are drafts to verify (0: a plain step)
    want_draft: int = 0  # speculate="draft": the head asks its drafter for this many, then attach_draft
    keep: bool = False  # the prompt's last step on a hybrid: every stage keeps the state after it (prefix.py)

    def positions(self) -> np.ndarray:
        """The logical positions of the step's tokens (frames.Activation carries the same)."""
        return np.arange(self.pos0, self.pos0 + len(self.tokens), dtype=np.int64)

    def mask(self) -> np.ndarray:
        """Ones over the slot's physical positions and the new ones, but the masked-out `zeros`."""
        m = np.ones(self.cache_len + len(self.tokens), dtype=np.int64)
        if self.zeros:
            m[list(self.zeros)] = 0
        return m


@dataclass(frozen=True)
class TokenOut:
    req_id: str
    origin: str
    token: int


@dataclass(frozen=True)
class Finished:
    req_id: str
    origin: str
    finish: str  # "stop" | "length" | "error" | "cancelled"
    error: str = ""
    status: int = 0
    spec: SpecStats | None = None  # the request's speculation counts (None: it did not speculate)
    cached: int = 0  # prompt tokens found in its slot's KV already (prompt caching: prefix.py)


@dataclass(frozen=True)
class SlotFreed:
    slot: int
    parked: bool = False  # its KV stays on every stage for a prompt that starts the same way


Event = TokenOut | Finished | SlotFreed


@dataclass
class _Request:
    req_id: str
    origin: str
    prompt: tuple[int, ...]
    max_new: int
    stop_at_eos: bool
    slot: int | None = None
    cache_len: int = 0
    pos: int = 0
    generated: list[int] = field(default_factory=list)
    in_flight: int = 0  # positions of the step in flight (0: none)
    cancelled: bool = False
    speculate: bool = False
    zeros: list[int] = field(default_factory=list)  # masked-out physical positions
    draft: tuple[int, ...] = ()  # the drafts of the step in flight
    want_draft: int = 0  # speculate="draft": the drafts asked of the head's drafter (attach_draft)
    offered: tuple[int, tuple[int, ...]] | None = None  # speculate="origin": the origin's latest (base, draft)
    spec: SpecStats = field(default_factory=SpecStats)
    acceptance: Acceptance = field(default_factory=Acceptance)
    cached: int = 0  # prompt tokens its slot held already (prompt caching)
    refeed: tuple[int, ...] = ()  # after a compaction: the history fed again into the reset slot
    kept: tuple[int, ...] = ()  # hybrids: the physical positions whose recurrent states every stage keeps
    keep_at: int = 0  # hybrids: the prompt position to keep the state at (0: the prompt's end)
    keeping: bool = False  # the step in flight keeps the state after it (Step.keep)

    @property
    def target(self) -> tuple[int, ...]:
        """What the slot must hold before the request decodes: its prompt, or after a
        compaction its whole history."""
        return self.refeed or self.prompt


class Scheduler:
    def __init__(self, slots: int, context: int, eos_ids: frozenset[int] = frozenset(),
                 max_queue: int = 64, chunk_tokens: int = 512, speculate: str = "off",
                 draft_k: int = DRAFT_K, adaptive_k: bool = True, prompt_cache: bool | str = True,
                 recurrent: bool = False) -> None:  # fmt: skip
        """`draft_k`: the most drafts a step carries; `adaptive_k` False drafts that many
        whenever the drafter finds them (tests of verification), True lets choose_k decide.
        `prompt_cache`: a finished request's slot keeps its KV for a prompt that starts the same
        way (prefix.py); off, every request starts in a reset slot. `recurrent` (hybrid models:
        masking cannot rewind their state): rejected drafts are cut off, not masked (every stage
        cuts back inside the step), and the prompt cache continues whole histories, or the history
        up to the end of the last prompt, whose state every stage keeps (Step.keep)."""
        if speculate not in SPECULATE_MODES:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, not {speculate!r}")
        if not 0 <= draft_k <= MAX_DRAFT_K:
            raise ValueError(f"draft_k must be in 0..{MAX_DRAFT_K}")
        self.speculate = speculate
        self.draft_k = draft_k
        self.adaptive_k = adaptive_k
        self.spec = SpecStats()  # every finished request's counts
        self.step_cost = StepCost()  # decode trips' measured ms by position count
        self.acceptance = Acceptance()  # every request's trips: a new request's prior
        self.planned: dict[str, int] = {}  # req_id → draft length the live optimiser chose (dipsd_live)
        if max_queue < 0:
            raise ValueError("max_queue cannot be negative")
        if slots < 1 or context < 2:
            raise ValueError("a scheduler needs at least one slot and a context of two positions")
        if chunk_tokens < 1:
            raise ValueError("a prefill chunk holds at least one position")
        self.chunk_tokens = chunk_tokens
        self.slots = slots
        self.context = context
        self.eos_ids = eos_ids
        self.max_queue = max_queue
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.prompt_cache = bool(prompt_cache)
        self.recurrent = recurrent
        self._parked = ParkedSlots(whole=prompt_cache == WHOLE or recurrent)  # prompt caching
        self._keeps = self.prompt_cache and self._parked.whole  # a state kept where each prompt's messages end
        self._queue: deque[str] = deque()
        self._requests: dict[str, _Request] = {}

    # --- inputs ------------------------------------------------------------------------------

    def submit(self, req_id: str, origin: str, prompt: list[int] | tuple[int, ...], max_new: int,
               stop_at_eos: bool = True, speculate: bool = True, keep_at: int = 0) -> None:  # fmt: skip
        """`speculate`: whether this request may speculate (when the session does; greedy only);
        `keep_at`: hybrids, where in the prompt every stage keeps the state (0: at its end)."""
        if req_id in self._requests:
            raise SchedulerError(f"request id {req_id} is already in use")
        if not prompt:
            raise SchedulerError("the prompt is empty")
        if len(prompt) >= self.context:
            raise SchedulerError(
                f"the prompt has {len(prompt)} tokens; this session's context is {self.context} "
                "(prompt and answer together): shorten it"
            )
        if max_new < 1:
            raise SchedulerError("max_new_tokens must be at least 1")
        # queued requests not yet given a free slot (steps() admits them) do not count as waiting
        if len(self._queue) + 1 > self.max_queue + self.free_slots:
            raise SchedulerError(f"all {self.slots} slots are busy and {len(self._queue)} requests are "
                                 "already waiting: try again shortly", QUEUE_FULL_STATUS)  # fmt: skip
        max_new = min(max_new, self.context - len(prompt))
        self._requests[req_id] = _Request(req_id, origin, tuple(int(t) for t in prompt), max_new, stop_at_eos,
                                       speculate=bool(speculate) and self.speculate != "off" and self.draft_k > 0,
                                       acceptance=Acceptance(prior=self.acceptance.as_prior()), keep_at=keep_at)  # fmt: skip
        self._queue.append(req_id)

    def steps(self) -> list[Step]:
        """Every step that can start now (admitting queued requests into free slots)."""
        while self._queue and self.free_slots:
            self._admit(self._requests[self._queue.popleft()])
        out = []
        for req in self._requests.values():
            if req.slot is None or req.in_flight or req.cancelled:
                continue
            done = req.pos  # logical: the prompt tokens in the slot (a cached prefix included)
            target = req.target
            if done < len(target):  # prefill, one chunk at a time; a hybrid's stages keep the state at one point
                keep_at = self._keeps and req.cached < req.keep_at < len(target) and not req.refeed
                at = req.keep_at if keep_at else len(target)
                end = done + next_chunk(done, self.chunk_tokens)
                feed = target[done : at if done < at < end else end]
                req.in_flight, req.keeping = len(feed), self._keeps and done + len(feed) == at
                out.append(self._step(req, feed, keep=req.keeping))
                continue
            if self.speculate == "draft" and (k := self._draft_k(req)):
                req.in_flight, req.want_draft = 1, k  # the step is the head's until attach_draft
                out.append(self._step(req, (req.generated[-1],), want_draft=k))
                continue
            else:
                req.draft = self._draft(req)
                feed = (req.generated[-1], *req.draft)
            req.in_flight = len(feed)
            out.append(self._step(req, feed))
        return out

    def _admit(self, req: _Request) -> None:
        """Give `req` a slot: a parked one whose KV its prompt continues, else one nobody used,
        else the least recently parked one, with the prefix they share (prefix.py)."""
        room = self.context - len(req.prompt)
        reuse = self._parked.best(req.prompt, room) if self.prompt_cache else None
        if reuse is None and self._free:
            req.slot = self._free.pop()
            return
        if reuse is None:
            req.slot, reuse = self._parked.evict(req.prompt, room)
            if reuse is None or not self.prompt_cache:
                return  # its first step (cache_len 0) resets the slot on every stage
        req.slot, req.cache_len, req.pos, req.cached = reuse.slot, reuse.cache_len, reuse.shared, reuse.shared
        req.zeros, req.kept = list(reuse.zeros), reuse.kept

    def _step(self, req: _Request, feed, want_draft: int = 0, keep: bool = False) -> Step:
        return Step(req.req_id, req.slot, np.array(feed, dtype=np.int64), req.cache_len, req.pos,
                    tuple(req.zeros), len(req.draft), want_draft, keep)  # fmt: skip

    def attach_draft(self, req_id: str, draft: tuple[int, ...]) -> Step | None:
        """The drafter's proposals for a step that asked for them (`Step.want_draft`): the step
        to send (its last token and the drafts); None if the request ended meanwhile."""
        req = self._requests.get(req_id)
        if req is None or req.in_flight != 1:
            return None  # it failed meanwhile: nothing of it may go round
        # a request cancelled meanwhile still sends its plain step: it ends when the step is back
        req.draft = () if req.cancelled else tuple(int(t) for t in draft)[: req.want_draft]
        req.want_draft = 0
        if not req.draft:
            req.acceptance.idle()
        req.in_flight = 1 + len(req.draft)
        return self._step(req, (req.generated[-1], *req.draft))

    def history(self, req_id: str) -> tuple[int, ...]:
        """A request's prompt and the tokens it has been given so far."""
        return self._history(self._requests[req_id])

    @staticmethod
    def _history(req: _Request) -> tuple[int, ...]:
        return req.prompt + tuple(req.generated)

    def _draft_k(self, req: _Request) -> int:
        """How many drafts `req`'s next decode step may carry. K is bounded by the tokens still
        wanted and by the physical room: room − K − 1 ≥ tokens still wanted keeps the invariant
        room ≥ wanted (a step of K drafts uses K+1 positions and yields at least one token), so
        speculation never ends a request earlier than plain decoding would. Within that bound the
        live optimiser's length for the request (`planned`, several speculating: dipsd_live.py)
        decides, else choose_k."""
        if not req.speculate:
            return 0
        wanted = req.max_new - len(req.generated)
        room = self.context - req.cache_len
        k = min(self.draft_k, wanted - 1, room - wanted - 1)
        if k >= 1 and self.adaptive_k:
            planned = self.planned.get(req.req_id)
            k = min(k, planned) if planned is not None else choose_k(req.acceptance.rate, self.step_cost, k)
        return max(k, 0)

    def _draft(self, req: _Request) -> tuple[int, ...]:
        """The drafts of `req`'s next decode step (at most _draft_k of them): the origin's latest
        draft when it is aligned with the history (speculate="origin"), else n-grams."""
        k = self._draft_k(req)
        if k < 1:
            req.acceptance.idle()
            return ()
        history = self._history(req)
        draft: tuple[int, ...] = ()
        if self.speculate == "origin":
            if req.offered is not None:
                draft = aligned_draft(history, *req.offered, k)
            if draft:
                req.spec.origin += 1
            else:
                req.spec.fallback += 1
        if not draft:
            draft = ngram_draft(history, k)
        if not draft:
            req.acceptance.idle()
        return draft

    def offer_draft(self, req_id: str, base: int, tokens) -> bool:
        """The origin member's latest draft of `req_id`, continuing its first `base` tokens
        (speculate="origin"). Kept if it is one: 1..MAX_ORIGIN_DRAFT non-negative ids after a
        history the head has produced (`base` ≤ its length), not older than the one kept;
        False (and nothing kept) otherwise. Whether it is still aligned is for the next step."""
        req = self._requests.get(req_id)
        if req is None or not req.speculate or self.speculate != "origin":
            return False
        toks = tuple(tokens)
        if not isinstance(base, int) or isinstance(base, bool) or not 1 <= len(toks) <= MAX_ORIGIN_DRAFT:
            return False
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in toks):
            return False
        if not 0 < base <= len(req.prompt) + len(req.generated):
            return False
        if req.offered is not None and base < req.offered[0]:
            return False
        req.offered = (base, tuple(int(t) for t in toks))
        return True

    def observe_step(self, req_id: str, positions: int, ms: float) -> None:
        """The head measured `req_id`'s step in flight round the ring: `ms` for `positions`
        positions. Decode steps only (a prefill chunk's cost grows with its length)."""
        req = self._requests.get(req_id)
        if req is not None and req.in_flight and req.pos >= len(req.target):
            self.step_cost.observe(positions, ms)

    def decoding(self, req_id: str) -> bool:
        """Whether `req_id`'s step in flight is a decode step (not a prefill chunk)."""
        req = self._requests.get(req_id)
        return req is not None and req.in_flight > 0 and req.pos >= len(req.target)

    def draft_of(self, req_id: str) -> tuple[int, ...]:
        """The drafts in `req_id`'s step in flight: the head verifies a row per position."""
        req = self._requests.get(req_id)
        return () if req is None or not req.in_flight else req.draft

    def drafted(self, req_id: str) -> int:
        return len(self.draft_of(req_id))

    def wants_token(self, req_id: str) -> bool:
        """Whether the step of `req_id` in flight ends with a sampled token (not a prefill chunk
        before the prompt's last one): the head skips lm_head for the others."""
        req = self._requests.get(req_id)
        return req is not None and req.in_flight > 0 and req.pos + req.in_flight >= len(req.target)

    def complete(self, req_id: str, token) -> list[Event]:
        """A step of `req_id` came back round the ring and the head sampled `token` (None, and
        ignored, for a prefill chunk before the last). For a step with drafts, `token` is the
        sequence the head's verification yielded (speculate.verify): the accepted drafts, then
        one token of the model's own (1 ..drafted + 1 tokens)."""
        req = self._requests.get(req_id)
        if req is None or not req.in_flight:
            return []  # a request already failed or cancelled: ignore its late step
        fed, draft = req.in_flight, req.draft
        if draft:  # checked before anything changes: a wrong call leaves the step in flight
            tokens = tuple(int(t) for t in np.atleast_1d(token)) if token is not None else ()
            if not 1 <= len(tokens) <= len(draft) + 1 or tokens[:-1] != tuple(draft[: len(tokens) - 1]):
                raise ValueError(f"request {req_id}'s step with {len(draft)} drafts needs its accepted drafts "
                                 f"and one more token, got {list(tokens)}")  # fmt: skip
        req.draft, req.in_flight = (), 0
        if draft:
            kept = len(tokens)  # positions that stay live: the last token and the accepted drafts
            if self.recurrent:  # cut off, not masked: the next step builds on the kept ones
                fed = kept
            req.zeros.extend(range(req.cache_len + kept, req.cache_len + fed))  # none when cut off
            req.spec.add(len(draft), kept)
            req.acceptance.add(len(draft), kept - 1)
            self.acceptance.add(len(draft), kept - 1)
        else:
            kept = fed
            tokens = None if token is None else (int(token),)
            if req.speculate and req.pos >= len(req.target):
                req.spec.add(0, 1)
        req.cache_len += fed
        req.pos += kept
        if req.keeping:  # the step kept the state there on every stage (Step.keep)
            req.kept, req.keeping = kept_after(req.kept, req.cache_len), False
        if req.cancelled:
            return self._finish(req, "cancelled")
        if req.pos < len(req.target):
            return []  # more of the prompt to feed
        if tokens is None:
            raise ValueError(f"the step that ends request {req_id}'s prompt needs a token")
        events: list[Event] = []
        for t in tokens:
            if req.stop_at_eos and t in self.eos_ids:
                return events + self._finish(req, "stop")
            req.generated.append(t)
            events.append(TokenOut(req_id, req.origin, t))
            if len(req.generated) >= req.max_new or req.pos >= self.context:
                return events + self._finish(req, "length")
        if req.cache_len >= self.context:
            self._compact(req)
        return events

    def _compact(self, req: _Request) -> None:
        """The slot is full but masked positions hold part of it (a cached prefix's tail, or
        rejected drafts) and the request has room left: its next steps feed its whole history
        into the slot again from position 0 (the stages reset it), then it decodes on. So a
        cached prefix never ends an answer earlier than a fresh slot would."""
        req.refeed = req.prompt + tuple(req.generated)
        req.cache_len = req.pos = 0
        req.zeros, req.kept = [], ()  # the stages reset the slot, kept states and all

    def cancel(self, req_id: str) -> list[Event]:
        req = self._requests.get(req_id)
        if req is None:
            return []
        if req.in_flight:
            req.cancelled = True  # finished when its step returns, so the slot is not reused under it
            return []
        return self._finish(req, "cancelled")

    def fail(self, req_id: str, reason: str, status: int = 500) -> list[Event]:
        """One request cannot go on (e.g. a frame of it over a bound): it alone ends with
        `reason` and its slot is free again. Only for a request with no step on the ring (its
        step was never sent), so nothing of it can reach a stage after the slot is reused."""
        req = self._requests.get(req_id)
        return [] if req is None else self._finish(req, "error", reason, status)

    def fail_all(self, reason: str, status: int = 503) -> list[Event]:
        """The ring broke: every request ends with `reason`; every slot is free again (and no
        parked KV is trusted: the next ring's stages start empty)."""
        events: list[Event] = []
        for req in list(self._requests.values()):
            events += self._finish(req, "error", reason, status)
        self._free.extend(self._parked.clear())
        return events

    # --- state -------------------------------------------------------------------------------

    def _finish(self, req: _Request, finish: str, error: str = "", status: int = 0) -> list[Event]:
        del self._requests[req.req_id]
        self.planned.pop(req.req_id, None)
        spec = req.spec if req.speculate else None
        if spec is not None:
            self.spec.merge(spec)
        events: list[Event] = [Finished(req.req_id, req.origin, finish, error, status, spec, req.cached)]
        if req.slot is None:
            self._queue.remove(req.req_id)
        elif self.prompt_cache and finish != "error":  # the stages keep its KV: prefix.py
            # its visible positions hold its history as fed, logical position i its token i
            self._parked.park(req.slot, self._history(req)[: req.pos], req.zeros, len(req.prompt), req.kept)
            events.append(SlotFreed(req.slot, parked=True))
        else:
            self._free.append(req.slot)
            events.append(SlotFreed(req.slot))
        return events

    @property
    def active(self) -> int:
        return sum(1 for r in self._requests.values() if r.slot is not None)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def free_slots(self) -> int:
        """Slots a request may take now: unused ones and parked ones (prompt caching)."""
        return len(self._free) + len(self._parked)

    @property
    def parked(self) -> int:
        """Slots holding a finished request's KV for a prompt that starts the same way."""
        return len(self._parked)

    def parked_slots(self) -> list[int]:
        return self._parked.slots()

    def speculating(self) -> list[tuple[str, float, str]]:
        """(req_id, α, origin) of every request with a slot that may draft (the live optimiser's users)."""
        return [(r.req_id, r.acceptance.rate, r.origin) for r in self._requests.values()
                if r.speculate and r.slot is not None and not r.cancelled]  # fmt: skip

    def in_flight(self) -> list[str]:
        return [r.req_id for r in self._requests.values() if r.in_flight]

    def views(self) -> list[RequestView]:
        """Every request the head holds, in arrival order (for /status)."""
        return [RequestView(r.req_id, r.origin, _state(r), len(r.prompt), len(r.generated), r.max_new)
                for r in self._requests.values()]  # fmt: skip


@dataclass(frozen=True)
class RequestView:
    """One request as /status shows it: `state` is queued, prefill or decode."""

    req_id: str
    origin: str
    state: str
    prompt_tokens: int
    generated: int
    max_new: int


def _state(req: _Request) -> str:
    if req.slot is None:
        return "queued"
    return "prefill" if req.pos < len(req.target) else "decode"
