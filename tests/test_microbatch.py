"""The head's micro-batch grouping (kafila/session/ring/microbatch.py), without a ring."""

from types import SimpleNamespace

from kafila.session.ring.microbatch import SHARED_BUSY_SHARE, MicroBatches, best_groups, prompt_batches


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


def test_groups_that_came_out_uneven_even_out_at_the_next_steps():
    """Five users joined while one group was wanted, three more after two were: a row of the
    bigger group moves at its next step, and the groups stay within a row of each other."""
    mb = MicroBatches(groups=1, max_rows=8)
    for rid in "abcde":
        mb.ready(step(rid))
    mb.groups = 2
    for rid in "fgh":
        mb.ready(step(rid))
    assert sorted(mb.sizes) == [3, 5]
    mb.due()
    for rid in "abcdefgh":
        mb.ready(step(rid))
    assert sorted(mb.sizes) == [4, 4]
    assert sorted(len(g) for g in mb.due()) == [4, 4]
    for rid in "abcdefgh":  # even now: nobody moves
        mb.ready(step(rid))
    assert sorted(len(g) for g in mb.due()) == [4, 4]


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


def test_best_groups_weighs_trips_against_compute():
    # one machine, 20 ms a hop (60 ms a trip of hops), a batch of r rows computing 26 + 8.7·r ms
    # (the default model's three stages on two AVX2 cores): 8 rows go as 2 groups of 4 (a round
    # of 122 ms) rather than 1 of 8 (156 ms) or 3 of 3 (156 ms); 16 rows too
    assert [best_groups(r, 26.0, 8.7, 60.0, 0.0, 32) for r in (1, 2, 4, 8, 16)] == [1, 2, 2, 2, 2]
    # no hops to hide (one machine, loopback): one group, every row in one forward
    assert {best_groups(r, 26.0, 8.7, 0.0, 0.0, 32) for r in (1, 2, 8, 32)} == {1}
    # three machines of 10 ms a stage on a fast network: three groups keep all three busy
    assert best_groups(3, 9.0, 1.0, 0.5, 20.0, 32) == 3 and best_groups(12, 9.0, 1.0, 0.5, 20.0, 32) == 3
    # long hops: as many groups as rows, but never more than allowed, never fewer than one
    assert best_groups(2, 1.0, 100.0, 1000.0, 0.0, 32) == 2 and best_groups(64, 1.0, 10.0, 1000.0, 0.0, 4) == 4
    # ... unless a group more gains less than GROUP_GAIN: rows that cost little go together
    assert best_groups(2, 1.0, 1.0, 1000.0, 0.0, 32) == 1
    # a batch that costs what one row costs (β = 0): nothing to gain from splitting it
    assert best_groups(8, 5.0, 0.0, 1000.0, 0.0, 32) == 1
    assert best_groups(0, 26.0, 8.7, 60.0, 0.0, 32) == 1
    # a machine running several stages computes at most ¾ of a round: 8 rows of 10 + 4·r ms, 60 ms
    # of hops, go as 2 groups of 4 (a round of 86 ms) where 4 would keep it computing throughout
    assert best_groups(8, 10.0, 4.0, 60.0, 0.0, 32) == 4
    assert best_groups(8, 10.0, 4.0, 60.0, 0.0, 32, SHARED_BUSY_SHARE) == 2
    # users arriving one by one on the measured fit (17 + 3·r ms, 60 ms of hops, a shared machine):
    # the third does not open a third group that the next five would then fill
    assert [best_groups(r, 17.0, 3.0, 60.0, 0.0, 32, SHARED_BUSY_SHARE) for r in range(1, 9)] == [1, 1, 2, 2, 2, 2, 2, 2]


def test_prompts_ready_together_go_as_batches_within_the_chunk():
    def prompt(rid, n):
        return SimpleNamespace(req_id=rid, tokens=[0] * n)

    def ids(batches):
        return [[s.req_id for s in b] for b in batches]

    ready = [prompt("a", 40), prompt("b", 30), prompt("c", 50), prompt("d", 10)]
    assert ids(prompt_batches(ready, 3640, 32)) == [["a", "b", "c", "d"]]  # 4 × 50 padded positions
    # the padded size bounds a batch: c makes 3 × 50 > 120, so it starts the next one (arrival order kept)
    assert ids(prompt_batches(ready, 120, 32)) == [["a", "b"], ["c", "d"]]
    assert ids(prompt_batches(ready, 3640, 3)) == [["a", "b", "c"], ["d"]]  # and the rows
    # a chunk as long as the bound goes alone, and so does everything when the bound is one step
    assert ids(prompt_batches([prompt("a", 120), prompt("b", 1)], 120, 32)) == [["a"], ["b"]]
    assert ids(prompt_batches(ready, 1, 32)) == [["a"], ["b"], ["c"], ["d"]]
    assert prompt_batches([], 120, 32) == []
