"""An Engine over one process's chain of shards (kafila.engine.chain.LocalChain).

Theory of operation. Everything that touches the model runs on one worker thread, so the event
loop never blocks and shards never see two calls at once. Each request gets its own slot (its
own KV state on every stage) and a step iterator that yields its greedy tokens one by one; each
`next()` is one job on the worker. Requests with a slot take turns on the worker's FIFO queue,
so concurrent requests interleave token by token, and each gets exactly the tokens it gets
alone because slots share nothing. At most `max_slots` requests hold a slot; the others wait
(FIFO, at most `max_queued`). A request that ends early — a stop sequence, a client that hung
up — closes its iterator on the worker, which frees the slot before the next request opens one.
With prompt caching (the default) a finished request's cursor keeps its KV instead, and a prompt
that starts the same way feeds only the rest (prompt_cache.py: the session head's rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import backends
from backends.errors import BadInput
from backends.kept import continues_whole
from kafila.engine import EngineError, GenerationRequest, GenerationStats
from kafila.sampling import Sampler, sample_token  # noqa: F401 (sample_token: importable from here, as before)

DEFAULT_MAX_SLOTS = 4  # requests generating at once (each holds a KV state on every stage)
DEFAULT_MAX_QUEUED = 64  # requests waiting for a slot
_END = object()

# A request (and its stats, where the source reports cached prompt tokens) → an iterator of its
# new token ids, run only on the worker thread.
StepSource = Callable[[GenerationRequest, GenerationStats], Iterator[int]]


class LocalEngine:
    """kafila.engine.Engine for one process. Build with `LocalEngine.open(...)` for a model,
    or give any `source` (tests). Call `close()` when done."""

    def __init__(
        self,
        source: StepSource,
        tokenizer,
        model_name: str,
        context_length: int,
        *,
        max_slots: int = DEFAULT_MAX_SLOTS,
        max_queued: int = DEFAULT_MAX_QUEUED,
        describe: dict | None = None,
        cache=None,
    ) -> None:
        self.model_name = model_name
        self.context_length = context_length
        self.max_slots = max_slots
        self.max_queued = max_queued
        self._source = source
        self._tokenizer = tokenizer
        self._describe = describe or {}
        self._cache = cache  # the source's kafila.engine.prompt_cache.ParkedCursors (/status counts it)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kafila-local")
        self._slots: asyncio.Semaphore | None = None  # made on first use, in the serving loop
        self._closed = False
        self.active = 0  # requests holding a slot
        self.queued = 0  # requests waiting for one
        self.served = 0  # requests finished (any way)
        self.last_stats: GenerationStats | None = None

    @classmethod
    def open(
        cls,
        model: str,
        stages: int = 1,
        backend: str = "openvino",
        context: int | None = None,
        precision: str = "serving",
        kquant: str = backends.DEFAULT_KQUANT,
        **options,
    ) -> LocalEngine:
        """Load `model` (an alias or a GGUF path) as a chain of `stages` shards (slow: compiles)."""
        from backends.gguf import open_model
        from kafila.engine.chain import LocalChain
        from kafila.models import ALIASES, load_tokenizer, resolve_model

        path = resolve_model(model)
        index = open_model(path)
        tokenizer = load_tokenizer(index)
        limit = index.hparams.context_length
        if context is not None and context > limit:
            raise BadInput(
                f"--context {context} is more than the model's context of {limit} tokens"
            )
        chain = LocalChain.build(path, stages, backend, precision, index=index, kquant=kquant)
        name = model if model in ALIASES else os.path.splitext(os.path.basename(path))[0]
        return cls.over_chain(chain, tokenizer, name, context or limit, **options)

    @classmethod
    def over_chain(
        cls, chain, tokenizer, model_name: str, context_length: int, prompt_cache: bool = True, **options
    ) -> LocalEngine:
        """An engine over an already built kafila.engine.chain.LocalChain; `prompt_cache`: finished
        requests' KV kept for prompts that start the same way (prompt_cache.py)."""
        from kafila.engine.prompt_cache import ParkedCursors

        # hybrid and sliding-window models: whole histories are continued (backends/kept.py)
        whole = any(continues_whole(s.index.hparams) for s in chain.shards if hasattr(s, "index"))
        cache = ParkedCursors(chain, options.get("max_slots", DEFAULT_MAX_SLOTS), whole) if prompt_cache else None
        return cls(chain_source(chain, tokenizer.eos_ids, context_length, cache), tokenizer, model_name,
                   context_length, describe={"stages": chain.stages}, cache=cache, **options)  # fmt: skip

    # --- Engine protocol ------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return not self._closed

    def tokenizer(self):
        return self._tokenizer

    async def generate(
        self, request: GenerationRequest, stats: GenerationStats
    ) -> AsyncIterator[int]:
        self._check(request)
        if self.queued >= self.max_queued:
            # 429 (Too Many Requests, with Retry-After), as the session's head answers a full queue
            raise EngineError(f"{self.queued} requests are already waiting; try again shortly", 429)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_slots)
        loop = asyncio.get_running_loop()
        stats.started_s = time.perf_counter()
        stats.prompt_tokens = len(request.prompt_ids)
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        # Created here, started on the worker by the first next(): the source's own work (opening
        # the slot, prefill) happens on the worker too, and closing it is safe at any point.
        steps = _steps(self._source, request, stats)
        self.active += 1
        try:
            eos = self._tokenizer.eos_ids
            while True:
                token = await loop.run_in_executor(self._worker, _next, steps)
                if token is _END:
                    stats.finish_reason = "length"
                    break
                if request.stop_at_eos and token in eos:
                    stats.finish_reason = "stop"
                    break
                stats.count_token(time.perf_counter())
                yield token
                if stats.new_tokens >= request.max_new_tokens:
                    stats.finish_reason = "length"
                    break
        except EngineError:
            stats.finish_reason = "error"
            raise
        except Exception as exc:  # a backend failure: one line for the client, not a crash
            stats.finish_reason = "error"
            raise EngineError(f"generation failed: {type(exc).__name__}: {exc}", 500) from exc
        finally:
            # Queued behind any step still running for this request; frees its slot.
            with contextlib.suppress(RuntimeError):  # the worker is already shut down
                self._worker.submit(_close, steps)
            self.active -= 1
            self.served += 1
            self.last_stats = stats
            self._slots.release()

    def status(self) -> dict:
        last = self.last_stats
        return {
            "mode": "local",
            "model": self.model_name,
            "ready": self.ready,
            "context_length": self.context_length,
            "slots": {"max": self.max_slots, "active": self.active, "queued": self.queued,
                      **({"parked": len(self._cache)} if self._cache is not None else {})},
            "served_requests": self.served,
            "last_request": None
            if last is None
            else {"prompt_tokens": last.prompt_tokens, "new_tokens": last.new_tokens,
                  "ttft_ms": last.ttft_ms, "tok_s": last.tok_s, "finish_reason": last.finish_reason},
            **self._describe,
        }  # fmt: skip

    # --- lifecycle --------------------------------------------------------------------------

    def _check(self, request: GenerationRequest) -> None:
        if self._closed:
            raise EngineError("the engine is shut down", 503)
        n = len(request.prompt_ids)
        if n == 0 or request.max_new_tokens < 1:
            raise EngineError("a request needs a prompt and at least one new token", 400)
        if n + request.max_new_tokens > self.context_length:
            raise EngineError(
                f"the prompt ({n} tokens) and max_new_tokens ({request.max_new_tokens}) exceed the "
                f"context of {self.context_length} tokens",
                400,
            )

    async def aclose(self) -> None:
        """Stop taking requests and wait for the worker to finish what it has."""
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._worker.shutdown, True)

    def close(self) -> None:
        self._closed = True
        self._worker.shutdown(wait=True)


