"""Speculative decoding on the ring (issue 12): the n-gram drafter, greedy acceptance, the
scheduler's masked rewind, bad input, and exactness on real shards of the default model.

Exactness is the contract: greedy with `ngram` gives the ids of decoding without speculation.
The real-model tests run one in-process ring of three OpenVINO stages (as test_long_prompts) with
`speculate="ngram"` and ask each prompt twice, with the API's per-request `speculate` off and on."""

import asyncio

import numpy as np
import pytest

from kafila.engine import GenerationRequest, GenerationStats
from kafila.engine.ring import RingEngine
from kafila.session.ring.speculation.draft import ModelDrafter
from kafila.session.wire.frames import FrameDecoder, Limits, Request, encode
from kafila.session.ring.node import RingNode
from kafila.session.ring.scheduler import Finished, Scheduler, TokenOut
from kafila.session.ring.speculation.speculate import SpecStats, accept, ngram_draft
from tests.fake_link import Pipe

N_NEW = 64

# --- the drafter and acceptance (no model) ------------------------------------------------------


def test_ngram_draft_proposes_what_followed_the_latest_match():
    h = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_draft(h, 2) == (7, 8)  # the latest earlier "1 2 3" was followed by 7 8
    assert ngram_draft(h, 10) == (7, 8, 1, 2, 3)  # as much as there is
    assert ngram_draft([5, 6, 7, 5, 6], 3) == (7, 5, 6)
    assert ngram_draft([1, 2, 3, 4], 4) == ()  # no suffix of 2+ tokens occurs earlier
    assert ngram_draft([1, 2, 1, 2], 0) == ()
    assert ngram_draft([], 3) == () and ngram_draft([4], 3) == ()
    # the longest suffix wins over a more recent shorter one
    assert ngram_draft([9, 1, 2, 5, 0, 2, 6, 9, 1, 2], 1) == (5,)


def test_accept_takes_the_matching_prefix_plus_one():
    assert accept((4, 5, 6), (4, 5, 6, 7)) == (4, 5, 6, 7)  # all accepted + the bonus
    assert accept((4, 5, 6), (4, 9, 6, 7)) == (4, 9)  # the first mismatch is the model's token
    assert accept((4, 5, 6), (3, 5, 6, 7)) == (3,)
    assert accept((), (8,)) == (8,)
    with pytest.raises(ValueError):
        accept((4, 5), (4, 5))


def test_spec_stats_round_trip_pairs():
    s = SpecStats()
    s.add(4, 3)
    s.add(0, 1)
    assert (s.drafted, s.accepted, s.trips, s.tokens) == (4, 2, 2, 4)
    assert s.as_dict() == {"drafted": 4, "accepted": 2, "acceptance_rate": 0.5, "tokens_per_trip": 2.0,
                           "drafts_per_trip": 2.0}  # fmt: skip
    assert SpecStats.from_pairs(s.as_pairs() + (("step_ms", 3.0),)) == s
    assert SpecStats.from_pairs((("step_ms", 3.0),)) is None


# --- the scheduler: drafts, acceptance, zeros ---------------------------------------------------


def test_scheduler_verifies_drafts_and_masks_the_rejected_positions():
    s = Scheduler(slots=1, context=64, eos_ids=frozenset({0}), speculate="ngram", draft_k=3, adaptive_k=False)
    prompt = [5, 6, 7, 8, 5, 6]
    s.submit("a", "o", prompt, max_new=10)
    (step,) = s.steps()
    assert step.drafted == 0 and len(step.tokens) == 6
    assert s.complete("a", 7) == [TokenOut("a", "o", 7)]  # history …5 6 7: "5 6 7" → 8 5 6
    (step,) = s.steps()
    assert step.tokens.tolist() == [7, 8, 5, 6] and step.drafted == 3
    assert (step.cache_len, step.pos0, step.zeros) == (6, 6, ())
    assert s.drafted("a") == 3
    # the model agrees with the first draft only: 8 accepted, then its own 9
    events = s.complete("a", accept(step.tokens[1:], [8, 9, 9, 9]))  # what the head's verify yields
    assert events == [TokenOut("a", "o", 8), TokenOut("a", "o", 9)]
    (step,) = s.steps()
    # positions 6 (7) and 7 (8) stay live; 8 and 9 (the rejected 5 6) are masked out
    assert (step.cache_len, step.pos0, step.zeros) == (10, 8, (8, 9))
    assert step.tokens.tolist()[0] == 9


