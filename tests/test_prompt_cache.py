"""Prompt caching (kafila/session/ring/prefix.py): a finished request's slot keeps its KV, and a prompt
that starts the same way feeds only the rest — with the tokens a fresh slot gives.

The rules alone, the scheduler against a fake ring that honours the mask, and the real ring
(RingNode on three OpenVINO or MLX stages at f32, batched rows on): conversations of two turns,
asked one by one and four at once, answer as with the cache off, and the second turns find
their first turn's tokens in the KV."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
from hypothesis import given, settings, strategies as st

from kafila.session.ring.prefix import EVICT_SHARED, MAX_WASTE, Parked, ParkedSlots, reuse_in, shared_prefix
from kafila.session.ring.scheduler import Finished, Scheduler, SlotFreed, TokenOut
from tests.test_scheduler import EOS, FakeRing, drive

def feed_through(shards, slots, ids, cache_len: int):
    """`ids` at positions cache_len… through `shards` in turn (one slot each), every position seen:
    the last shard's hidden states."""
    import numpy as np

    x = np.array(ids, np.int64)
    n = len(ids)
    for shard, slot in zip(shards, slots):
        x = shard.forward(slot, x, np.arange(cache_len, cache_len + n), np.ones(cache_len + n, np.int64))
    return x


# --- the rules ---------------------------------------------------------------------------------


def test_the_shared_prefix_skips_masked_positions_and_leaves_the_last_prompt_token():
    parked = Parked((5, 6, 7, 8), frozenset({2}))  # physical position 2 was a rejected draft
    assert shared_prefix(parked, [5, 6, 7, 8, 1]) == (4, 5)
    assert shared_prefix(parked, [5, 6, 7, 8]) == (3, 4)  # the last token is fed again
    assert shared_prefix(parked, [5, 1, 7]) == (1, 1)
    assert shared_prefix(parked, [4, 6]) == (0, 0)


def test_a_reuse_cuts_the_slot_after_the_prefix_and_keeps_the_old_zeros_in_it():
    parked = Parked((5, 6, 7, 8, 3, 3), frozenset({2, 6}))  # physical 2 and 6: rejected drafts
    r = reuse_in(4, parked, [5, 6, 7, 2, 2], room=100)
    assert (r.slot, r.shared, r.cache_len, r.waste) == (4, 3, 4, 1)  # the stages keep 4 positions
    assert r.zeros == (2,)  # the zero past the cut goes with the rest
    assert reuse_in(4, parked, [5, 6, 7, 2, 2], room=1) is None  # 1 masked > half the room left
    assert reuse_in(4, parked, [1, 2], room=100) is None  # nothing shared


def test_masked_positions_carried_are_bounded_whatever_the_room():
    zeros = frozenset(range(1, 2 * MAX_WASTE + 3, 2))  # every other physical position
    parked = Parked(tuple(range(1, MAX_WASTE + 3)), zeros)
    assert reuse_in(0, parked, [*range(1, MAX_WASTE + 3), 999], room=10**6) is None  # MAX_WASTE + 1 carried
    r = reuse_in(0, parked, [*range(1, MAX_WASTE + 2), 999], room=10**6)
    assert (r.shared, r.waste, r.cache_len) == (MAX_WASTE + 1, MAX_WASTE, 2 * MAX_WASTE + 1)


def test_the_longest_continued_prefix_wins_and_the_oldest_parked_goes_first():
    p = ParkedSlots()
    p.park(0, [1, 2, 3, 4], [], prompt=3)
    p.park(1, [1, 2, 9], [], prompt=2)
    p.park(2, [1, 7, 7], [], prompt=3)
    p.park(3, [7, 7], [], prompt=2)
    assert p.best([1, 2, 3, 5], room=50).slot == 0
    assert p.best([1, 2, 3, 5], room=50).slot == 1  # slot 0 is taken now
    assert p.best([1, 2, 3, 5], room=50) is None  # slot 2 shares 1 position of its prompt's 3
    assert p.evict([1, 2, 3, 5], room=50) == (2, None)  # the one to go anyway: 1 shared position is not kept
    assert p.evict([1, 2], room=50) == (3, None) and len(p) == 0


