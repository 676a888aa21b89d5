"""Long prompts: chunked prefill keeps every activation frame under the frame limit and every
stage's batch bounded; a frame that still would not fit fails its own request, never the ring.

The ring tests run three RingNodes in one process over in-memory streams (as test_session_ring)
with `Limits.frame_bytes` lowered — the explicit, documented knob for tests — so a prompt of a few
dozen positions needs several chunks. The model test does the same with the default model's real
shards and holds the ring to what `kafila run --stages 1` answers."""

import asyncio

import numpy as np
import pytest

from kafila.engine import EngineError, GenerationRequest, GenerationStats
from kafila.engine.ring import RingEngine
from kafila.session.wire.frames import MAX_FRAME_BYTES, Activation, EncodeError, Limits, encode
from kafila.session.ring.node import RingNode
from backends.memory import PREFILL_WORK_BYTES, PREFILL_WORK_BYTES_PER_POSITION
from kafila.session.ring.chunks import later_chunk_tokens, prefill_chunk_tokens
from kafila.session.ring.scheduler import Scheduler
from tests.default_model import MODEL, needs_default_model
from tests.fake_link import Pipe
from tests.test_session_ring import H, LIM, V, shards

CHUNK = 5  # positions per activation frame in the ring tests
SMALL = Limits(hidden=H, context=LIM.context, slots=LIM.slots, vocab=V, frame_bytes=CHUNK * H * 4)


class Tap(Pipe):
    """A Pipe that records the size of every activation payload written to it."""

    def __init__(self, limits=LIM):
        from kafila.session.wire.frames import FrameDecoder

        super().__init__()
        self.rows: list[int] = []
        self.decoder = FrameDecoder(limits)

    def write(self, data):
        for f in self.decoder.feed(data):
            if isinstance(f, Activation):
                self.rows.append(f.n)
        super().write(data)


def ring(n, limits, prefill_chunk=None):
    names = [f"m{i + 1}" for i in range(n)]
    nodes = [RingNode(nm, "m1", names, s, limits, eos_ids=frozenset({0}),
                      prefill_chunk=prefill_chunk if nm == "m1" else None)
             for nm, s in zip(names, shards(n))]  # fmt: skip
    pipes = [Tap() for _ in range(n)]
    for i, node in enumerate(nodes):
        node.start(*((pipes[i - 1].reader, pipes[i]) if n > 1 else ()))
    return nodes, pipes


def engine(node, context=LIM.context):
    e = RingEngine("fake", context, None, dict)
    e.node = node
    return e


async def collect(e, prompt, n=8):
    st = GenerationStats()
    return [t async for t in e.generate(GenerationRequest(tuple(prompt), n), st)]


# --- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [64, 576, 2048, 4096, 8192, 16384, MAX_FRAME_BYTES // 4])
def test_chunk_rule_keeps_a_frame_and_a_stage_bounded(hidden):
    n = prefill_chunk_tokens(hidden)
    assert n >= 1
    assert n * hidden * 4 <= MAX_FRAME_BYTES
    assert n * hidden * PREFILL_WORK_BYTES_PER_POSITION <= max(PREFILL_WORK_BYTES, hidden * PREFILL_WORK_BYTES_PER_POSITION)
    assert prefill_chunk_tokens(hidden, frame_bytes=hidden * 4 * 3) == min(3, n)


def test_chunk_rule_at_real_hidden_sizes():
    # Llama-3-8B (4096): a 4,000-token prompt goes round in 8 chunks of 512 (8 MiB frames)
    assert prefill_chunk_tokens(4096) == 512
    assert prefill_chunk_tokens(2048) == 1024
    assert prefill_chunk_tokens(576) == 3640


def test_later_chunks_are_a_quarter_of_the_first():
    assert [later_chunk_tokens(n) for n in (1, 3, 4, 512, 1024, 3640)] == [1, 1, 1, 128, 256, 910]