def test_scheduler_without_speculation_or_when_asked_not_to_never_drafts():
    for session, per_request in (("off", True), ("ngram", False)):
        s = Scheduler(slots=1, context=64, speculate=session)
        s.submit("a", "o", [1, 2, 1, 2, 1], max_new=5, speculate=per_request)
        s.steps()
        s.complete("a", 2)
        (step,) = s.steps()
        assert step.drafted == 0 and len(step.tokens) == 1


def test_scheduler_speculation_stops_at_eos_and_max_new_inside_a_trip():
    s = Scheduler(slots=1, context=64, eos_ids=frozenset({0}), speculate="ngram", draft_k=4, adaptive_k=False)
    s.submit("a", "o", [1, 2, 3, 1, 2], max_new=3)
    s.steps()
    s.complete("a", 3)  # history 1 2 3 1 2 3 → drafts 1 2 (k = min(4, wanted − 1 = 1, …)) → 1
    (step,) = s.steps()
    assert step.drafted == 1
    events = s.complete("a", accept(step.tokens[1:], [1, 2]))  # accepted 1, bonus 2: max_new reached
    assert [e.token for e in events if isinstance(e, TokenOut)] == [1, 2]
    assert isinstance(events[2], Finished) and events[2].finish == "length"
    assert events[2].spec is not None and events[2].spec.drafted == 1
    s.submit("b", "o", [1, 2, 3, 1, 2], max_new=9)
    s.steps()
    s.complete("b", 3)
    (step,) = s.steps()
    events = s.complete("b", accept(step.tokens[1:], [1, 0, 5, 5, 5][: step.drafted + 1]))  # EOS after a draft
    assert [e.token for e in events if isinstance(e, TokenOut)] == [1]
    assert events[1].finish == "stop"


def test_scheduler_speculation_never_runs_out_of_context_earlier():
    """A request gets every token it would get without drafts, whatever is rejected: the
    drafter keeps physical room ≥ the tokens still wanted (so one that asks for the whole
    context never drafts: rejected positions are not reclaimed by compaction yet)."""
    context, prompt = 24, [1, 2, 3, 1, 2, 3, 1, 2]
    s = Scheduler(slots=1, context=context, speculate="ngram", draft_k=4, adaptive_k=False)
    s.submit("a", "o", prompt, max_new=10)
    out, events, drafted = [], [], 0
    while not any(isinstance(e, Finished) for e in events):
        assert len(out) < 100
        (step,) = s.steps()
        assert step.cache_len + len(step.tokens) <= context
        drafted += step.drafted
        # a model that rejects every draft: always 3
        token = accept(step.tokens[1:], [3] * (step.drafted + 1)) if step.drafted else 3
        events = s.complete("a", token)
        out += [e.token for e in events if isinstance(e, TokenOut)]
    assert drafted > 0
    assert len(out) == 10
    s.submit("b", "o", prompt, max_new=100)  # clamped to the 16 positions left: no room to draft
    s.steps()
    s.complete("b", 3)
    (step,) = s.steps()
    assert step.drafted == 0


