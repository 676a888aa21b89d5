"""Hybrid `qwen35` (Qwen3.5 dense: gated delta-net layers beside gated attention) on OpenVINO
computes what llama.cpp computes from the same GGUF (issue 35).

The file is tests/hybrid_gguf.py's small random model (llama.cpp's dummy tokenizer, token-id
prompts). llama.cpp (llama-cpp-python 0.3.36, f32 KV) is the yardstick: Kafila's LocalChain at
--precision f32, at 1 stage and split over 2 and 3 stages (a delta-net layer alone on a stage, an
attention layer alone), feeds a prompt in several prefill chunks (so the conv and matrix states
carry across chunks) and decodes 128 greedy ids, which must equal llama.cpp's.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import ShardSpec, load_shard, status
from backends.errors import BadInput
from backends.gguf import open_model
from tests.arch_gguf import write_arch_gguf
from tests.hybrid_gguf import SHAPE, write_qwen35_gguf
from tests.test_llamacpp_arch import check_against_llamacpp, kafila_greedy, needs_llamacpp

N_TOKENS = 128
CHUNK_TOKENS = 64  # the chain's first prefill chunk; later ones are smaller (scheduler.next_chunk)
PROMPT_IDS = [int(i) for i in np.random.default_rng(1).integers(0, SHAPE["vocab"], 150)]
needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe", "qwen3next"])
def qwen35(request, tmp_path_factory):
    """(path, index, llama.cpp's ids, llama.cpp's logits) for the random qwen35 (dense), qwen35moe
    (experts and a gated shared expert) and qwen3next (its fused legacy layout) files."""
    from tests.llamacpp_ref import greedy_run

    path = write_qwen35_gguf(tmp_path_factory.mktemp("hybrid") / f"{request.param}.gguf",
                             moe=request.param == "qwen35moe", arch=request.param)
    ids, logits = greedy_run(path, PROMPT_IDS, N_TOKENS)
    return path, open_model(path), ids, logits


def test_index_reads_which_blocks_are_recurrent(tmp_path):
    h = open_model(write_qwen35_gguf(tmp_path / "q.gguf")).hparams
    assert h.arch == "qwen35" and h.hybrid is not None
    assert h.hybrid.recurrent == (True, False, True, False)  # full_attention_interval 2
    assert (h.hybrid.k_heads, h.hybrid.v_heads, h.hybrid.state, h.hybrid.conv_kernel) == (2, 4, 16, 4)
    assert h.hybrid.rope_dims == 16 and h.head_dim == 32
    # per request, per delta-net block: (K − 1) × C conv values + Hv × S × S matrix values, f32
    assert h.hybrid.state_bytes_per_request(0) == 4 * (3 * (2 * 2 + 4) * 16 + 4 * 16 * 16)
    assert h.hybrid.state_bytes_per_request(1) == 0
    assert h.family.n_experts == 0


def test_index_reads_the_moe_hybrid(tmp_path):
    h = open_model(write_qwen35_gguf(tmp_path / "q.gguf", moe=True)).hparams
    assert h.arch == "qwen35moe" and h.hybrid.recurrent == (True, False, True, False)
    f = h.family
    assert (f.n_experts, f.n_experts_used, f.experts_renorm, f.shared_expert) == (8, 2, True, True)


def test_the_reference_backend_refuses_hybrid_blocks(tmp_path):
    path = write_qwen35_gguf(tmp_path / "q.gguf")
    with pytest.raises(BadInput, match="openvino and mlx backends only"):
        load_shard("reference", ShardSpec(path, 0, 4, True, True), "f32")


@needs_llamacpp
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
@pytest.mark.parametrize("ranges", [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]],
                         ids=["1-stage", "2-stages", "3-stages"])
def test_a_chain_gives_llamacpps_greedy_ids(qwen35, ranges, backend):
    from kafila.engine.chain import LocalChain

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    path, index, ref_ids, _ = qwen35
    assert len(set(ref_ids)) > N_TOKENS // 4, ref_ids  # the random model is not degenerate
    shards = [load_shard(backend, ShardSpec(path, a, b, a == 0, a == 0), "f32", index=index) for a, b in ranges]
    chain = LocalChain(shards, chunk_tokens=CHUNK_TOKENS)
    assert len(PROMPT_IDS) > CHUNK_TOKENS
    assert list(chain.generate(PROMPT_IDS, N_TOKENS)) == ref_ids


@needs_llamacpp
@needs_openvino
def test_openvino_logits_match_llamacpps_step_by_step(qwen35):
    """The whole prompt in one feed, then one id a step: logits within the suite's bound."""
    path, index, ref_ids, ref_logits = qwen35
    shard = load_shard("openvino", ShardSpec(path, 0, 4, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, 24), ref_ids[:24], ref_logits[:24])



