"""Tokens for other members a few at a time (kafila/session/tokens_out.py): the first at once, then
what gathered once the interval has passed, the rest with the last frame — and the head's
actions carry exactly the tokens, in order, whatever the interval."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kafila.session.frames import MAX_TOKENS_PER_FRAME
from kafila.session.tokens_out import TokenBatches


def test_the_first_token_leaves_at_once_then_every_interval_then_the_rest_at_the_end():
    b = TokenBatches(0.04)
    assert b.add("r", "m2", 7, now=0.0).ids == (7,)  # time to first token unchanged
    assert b.add("r", "m2", 8, now=0.01) is None
    assert b.add("r", "m2", 9, now=0.03) is None
    assert b.add("r", "m2", 10, now=0.041).ids == (8, 9, 10)
    assert b.add("r", "m2", 11, now=0.05) is None
    assert b.end("r") == (11,) and len(b) == 0
    assert b.end("r") == ()


def test_held_tokens_leave_when_their_request_is_late_and_a_full_frame_leaves_at_once():
    b = TokenBatches(0.04)
    b.add("a", "m2", 1, now=0.0)
    b.add("a", "m2", 2, now=0.01)
    b.add("b", "m3", 5, now=0.0)
    assert b.due(0.02) == []
    (late,) = b.due(0.05)  # "b" holds nothing: nothing to send for it
    assert (late.req_id, late.dst, late.ids) == ("a", "m2", (2,))
    assert b.due(0.06) == []
    c = TokenBatches(10.0)
    c.add("c", "m2", 0, now=0.0)
    frames = [c.add("c", "m2", t, now=0.0) for t in range(1, MAX_TOKENS_PER_FRAME + 1)]
    assert [f.ids for f in frames if f is not None] == [tuple(range(1, MAX_TOKENS_PER_FRAME + 1))]


def test_interval_zero_sends_every_token_alone():
    b = TokenBatches(0.0)
    assert [b.add("r", "m2", t, now=0.0).ids for t in (1, 2, 3)] == [(1,), (2,), (3,)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 0.05)), max_size=60), st.sampled_from([0.0, 0.01, 0.04]))
def test_every_token_arrives_once_in_order(events, interval):
    b, now, sent, want = TokenBatches(interval), 0.0, {}, {}
    for i, (rid, dt) in enumerate(events):
        now += dt
        want.setdefault(rid, []).append(i)
        f = b.add(rid, "m2", i, now)
        for frame in ([f] if f else []) + b.due(now):
            sent.setdefault(frame.req_id, []).extend(frame.ids)
    for rid in want:
        sent.setdefault(rid, []).extend(b.end(rid))
    assert sent == want
