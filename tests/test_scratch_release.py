"""A long prompt's working set is given back (issue 10): the CPU plugin keeps a large step's
intermediate buffers at that step's size, so after one long prompt a member held hundreds of MB
more for the rest of the session (the 8B shape's members went from ≤ 1.25× to 1.42–1.56× their
shard + KV after an 1,800-token prompt: docs/BENCHMARKS.md). The OpenVINO shard hands them back
(CompiledModel.release_memory) when the steps are small again, and works around the plugin's
failure on the first inference after that (backends/openvino/shard.py `_release_scratch`); the
MLX shard empties MLX's buffer cache at the same point (backends.memory.large_step decides)."""

import numpy as np
import pytest

import backends.openvino.shard as shard_mod
from backends import memory
from backends import status
from backends.base import ShardSpec
from backends.gguf import open_model
from tests.default_model import MODEL, needs_default_model

pytestmark = [pytest.mark.model, needs_default_model]
needs_mlx = pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)

LONG = 2000  # positions of the long prompt: one step (the default model's chunk is 3640)
MLX_LONG = 1200  # MLX's CPU backend prefills far slower


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def feed(shard, slot, ids, at):
    return shard.forward(slot, ids, np.arange(at, at + len(ids)), np.ones(at + len(ids), np.int64))


@pytest.fixture(scope="module")
def index():
    return open_model(MODEL)


def answer(index, release: bool, monkeypatch) -> tuple[list[int], dict]:
    """A short request decoding, a long prompt in a fresh slot, 4 greedy tokens after it, then the
    short request's next step and the same long prompt again: the tokens and RSS along the way."""
    monkeypatch.setattr(memory, "RELEASE_WORK_BYTES", 64 << 20 if release else 1 << 62)
    # the exact form, whose matrices are the plugin's own nodes: the ggml form holds less
    # throughout (163 / 336 / 315 MB against 327 / 585 / 388 here), but the plugin's release gives
    # back little of its long step (its ops' outputs, suspected)
    shard = shard_mod.OpenVINOShard(ShardSpec(MODEL, 0, index.hparams.n_blocks, True, True), "serving",
                                    index=index, kquant="exact")  # fmt: skip
    ids = np.random.default_rng(0).integers(0, index.hparams.vocab, LONG)
    short = shard.open_slot()
    feed(shard, short, ids[:8], 0)
    feed(shard, short, ids[8:9], 8)
    rss = {"before": rss_mb()}
    slot = shard.open_slot()
    h = feed(shard, slot, ids, 0)
    rss["long"] = rss_mb()
    tokens = [shard.greedy(h)]
    for i in range(4):
        tokens.append(shard.greedy(feed(shard, slot, np.array([tokens[-1]]), LONG + i)))
    rss["after"] = rss_mb()
    tokens.append(shard.greedy(feed(shard, short, ids[9:10], 9)))
    again = shard.open_slot()  # the long step's very shapes once more, then a decode step
    tokens.append(shard.greedy(feed(shard, again, ids, 0)))
    tokens.append(shard.greedy(feed(shard, again, np.array([tokens[-1]]), LONG)))
    return tokens, {**rss, "releases": shard.scratch_releases}


def test_a_long_prompts_buffers_are_given_back_and_every_answer_is_the_same(index, monkeypatch):
    kept, kept_rss = answer(index, False, monkeypatch)
    given, given_rss = answer(index, True, monkeypatch)
    assert given == kept
    assert kept_rss["releases"] == 0 and given_rss["releases"] == 2  # once after each long prompt
    grown = given_rss["long"] - given_rss["before"]
    assert grown > 60, given_rss  # the long step's buffers (and its KV)
    # most of it is handed back; what stays is mostly the long slot's KV (≈ 1/3 here)
    assert given_rss["after"] < given_rss["long"] - 0.3 * grown, given_rss


def test_a_batch_of_the_long_steps_size_right_after_the_release(index, monkeypatch):
    """Batched decode rows after a long step's buffers were given back: 32 rows of one position
    after one row of 32 (the matrices see 32 rows either way)."""
    shard = shard_mod.OpenVINOShard(ShardSpec(MODEL, 0, index.hparams.n_blocks, True, True), "serving",
                                    index=index)  # fmt: skip
    ids = np.random.default_rng(1).integers(0, index.hparams.vocab, 64)
    rows = [shard.open_slot() for _ in range(32)]
    for i, slot in enumerate(rows):
        feed(shard, slot, ids[i:i + 2], 0)
    shard.forward_batch(rows, [ids[i:i + 1] for i in range(32)], [np.array([2])] * 32,
                        [np.ones(3, np.int64)] * 32)  # fmt: skip
    monkeypatch.setattr(memory, "RELEASE_WORK_BYTES", 1)  # every step of 16+ positions is large
    feed(shard, shard.open_slot(), ids[:32], 0)  # large: one row of 32 positions
    hs = shard.forward_batch(rows, [ids[i + 1:i + 2] for i in range(32)], [np.array([3])] * 32,
                             [np.ones(4, np.int64)] * 32)  # small: 32 rows of one  # fmt: skip
    assert shard.scratch_releases == 1
    assert len(hs) == 32 and all(np.isfinite(h).all() for h in hs)


def test_after_the_release_a_step_of_the_last_steps_shapes_runs(index):
    """The plugin fails the first inference after release_memory in every node whose shapes equal
    the last inference's (OpenVINO 2026.4: "Memory has not been allocated"; a fresh prompt of the
    same length, or a decode step after a decode step). The shard's release primes the buffers
    with one position in a fresh state, so any step may follow it."""
    shard = shard_mod.OpenVINOShard(ShardSpec(MODEL, 0, index.hparams.n_blocks, True, True), "serving",
                                    index=index)  # fmt: skip
    ids = np.random.default_rng(2).integers(0, index.hparams.vocab, 64)
    first = shard.greedy(feed(shard, shard.open_slot(), ids, 0))
    shard._release_scratch()
    assert shard.greedy(feed(shard, shard.open_slot(), ids, 0)) == first


@needs_mlx
def test_mlx_empties_its_buffer_cache_once_the_long_prompt_is_done(index):
    """MLX keeps a freed step's buffers in its cache; the shard empties it when a small step
    follows a large one (mlx-lm's own prefill loop empties it too)."""
    import mlx.core as mx

    from backends.mlx.shard import MLXShard

    shard = MLXShard(ShardSpec(MODEL, 0, index.hparams.n_blocks, True, True), "serving", index=index)
    ids = np.random.default_rng(0).integers(0, index.hparams.vocab, MLX_LONG)
    slot = shard.open_slot()
    tokens = [shard.greedy(feed(shard, slot, ids, 0))]
    cached = [mx.get_cache_memory()]  # after the long step: its buffers, cached
    for i in range(2):
        tokens.append(shard.greedy(feed(shard, slot, np.array([tokens[-1]]), MLX_LONG + i)))
        cached.append(mx.get_cache_memory())
    assert shard.scratch_releases == 1
    assert cached[0] > 2 * max(cached[1:]), cached
