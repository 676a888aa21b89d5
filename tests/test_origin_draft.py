"""Drafting at the origin member (--speculate origin, kafila/session/ring/speculation/origin.py), without a ring:
the alignment rule, the origin's drafter, the head's scheduler taking (aligned, stale but
aligned, misaligned → its own n-grams) and refusing drafts, and the activation's draft fields on
the wire (round trip, malformed ones refused; the pinned old bytes are tests/test_frames_wire.py)."""

import numpy as np
import pytest

from kafila.session.wire import frames as F
from kafila.session.wire.fields import MAX_ORIGIN_DRAFT
from kafila.session.ring.speculation.origin import OriginDrafts, aligned_draft
from kafila.session.ring.scheduler import Scheduler
from kafila.session.ring.speculation.speculate import SPECULATE_MODES, SpecStats, ngram_draft

PROMPT = (5, 6, 7, 8, 9, 5, 6)  # n-grams propose 7 8 9 5 6 after it


def test_aligned_draft_continues_where_the_history_has_got_to():
    h = (1, 2, 3, 4, 5)
    assert aligned_draft(h, 3, (4, 5, 6, 7, 8), 2) == (6, 7)  # 4 5 produced since base 3: as drafted
    assert aligned_draft(h, 5, (6, 7, 8), 8) == (6, 7, 8)  # fresh: all of it, at most k
    assert aligned_draft(h, 3, (4, 9, 6), 2) == ()  # the head produced 5, the draft said 9
    assert aligned_draft(h, 3, (4, 5), 2) == ()  # stale past its end: nothing left to propose
    assert aligned_draft(h, 6, (6, 7), 2) == ()  # a base the head has not reached
    assert aligned_draft(h, -1, (1, 2, 3), 2) == ()
    assert aligned_draft(h, 5, (6, 7), 0) == ()


def test_the_origin_drafts_after_every_token_and_keeps_the_latest():
    o = OriginDrafts(length=5)
    o.start("r", PROMPT)
    assert o.draft("r") == (7, ngram_draft(PROMPT, 5))
    o.add("r", [7])
    assert o.draft("r") == (8, ngram_draft(PROMPT + (7,), 5))
    o.add("other", [1])  # not typed here: ignored
    assert o.draft("other") is None and len(o) == 1
    o.end("r")
    assert o.draft("r") is None and len(o) == 0
    with pytest.raises(ValueError):
        OriginDrafts(0)
    with pytest.raises(ValueError):
        OriginDrafts(MAX_ORIGIN_DRAFT + 1)


def _prefilled(k: int = 3) -> Scheduler:
    """A speculate="origin" scheduler whose request "r" has its prompt in and token 7 out."""
    assert "origin" in SPECULATE_MODES
    s = Scheduler(slots=1, context=64, speculate="origin", draft_k=k, adaptive_k=False)
    s.submit("r", "m2", PROMPT, max_new=20)
    (step,) = s.steps()
    assert step.drafted == 0  # prefill
    s.complete("r", 7)
    return s


def _stats(s: Scheduler, req_id: str = "r") -> SpecStats:
    return s._requests[req_id].spec


def test_an_aligned_origin_draft_is_the_next_steps_drafts():
    s = _prefilled()
    assert s.offer_draft("r", len(PROMPT) + 1, (40, 41, 42, 43))
    (step,) = s.steps()
    assert tuple(step.tokens) == (7, 40, 41, 42)  # the last token, then the origin's next 3
    assert s.draft_of("r") == (40, 41, 42)
    assert (_stats(s).origin, _stats(s).fallback) == (1, 0)


def test_a_stale_draft_still_aligned_covers_the_step_after_a_full_acceptance():
    s = _prefilled()
    # made from the prompt alone (the origin saw the prefill pass), before token 7 was produced
    assert s.offer_draft("r", len(PROMPT), (7, 40, 41, 42, 43, 44, 45, 46))
    (step,) = s.steps()
    assert s.draft_of("r") == (40, 41, 42)
    s.complete("r", (40, 41, 42, 43))  # every draft accepted, and 43 as the origin said
    (step,) = s.steps()
    assert s.draft_of("r") == (44, 45, 46)  # still aligned: its next three
    assert (_stats(s).origin, _stats(s).fallback) == (2, 0)


def test_a_misaligned_draft_falls_back_to_the_heads_ngrams():
    s = _prefilled()
    assert s.offer_draft("r", len(PROMPT), (7, 40, 41, 42))
    (step,) = s.steps()
    s.complete("r", (40, 8))  # 41 rejected: the head produced 8, the draft is stale
    (step,) = s.steps()
    history = PROMPT + (7, 40, 8)
    assert s.draft_of("r") == ngram_draft(history, 3)
    assert (_stats(s).origin, _stats(s).fallback) == (1, 1)


def test_no_draft_at_all_is_the_heads_ngrams_and_counted_as_fallback():
    s = _prefilled()
    (step,) = s.steps()
    assert s.draft_of("r") == ngram_draft(PROMPT + (7,), 3)
    assert (_stats(s).origin, _stats(s).fallback) == (0, 1)