def test_scheduler_refuses_bad_settings():
    with pytest.raises(ValueError, match="speculate"):
        Scheduler(1, 64, speculate="maybe")
    with pytest.raises(ValueError, match="draft_k"):
        Scheduler(1, 64, speculate="ngram", draft_k=-1)
    s = Scheduler(1, 64, speculate="ngram")
    s.submit("a", "o", [1, 2, 1, 2], max_new=8)
    s.steps()
    s.complete("a", 1)
    (step,) = s.steps()
    assert step.drafted
    with pytest.raises(ValueError, match="accepted drafts"):
        s.complete("a", (int(step.tokens[1]) + 1, 5))  # a token after a draft it did not accept
    with pytest.raises(ValueError, match="accepted drafts"):
        s.complete("a", (*step.tokens[1:].tolist(), 5, 5))  # more than drafts + 1


def test_request_frame_carries_speculate():
    lim = Limits(hidden=8, context=64, slots=2, vocab=50)
    for flag in (True, False):
        req = Request("r", "m2", "m1", 4, True, np.array([1, 2], dtype=np.int32), speculate=flag)
        (back,) = FrameDecoder(lim).feed(encode(req))
        assert back.speculate is flag


def test_api_refuses_a_speculate_that_is_not_a_boolean():
    from kafila.api._errors import ApiError
    from kafila.api._limits import ApiLimits
    from kafila.api._validate import sampling_of

    limits = ApiLimits()
    assert sampling_of({}, limits, ("max_tokens",)).speculate is True
    assert sampling_of({"speculate": False}, limits, ("max_tokens",)).speculate is False
    for bad in ("maybe", 1, []):
        with pytest.raises(ApiError) as err:
            sampling_of({"speculate": bad}, limits, ("max_tokens",))
        assert err.value.status == 400 and "speculate" in str(err.value)


# --- real shards: exactness round a ring of three OpenVINO stages --------------------------------


def _ring(shards, limits, eos_ids, speculate="ngram", adaptive_k=False, drafter=None, delay_s=0.0):
    """adaptive_k False: draft whenever the drafter can (choose_k would rightly draft little on a
    compute-bound in-process ring, and these tests are about verifying drafts)."""
    names = [f"m{i + 1}" for i in range(len(shards))]
    nodes = [RingNode(nm, "m1", names, s, limits, eos_ids=frozenset(eos_ids), speculate=speculate,
                      adaptive_k=adaptive_k, drafter=drafter if nm == "m1" else None)
             for nm, s in zip(names, shards)]  # fmt: skip
    pipes = [Pipe(delay_s=delay_s) for _ in names]
    for i, node in enumerate(nodes):
        node.start(pipes[i - 1].reader, pipes[i])
    return nodes


async def _generate(node, context, ids, n, speculate):
    e = RingEngine("m", context, None, dict)
    e.node = node
    st = GenerationStats()
    req = GenerationRequest(tuple(ids), n, stop_at_eos=False, speculate=speculate)
    return [t async for t in e.generate(req, st)], st


def _exactness(shards, index, prompts, asked_at=1, speculate="ngram", drafter=None, rejections=True, delay_s=0.0,
               seen=None):  # fmt: skip
    """`delay_s`: each hop's latency; `seen`: a list the ring's nodes are put in."""
    limits = Limits(hidden=index.hparams.hidden, context=1024, slots=2, vocab=index.hparams.vocab)

    async def main():
        nodes = _ring(shards, limits, (), speculate, drafter=drafter, delay_s=delay_s)
        if seen is not None:
            seen.extend(nodes)
        total = SpecStats()
        try:
            for ids in prompts:
                plain, st0 = await _generate(nodes[asked_at], 1024, ids, N_NEW, False)
                spec, st1 = await _generate(nodes[asked_at], 1024, ids, N_NEW, True)
                assert "speculation" not in st0.extra
                assert len(plain) == N_NEW
                assert spec == plain, (ids, plain, spec)
                d = st1.extra["speculation"]
                total.drafted += d["drafted"]
                total.accepted += d["accepted"]
        finally:
            for n in nodes:
                await n.close()
        return total

    total = asyncio.run(main())
    # the drafter did draft, and some drafts were rejected (masked rewinds happened)
    assert total.drafted > 0 and 0 < total.accepted, total
    assert total.accepted < total.drafted or not rejections, total
    return total


