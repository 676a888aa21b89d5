"""LocalEngine's scheduling with a scripted step source (no model): the worker thread, slots,
interleaving, cancellation and errors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kafila.engine import EngineError, GenerationRequest, GenerationStats
from kafila.engine.local import LocalEngine


class FakeTokenizer:
    eos_ids = frozenset({0})


class Source:
    """Yields prompt[0]*100 + i ...; ends with EOS after `eos_after` tokens if set."""

    def __init__(self, delay_s=0.0, eos_after=None, fail_at=None):
        self.delay_s, self.eos_after, self.fail_at = delay_s, eos_after, fail_at
        self.open = 0
        self.log: list[int] = []  # which request each step served, in order
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, request, stats=None):
        self.threads.add(threading.current_thread().name)
        with self.lock:
            self.open += 1
        try:
            for i in range(10_000):
                if self.fail_at is not None and i == self.fail_at:
                    raise RuntimeError("stage 2 exploded")
                if self.eos_after is not None and i == self.eos_after:
                    yield 0
                threading.Event().wait(self.delay_s)
                self.log.append(request.prompt_ids[0])
                yield request.prompt_ids[0] * 100 + i + 1
        finally:
            with self.lock:
                self.open -= 1


def engine_with(source, **kw):
    return LocalEngine(
        source, FakeTokenizer(), "fake", context_length=kw.pop("context", 1000), **kw
    )


async def collect(engine, first, n, stats=None):
    stats = stats or GenerationStats()
    return [t async for t in engine.generate(GenerationRequest((first, 5), n), stats)]


def test_tokens_stats_and_the_worker_thread():
    source = Source(eos_after=3)
    engine = engine_with(source)

    async def main():
        stats = GenerationStats()
        assert await collect(engine, 7, 10, stats) == [701, 702, 703]
        assert (stats.new_tokens, stats.finish_reason, stats.prompt_tokens) == (3, "stop", 2)
        assert stats.ttft_ms > 0 and stats.tok_s > 0
        stats = GenerationStats()
        assert await collect(engine, 7, 2, stats) == [701, 702]
        assert stats.finish_reason == "length"

    asyncio.run(main())
    engine.close()
    assert source.open == 0
    assert all(name.startswith("kafila-local") for name in source.threads)


def test_concurrent_requests_interleave_and_get_their_solo_tokens():
    source = Source(delay_s=0.002)
    engine = engine_with(source, max_slots=4)

    async def main():
        return await asyncio.gather(*(collect(engine, k, 6) for k in (1, 2, 3)))

    got = asyncio.run(main())
    engine.close()
    assert got == [[k * 100 + i for i in range(1, 7)] for k in (1, 2, 3)]
    assert source.log[:3] != [1, 1, 1]  # token by token in turn, not one request after another
    assert source.open == 0


def test_slots_are_bounded_and_waiters_queue():
    source = Source(delay_s=0.01)
    engine = engine_with(source, max_slots=1)

    async def main():
        first = asyncio.ensure_future(collect(engine, 1, 5))
        second = asyncio.ensure_future(collect(engine, 2, 5))
        await asyncio.sleep(0.02)
        assert engine.status()["slots"] == {"max": 1, "active": 1, "queued": 1}
        assert await first == [101, 102, 103, 104, 105]
        assert await second == [201, 202, 203, 204, 205]
        assert source.log == [1] * 5 + [2] * 5  # one slot: strictly one after the other

    asyncio.run(main())
    engine.close()


def test_leaving_early_closes_the_steps_and_frees_the_slot():
    source = Source(delay_s=0.005)
    engine = engine_with(source, max_slots=1)

    async def main():
        gen = engine.generate(GenerationRequest((4, 4), 500), GenerationStats())
        assert [await anext(gen) for _ in range(3)] == [401, 402, 403]
        await gen.aclose()
        task = asyncio.ensure_future(collect(engine, 5, 500))  # cancelled mid-generation
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.status()["slots"]["active"] == 0
        assert await collect(engine, 6, 2) == [601, 602]  # the slot is free again

    asyncio.run(main())
    engine.close()
    assert source.open == 0


def test_bad_requests_and_failures_are_engine_errors():
    engine = engine_with(Source(fail_at=2), context=10)

    async def main():
        with pytest.raises(EngineError) as info:
            await collect(engine, 1, 9)  # 2 prompt + 9 new > 10
        assert info.value.status == 400
        stats = GenerationStats()
        with pytest.raises(EngineError, match="stage 2 exploded") as info:
            await collect(engine, 1, 5, stats)
        assert info.value.status == 500 and stats.finish_reason == "error"
        assert engine.status()["slots"]["active"] == 0

    asyncio.run(main())
    engine.close()
    assert not engine.ready


def test_sample_token():
    import numpy as np

    from kafila.engine.local import sample_token

    logits = np.array([0.0, 3.0, 2.9, -5.0])
    rng = np.random.default_rng(0)
    assert sample_token(logits, 1e-4, 1.0, rng) == 1  # near-zero temperature: the argmax
    assert sample_token(logits, 1.0, 1e-9, rng) == 1  # a tiny nucleus: the argmax
    draws = [sample_token(logits, 1.0, 0.9, rng) for _ in range(300)]
    assert set(draws) <= {1, 2} and draws.count(2) > 50  # the nucleus holds the top two
    again = [sample_token(logits, 1.0, 1.0, np.random.default_rng(7)) for _ in range(5)]
    assert again == [sample_token(logits, 1.0, 1.0, np.random.default_rng(7)) for _ in range(5)]