def test_the_same_question_again_takes_its_slot_whatever_the_answer_was():
    p = ParkedSlots()
    p.park(0, [1, 2, 3, *range(10, 40)], [], prompt=3)  # a long answer after a 3-token prompt
    p.park(1, [1, 2, 8, 8, 8], [], prompt=4)
    r = p.best([1, 2, 3], room=100)
    assert (r.slot, r.shared, r.cache_len) == (0, 2, 2)  # the prompt's last token is fed again
    assert p.best([1, 2, 4, 4, 4], room=100) is None  # shares 2 of slot 1's prompt of 4


def test_the_evicted_slot_keeps_only_a_long_shared_prefix():
    system = list(range(1, EVICT_SHARED + 1))  # a long system prompt
    p = ParkedSlots()
    p.park(0, [*system, 7, 7, 7, 7], [], prompt=EVICT_SHARED + 2)
    p.park(1, [*system[:-1], 5, 5], [], prompt=EVICT_SHARED + 1)
    slot, reuse = p.evict([*system, 9, 9], room=10**4)
    assert slot == 0 and (reuse.shared, reuse.cache_len) == (EVICT_SHARED, EVICT_SHARED)
    assert p.evict([*system, 9, 9], room=10**4) == (1, None)  # one position short of it: reset


# --- the scheduler -----------------------------------------------------------------------------


def run_turns(prompt_cache: bool, turns, slots: int = 2, speculate: str = "off", seed: int = 0):
    """Each turn's requests submitted together, driven to the end; returns every request's tokens
    and how many prompt tokens it found cached."""
    s = Scheduler(slots=slots, context=256, eos_ids=frozenset({EOS}), speculate=speculate,
                  prompt_cache=prompt_cache)  # fmt: skip
    ring = FakeRing(slots)
    out, finished = {}, []
    for turn in turns:
        for rid, prompt in turn.items():
            s.submit(rid, "m1", prompt, 12)
        out.update(drive(s, ring, random.Random(seed), finished)[0])
    return out, {ev.req_id: ev.cached for ev in finished}


