"""The ring data plane in one process: three RingNodes over in-memory streams, a fake model.

The fake stages keep real per-slot state (a running sum of what they saw), so a wrong slot,
mask or ordering changes the tokens."""

import asyncio
import threading
import time

import numpy as np
import pytest

from backends.base import HeadOps
from kafila.engine import EngineError, GenerationRequest, GenerationStats
from kafila.engine.ring import RingEngine
from kafila.session.wire.frames import Activation, Limits, Tokens
from kafila.session.ring.node import RingNode
from kafila.session.wire.streams import FrameWriter, read_frame
from tests.fake_link import Pipe

H, V = 8, 50
LIM = Limits(hidden=H, context=64, slots=2, vocab=V)


class FakeShard(HeadOps):
    def __init__(self, seed, embed=False, head=False):
        rng = np.random.default_rng(seed)
        self.w = rng.standard_normal((H, H)).astype(np.float32) / 3
        self.emb = rng.standard_normal((V, H)).astype(np.float32) if embed else None
        self.out = rng.standard_normal((H, V)).astype(np.float32) if head else None
        self.kv, self.next = {}, 0
        self.opened = 0

    def open_slot(self):
        self.next += 1
        self.kv[self.next] = []
        self.opened += 1
        return self.next

    def close_slot(self, s):
        del self.kv[s]

    def trim(self, s, length):
        assert length <= len(self.kv[s])
        del self.kv[s][length:]

    def forward(self, slot, x, positions, mask):
        kv = self.kv[slot]
        assert len(mask) == len(kv) + len(positions)
        x = self.emb[x] if self.emb is not None else x
        out, base = [], len(kv)
        for i, (row, p) in enumerate(zip(x, positions)):
            kv.append(row)
            ctx = np.sum(np.asarray(kv)[np.asarray(mask[: base + i + 1], bool)], axis=0)  # what the mask shows
            out.append(np.tanh(row @ self.w + 0.1 * ctx + 0.01 * p))
        return np.array(out, dtype=np.float32)

    def logits(self, h):
        return h @ self.out




def settled(nodes) -> bool:
    """No request holds a slot, and every stage holds KV only in the slots the head parked
    (prompt caching: session/ring/prefix.py) — nothing leaked."""
    sched = nodes[0].scheduler
    parked = set(sched.parked_slots())
    return sched.active == 0 and all(set(n.slots.slots) <= parked for n in nodes)


def shards(n):
    """Block ranges of one fake model over n stages: same numbers whatever n is."""
    layers = [FakeShard(i, embed=i == 0, head=i == 0) for i in range(3)]
    if n == 1:
        class Chain(HeadOps):
            def __init__(self):
                self.slots, self.n = {}, 100
            def open_slot(self):
                self.n += 1
                s = self.n
                self.slots[s] = [l.open_slot() for l in layers]
                return s
            def close_slot(self, s):
                for l, ls in zip(layers, self.slots.pop(s)):
                    l.close_slot(ls)
            def trim(self, s, length):
                for l, ls in zip(layers, self.slots[s]):
                    l.trim(ls, length)
            def forward(self, slot, x, pos, mask):
                for l, ls in zip(layers, self.slots[slot]):
                    x = l.forward(ls, x, pos, mask)
                return x
            def logits(self, h):
                return layers[0].logits(h)
        return [Chain()]
    return layers


def ring(n):
    names = [f"m{i + 1}" for i in range(n)]
    nodes = [RingNode(nm, "m1", names, s, LIM, eos_ids=frozenset({0})) for nm, s in zip(names, shards(n))]
    pipes = [Pipe() for _ in range(n)]  # pipes[i]: node i → node i+1
    for i, node in enumerate(nodes):
        if n == 1:
            node.start()
        else:
            node.start(pipes[i - 1].reader, pipes[i])
    return nodes, pipes


def engine(node):
    e = RingEngine("fake", LIM.context, None, dict)
    e.node = node
    return e