def chain_source(chain, eos_ids: frozenset[int], context: int | None = None, cache=None) -> StepSource:
    """Requests → token iterators on a LocalChain: greedy when temperature is 0 (token-identical
    to `kafila run`), else sampled from its logits (seeded when asked). With `cache`
    (prompt_cache.ParkedCursors; `context`: the engine's positions per request), a request
    starts in a parked cursor that holds part of its prompt."""

    def source(request: GenerationRequest, stats: GenerationStats | None = None) -> Iterator[int]:
        return _decode(chain, request, eos_ids if request.stop_at_eos else frozenset(), context, cache, stats)

    return source


def _decode(chain, request: GenerationRequest, stop, context, cache, stats) -> Iterator[int]:
    prompt = [int(t) for t in request.prompt_ids]
    if cache is None:
        cursor, shared = chain.open(), 0
    else:
        room = (context if context is not None else len(prompt) + request.max_new_tokens) - len(prompt)
        cursor, shared = cache.take(prompt, room)
    if stats is not None:
        stats.extra["cached_tokens"] = shared
    sampler = (Sampler(request.temperature, request.top_p, np.random.default_rng(request.seed))
               if request.temperature > 0 else None)  # its own stream
    whole = False  # whole: the cursor's KV is exactly `fed` on every shard (else a failure left it part-way)
    try:
        # a hybrid's shards keep the state at keep_at (the chat's messages' end) or the prompt's end
        keep_at = cache is not None and cache.keeps and shared < request.keep_at < len(prompt)
        at = request.keep_at if keep_at else len(prompt)
        hidden = chain.prefill(cursor, prompt[shared:at])
        if cache is not None:
            cache.keep(cursor)
        if at < len(prompt):
            hidden = chain.prefill(cursor, prompt[at:])
        fed, whole = list(prompt), True
        for i in range(request.max_new_tokens):
            token = chain.next_token(hidden) if sampler is None else sampler.draw(chain.logits(hidden[-1:])[0])
            yield token
            if token in stop or i + 1 == request.max_new_tokens:
                return
            whole = False
            hidden = chain.feed(cursor, (token,))
            fed.append(token)
            whole = True
    finally:
        if cache is None:
            chain.close(cursor)
        elif whole:
            cache.park(cursor, fed, len(prompt))
        else:
            cache.drop(cursor)


def _steps(source: StepSource, request: GenerationRequest, stats: GenerationStats) -> Iterator[int]:
    steps = source(request, stats)
    try:
        yield from steps
    finally:
        _close(steps)


def _next(steps: Iterator[int]):
    return next(steps, _END)


def _close(steps: Iterator[int]) -> None:
    close = getattr(steps, "close", None)
    if close is not None:
        close()