def _speculative_ids(chain, prompt: list[int], truth: list[int], n: int, k: int = 3) -> tuple[list[int], list[int]]:
    """Greedy ids with k drafts a step, verified in one feed and the rejected ones cut off
    (LocalChain.cut → each shard's trim, what a ring stage does when the head's next step builds
    on fewer positions). Step s drafts s mod (k + 1) right ids (llama.cpp's) then wrong ones, so
    every count of accepted drafts occurs. Returns (ids, accepted drafts per step)."""
    cursor = chain.open()
    ids: list[int] = [chain.next_token(chain.prefill(cursor, prompt))]
    accepted: list[int] = []
    step = 0
    while len(ids) < n:
        right = step % (k + 1)
        drafts = [t if j < right else (t + 1) % SHAPE["vocab"] for j, t in enumerate(truth[len(ids): len(ids) + k])]
        hidden = chain.feed(cursor, [ids[-1], *drafts])
        picks = [int(i) for i in np.argmax(chain.logits(hidden), axis=-1)]  # after each fed position
        j = 0
        while j < len(drafts) and drafts[j] == picks[j]:
            j += 1
        rejected = len(drafts) - j
        if rejected:
            chain.cut(cursor, cursor.cache_len - rejected, cursor.logical - rejected)
        ids += drafts[:j] + [picks[j]]
        accepted.append(j)
        step += 1
    chain.close(cursor)
    return ids[:n], accepted


@needs_llamacpp
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
@pytest.mark.parametrize("ranges", [[(0, 4)], [(0, 1), (1, 3), (3, 4)]], ids=["1-stage", "3-stages"])
def test_cutting_back_rejected_drafts_keeps_llamacpps_ids(qwen35, ranges, backend):
    """A verify step that accepts j of k drafts leaves every stage's recurrent state as if only
    the accepted ones had been fed (backends/openvino/recurrent.py, backends/mlx/hybrid.py): the
    ids stay llama.cpp's."""
    from kafila.engine.chain import LocalChain

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    path, index, ref_ids, _ = qwen35
    shards = [load_shard(backend, ShardSpec(path, a, b, a == 0, a == 0), "f32", index=index) for a, b in ranges]
    chain = LocalChain(shards, chunk_tokens=CHUNK_TOKENS)
    ids, accepted = _speculative_ids(chain, PROMPT_IDS, ref_ids, 64)
    assert set(accepted) == {0, 1, 2, 3}, accepted  # every kind of step ran, cuts included
    assert ids == ref_ids[:64]


def test_a_hybrid_slot_is_not_cut_back_before_its_last_step(tmp_path):
    if not status("openvino").available:
        pytest.skip(status("openvino").reason)
    path = write_qwen35_gguf(tmp_path / "q.gguf")
    shard = load_shard("openvino", ShardSpec(path, 0, 4, True, True), "f32")
    slot = shard.open_slot()
    shard.forward(slot, np.arange(6), np.arange(6), np.ones(6, np.int64))
    shard.forward(slot, np.arange(6, 9), np.arange(6, 9), np.ones(9, np.int64))
    with pytest.raises(ValueError, match="cut back only within its last step"):
        shard.trim(slot, 5)  # a prompt-cache prefix: the recurrent state cannot go back there
    shard.trim(slot, 7)  # inside the last step: fine
    assert shard.forward(slot, np.array([1]), np.array([7]), np.ones(8, np.int64)).shape == (1, SHAPE["hidden"])