async def collect(e, prompt, n=12):
    st = GenerationStats()
    return [t async for t in e.generate(GenerationRequest(tuple(prompt), n), st)], st


PROMPTS = [[3, 4, 5], [7], [9, 9, 9, 9], [1, 2], [11, 12, 13], [20, 21]]


async def solo_tokens():
    (node,), _ = ring(1)
    out = [(await collect(engine(node), p))[0] for p in PROMPTS]
    await node.close()
    return out


def test_three_members_match_one_and_concurrency_from_every_member():
    async def main():
        solo = await solo_tokens()
        nodes, _ = ring(3)
        engines = [engine(n) for n in nodes]
        # sequential, asked at each member in turn
        for i, p in enumerate(PROMPTS):
            toks, st = await collect(engines[i % 3], p)
            assert toks == solo[i]
        # concurrent: all six at once from all three members (2 slots: some queue)
        results = await asyncio.gather(*(collect(engines[i % 3], p) for i, p in enumerate(PROMPTS)))
        assert [r[0] for r in results] == solo
        assert nodes[0].scheduler.free_slots == 2
        for _ in range(100):  # the Free frames follow the last tokens round the ring
            if settled(nodes):
                break
            await asyncio.sleep(0.01)
        assert settled(nodes), "every stage freed its slots, but those the head parked"
        assert set(nodes[0].measured.stage_ms) == {"m1", "m2", "m3"}
        assert nodes[1].measured.step_ms is not None  # stats reach the origin with the last token
        for n in nodes:
            await n.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_member_gone_fails_in_flight_requests_naming_it():
    async def main():
        nodes, pipes = ring(3)
        e = engine(nodes[1])
        gen = e.generate(GenerationRequest((3, 4), 40, stop_at_eos=False), GenerationStats())
        await anext(gen)
        pipes[2].close()  # m3 → m1 edge gone: m3 died
        with pytest.raises(EngineError, match="m3") as err:
            async for _ in gen:
                pass
        assert err.value.status == 503
        assert not engine(nodes[0]).ready
        nodes[1].degrade("member m3 left the session")  # as the host would tell it
        with pytest.raises(EngineError, match="degraded"):
            await collect(e, [1])
        for n in nodes:
            await n.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_cancel_frees_the_slot_and_errors_come_back_to_the_origin():
    async def main():
        nodes, _ = ring(3)
        e = engine(nodes[2])
        gen = e.generate(GenerationRequest((3, 4), 40, stop_at_eos=False), GenerationStats())
        await anext(gen)
        await gen.aclose()  # the client went away
        for _ in range(200):
            if nodes[0].scheduler.free_slots == 2:
                break
            await asyncio.sleep(0.01)
        assert nodes[0].scheduler.free_slots == 2
        with pytest.raises(EngineError, match="context") as err:
            await collect(e, [1] * 64)
        assert err.value.status == 400
        with pytest.raises(EngineError, match="token ids") as err:
            await collect(e, [V])
        assert err.value.status == 400
        # the head refuses too (a prompt shorter than the engine's check but no room left)
        toks, st = await collect(e, [5, 6], 3)
        assert len(toks) <= 3 and st.finish_reason in ("stop", "length")
        for n in nodes:
            await n.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_sampling_is_seeded_and_travels_with_the_request():
    async def main():
        nodes, _ = ring(3)
        outs = []
        for e in (engine(nodes[0]), engine(nodes[2]), engine(nodes[2])):
            st = GenerationStats()
            req = GenerationRequest((3, 4, 5), 10, stop_at_eos=False, temperature=1.5, seed=7)
            outs.append([t async for t in e.generate(req, st)])
        assert outs[0] == outs[1] == outs[2]  # the same seed at the head, wherever it was asked
        st = GenerationStats()
        other = [t async for t in engine(nodes[1]).generate(
            GenerationRequest((3, 4, 5), 10, stop_at_eos=False, temperature=1.5, seed=8), st)]
        assert other != outs[0]
        for n in nodes:
            await n.close()

    asyncio.run(asyncio.wait_for(main(), 30))


