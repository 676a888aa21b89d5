"""The head's micro-batch grouping (kafila/session/microbatch.py), without a ring."""

from types import SimpleNamespace

from kafila.session.microbatch import MicroBatches


def step(rid):
    return SimpleNamespace(req_id=rid)


def test_groups_fill_the_ring_then_grow_and_keep_their_members():
    mb = MicroBatches(groups=3, max_rows=4)
    for rid in "abcdefg":
        mb.ready(step(rid))
    assert sorted(mb.sizes) == [2, 2, 3]  # three groups (one per stage), then the smallest grows
    first = mb.due()
    assert sorted(len(g) for g in first) == [2, 2, 3] and mb.due() == []
    groups = {mb.group_of(r) for r in "abcdefg"}
    # round again: the same members together, in the same order
    for rid in "gfedcba":
        mb.ready(step(rid))
    again = mb.due()
    assert [[s.req_id for s in g] for g in again] == [[s.req_id for s in g] for g in first]
    assert {mb.group_of(r) for r in "abcdefg"} == groups


def test_a_group_waits_for_a_member_that_is_away_and_not_for_one_that_left():
    mb = MicroBatches(groups=1, max_rows=8)
    mb.ready(step("a"))
    assert [[s.req_id for s in g] for g in mb.due()] == [["a"]]
    mb.ready(step("b"))  # joins while a's step is round the ring
    assert mb.due() == []
    mb.ready(step("a"))
    assert [[s.req_id for s in g] for g in mb.due()] == [["a", "b"]]
    mb.ready(step("b"))
    assert mb.due() == []  # a is away
    assert mb.leave("a") is None  # a ended: b goes alone now
    assert [[s.req_id for s in g] for g in mb.due()] == [["b"]]
    mb.ready(step("b"))
    assert mb.leave("b").req_id == "b" and mb.sizes == []


def test_a_full_group_opens_another():
    mb = MicroBatches(groups=1, max_rows=2)
    for rid in "abc":
        mb.ready(step(rid))
    assert sorted(mb.sizes) == [1, 2]