def test_a_captured_hybrid_slot_restores_its_recurrent_state(tmp_path):
    """capture/restore carries the conv and matrix states with the KV: the same next step."""
    if not status("openvino").available:
        pytest.skip(status("openvino").reason)
    path = write_qwen35_gguf(tmp_path / "q.gguf")
    shard = load_shard("openvino", ShardSpec(path, 0, 4, True, True), "f32")
    a, b = shard.open_slot(), shard.open_slot()
    shard.forward(a, np.arange(10, 20), np.arange(10), np.ones(10, np.int64))
    names = set(shard.capture(a))
    assert {"recurrent.0.conv", "recurrent.0.matrix", "past_key_values.1.key"} <= names
    shard.restore(b, shard.capture(a))
    step = (np.array([5]), np.array([10]), np.ones(11, np.int64))
    after = shard.forward(a, *step)
    np.testing.assert_array_equal(after, shard.forward(b, *step))
    # without the history (a fresh slot, the same token at the same position) the step differs
    fresh = shard.open_slot()
    assert not np.allclose(shard.forward(fresh, step[0], step[1], np.ones(1, np.int64)), after)


def test_the_planner_prices_a_requests_state_per_block_and_kv_only_for_attention(tmp_path):
    """The planner's model entry: KV for the attention blocks only (a mean per block) and the
    recurrent state as a fixed number of bytes per request (not per token): the live state, a
    verify step's start and the ends of the last KEPT_STATES turns' messages kept
    (backends.memory.RECURRENT_STATE_COPIES); a slot's state as the OpenVINO stage holds it at
    its most is exactly that figure, its copies included."""
    from backends.kept import KEPT_STATES
    from backends.memory import RECURRENT_STATE_COPIES
    from planner import member_bytes, parse_fleet

    index = open_model(write_qwen35_gguf(tmp_path / "q.gguf"))
    raw = index.planner_model()
    per_kv = 2 * SHAPE["kv_heads"] * SHAPE["head_dim"] * 2
    assert raw["kv_bytes_per_token_per_block"] == per_kv * 2 / 4  # 2 of 4 blocks attend
    state = index.hparams.hybrid.state_bytes_per_request(0) * 2  # 2 delta-net blocks
    assert raw["state_bytes_per_request_per_block"] == RECURRENT_STATE_COPIES * state / 4
    model = parse_fleet({"context": 64, "concurrency": 1, "anchor": "a", "model": raw,
                         "devices": [{"name": "a", "memory_gb": 1}]}).model  # fmt: skip
    one, three = (member_bytes(model, 4, True, 0, requests=n) for n in (1, 3))
    assert three - one == pytest.approx(2 * RECURRENT_STATE_COPIES * state)
    if status("openvino").available:
        shard = load_shard("openvino", ShardSpec(index.path, 0, 4, True, True), "f32", index=index)
        slot = shard.open_slot()
        shard.forward(slot, np.arange(5), np.arange(5), np.ones(5, np.int64))
        held = sum(s.state.data.nbytes for s in shard._reqs[slot].query_state() if s.name.startswith("recurrent."))
        assert held == index.state_bytes_per_request() == state
        # turns' ends kept (one more than it keeps), then a step of several positions (a verify step)
        for n in range(5, 5 + KEPT_STATES + 1):
            shard.checkpoint(slot)
            shard.forward(slot, np.arange(1), np.array([n]), np.ones(n + 1, np.int64))
        shard.forward(slot, np.arange(3), np.arange(n + 1, n + 4), np.ones(n + 4, np.int64))
        steps = shard._steps
        assert steps.kept.lengths(slot) == tuple(range(6, 6 + KEPT_STATES))  # the earliest went
        copies = [steps._last[slot].states, *steps.kept.states(slot)]
        assert held + sum(a.nbytes for c in copies for a in c.values()) == RECURRENT_STATE_COPIES * state


def test_prompt_cache_rules_for_hybrids_continue_whole_histories_only():
    from kafila.session.ring.prefix import ParkedSlots

    parked = ParkedSlots(whole=True)
    parked.park(0, [5, 6, 7, 8], [9], prompt=3)  # position 9: a rejected draft at the tail, masked
    assert parked.best([5, 6, 7, 1, 2], 100) is None  # shares 3 of the 4 positions: starts afresh
    r = parked.best([5, 6, 7, 8, 1, 2], 100)
    assert (r.slot, r.shared, r.cache_len) == (0, 4, 4)