def test_scheduler_chunks_in_order():
    s = Scheduler(slots=1, context=64, eos_ids=frozenset({0}), chunk_tokens=8)
    s.submit("a", "m1", list(range(1, 13)), 3)
    got = []
    for expect_token in (False, False, True):
        (step,) = s.steps()
        got.append((step.tokens.tolist(), step.cache_len, step.pos0))
        assert s.wants_token("a") is expect_token
        events = s.complete("a", 7 if expect_token else None)
        assert bool(events) is expect_token
    # the first chunk whole, the later ones a quarter of it (chunks.later_chunk_tokens)
    assert got == [(list(range(1, 9)), 0, 0), ([9, 10], 8, 8), ([11, 12], 10, 10)]
    (step,) = s.steps()  # then decode, one position a step
    assert (step.tokens.tolist(), step.cache_len, step.pos0) == ([7], 12, 12)


def test_an_oversized_activation_is_our_error_before_a_byte_is_written():
    act = Activation("r", 0, 0, 0, (), np.zeros((CHUNK + 1, H), np.float32))
    with pytest.raises(EncodeError, match="frame limit"):
        encode(act, SMALL)
    assert encode(Activation("r", 0, 0, 0, (), np.zeros((CHUNK, H), np.float32)), SMALL)


# --- the ring ---------------------------------------------------------------------------------

LONG = [[(7 * i + j) % (V - 1) + 1 for j in range(n)] for i, n in enumerate((23, 17, 31, 12))]


def test_a_prompt_over_the_frame_limit_goes_round_in_chunks_with_the_solo_tokens():
    async def main():
        (solo,), _ = ring(1, LIM)  # one member, no frame at all: the whole prompt in one step
        want = [await collect(engine(solo), p) for p in LONG]
        await solo.close()
        nodes, pipes = ring(3, SMALL)
        assert nodes[0].scheduler.chunk_tokens == CHUNK
        engines = [engine(n) for n in nodes]
        got = [await collect(engines[i % 3], p) for i, p in enumerate(LONG)]
        # and concurrently, from every member
        both = await asyncio.gather(*(collect(engines[i % 3], p) for i, p in enumerate(LONG)))
        rows = [r for p in pipes for r in p.rows]
        assert [n.degraded for n in nodes] == [None, None, None]
        for n in nodes:
            await n.close()
        return want, got, list(both), rows

    want, got, both, rows = asyncio.run(main())
    assert got == want and both == want
    assert max(rows) == CHUNK and sum(map(len, want)) > 2 * len(want)  # chunks travelled, none over


def test_a_frame_over_the_limit_fails_that_request_alone_and_the_next_succeeds():
    async def main():
        (solo,), _ = ring(1, LIM)
        short = [3, 4, 5]
        want = await collect(engine(solo), short)
        await solo.close()
        # the head is told to feed 50 positions a step: a 12-position prompt makes a frame over
        # the limit, at the head and at a member that asked for it through the ring
        nodes, _ = ring(3, SMALL, prefill_chunk=50)
        out = []
        for asked in (0, 2):
            with pytest.raises(EngineError) as err:
                await collect(engine(nodes[asked]), LONG[3])
            out.append((err.value.status, str(err.value)))
            out.append(await collect(engine(nodes[asked]), short))
        # a prompt longer than the context: refused alone at the member and at the head
        for asked in (0, 1):
            with pytest.raises(EngineError) as err:
                await collect(engine(nodes[asked]), [i % 40 + 1 for i in range(LIM.context + 5)])
            out.append((err.value.status, str(err.value)))
            with pytest.raises(EngineError) as err:  # the member's engine would send it on
                await collect(engine(nodes[asked], context=10 * LIM.context), [i % 40 + 1 for i in range(LIM.context + 5)])
            out.append((err.value.status, str(err.value)))
            out.append(await collect(engine(nodes[asked]), short))
        degraded = [n.degraded for n in nodes]
        for n in nodes:
            await n.close()
        return want, out, degraded

    want, out, degraded = asyncio.run(main())
    assert degraded == [None, None, None]
    for status, message in (out[0], out[2]):
        assert status == 500 and "frame limit" in message, message
    assert out[1] == want and out[3] == want
    for i in (4, 7):
        assert out[i][0] == 400 and "context" in out[i][1]
        assert out[i + 1][0] == 400 and "context" in out[i + 1][1]
        assert out[i + 2] == want


