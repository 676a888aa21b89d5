"""Prompts that reach the head together go round the ring as one batch (session/ring/microbatch.py
`prompt_batches`): three RingNodes over in-memory pipes (the ring's own code) on real shards of
the default model at f32, on OpenVINO and on MLX. Four requests submitted at once each get the tokens they get alone, and
every stage ran their four prompts as one forward into fresh slots."""

import asyncio

import pytest

from kafila.session.wire.frames import Limits
from kafila.session.ring.node import RingNode
from tests.fake_link import Pipe

pytestmark = pytest.mark.model

NAMES = ["m1", "m2", "m3"]
TOKENS = 8


class Recording:
    """A shard that records the new positions of each row of every forward_batch it runs."""

    def __init__(self, shard) -> None:
        self.shard, self.batches = shard, []

    def forward_batch(self, slots, xs, positions, masks):
        self.batches.append([len(p) for p in positions])
        return self.shard.forward_batch(slots, xs, positions, masks)

    def __getattr__(self, name):
        return getattr(self.shard, name)


def _ring(shards, limits):
    # prompt caching off: the same prompts are asked twice, and the second time they must be read whole
    nodes = [RingNode(n, "m1", NAMES, s, limits, prompt_cache=False) for n, s in zip(NAMES, shards)]
    pipes = [Pipe() for _ in NAMES]
    for i, node in enumerate(nodes):
        node.start(pipes[i - 1].reader, pipes[i])
    return nodes


async def _answer(waiter) -> list[int]:
    tokens = []
    while True:
        item = await asyncio.wait_for(waiter.queue.get(), 60)
        if not isinstance(item, int):
            assert item.finish != "error", item
            return tokens
        tokens.append(item)


@pytest.mark.parametrize("backend", ["openvino", "mlx"])
def test_prompts_submitted_together_go_as_one_batch_and_answer_as_alone(backend, chain_factory, prompt_ids,
                                                                        default_index):  # fmt: skip
    chain = chain_factory(backend, 3, "f32")
    hp = default_index.hparams
    limits = Limits(hidden=hp.hidden, context=512, slots=4, vocab=hp.vocab)
    prompts = [list(p) for p in prompt_ids[:4]]

    async def main():
        shards = [Recording(s) for s in chain.shards]
        nodes = _ring(shards, limits)
        try:
            alone = []
            for p in prompts:
                _, waiter = await nodes[0].submit(p, TOKENS, stop_at_eos=False)
                alone.append(await _answer(waiter))
            for s in shards:
                s.batches.clear()
            waiters = [w for _, w in await asyncio.gather(*(nodes[0].submit(p, TOKENS, stop_at_eos=False)
                                                             for p in prompts))]  # fmt: skip
            together = await asyncio.gather(*(_answer(w) for w in waiters))
            return alone, together, [s.batches for s in shards]
        finally:
            for n in nodes:
                await n.close()

    alone, together, batches = asyncio.run(main())
    assert together == alone and all(len(t) == TOKENS for t in alone)
    lengths = sorted(len(p) for p in prompts)
    for stage in batches:  # every stage: the four prompts in one forward, then decode rows
        assert sorted(stage[0]) == lengths, stage[:2]
        assert all(n == 1 for rows in stage[1:] for n in rows)