def test_prompt_cache_rules_for_hybrids_go_back_to_the_kept_state_at_the_last_prompts_end():
    """Every stage kept the state after the prompt (3 positions): a prompt that continues the
    prompt but not the answer goes back there; one that stops inside the prompt starts afresh."""
    from kafila.session.ring.prefix import ParkedSlots

    parked = ParkedSlots(whole=True)
    parked.park(0, [5, 6, 7, 8, 9], [], prompt=3, kept=(3,))
    assert parked.best([5, 6, 1, 2], 100) is None  # stops before the kept state
    r = parked.best([5, 6, 7, 1, 2], 100)  # the prompt again, another answer: the kept state
    assert (r.slot, r.shared, r.cache_len, r.kept) == (0, 3, 3, (3,))
    parked.park(0, [5, 6, 7, 8, 9], [], prompt=3, kept=(3,))
    r = parked.best([5, 6, 7, 8, 9, 4], 100)  # the whole history continued: all of it
    assert (r.slot, r.shared, r.cache_len) == (0, 5, 5)
    parked.park(0, [5, 6, 7, 8, 9], [], prompt=3)  # nothing kept (a stage without the state)
    assert parked.best([5, 6, 7, 1, 2], 100) is None


def test_prompt_cache_rules_for_hybrids_go_back_to_the_latest_kept_state_a_prompt_reaches():
    """A conversation's slot kept the state where each turn's messages ended (3, 7, 10): a turn
    that edits the second message goes back to the first turn's state, one that edits the third
    to the second's; the kept states after the one gone back to are gone with the cut."""
    from kafila.session.ring.prefix import ParkedSlots

    history = [5, 6, 7, 1, 2, 3, 4, 8, 9, 10, 11, 12]
    parked = ParkedSlots(whole=True)
    for prompt, want in (([5, 6, 7, 1, 2, 30, 31], (3, 3, (3,))),  # the second message edited
                         ([5, 6, 7, 1, 2, 3, 4, 8, 30], (7, 7, (3, 7))),  # the third
                         ([5, 6, 7, 1, 2, 3, 4, 8, 9, 10, 30], (10, 10, (3, 7, 10))),  # the last turn's answer
                         ([5, 6, 30], None)):  # the first message edited: afresh
        parked.park(0, history, [], prompt=10, kept=(3, 7, 10))
        r = parked.best(prompt, 100)
        assert (r.shared, r.cache_len, r.kept) == want if want else r is None, prompt


def test_the_head_mirrors_the_kept_states_every_stage_holds():
    """backends/kept.py's rules, applied by a stage (KeptStates) and by the head without asking
    it (kept_after, kept_until): at most KEPT_STATES, the earliest going first; a cut drops those
    after it and goes back to one kept at exactly its length."""
    from backends.kept import KEPT_STATES, KeptStates, kept_after, kept_until

    stage, head = KeptStates(), ()
    for length in range(10, 10 + 6 * KEPT_STATES, 3):
        stage.keep(0, length, f"at {length}")
        head = kept_after(head, length)
        assert stage.lengths(0) == head and len(head) <= KEPT_STATES
    assert head[0] == 10 + 3 * KEPT_STATES  # the earliest went
    cut = head[1]
    assert stage.back_to(0, cut) == f"at {cut}" and stage.lengths(0) == kept_until(head, cut) == head[:2]
    assert stage.back_to(0, cut - 1) is None and stage.lengths(0) == head[:1]  # not kept there: dropped
    stage.keep(0, head[0], "again")  # keeping at a kept length replaces it
    assert stage.states(0) == ["again"]