@pytest.mark.model
def test_ngram_on_three_openvino_stages_gives_the_ids_without_speculation(chain_factory, prompt_ids,
                                                                          default_index):  # fmt: skip
    chain = chain_factory("openvino", 3, "f32")
    _exactness(chain.shards, default_index, prompt_ids)


@pytest.mark.model
def test_origin_drafts_on_three_openvino_stages_give_the_ids_without_speculation(chain_factory, prompt_ids,
                                                                                 default_index):  # fmt: skip
    """speculate="origin", asked at m3 (two hops from the head): its drafts ride the activations
    as bytes over the pipes, the head verifies them or drafts its own; the same ids as plain."""
    chain = chain_factory("openvino", 3, "f32")
    _exactness(chain.shards, default_index, prompt_ids, asked_at=2, speculate="origin")


@pytest.mark.model
@pytest.mark.slow  # MLX's CPU kernels: 8 prompts × 64 tokens twice take a minute or two
def test_ngram_on_a_mixed_openvino_mlx_chain_gives_the_ids_without_speculation(chain_factory, prompt_ids,
                                                                                default_index):  # fmt: skip
    chain = chain_factory("openvino,mlx", 2, "f32")
    _exactness(chain.shards, default_index, prompt_ids)


@pytest.mark.model
def test_concurrent_speculating_requests_each_get_their_solo_ids(chain_factory, prompt_ids, default_index):
    """Four requests at once, speculating (each its own drafts, acceptance and masked positions in
    its own slot), each equal to its plain solo run."""
    chain = chain_factory("openvino", 3, "f32")
    limits = Limits(hidden=default_index.hparams.hidden, context=1024, slots=4, vocab=default_index.hparams.vocab)

    async def main():
        nodes = _ring(chain.shards, limits, ())
        try:
            solo = [(await _generate(nodes[1], 1024, ids, 32, False))[0] for ids in prompt_ids[:4]]
            together = await asyncio.gather(*(_generate(nodes[i % 3], 1024, ids, 32, True)
                                              for i, ids in enumerate(prompt_ids[:4])))  # fmt: skip
            return solo, together
        finally:
            for n in nodes:
                await n.close()

    solo, together = asyncio.run(main())
    assert [t for t, _ in together] == solo
    assert sum(st.extra["speculation"]["drafted"] for _, st in together) > 0


@pytest.mark.model
def test_a_draft_model_on_three_openvino_stages_gives_the_ids_without_speculation(chain_factory, prompt_ids,
                                                                                  default_index):  # fmt: skip
    """speculate="draft": the default model at serving precision drafts for itself at f32 (an
    upper bound on acceptance; its bf16/u8-KV numerics still disagree now and then)."""
    chain = chain_factory("openvino", 3, "f32")
    drafter = ModelDrafter(chain_factory("openvino", 1, "serving"), max_positions=2048)
    total = _exactness(chain.shards, default_index, prompt_ids, speculate="draft", drafter=drafter,
                       rejections=False)  # fmt: skip
    assert total.accepted > 0.5 * total.drafted, total
    assert not drafter._states  # every request's cursor was freed


@pytest.mark.model
def test_drafts_made_while_a_step_is_out_are_used_and_change_nothing(chain_factory, prompt_ids, default_index):
    """20 ms a hop: while each verifying step is out, the head's draft model drafts on from the
    drafts it sent (head_driver._draft_ahead). The model drafting for itself at f32 agrees with
    the ring, so the next step's drafts are ready when the step is back; the ids are the plain
    ones and every request's cursor is freed."""
    chain = chain_factory("openvino", 3, "f32")
    drafter = ModelDrafter(chain_factory("openvino", 1, "f32"), max_positions=2048)
    nodes = []
    _exactness(chain.shards, default_index, prompt_ids[:2], speculate="draft", drafter=drafter, rejections=False,
               delay_s=0.02, seen=nodes)  # fmt: skip
    assert nodes[0].drafts_ahead_used > 0
    assert not drafter._states