def conversation(seed: int, users: int):
    """Turn 1: users with a shared system prompt; turn 2: each user's first turn, its answer
    (from a cache-off run) and more."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))]
    first = {f"u{i}": system + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))] for i in range(users)}
    answers, _ = run_turns(False, [first])
    second = {f"{u}b": p + answers.get(u, []) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 5))]
              for u, p in first.items()}  # fmt: skip
    return [first, second]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 3), st.sampled_from(["off", "ngram"]))
def test_cached_prompts_answer_as_fresh_ones(seed, users, slots, speculate):
    turns = conversation(seed, users)
    on, cached = run_turns(True, turns, slots, speculate, seed)
    off, cached_off = run_turns(False, turns, slots, speculate, seed)
    assert on == off
    assert set(cached_off.values()) == {0}


def test_the_next_turn_feeds_only_what_is_new():
    s = Scheduler(slots=2, context=64, eos_ids=frozenset({EOS}))
    ring = FakeRing(2)
    s.submit("a", "m1", [3, 4, 5, 6], 3, stop_at_eos=False)
    out, _ = drive(s, ring)
    history = [3, 4, 5, 6, *out["a"]]
    s.submit("b", "m1", [*history, 9, 9], 3, stop_at_eos=False)
    (step,) = s.steps()
    # the answer's last token was never fed: it comes with the new ones, after the 6 positions in the KV
    assert step.tokens.tolist() == [history[-1], 9, 9] and (step.cache_len, step.pos0) == (6, 6)
    assert step.slot == 0 and step.zeros == ()
    events = s.complete("b", ring.run(step))
    for _ in range(2):
        (step,) = s.steps()
        events += s.complete("b", ring.run(step))
    done = next(e for e in events if isinstance(e, Finished))
    assert done.cached == 6 and SlotFreed(0, parked=True) in events
    assert s.parked == 1 and s.free_slots == 2


def test_a_prompt_sharing_little_takes_an_unused_slot_then_the_oldest_parked():
    s = Scheduler(slots=2, context=64, eos_ids=frozenset({EOS}))
    ring = FakeRing(2)
    for rid, prompt in (("a", [3, 4, 5]), ("b", [3, 8, 8])):  # b shares 1 position with a's 4
        s.submit(rid, "m1", prompt, 2, stop_at_eos=False)
        drive(s, ring)
    assert s.parked_slots() == [0, 1]  # b did not take a's conversation: a slot nobody used was left
    s.submit("c", "m1", [9, 9], 2, stop_at_eos=False)
    (step,) = s.steps()
    assert (step.slot, step.cache_len) == (0, 0)  # slot 0 parked first: reset by this fresh step
    s.complete("c", ring.run(step))
    drive(s, ring)
    s.submit("d", "m1", [3, 7], 2, stop_at_eos=False)
    (step,) = s.steps()
    assert (step.slot, step.cache_len, step.pos0) == (1, 0, 0)  # the oldest, reset: 1 shared position is not kept


def test_off_frees_every_slot_and_a_failed_ring_trusts_no_parked_kv():
    s = Scheduler(slots=1, context=64, prompt_cache=False)
    s.submit("a", "m1", [3, 4], 1)
    (step,) = s.steps()
    assert s.complete("a", 5) == [TokenOut("a", "m1", 5), Finished("a", "m1", "length"), SlotFreed(0)]
    on = Scheduler(slots=2, context=64)
    on.submit("a", "m1", [3, 4], 1)
    (step,) = on.steps()
    on.complete("a", 5)
    assert on.parked == 1
    on.fail_all("the ring broke")
    assert on.parked == 0 and on.free_slots == 2
    on.submit("b", "m1", [3, 4, 5], 1)
    (step,) = on.steps()
    assert step.cache_len == 0  # a new ring's stages start empty


def test_a_full_slot_with_masked_positions_is_fed_again_and_the_answer_runs_its_length():
    """Rejected drafts inside a reused prefix keep their physical room: when the slot is full and
    the request still has logical room, its history goes into the reset slot again (a
    compaction), so the answer is as long, and the same, as in a fresh slot."""
    def answer(prompt_cache: bool):
        s = Scheduler(slots=1, context=40, eos_ids=frozenset(), prompt_cache=prompt_cache, speculate="ngram")
        ring = FakeRing(1)
        s.submit("a", "m1", [4] * 8, 8, stop_at_eos=False)
        first, _ = drive(s, ring)  # n-gram drafts of the repeated 4s, some rejected: masked
        s.submit("b", "m1", [4] * 8 + first["a"] + [9], 100, stop_at_eos=False)  # the next turn
        answers.append(first["a"])
        steps, events = [], []
        for _ in range(300):
            batch = s.steps()
            if not batch:
                break
            steps += batch
            for step in batch:
                events += s.complete(step.req_id, ring.run(step))
        return [e.token for e in events if isinstance(e, TokenOut)], steps, events

    answers = []
    fresh, _, _ = answer(False)
    got, steps, events = answer(True)
    prompt_b, a_last = [4] * 8 + answers[1] + [9], answers[1][-1]
    assert got == fresh and len(got) == 40 - 17  # the context less the prompt's 17 tokens
    first = steps[0]  # a's 15 fed tokens are shared (its last answer token was never fed)
    assert first.zeros and first.cache_len == 15 + len(first.zeros) and first.tokens.tolist() == [a_last, 9]
    assert next(e for e in events if isinstance(e, Finished)).cached == 15
    resets = [st for st in steps if st.cache_len == 0]
    assert len(resets) == 1
    refed = resets[0].tokens.tolist()
    assert refed == (prompt_b + got)[: len(refed)] and len(refed) > len(prompt_b)


# --- the backends' cut -------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
def test_a_slot_cut_back_continues_as_a_fresh_one(backend, chain_factory):
    """trim(slot, n) keeps the first n physical positions: what follows is computed as in a slot
    fed only those n, alone and as a row of a batch (OpenVINO's row groups)."""
    import numpy as np

    shard = chain_factory(backend, 3, "f32").shards[0]  # embeds ids: feeds take token ids

    def feed(slot, ids, cache_len):
        return feed_through([shard], [slot], ids, cache_len)

    prefix, old, new = [1, 400, 2000, 17, 9], [33, 34, 35, 36], [77, 78, 79]
    fresh = shard.open_slot()
    feed(fresh, prefix, 0)
    want = feed(fresh, new, len(prefix))
    reused, other = shard.open_slot(), shard.open_slot()
    try:
        feed(reused, prefix + old, 0)
        shard.trim(reused, len(prefix))
        np.testing.assert_allclose(feed(reused, new, len(prefix)), want, rtol=1e-4, atol=1e-4)
        # as a row of a batch: the row's KV past the cut goes, the other row's stays
        feed(other, [5, 6], 0)
        ids = lambda xs: np.array(xs, np.int64)  # noqa: E731
        shard.forward_batch([reused, other], [ids(old[:1]), ids([7])],
                            [np.array([len(prefix) + 3]), np.array([2])],
                            [np.ones(len(prefix) + 4, np.int64), np.ones(3, np.int64)])  # fmt: skip
        shard.trim(reused, len(prefix) + 3)
        shard.trim(reused, len(prefix))
        got, _ = shard.forward_batch([reused, other], [ids(new), ids([8])],
                                     [np.arange(len(prefix), len(prefix) + 3), np.array([3])],
                                     [np.ones(len(prefix) + 3, np.int64), np.ones(4, np.int64)])  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError):
            shard.trim(reused, 100)
        shard.trim(reused, 0)  # a reset
        np.testing.assert_allclose(feed(reused, prefix + new, 0)[len(prefix):], want, rtol=1e-4, atol=1e-4)
    finally:
        for slot in (fresh, reused, other):
            shard.close_slot(slot)