class Stack(HeadOps):
    """Several fake stages as one shard (what a member holds after a replan gives it more blocks)."""

    def __init__(self, layers):
        self.layers, self.slots, self.n = layers, {}, 200

    def open_slot(self):
        self.n += 1
        self.slots[self.n] = [l.open_slot() for l in self.layers]
        return self.n

    def close_slot(self, s):
        for l, ls in zip(self.layers, self.slots.pop(s)):
            l.close_slot(ls)

    def trim(self, s, length):
        for l, ls in zip(self.layers, self.slots[s]):
            l.trim(ls, length)

    def forward(self, slot, x, pos, mask):
        for l, ls in zip(self.layers, self.slots[slot]):
            x = l.forward(ls, x, pos, mask)
        return x

    def logits(self, h):
        return self.layers[0].logits(h)


def test_a_request_resumes_on_the_replanned_ring_with_the_same_tokens():
    """m3 dies mid-answer; the origin m2 keeps the stream, waits for the new ring (m1 + m2 holding
    m3's blocks too) and replays prompt + what it received: the client sees one answer, the same."""

    async def main():
        solo = await solo_tokens()
        nodes, pipes = ring(3)
        e = engine(nodes[1])
        e.resume_wait_s = 10.0
        gen = e.generate(GenerationRequest(tuple(PROMPTS[0]), 12), GenerationStats())
        got = [await anext(gen), await anext(gen)]
        pipes[2].close()  # m3 → m1 edge gone: m3 died
        rest = asyncio.ensure_future(_drain(gen))
        await asyncio.sleep(0.2)
        assert not rest.done()  # waiting for a ring, not failed
        for n in nodes:
            await n.close()
        layers = shards(3)
        new = [RingNode("m1", "m1", ["m1", "m2"], layers[0], LIM, eos_ids=frozenset({0})),
               RingNode("m2", "m1", ["m1", "m2"], Stack(layers[1:]), LIM, eos_ids=frozenset({0}))]
        a, b = Pipe(), Pipe()
        new[0].start(b.reader, a)
        new[1].start(a.reader, b)
        e.set_node(new[1])
        got += await asyncio.wait_for(rest, 10)
        assert got == solo[0] and e.resumed == 1
        # a ring that never comes back: the wait is bounded and says so
        e2 = engine(new[0])
        e2.resume_wait_s = 0.3
        gen2 = e2.generate(GenerationRequest((3, 4), 40, stop_at_eos=False), GenerationStats())
        await anext(gen2)
        b.close()
        with pytest.raises(EngineError, match="did not come back"):
            await _drain(gen2)
        # the session ending fails what waits at once, naming why
        e.end("the host left")
        with pytest.raises(EngineError, match="the host left"):
            await collect(e, [1])
        for n in new:
            await n.close()

    asyncio.run(asyncio.wait_for(main(), 30))


async def _drain(gen):
    return [t async for t in gen]


class BatchingShard(FakeShard):
    """FakeShard with forward_batch (row by row: the ring's protocol is under test, not speed)."""

    batches: list

    def forward_batch(self, slots, xs, positions, masks):
        self.batches = getattr(self, "batches", [])
        self.batches.append(len(slots))
        assert len(set(slots)) == len(slots)
        return [self.forward(s, x, p, m) for s, x, p, m in zip(slots, xs, positions, masks)]