@needs_llamacpp
@needs_openvino
def test_on_three_stages_a_second_turn_feeds_only_what_is_new_and_answers_as_afresh(tmp_path):
    """The ring's prompt cache on a hybrid file at f32 (prefix.WHOLE): each second turn (its first
    turn, the answer, then new ids) finds its first turn's history in the slot and answers as with
    the cache off; the same second turn asked again (a "regenerate", sharing less than the slot
    holds) goes back to the state kept at the end of the first turn's prompt, with the same ids."""
    from kafila.engine.chain import LocalChain
    from kafila.session.ring.prefix import WHOLE
    from kafila.session.wire.frames import Limits
    from tests.test_prompt_cache import ring_turns

    path = write_qwen35_gguf(tmp_path / "q.gguf", moe=True)
    index = open_model(path)
    chain = LocalChain([load_shard("openvino", ShardSpec(path, a, b, a == 0, a == 0), "f32", index=index)
                        for a, b in ((0, 1), (1, 3), (3, 4))], chunk_tokens=CHUNK_TOKENS)  # fmt: skip
    limits = Limits(hidden=SHAPE["hidden"], context=512, slots=4, vocab=SHAPE["vocab"])
    rng = np.random.default_rng(7)
    first = [[int(i) for i in rng.integers(0, SHAPE["vocab"], n)] for n in (20, 70, 33, 9)]
    answers, _ = ring_turns(chain, limits, [first], prompt_cache=False, concurrent=False)
    second = [p + a + [int(i) for i in rng.integers(0, SHAPE["vocab"], 5)] for p, a in zip(first, answers)]
    for concurrent in (False, True):
        want, _ = ring_turns(chain, limits, [first, second, second], prompt_cache=False, concurrent=concurrent)
        got, cached = ring_turns(chain, limits, [first, second, second], prompt_cache=WHOLE, concurrent=concurrent)
        assert got == want, concurrent
        # the first turn's slot held its prompt and all of its answer but the last id (never fed)
        assert cached[4:8] == [len(p) + len(a) - 1 for p, a in zip(first, answers)], cached
        assert cached[8:] == [len(p) for p in first], cached  # not the second's end: its last id is fed


def _ring_answers(chain, limits, requests, prompt_cache):
    """Each GenerationRequest in turn, typed at the members in turn, on a 3-member ring of
    `chain`'s shards: (ids, cached_tokens) of each."""
    import asyncio

    from kafila.engine import GenerationStats
    from kafila.engine.ring import RingEngine
    from tests.test_prompt_cache import ring_nodes

    async def main():
        async with ring_nodes(chain, limits, prompt_cache) as nodes:
            out = []
            for i, req in enumerate(requests):
                e = RingEngine("m", limits.context, None, dict)
                e.node, st = nodes[i % 3], GenerationStats()
                out.append(([t async for t in e.generate(req, st)], st.extra.get("cached_tokens")))
            return out

    return asyncio.run(main())


@needs_openvino
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
@pytest.mark.parametrize("back", [0, 3])
def test_a_turn_that_repeats_the_messages_but_not_the_answer_goes_back_to_the_kept_state(tmp_path, backend, back):
    """A chat template that renders an answer otherwise than it was generated (Qwen3.5's drops the
    reasoning and the `<think>` its prompt opened) shares only the messages with the slot: every
    stage goes back to the state it kept where the first prompt's messages ended (keep_at, `back`
    ids before the prompt's end; 0: the prompt's end), the turn feeds only what follows (cached =
    keep_at) and answers as with the cache off: on the ring (3 stages) and in one process
    (`kafila serve`'s engine), at f32."""
    from kafila.engine import GenerationRequest, GenerationStats
    from kafila.engine.chain import LocalChain
    from kafila.engine.local import chain_source
    from kafila.engine.prompt_cache import ParkedCursors
    from kafila.session.ring.prefix import WHOLE
    from kafila.session.wire.frames import Limits

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    path = write_qwen35_gguf(tmp_path / "q.gguf", moe=True)
    index = open_model(path)
    chain = LocalChain([load_shard(backend, ShardSpec(path, a, b, a == 0, a == 0), "f32", index=index)
                        for a, b in ((0, 1), (1, 3), (3, 4))], chunk_tokens=CHUNK_TOKENS)  # fmt: skip
    limits = Limits(hidden=SHAPE["hidden"], context=512, slots=4, vocab=SHAPE["vocab"])
    rng = np.random.default_rng(11)
    first = [[int(i) for i in rng.integers(0, SHAPE["vocab"], n)] for n in (20, 70, 33, 9)]
    keep = [len(p) - back for p in first]
    # the next turn: the messages again, then the answer as the template renders it and a new message
    edited = [p[:k] + [int(i) for i in rng.integers(0, SHAPE["vocab"], 6 + 5)] for p, k in zip(first, keep)]
    asks = [GenerationRequest(tuple(p), 16, stop_at_eos=False, keep_at=k if back else 0) for p, k in zip(first, keep)]
    asks += [GenerationRequest(tuple(e), 16, stop_at_eos=False) for e in edited]
    want = [ids for ids, _ in _ring_answers(chain, limits, asks, prompt_cache=False)]
    got = _ring_answers(chain, limits, asks, prompt_cache=WHOLE)
    assert [ids for ids, _ in got] == want
    assert [c for _, c in got[4:]] == keep
    source = chain_source(chain, frozenset(), 512, ParkedCursors(chain, 4, whole=True))
    for ask, again, w, k in zip(asks, asks[4:], want[4:], keep):
        list(source(ask, GenerationStats()))
        stats = GenerationStats()
        assert list(source(again, stats)) == w
        assert stats.extra["cached_tokens"] == k