# --- the default model --------------------------------------------------------------------------


@pytest.mark.model
@needs_default_model
def test_real_shards_chunked_round_the_ring_give_kafila_runs_ids():
    """Three real openvino stages of the default model, a frame limit of 48 positions (the
    documented test knob), a 200-token prompt: a chunk of 48 positions and then chunks of 12, and
    the greedy ids of one stage."""
    from backends.gguf import open_model
    from kafila.api import chat_prompt_ids
    from kafila.engine.chain import LocalChain
    from kafila.models import load_tokenizer

    index = open_model(MODEL)
    tok = load_tokenizer(index)
    text = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} stones." for i in range(18))
    ids = chat_prompt_ids(tok, [{"role": "user", "content": text + " Which box holds the most?"}])
    assert 180 <= len(ids) <= 400, len(ids)
    one = LocalChain.build(MODEL, 1, "openvino", index=index)
    want = list(one.generate(ids, 12, stop=tok.eos_ids))
    three = LocalChain.build(MODEL, 3, "openvino", index=index)
    hidden = index.hparams.hidden
    limits = Limits(hidden=hidden, context=1024, slots=2, vocab=index.hparams.vocab, frame_bytes=48 * hidden * 4)

    async def main():
        names = ["m1", "m2", "m3"]
        nodes = [RingNode(nm, "m1", names, s, limits, eos_ids=frozenset(tok.eos_ids))
                 for nm, s in zip(names, three.shards)]  # fmt: skip
        pipes = [Tap(limits) for _ in names]
        for i, node in enumerate(nodes):
            node.start(pipes[i - 1].reader, pipes[i])
        e = engine(nodes[1], context=1024)
        st = GenerationStats()
        got = [t async for t in e.generate(GenerationRequest(tuple(ids), 12, stop_at_eos=True), st)]
        rows = [r for p in pipes for r in p.rows]
        for n in nodes:
            await n.close()
        return got, rows

    got, rows = asyncio.run(main())
    # the first chunk of 48 positions, then chunks of 12 (chunks.later_chunk_tokens)
    assert max(rows) == 48 and rows.count(48) == 3 and rows.count(12) >= 3 * 10
    assert got == [t for t in want if t not in tok.eos_ids]


# --- kafila run / LocalChain: the same chunked prefill in one process --------------------------


class Recorder:
    """A real shard whose forward calls are recorded (positions per call); nothing else changes."""

    def __init__(self, shard):
        self.shard, self.sizes = shard, []

    def __getattr__(self, name):
        return getattr(self.shard, name)

    def forward(self, slot, x, positions, mask):
        self.sizes.append(len(positions))
        return self.shard.forward(slot, x, positions, mask)


@pytest.mark.parametrize("stages", [1, 2])
def test_local_chain_prefills_in_chunks_with_the_one_shot_ids(synthetic_model, stages):
    """A 400-token prompt on the synthetic model at f32: a first chunk of 37 positions, then chunks
    of 9 (none larger) give the greedy ids of one 400-position batch; the default chunk follows
    the rule."""
    from backends.gguf import open_model
    from kafila.engine.chain import LocalChain

    index = open_model(synthetic_model)
    ids = [int(t) for t in np.random.default_rng(3).integers(1, index.hparams.vocab, 400)]
    one = LocalChain.build(synthetic_model, stages, "openvino", "f32", index=index, chunk_tokens=10**6)
    want = list(one.generate(ids, 16))
    chunked = LocalChain.build(synthetic_model, stages, "openvino", "f32", index=index, chunk_tokens=37)
    rec = [Recorder(s) for s in chunked.shards]
    chunked.shards = rec
    chunked.head = next(r for r in rec if r.spec.head)
    got = list(chunked.generate(ids, 16))
    assert got == want
    prefill = rec[0].sizes[: -(len(got) - 1)]
    assert prefill == [37] + [9] * 40 + [3] and max(rec[0].sizes) == 37
    assert LocalChain.build(synthetic_model, 1, "openvino", index=index).chunk_tokens == prefill_chunk_tokens(
        index.hparams.hidden)