@pytest.mark.model
def test_the_draft_models_rewind_equals_drafting_afresh(chain_factory, prompt_ids):
    """After the ring rejects some of its drafts, the drafter masks them out of its own KV: what it
    proposes next equals what a drafter that never saw the rejected drafts proposes."""
    kept = ModelDrafter(chain_factory("openvino", 1, "f32"), max_positions=4096)
    history = list(prompt_ids[3])
    for _ in range(4):
        drafts = kept.propose("r", history, 5)
        assert len(drafts) == 5
        history += [drafts[0], (drafts[1] + 1) % 1000]  # the first accepted, then the ring's own token
        fresh = ModelDrafter(kept.chain, max_positions=4096)
        assert kept.propose("r", history, 5) == fresh.propose("f", history, 5)
        fresh.close()
        history.append(kept.propose("r", history, 1)[0])
    kept.release("r")
    kept.close()
    assert not kept._states


@pytest.mark.model
def test_masked_rewind_on_every_stage_equals_never_feeding_the_drafts(chain_factory, prompt_ids):
    """The ring's own feeds (Step → every stage's mask and positions), done by hand on three
    stages: a verifying step with rejected drafts, then the next step, gives the same hidden
    states (and token) as never having fed the rejected drafts."""
    chain = chain_factory("openvino", 3, "f32")
    shards = chain.shards
    ids = np.asarray(prompt_ids[2], dtype=np.int64)
    n = len(ids)

    def feed(slots, x, cache_len, pos0, zeros):
        mask = np.ones(cache_len + len(x), dtype=np.int64)
        mask[list(zeros)] = 0
        pos = np.arange(pos0, pos0 + len(x), dtype=np.int64)
        for s, slot in zip(shards, slots):
            x = s.forward(slot, x, pos, mask)
        return x

    plain = [s.open_slot() for s in shards]
    spec = [s.open_slot() for s in shards]
    try:
        h = feed(plain, ids, 0, 0, ())
        feed(spec, ids, 0, 0, ())
        t0 = int(np.argmax(chain.logits(h[-1:])[0]))
        # plain: t0 then d1 (accepted); spec: t0 d1 d2 d3 with d2, d3 rejected
        d = [t0, 1274, 3548, 28]
        hp = feed(plain, np.array(d[:2]), n, n, ())
        hs = feed(spec, np.array(d), n, n, ())
        np.testing.assert_allclose(hs[:2], hp, atol=1e-4 * np.abs(hp).max())
        nxt = np.array([int(np.argmax(chain.logits(hp[-1:])[0]))])
        hp2 = feed(plain, nxt, n + 2, n + 2, ())
        hs2 = feed(spec, nxt, n + 4, n + 2, (n + 2, n + 3))
        lp, ls = chain.logits(hp2)[0], chain.logits(hs2)[0]
        assert np.argmax(lp) == np.argmax(ls)
        np.testing.assert_allclose(ls, lp, rtol=0, atol=1e-4 * np.abs(lp).max())
    finally:
        for s, a, b in zip(shards, plain, spec):
            s.close_slot(a)
            s.close_slot(b)


def test_drafts_made_ahead_hold_only_after_every_draft_and_the_guessed_token():
    from kafila.session.ring.speculation.draft import ahead_drafts

    base = (1, 2, 3, 7, 8)  # history 1 2 3, drafts 7 8 sent
    ahead = (9, 4, 5)  # the guess at the target's token after 8, then two more
    assert ahead_drafts(base, ahead, (*base, 9)) == (4, 5)
    assert ahead_drafts(base, ahead, (*base, 6)) == ()  # the target gave another token
    assert ahead_drafts(base, ahead, (1, 2, 3, 7, 6)) == ()  # a draft was rejected
    assert ahead_drafts(base, (9,), (*base, 9)) == ()  # only the guess: nothing to send
    assert ahead_drafts(base, ahead, (*base, 9, 4)) == ()  # not the history it was made for