@needs_openvino
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
@pytest.mark.parametrize("kind", ["qwen35moe", "gemma3"])
def test_an_edited_earlier_message_goes_back_to_the_turn_before_it(tmp_path, backend, kind):
    """Three turns of two conversations, each turn's messages repeated by the next with its answer
    rendered otherwise (as Qwen3.5's template does), then the second message edited: every stage
    kept the state where each turn's messages ended, so turn k feeds from turn k-1's end
    (cached = its keep_at) and the edit goes back to the first turn's end, on the ring (3 stages)
    and in one process, answering as with the cache off at f32. On a hybrid (the recurrent state
    kept) and on a sliding-window model of window 8 (on OpenVINO the window kept: its windowed
    layers hold only the newest positions, window.py)."""
    from kafila.engine import GenerationRequest, GenerationStats
    from kafila.engine.chain import LocalChain
    from kafila.engine.local import chain_source
    from kafila.engine.prompt_cache import ParkedCursors
    from kafila.session.ring.prefix import WHOLE
    from kafila.session.wire.frames import Limits

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    if kind == "gemma3":
        path, shape = write_arch_gguf(tmp_path / "g.gguf", kind, blocks=4, tiny_vocab=256), {"hidden": 64, "vocab": 256}
    else:
        path, shape = write_qwen35_gguf(tmp_path / "q.gguf", moe=True), SHAPE
    index = open_model(path)
    chain = LocalChain([load_shard(backend, ShardSpec(path, a, b, a == 0, a == 0), "f32", index=index)
                        for a, b in ((0, 1), (1, 3), (3, 4))], chunk_tokens=CHUNK_TOKENS)  # fmt: skip
    limits = Limits(hidden=shape["hidden"], context=512, slots=4, vocab=shape["vocab"])
    rng = np.random.default_rng(5)

    def ids(n: int) -> list[int]:
        return [int(i) for i in rng.integers(0, shape["vocab"], n)]

    # a turn: the history to the last messages' end, the last answer as rendered, a message, the
    # template's answer prefix (3 ids); keep_at: where the messages end
    turns = [[ids(n) + ids(3) for n in (40, 9)]]
    for _ in range(2):
        turns.append([t[:-3] + ids(6) + ids(5) + ids(3) for t in turns[-1]])
    edited = [t[: len(first) - 3 + 6] + ids(7) + ids(3) for t, first in zip(turns[1], turns[0])]
    asks = [GenerationRequest(tuple(p), 12, stop_at_eos=False, keep_at=len(p) - 3)
            for turn in (*turns, edited) for p in turn]  # fmt: skip
    want_cached = [0, 0] + [len(p) - 3 for turn in turns[:2] for p in turn] + [len(p) - 3 for p in turns[0]]
    want = [ids for ids, _ in _ring_answers(chain, limits, asks, prompt_cache=False)]
    got = _ring_answers(chain, limits, asks, prompt_cache=WHOLE)
    assert [ids for ids, _ in got] == want
    assert [c for _, c in got] == want_cached
    source = chain_source(chain, frozenset(), 512, ParkedCursors(chain, 4, whole=True))
    for ask, w, c in zip(asks, want, want_cached):
        stats = GenerationStats()
        assert list(source(ask, stats)) == w
        assert stats.extra["cached_tokens"] == c