def batching_ring(batch_rows: bool, slots: int = 4):
    names = ["m1", "m2", "m3"]
    lim = Limits(hidden=H, context=64, slots=slots, vocab=V)
    layers = [BatchingShard(i, embed=i == 0, head=i == 0) for i in range(3)]
    nodes = [RingNode(nm, "m1", names, s, lim, eos_ids=frozenset({0}), batch_rows=batch_rows)
             for nm, s in zip(names, layers)]  # fmt: skip
    pipes = [Pipe() for _ in range(3)]
    for i, node in enumerate(nodes):
        node.start(pipes[i - 1].reader, pipes[i])
    return nodes, layers


@pytest.mark.parametrize("batch_rows", [True, False])
def test_micro_batches_go_round_the_ring_together_and_answer_as_solo(batch_rows):
    """Concurrent requests' decode steps travel as micro-batches (one forward_batch per stage);
    every answer is its solo answer, with batching on and off."""
    async def main():
        solo = await solo_tokens()
        nodes, layers = batching_ring(batch_rows)
        engines = [engine(n) for n in nodes]
        results = await asyncio.gather(*(collect(engines[i % 3], p) for i, p in enumerate(PROMPTS)))
        assert [r[0] for r in results] == solo
        sizes = [getattr(shard, "batches", []) for shard in layers]
        if batch_rows:  # the same micro-batches at every stage, several rows each
            assert max(sizes[0]) > 1 and sizes[0] == sizes[1] == sizes[2], sizes
        else:
            assert sizes == [[], [], []]
        for _ in range(100):
            if settled(nodes):
                break
            await asyncio.sleep(0.01)
        assert settled(nodes), "every stage freed its slots, but those the head parked"
        for n in nodes:
            await n.close()

    asyncio.run(asyncio.wait_for(main(), 30))


class SlowPromptShard(BatchingShard):
    """The head's stage: a prompt's forward takes 0.2 s, and the prompt batches are recorded."""

    prompt_batches: list

    def forward(self, slot, x, positions, mask):
        if len(positions) > 1:
            time.sleep(0.2)
        return super().forward(slot, x, positions, mask)

    def forward_batch(self, slots, xs, positions, masks):
        if min(len(p) for p in positions) > 1:
            self.prompt_batches = getattr(self, "prompt_batches", []) + [len(slots)]
        return super().forward_batch(slots, xs, positions, masks)


def test_prompts_that_reach_the_head_while_it_computes_leave_as_one_batch():
    """Two prompts typed at m2 and m3 reach the head while its stage reads a first prompt: the
    head takes every event that came meanwhile before it sends anything, so the two go round as
    one batch (one forward per stage), not one after the other; every answer is its solo one."""
    async def main():
        solo = await solo_tokens()
        names = ["m1", "m2", "m3"]
        lim = Limits(hidden=H, context=64, slots=4, vocab=V)
        layers = [SlowPromptShard(0, embed=True, head=True), BatchingShard(1), BatchingShard(2)]
        nodes = [RingNode(nm, "m1", names, s, lim, eos_ids=frozenset({0})) for nm, s in zip(names, layers)]
        pipes = [Pipe() for _ in range(3)]
        for i, node in enumerate(nodes):
            node.start(pipes[i - 1].reader, pipes[i])
        first = asyncio.create_task(collect(engine(nodes[0]), PROMPTS[0]))
        await asyncio.sleep(0.05)  # the head computes the first prompt
        others = [collect(engine(nodes[1]), PROMPTS[2]), collect(engine(nodes[2]), PROMPTS[4])]
        results = await asyncio.gather(first, *others)
        assert [r[0] for r in results] == [solo[0], solo[2], solo[4]]
        assert getattr(layers[0], "prompt_batches", []) == [2]
        for n in nodes:
            await n.close()

    asyncio.run(asyncio.wait_for(main(), 30))


class GatedShard(FakeShard):
    """A stage whose forward waits for the test to open its gate."""

    def __init__(self, seed):
        super().__init__(seed)
        self.gate = threading.Event()

    def forward(self, slot, x, positions, mask):
        assert self.gate.wait(10)
        return super().forward(slot, x, positions, mask)


