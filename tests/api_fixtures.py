"""Fixtures for the HTTP API tests: a scripted engine, the real tokenizer, a server on port 0.

The scripted engine implements kafila.engine.Engine without a model: its answer is a pure
function of the prompt, so tests can check what each concurrent request gets, and it counts
open slots so tests can check that a client that leaves frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import pytest

from kafila.engine import EngineError, GenerationRequest, GenerationStats

# Ids of plain words in SmolLM2's vocabulary, so scripted answers decode to readable text.
WORD_IDS = (
    260,
    2644,
    2643,
    335,
    253,
    1171,
    284,
    965,
    392,
    3514,
    1478,
    3112,
)  # " the cat sat on a mat and then we went home quickly"


class ScriptedEngine:
    """An Engine whose i-th new token is WORD_IDS[(sum(prompt) + i) % len(WORD_IDS)]."""

    def __init__(self, tokenizer, context_length: int = 256, model_name: str = "scripted",
                 token_delay_s: float = 0.0, eos_after: int | None = None) -> None:  # fmt: skip
        self._tokenizer = tokenizer
        self.context_length = context_length
        self.model_name = model_name
        self.token_delay_s = token_delay_s
        self.eos_after = eos_after  # yield EOS after this many tokens (None: never)
        self.is_ready = True
        self.fail_after: int | None = None  # raise EngineError after this many tokens
        self.open_slots = 0
        self.served = 0
        self.requests: list[GenerationRequest] = []
        self.slot_freed = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self.is_ready

    def tokenizer(self):
        return self._tokenizer

    @staticmethod
    def answer(prompt_ids, n: int) -> list[int]:
        s = sum(prompt_ids)
        return [WORD_IDS[(s + i) % len(WORD_IDS)] for i in range(n)]

    async def generate(
        self, request: GenerationRequest, stats: GenerationStats
    ) -> AsyncIterator[int]:
        self.requests.append(request)
        self.open_slots += 1
        try:
            eos = min(self._tokenizer.eos_ids)
            for i, token in enumerate(self.answer(request.prompt_ids, request.max_new_tokens)):
                if self.fail_after is not None and i >= self.fail_after:
                    raise EngineError("member m2 is gone", status=503)
                if self.eos_after is not None and i >= self.eos_after:
                    stats.finish_reason = "stop"
                    yield eos
                    return
                await asyncio.sleep(self.token_delay_s)
                stats.new_tokens = i + 1
                yield token
            stats.finish_reason = "length"
        finally:
            self.open_slots -= 1
            self.served += 1
            self.slot_freed.set()

    def status(self) -> dict:
        return {"model": self.model_name, "ready": self.is_ready, "open_slots": self.open_slots}


@pytest.fixture(scope="session")
def tokenizer(default_tokenizer):
    """SmolLM2's tokenizer (tests/conftest.py skips when the default model is not installed)."""
    return default_tokenizer


class LoopThread:
    """An event loop on its own thread, so sync clients (openai, urllib) can call its server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        with contextlib.suppress(Exception):
            self.loop.close()