ASKED_AGAIN_BOUND = 0.15


def test_a_question_asked_again_gets_the_first_asks_logits_at_serving_precision(chain_factory, default_tokenizer):
    """The prompt cache at serving precision: the first ask feeds the chat prompt in one forward,
    so its last position attends to the prompt's K/V as computed; asked again, the prefix comes
    from the KV cache and only the last token is fed. The two must give the same first-token
    logits within the cache's rounding, or a greedy answer changes when the question comes back
    (with the plugin's default u8 KV cache the logits moved by 0.57 on an AVX2-only CPU and
    "The capital of France is Paris." became "L'Étoile, la Mar": tests/test_api_model.py)."""
    import numpy as np

    from kafila.api import chat_prompt_ids

    chain = chain_factory("openvino", 2, "serving")
    ids = chat_prompt_ids(default_tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    answer = [504, 3575, 282, 4649, 314, 7042, 30]  # tokens the first ask left in the slot

    def feed(slots, tokens, start):
        return feed_through(chain.shards, slots, tokens, start)

    first, again = [s.open_slot() for s in chain.shards], [s.open_slot() for s in chain.shards]
    try:
        want = chain.logits(feed(first, ids, 0)[-1:])[0]
        feed(again, ids + answer, 0)
        for shard, slot in zip(chain.shards, again):
            shard.trim(slot, len(ids) - 1)
        got = chain.logits(feed(again, ids[-1:], len(ids) - 1))[0]
    finally:
        for shard, a, b in zip(chain.shards, first, again):
            shard.close_slot(a)
            shard.close_slot(b)
    # The f16 cache's rounding moves these logits by 0.04-0.05 on AVX-512 kernels and by 0.07 on
    # the AVX2 and pre-VNNI AVX-512 ones (tests/test_cpu_kinds.py runs this test on them); the
    # failures this guards against moved them by 0.57 (a u8 KV cache) and 0.65 (bf16 inference).
    assert np.abs(got - want).max() < ASKED_AGAIN_BOUND
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_an_openvino_slot_cut_back_copies_nothing_and_a_long_dead_tail_is_compacted(chain_factory):
    """At serving precision a cut copies nothing: the state stays, its tail masked, and the same
    prompt re-fed after two cuts gives the same hidden states up to the attention's rounding
    over a longer masked tail (bit-identical on an AMX CPU; 2e-3 on an AVX2-only one, whose f16
    cache the plugin's attention reads at half precision). A tail over COMPACT_DEAD positions that
    outweighs the rest is copied out once, exactly at f32."""
    import numpy as np

    from backends.openvino.shard import COMPACT_DEAD

    def feed(shard, slot, ids, cache_len):
        return feed_through([shard], [slot], ids, cache_len)

    shard = chain_factory("openvino", 3, "serving").shards[0]
    slot = shard.open_slot()
    try:
        prefix = [1, 400, 2000, 17, 9]
        feed(shard, slot, prefix + [33, 34], 0)
        shard.trim(slot, len(prefix))
        first = feed(shard, slot, [77, 78], len(prefix))
        shard.trim(slot, len(prefix))
        assert slot in shard._live  # masked, not copied
        again = feed(shard, slot, [77, 78], len(prefix))
        np.testing.assert_allclose(again, first, rtol=0, atol=1e-2)
    finally:
        shard.close_slot(slot)

    shard = chain_factory("openvino", 3, "f32").shards[0]
    fresh, slot = shard.open_slot(), shard.open_slot()
    try:
        feed(shard, fresh, prefix, 0)
        want = feed(shard, fresh, [77, 78], len(prefix))
        feed(shard, slot, prefix + list(range(100, 100 + COMPACT_DEAD + 1)), 0)
        shard.trim(slot, len(prefix))
        assert shard._held[slot] == len(prefix) and slot not in shard._live  # copied out
        np.testing.assert_allclose(feed(shard, slot, [77, 78], len(prefix)), want, rtol=1e-4, atol=1e-4)
    finally:
        shard.close_slot(fresh)
        shard.close_slot(slot)


# --- the real ring ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def ring_nodes(chain, limits, prompt_cache):
    """A 3-member ring of `chain`'s shards over fake links: its nodes, closed on exit."""
    from kafila.session.ring.node import RingNode
    from tests.fake_link import Pipe

    names = ["m1", "m2", "m3"]
    nodes = [RingNode(nm, "m1", names, s, limits, prompt_cache=prompt_cache) for nm, s in zip(names, chain.shards)]
    pipes = [Pipe() for _ in names]
    for i, node in enumerate(nodes):
        node.start(pipes[i - 1].reader, pipes[i])
    try:
        yield nodes
    finally:
        for n in nodes:
            await n.close()


def ring_turns(chain, limits, turns, prompt_cache: bool, concurrent: bool):
    from tests.test_speculate import _generate

    async def main():
        async with ring_nodes(chain, limits, prompt_cache) as nodes:
            out = []
            for turn in turns:
                if concurrent:
                    out += await asyncio.gather(*(_generate(nodes[i % 3], limits.context, ids, 16, False)
                                                  for i, ids in enumerate(turn)))  # fmt: skip
                else:
                    out += [await _generate(nodes[i % 3], limits.context, ids, 16, False) for i, ids in enumerate(turn)]
            return [t for t, _ in out], [st.extra.get("cached_tokens") for _, st in out]

    return asyncio.run(main())


@pytest.mark.model
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
def test_on_three_stages_second_turns_reuse_the_first_and_answer_as_without(backend, chain_factory, default_index,
                                                                            default_tokenizer):  # fmt: skip
    from kafila.session.wire.frames import Limits
    from tests.conftest import PROMPTS

    tok = default_tokenizer
    chain = chain_factory(backend, 3, "f32")
    limits = Limits(hidden=default_index.hparams.hidden, context=512, slots=4, vocab=default_index.hparams.vocab)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:4]]
    first = [tok.encode(tok.render_chat(c)) for c in chats]
    answers, _ = ring_turns(chain, limits, [first], prompt_cache=False, concurrent=False)
    second = [tok.encode(tok.render_chat([*c, {"role": "assistant", "content": tok.decode(a)},
                                         {"role": "user", "content": "Say that again, shorter."}]))
              for c, a in zip(chats, answers)]  # fmt: skip
    # then the second turns asked again (a client's "regenerate"): each takes its slot back, its
    # last answer masked out
    third = second
    for concurrent in (False, True):  # one by one, then four at once in batched rows
        want, cached_off = ring_turns(chain, limits, [first, second, third], prompt_cache=False, concurrent=concurrent)
        got, cached = ring_turns(chain, limits, [first, second, third], prompt_cache=True, concurrent=concurrent)
        assert got == want, concurrent
        assert set(cached_off) == {0}
        # each second turn found at least its first turn's prompt in the KV
        assert all(c >= len(p) - 1 for c, p in zip(cached[4:8], first)), (cached, [len(p) for p in first])
        assert cached[8:] == [len(p) - 1 for p in third], cached
