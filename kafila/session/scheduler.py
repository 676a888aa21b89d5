"""The head's request scheduler: which request feeds which positions into which slot, when.

Theory of operation. The head owns `slots` ring slots (the session's concurrency); every stage
keeps one KV state per ring slot. A submitted request waits FIFO for a free slot. Each request
with a slot and no step in flight is given the next Step: first its whole prompt (prefill), then
its last sampled token (decode). Several requests can be in flight round the ring at once, each
in its own slot, so concurrent requests interleave and each gets exactly the tokens it gets
alone. A prompt longer than `chunk_tokens` is fed in several steps of at most that many
positions (chunked prefill: every activation frame fits the frame limit and no stage runs an
unbounded batch; see `prefill_chunk_tokens`); only the step with its last position samples a
token. When a step returns, `complete(rid, token)` records the greedy token and says whether the
request is over (EOS, max_new or the context). Positions are logical and the mask is physical
(the OpenVINO paper's mask-based rewind); without speculation nothing is ever masked out, but
the bookkeeping (cache_len, pos, zeros) travels in every activation so stages stay stateless
about it.

States of a request: QUEUED → ACTIVE (has a slot) ⇄ IN_FLIGHT → DONE; cancel or fail from any.
No I/O, no clocks: the caller feeds events and carries out the returned actions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kafila.session.frames import MAX_FRAME_BYTES

F32_BYTES = 4
# A stage's transient working set while it runs n positions: the residual, its norm, q/k/v/o and
# the FFN's gate/up/act/down intermediates are about PREFILL_WORK_WIDTHS hidden-wide float32 rows
# per position (FFN ≈ 3.5 × hidden, three of them). PREFILL_WORK_BYTES bounds that working set.
PREFILL_WORK_WIDTHS = 16
PREFILL_WORK_BYTES = 128 << 20


def prefill_chunk_tokens(hidden: int, frame_bytes: int = MAX_FRAME_BYTES,
                         work_bytes: int = PREFILL_WORK_BYTES) -> int:  # fmt: skip
    """The most prompt positions one prefill step feeds (the rule, in one place):

        n × hidden × 4 B                          ≤ frame_bytes   (one activation frame)
        n × hidden × 4 B × PREFILL_WORK_WIDTHS    ≤ work_bytes    (one stage's working set)

    hidden 4096 → 512 positions a step, 2048 → 1024, 576 → 3640; at least 1."""
    row = hidden * F32_BYTES
    return max(1, min(frame_bytes // row, work_bytes // (row * PREFILL_WORK_WIDTHS)))


class SchedulerError(Exception):
    """A request the head refuses; `status` is the HTTP status the origin answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Step:
    """Feed `tokens` (logical positions pos0..) into `slot` after `cache_len` physical positions."""

    rid: str
    slot: int
    tokens: np.ndarray  # int64 [n]
    cache_len: int
    pos0: int
    zeros: tuple[int, ...]


@dataclass(frozen=True)
class TokenOut:
    rid: str
    origin: str
    token: int


@dataclass(frozen=True)
class Finished:
    rid: str
    origin: str
    finish: str  # "stop" | "length" | "error" | "cancelled"
    error: str = ""
    status: int = 0


@dataclass(frozen=True)
class SlotFreed:
    slot: int


Event = TokenOut | Finished | SlotFreed


@dataclass
class _Request:
    rid: str
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


class Scheduler:
    def __init__(self, slots: int, context: int, eos_ids: frozenset[int] = frozenset(),
                 max_queue: int = 64, chunk_tokens: int = 512) -> None:  # fmt: skip
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
        self._queue: deque[str] = deque()
        self._requests: dict[str, _Request] = {}

    # --- inputs ------------------------------------------------------------------------------

    def submit(self, rid: str, origin: str, prompt: list[int] | tuple[int, ...], max_new: int,
               stop_at_eos: bool = True) -> None:  # fmt: skip
        if rid in self._requests:
            raise SchedulerError(f"request id {rid} is already in use")
        if not prompt:
            raise SchedulerError("the prompt is empty")
        if len(prompt) >= self.context:
            raise SchedulerError(
                f"the prompt has {len(prompt)} tokens; this session's context is {self.context} "
                "(prompt and answer together): shorten it"
            )
        if max_new < 1:
            raise SchedulerError("max_new_tokens must be at least 1")
        if len(self._queue) >= self.max_queue:
            raise SchedulerError(f"{len(self._queue)} requests are already waiting: try again later", 503)
        max_new = min(max_new, self.context - len(prompt))
        self._requests[rid] = _Request(rid, origin, tuple(int(t) for t in prompt), max_new, stop_at_eos)
        self._queue.append(rid)

    def steps(self) -> list[Step]:
        """Every step that can start now (admitting queued requests into free slots)."""
        while self._queue and self._free:
            req = self._requests[self._queue.popleft()]
            req.slot = self._free.pop()
        out = []
        for req in self._requests.values():
            if req.slot is None or req.in_flight or req.cancelled:
                continue
            done = req.cache_len
            if done < len(req.prompt):  # prefill, one chunk at a time
                feed = req.prompt[done : done + self.chunk_tokens]
            else:
                feed = (req.generated[-1],)
            req.in_flight = len(feed)
            out.append(Step(req.rid, req.slot, np.array(feed, dtype=np.int64), req.cache_len, req.pos, ()))
        return out

    def wants_token(self, rid: str) -> bool:
        """Whether the step of `rid` in flight ends with a sampled token (not a prefill chunk
        before the prompt's last one): the head skips lm_head for the others."""
        req = self._requests.get(rid)
        return req is not None and req.in_flight > 0 and req.cache_len + req.in_flight >= len(req.prompt)

    def complete(self, rid: str, token: int | None) -> list[Event]:
        """A step of `rid` came back round the ring and the head sampled `token` (None, and
        ignored, for a prefill chunk before the last)."""
        req = self._requests.get(rid)
        if req is None or not req.in_flight:
            return []  # a request already failed or cancelled: ignore its late step
        fed = req.in_flight
        req.in_flight = 0
        req.cache_len += fed
        req.pos += fed
        if req.cancelled:
            return self._finish(req, "cancelled")
        if req.cache_len < len(req.prompt):
            return []  # more of the prompt to feed
        if token is None:
            raise ValueError(f"the step that ends request {rid}'s prompt needs a token")
        if req.stop_at_eos and token in self.eos_ids:
            return self._finish(req, "stop")
        req.generated.append(int(token))
        events: list[Event] = [TokenOut(rid, req.origin, int(token))]
        if len(req.generated) >= req.max_new or req.cache_len >= self.context:
            events += self._finish(req, "length")
        return events

    def cancel(self, rid: str) -> list[Event]:
        req = self._requests.get(rid)
        if req is None:
            return []
        if req.in_flight:
            req.cancelled = True  # finished when its step returns, so the slot is not reused under it
            return []
        return self._finish(req, "cancelled")

    def fail(self, rid: str, reason: str, status: int = 500) -> list[Event]:
        """One request cannot go on (e.g. a frame of it over a bound): it alone ends with
        `reason` and its slot is free again. Only for a request with no step on the ring (its
        step was never sent), so nothing of it can reach a stage after the slot is reused."""
        req = self._requests.get(rid)
        return [] if req is None else self._finish(req, "error", reason, status)

    def fail_all(self, reason: str, status: int = 503) -> list[Event]:
        """The ring broke: every request ends with `reason`; every slot is free again."""
        events: list[Event] = []
        for req in list(self._requests.values()):
            events += self._finish(req, "error", reason, status)
        return events

    # --- state -------------------------------------------------------------------------------

    def _finish(self, req: _Request, finish: str, error: str = "", status: int = 0) -> list[Event]:
        del self._requests[req.rid]
        events: list[Event] = [Finished(req.rid, req.origin, finish, error, status)]
        if req.slot is None:
            self._queue.remove(req.rid)
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
        return len(self._free)

    def in_flight(self) -> list[str]:
        return [r.rid for r in self._requests.values() if r.in_flight]