def test_bad_drafts_are_refused_and_nothing_is_kept():
    s = _prefilled()
    here = len(PROMPT) + 1
    for base, tokens in [
        (here + 1, (1, 2)),  # a history the head has not produced
        (0, (1, 2)),  # before the prompt
        (here, ()),  # empty
        (here, tuple(range(MAX_ORIGIN_DRAFT + 1))),  # over the bound
        (here, (1, -2)),  # not a token id
        (here, (1, True)),  # a boolean is not an id
        (here, (1, 2.0)),
        ("8", (1, 2)),
        (True, (1, 2)),
    ]:
        assert not s.offer_draft("r", base, tokens), (base, tokens)
    assert not s.offer_draft("nobody", here, (1, 2))
    assert s._requests["r"].offered is None
    assert s.offer_draft("r", here, (1, 2))
    assert not s.offer_draft("r", here - 1, (7, 1, 2))  # older than the one kept
    assert s._requests["r"].offered == (here, (1, 2))


def test_drafts_are_refused_where_the_request_or_the_session_does_not_speculate():
    s = Scheduler(slots=2, context=64, speculate="origin", draft_k=3, adaptive_k=False)
    s.submit("plain", "m2", PROMPT, max_new=5, speculate=False)
    assert not s.offer_draft("plain", len(PROMPT), (7, 8))
    n = Scheduler(slots=1, context=64, speculate="ngram", draft_k=3, adaptive_k=False)
    n.submit("r", "m2", PROMPT, max_new=5)
    assert not n.offer_draft("r", len(PROMPT), (7, 8))


def test_origin_counts_travel_in_the_stats_pairs_and_stay_out_when_zero():
    s = SpecStats(4, 2, 2, 4, origin=3, fallback=1)
    assert SpecStats.from_pairs(s.as_pairs()) == s
    assert s.as_dict()["origin_steps"] == 3 and s.as_dict()["fallback_steps"] == 1
    assert "origin_steps" not in SpecStats(4, 2, 2, 4).as_dict()
    assert len(SpecStats(4, 2, 2, 4).as_pairs()) == 4  # what a peer from before sends and reads


# --- the wire ----------------------------------------------------------------------------------

LIM = F.Limits(hidden=8, context=32, slots=2, vocab=100)
X = np.arange(16, dtype=np.float32).reshape(2, 8)


def test_an_activation_carries_its_origins_draft_and_decodes_back():
    a = F.Activation("m2:1", 1, 4, 4, (), X, (("m1", 5),), draft=(7, 8, 99), dbase=5)
    (back,) = F.FrameDecoder(LIM).feed(F.encode(a))
    assert back.draft == (7, 8, 99) and back.dbase == 5
    plain = F.Activation("m2:1", 1, 4, 4, (), X)
    assert b"draft" not in F.encode(plain)  # omitted when empty: the old bytes
    (back,) = F.FrameDecoder(LIM).feed(F.encode(plain))
    assert back.draft == () and back.dbase == 0


@pytest.mark.parametrize("fields", [
    {"draft": [1, 100], "dbase": 5},  # an id outside the vocabulary
    {"draft": [1, -1], "dbase": 5},
    {"draft": [1, True], "dbase": 5},
    {"draft": [1, 2.5], "dbase": 5},
    {"draft": [], "dbase": 5},
    {"draft": list(range(MAX_ORIGIN_DRAFT + 1)), "dbase": 5},
    {"draft": "12", "dbase": 5},
    {"draft": [1, 2]},  # no base
    {"draft": [1, 2], "dbase": 0},
    {"draft": [1, 2], "dbase": 33},  # past the context
    {"draft": [1, 2], "dbase": "5"},
    {"dbase": 5},  # a base without a draft
])  # fmt: skip
def test_malformed_origin_drafts_are_the_peers_frame_error(fields):
    import msgpack

    data = F.encode(F.Activation("m2:1", 1, 4, 4, (), X))
    hlen, plen = F.PREFIX.unpack(data[: F.PREFIX.size])
    header = msgpack.unpackb(data[F.PREFIX.size : F.PREFIX.size + hlen]) | fields
    h = msgpack.packb(header, use_bin_type=True)
    bad = F.PREFIX.pack(len(h), plen) + h + data[F.PREFIX.size + hlen :]
    with pytest.raises(F.FrameError):
        F.FrameDecoder(LIM).feed(bad)


def test_the_head_takes_the_draft_that_rode_on_a_returning_activation():
    """HeadCore.complete hands an activation's origin draft to the scheduler: the next step of
    that request carries the draft's next tokens (a request typed at m2, its prefill back)."""
    from kafila.session.wire.frames import Activation, Request
    from kafila.session.ring.head import Forward, HeadCore, Send

    lim = F.Limits(hidden=8, context=64, slots=2, vocab=100)
    core = HeadCore("m1", ["m1", "m2", "m3"], lim, speculate="origin", draft_k=3, adaptive_k=False, batch=False)
    assert core.on_request(Request("m2:1", "m2", "m1", 10, False, np.array(PROMPT, dtype=np.int32))) == []
    (work,) = core.pump(0.0)
    assert isinstance(work, Forward) and len(work.step.tokens) == len(PROMPT)
    core.starting(["m2:1"], 0.0, [len(PROMPT)])
    back = Activation("m2:1", work.step.slot, 0, 0, (), np.zeros((len(PROMPT), 8), np.float32),
                      draft=(7, 40, 41, 42, 43), dbase=len(PROMPT))  # fmt: skip
    (sent,) = core.complete([back], [7], 0.05)
    assert isinstance(sent, Send) and sent.frame.ids == (7,) and sent.frame.dst == "m2"
    (work,) = core.pump(0.05)
    assert tuple(work.step.tokens) == (7, 40, 41, 42) and work.step.drafted == 3
