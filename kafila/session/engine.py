"""RingEngine: the Engine protocol (kafila/engine.py) over a ring session, on every member."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

from kafila.engine import EngineError, GenerationRequest, GenerationStats
from kafila.session.frames import Tokens
from kafila.session.ring import RingNode
from kafila.session.scheduler import SchedulerError
from kafila.session.speculate import SpecStats
from kafila.session.streams import StreamClosed


class RingEngine:
    """Prompts typed at this member go to the head; its tokens come back as they are produced.

    Temperature 0 is greedy and reproduces `kafila run` token for token; otherwise the head
    samples from its logits (top_p nucleus, seeded when asked), as LocalEngine does."""

    def __init__(self, model_name: str, context_length: int, tokenizer, status: Callable[[], dict]) -> None:
        self.model_name = model_name
        self.context_length = context_length
        self._tokenizer = tokenizer
        self._status = status
        self.node: RingNode | None = None  # set when the ring is up
        self.last_stats: GenerationStats | None = None

    @property
    def ready(self) -> bool:
        return self.node is not None and self.node.degraded is None

    def tokenizer(self):
        return self._tokenizer

    async def generate(self, request: GenerationRequest, stats: GenerationStats) -> AsyncIterator[int]:
        node = self.node
        if node is None:
            raise EngineError("the session is not ready yet (forming); try again shortly", 503)
        if node.degraded:
            raise EngineError(f"the session is degraded: {node.degraded}", 503)
        stats.prompt_tokens = len(request.prompt_ids)
        if len(request.prompt_ids) >= self.context_length:
            raise EngineError(
                f"the prompt has {len(request.prompt_ids)} tokens; the session's context is "
                f"{self.context_length} (prompt and answer together)", 400)  # fmt: skip
        stats.started_s = time.perf_counter()
        try:
            rid, waiter = await node.submit(
                list(request.prompt_ids), request.max_new_tokens, request.stop_at_eos,
                request.temperature, getattr(request, "top_p", 1.0), request.seed,
                getattr(request, "speculate", True))
        except SchedulerError as exc:
            raise EngineError(str(exc), exc.status) from None
        except StreamClosed as exc:
            node.degrade(f"the ring edge from {node.name} to the next member closed ({exc})")
            raise EngineError(f"the session is degraded: {node.degraded}", 503) from None
        done = False
        try:
            while True:
                item = await waiter.queue.get()
                if isinstance(item, Tokens):
                    done = True
                    if item.finish == "error":
                        stats.finish_reason = "error"
                        raise EngineError(item.error or "the request failed", item.status or 503)
                    stats.finish_reason = item.finish or "length"
                    spec = SpecStats.from_pairs(item.stats)
                    if spec is not None:
                        stats.extra["speculation"] = spec.as_dict()
                    break
                stats.count_token(time.perf_counter())
                yield item
        finally:
            if not done:
                with contextlib.suppress(Exception):
                    await node.cancel(rid)
            stats.extra["request_id"] = rid
            self.last_stats = stats
            if stats.tok_s is not None:
                node.measured.tok_s = stats.tok_s

    def status(self) -> dict:
        return self._status()