class _HalfRightDrafter:
    """Drafts from the answer without speculation, the second of each draft wrong: every step
    accepts one draft and rejects the rest (a drafter around the thing under test, the ring's
    verification and every stage's cut of its recurrent state)."""

    def __init__(self, prompt: list[int], answer: list[int]) -> None:
        self.truth = prompt + answer

    def propose(self, req_id: str, history, k: int) -> tuple[int, ...]:
        n = len(history)
        right = self.truth[n: n + k]
        return tuple(t if j != 1 else (t + 1) % 128 for j, t in enumerate(right))

    def release(self, req_id: str) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("backend", ["openvino", "mlx"])
@pytest.mark.parametrize("name", ["qwen35-dense", "qwen35moe-moe", "qwen3next-moe"])
def test_speculation_on_a_ring_gives_the_ids_without_it(name, backend):
    """The ring's speculation on llama.cpp's own random hybrid models (2 blocks, one a stage) at
    f32, drafts accepted and rejected at every step: every stage cuts its recurrent state back
    inside the verify step (Scheduler's `recurrent`), and the ids are those without speculation."""
    from kafila.engine.chain import LocalChain
    from tests.llamacpp_files import llama_arch_models
    from tests.test_speculate import N_NEW, _exactness

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    path = str(llama_arch_models(("qwen35", "qwen35moe", "qwen3next"))[name])
    index = open_model(path)
    chain = LocalChain([load_shard(backend, ShardSpec(path, a, a + 1, a == 0, a == 0), "f32", index=index)
                        for a in range(index.hparams.n_blocks)], chunk_tokens=CHUNK_TOKENS)  # fmt: skip
    prompt = [int(i) for i in np.random.default_rng(1).integers(0, 128, 30)]
    drafter = _HalfRightDrafter(prompt, list(chain.generate(prompt, N_NEW + 8)))
    total = _exactness(chain.shards, index, [prompt], speculate="draft", drafter=drafter)
    print(f"drafts on the {name} ring: {total.accepted} of {total.drafted} accepted")


@needs_llamacpp
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_a_quantized_hybrid_with_a_real_tokenizer_gives_llamacpps_ids(tmp_path, ftype, backend):
    """A qwen35moe file with Qwen2's tokenizer, hidden 256 (K-quant rows), quantized by llama.cpp's
    own quantizer: 128 greedy ids after a 150-id prompt (several prefill chunks) equal llama.cpp's
    on the file's exactly dequantized weights, at 1 stage and 3 uneven stages, at f32."""
    from kafila.engine.chain import LocalChain
    from tests.llamacpp_ref import greedy_run, quantize
    from tests.test_llamacpp_quant import write_f32_copy

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    shape = dict(hidden=256, head_dim=64, rope_dims=32, ffn=256, k_heads=2, v_heads=4, state=64)
    src = write_qwen35_gguf(tmp_path / "f32.gguf", moe=True, tokenizer=True, shape=shape,
                            experts=dict(ffn=256, shared_ffn=256))  # fmt: skip
    path = quantize(src, str(tmp_path / f"{ftype}.gguf"), ftype)
    index = open_model(path)
    assert {t.qtype for t in index.tensors.values()} - {"F32"}, "nothing was quantized"
    prompt = [int(i) for i in np.random.default_rng(5).integers(0, 150_000, 150)]
    ref_ids, _ = greedy_run(write_f32_copy(path, str(tmp_path / "deq.gguf")), prompt, N_TOKENS)
    assert len(set(ref_ids)) > 8, ref_ids
    for ranges in ([(0, 4)], [(0, 1), (1, 3), (3, 4)]):
        shards = [load_shard(backend, ShardSpec(path, a, b, a == 0, a == 0), "f32", index=index) for a, b in ranges]
        assert list(LocalChain(shards, chunk_tokens=CHUNK_TOKENS).generate(prompt, N_TOKENS)) == ref_ids, ranges
