"""RingEngine: the Engine protocol (kafila/engine/__init__.py) over a ring session, on every member.

Resume at the origin. The member where a prompt was typed knows the prompt and every token it
has streamed back, so when its ring breaks for a replan (a member left) it keeps the client's
stream open, waits for the new ring (`set_node`) and submits prompt + received tokens as the new
prompt, asking for what is left of max_new (stop conditions unchanged). Greedy answers then
continue exactly where they stopped: token-identical at f32; at serving precision a replayed
prefill computes in another batching and may differ at a near-tie. A sampled (temperature > 0)
answer continues from a fresh draw of its seed, so it is a valid sample but not the same one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from kafila.engine import EngineError, GenerationRequest, GenerationStats
from kafila.session.wire.frames import Tokens
from kafila.session.ring.node import RingNode
from kafila.session.ring.scheduler import SchedulerError
from kafila.session.ring.prefix import cached_of
from kafila.session.ring.speculation.speculate import SpecStats
from kafila.session.wire.streams import StreamClosed

log = logging.getLogger(__name__)

RESUME_WAIT_S = 120.0  # how long a request waits for the ring to come back after a break
# The head's failure of a request can reach its origin (travelling the rest of a broken ring)
# before the origin's own node learns the ring broke: wait this long for that before failing it.
BREAK_GRACE_S = 5.0


class RingEngine:
    """Prompts typed at this member go to the head; its tokens come back as they are produced.

    Temperature 0 is greedy and reproduces `kafila run` token for token; otherwise the head
    samples from its logits (top_p nucleus, seeded when asked), as LocalEngine does.
    `resume_wait_s` > 0: requests survive a ring break by resuming on the next ring (above);
    0: they fail with the break's reason (a ring nobody replans)."""

    def __init__(self, model_name: str, context_length: int, tokenizer, status: Callable[[], dict],
                 resume_wait_s: float = 0.0) -> None:  # fmt: skip
        self.model_name = model_name
        self.context_length = context_length
        self._tokenizer = tokenizer
        self._status = status
        self.node: RingNode | None = None  # set when the ring is up (set_node)
        self.last_stats: GenerationStats | None = None
        self.resume_wait_s = resume_wait_s
        self.ended: str | None = None  # the session is over: nothing resumes (end)
        self.resumed = 0  # requests resumed on a new ring (status, tests)
        self._changed = asyncio.Event()  # pulsed when the ring is replaced or the session ends

    @property
    def ready(self) -> bool:
        return self.node is not None and self.node.degraded is None and self.ended is None

    def tokenizer(self):
        return self._tokenizer

    def set_node(self, node: RingNode) -> None:
        """A (new) ring serves: requests waiting to resume go on on it."""
        self.node = node
        self._pulse()

    def end(self, reason: str) -> None:
        """The session is over: requests waiting for a ring fail with `reason`."""
        self.ended = self.ended or reason
        self._pulse()

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _healthy_node(self, broken: RingNode | None, deadline: float) -> RingNode:
        """The serving ring, once there is one other than `broken` (waiting until `deadline`)."""
        while True:
            if self.ended:
                raise EngineError(f"the session is over: {self.ended}", 503)
            node = self.node
            if node is not None and node is not broken and node.degraded is None:
                return node
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"the ring did not come back within {self.resume_wait_s:g} s after "
                                  f"it broke ({(broken or node).degraded if (broken or node) else 'forming'})",
                                  503)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def _ring_broke(self, node: RingNode, item: Tokens) -> bool:
        """Whether `item` (a failure) is the ring breaking under the request, so it may resume."""
        if self.resume_wait_s <= 0 or self.ended or item.status != 503:
            return False
        deadline = time.monotonic() + BREAK_GRACE_S
        while node.degraded is None and self.node is node and not self.ended:
            if time.monotonic() >= deadline:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.1)
        return not self.ended

    async def generate(self, request: GenerationRequest, stats: GenerationStats) -> AsyncIterator[int]:
        node = self.node
        if node is None:
            raise EngineError("the session is not ready yet (forming); try again shortly", 503)
        if self.ended:
            raise EngineError(f"the session is over: {self.ended}", 503)
        if node.degraded and self.resume_wait_s <= 0:
            raise EngineError(f"the session is degraded: {node.degraded}", 503)
        stats.prompt_tokens = len(request.prompt_ids)
        if len(request.prompt_ids) >= self.context_length:
            raise EngineError(
                f"the prompt has {len(request.prompt_ids)} tokens; the session's context is "
                f"{self.context_length} (prompt and answer together)", 400)  # fmt: skip
        stats.started_s = time.perf_counter()
        got: list[int] = []  # every token streamed back so far: what a resume replays
        broken: RingNode | None = None
        while True:
            # a request that finds the ring replanning waits for it, as one in flight does
            node = await self._healthy_node(broken, time.monotonic() + self.resume_wait_s)
            if broken is not None:
                self.resumed += 1
                stats.extra["resumed"] = stats.extra.get("resumed", 0) + 1
            prompt, max_new = list(request.prompt_ids) + got, request.max_new_tokens - len(got)
            if max_new < 1 or len(prompt) >= self.context_length:
                stats.finish_reason = "length"  # it had every token; only the end was lost
                return
            try:
                req_id, waiter = await self._submit(node, request, prompt, max_new)
            except EngineError as exc:
                if exc.status == 503 and node.degraded and self.resume_wait_s > 0 and not self.ended:
                    broken = node  # the ring broke as it was asked: wait for the next one
                    continue
                raise
            done = False
            try:
                while True:
                    item = await waiter.queue.get()
                    if not isinstance(item, Tokens):
                        got.append(item)
                        stats.count_token(time.perf_counter())
                        yield item
                        continue
                    done = True
                    if item.finish == "error":
                        if await self._ring_broke(node, item):
                            broken = node
                            break  # resume on the next ring
                        stats.finish_reason = "error"
                        raise EngineError(item.error or "the request failed", item.status or 503)
                    stats.finish_reason = item.finish or "length"
                    spec = SpecStats.from_pairs(item.stats)
                    if spec is not None:
                        stats.extra["speculation"] = spec.as_dict()
                    cached = cached_of(item.stats)
                    if cached is not None:
                        stats.extra["cached_tokens"] = min(cached, len(request.prompt_ids))
                    return
            finally:
                if not done:
                    try:
                        await node.cancel(req_id)
                    except (StreamClosed, ConnectionError, OSError) as exc:  # the ring it ran on is gone
                        log.debug("request %s not cancelled on the ring: %r", req_id, exc)
                    except Exception as exc:  # noqa: BLE001 (a bug: said, and the request still ends)
                        log.warning("request %s: cancelling it on the ring failed: %r", req_id, exc)
                stats.extra["request_id"] = req_id
                self.last_stats = stats
                if stats.tok_s is not None:
                    node.measured.tok_s = stats.tok_s

    async def _submit(self, node: RingNode, request: GenerationRequest, prompt: list[int], max_new: int):
        try:
            return await node.submit(prompt, max_new, request.stop_at_eos, request.temperature,
                                     getattr(request, "top_p", 1.0), request.seed,
                                     getattr(request, "speculate", True), getattr(request, "keep_at", 0))  # fmt: skip
        except SchedulerError as exc:
            raise EngineError(str(exc), exc.status) from None
        except StreamClosed as exc:
            node.degrade(f"the ring edge from {node.name} to the next member closed ({exc})")
            raise EngineError(f"the session is degraded: {node.degraded}", 503) from None

    def status(self) -> dict:
        return self._status()