def test_frames_routed_through_a_member_do_not_wait_for_its_stage():
    """Tokens for a user at m3 reach m2 behind an activation that m2's stage is computing: m2
    passes them on at once (they waited for the forward when the read loop ran the stage), and
    the activation follows when its forward is done."""
    async def main():
        shard = GatedShard(1)
        node = RingNode("m2", "m1", ["m1", "m2", "m3"], shard, LIM)
        inp, out = Pipe(), Pipe()
        node.start(inp.reader, out)
        feed = FrameWriter(inp, LIM)
        await feed.send(Activation("m1:1", 1, 0, 0, (), np.ones((2, H), np.float32)))
        await feed.send(Tokens("m3:1", "m3", (5,)))
        first = await asyncio.wait_for(read_frame(out.reader, LIM), 5)
        assert isinstance(first, Tokens) and first.dst == "m3"  # while the stage still computes
        shard.gate.set()
        then = await asyncio.wait_for(read_frame(out.reader, LIM), 5)
        assert isinstance(then, Activation) and then.req_id == "m1:1" and then.n == 2
        await node.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_request_cancelled_inside_a_micro_batch_leaves_the_others_whole():
    async def main():
        solo = await solo_tokens()
        nodes, layers = batching_ring(True)
        engines = [engine(n) for n in nodes]
        gone = engines[1].generate(GenerationRequest((5, 6, 7), 40, stop_at_eos=False), GenerationStats())
        others = asyncio.gather(*(collect(engines[i % 3], p) for i, p in enumerate(PROMPTS[:3])))
        await anext(gone)
        await anext(gone)
        await gone.aclose()  # the client hung up mid-answer
        assert [r[0] for r in await others] == solo[:3]
        for _ in range(100):
            if settled(nodes) and nodes[0].scheduler.free_slots == 4:
                break
            await asyncio.sleep(0.01)
        assert settled(nodes) and nodes[0].scheduler.free_slots == 4
        assert max(layers[1].batches) > 1
        for n in nodes:
            await n.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_micro_batch_out_of_order_is_a_malformed_frame():
    from kafila.session.wire.frames import Activation, FrameError

    async def main():
        nodes, _ = batching_ring(True)
        row = Activation("m1:1", 0, 3, 3, (), np.zeros((1, H), np.float32), (), 3, 1)
        with pytest.raises(FrameError, match="row 1 of a micro-batch of 3"):
            nodes[1]._collect(row)
        for n in nodes:
            await n.close()

    asyncio.run(asyncio.wait_for(main(), 10))


@pytest.mark.parametrize("machines, rtt_ms, depth", [
    ({"m1": "a", "m2": "b", "m3": "c"}, 0.0, 3),  # three machines: one micro-batch on each
    ({"m1": "a", "m2": "a", "m3": "a"}, 0.0, 1),  # one machine's cores: one batch, the biggest rows
    ({"m1": "a", "m2": "a", "m3": "a"}, 40.0, 2),  # 20 ms a hop: batches to fill the wire's wait
    ({"m1": "a", "m2": "b", "m3": "c"}, 40.0, 9),  # (¾ of a round at most where stages share a machine)
])  # fmt: skip
def test_micro_batches_in_flight_follow_the_machines_and_the_wire(machines, rtt_ms, depth):
    async def main():
        lim = Limits(hidden=H, context=64, slots=4, vocab=V)
        node = RingNode("m1", "m1", ["m1", "m2", "m3"], BatchingShard(0, embed=True, head=True), lim,
                        machines=machines, edge_rtts=lambda: {n: rtt_ms for n in machines})  # fmt: skip
        assert node._pipeline_depth() == len(set(machines.values()))  # before any step is measured
        node.measured.stage_ms.update({"m1": 10.0, "m2": 10.0, "m3": 10.0})
        assert node._pipeline_depth() == depth
        await node.close()

    asyncio.run(asyncio.wait_for(main(), 10))
