"""The head's scheduler without a ring: a fake model whose next token depends on a slot's history."""

import random

import pytest

from kafila.session.ring.scheduler import Finished, Scheduler, SchedulerError, SlotFreed, TokenOut

EOS = 0


class FakeRing:
    """Per-slot KV as a list of (position, token); next token = hash of the visible history (the
    physical positions the step's mask leaves visible, as a model's attention sees them)."""

    def __init__(self, slots):
        self.kv = {s: [] for s in range(slots)}

    def run(self, step):
        kv = self.kv[step.slot]
        assert step.cache_len <= len(kv), "the scheduler's cache_len must be within the stage's KV"
        del kv[step.cache_len:]  # 0 resets the slot; less than it holds cuts it back (a reused prefix)
        for i, t in enumerate(step.tokens.tolist()):
            kv.append((step.pos0 + i, t))
        visible = [pt for i, pt in enumerate(kv) if i not in set(step.zeros)]
        return (sum((p + 1) * t for p, t in visible) * 2654435761) % 50  # 0 = EOS sometimes


def drive(sched, ring, order=random.Random(0), finished: list | None = None):
    """Every step to the end, returned in a shuffled order: each request's tokens and how it
    finished (`finished`, if given, collects the Finished events themselves)."""
    out, done = {}, {}
    for _ in range(10_000):
        steps = sched.steps()
        if not steps:
            break
        order.shuffle(steps)  # steps return in any order
        for s in steps:
            for ev in sched.complete(s.req_id, ring.run(s)):
                if isinstance(ev, TokenOut):
                    out.setdefault(ev.req_id, []).append(ev.token)
                elif isinstance(ev, Finished):
                    done[ev.req_id] = ev.finish
                    if finished is not None:
                        finished.append(ev)
    return out, done


PROMPTS = {f"r{i}": [random.Random(i).randrange(1, 50) for _ in range(3 + i)] for i in range(6)}


def solo(rid):
    s = Scheduler(slots=1, context=64, eos_ids=frozenset({EOS}))
    s.submit(rid, "m2", PROMPTS[rid], 20)
    return drive(s, FakeRing(1))[0].get(rid, [])


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_concurrent_requests_get_their_solo_tokens(slots):
    s = Scheduler(slots=slots, context=64, eos_ids=frozenset({EOS}))
    for rid, p in PROMPTS.items():
        s.submit(rid, "m" + rid[-1], p, 20)
    out, done = drive(s, FakeRing(slots))
    assert set(done) == set(PROMPTS)
    for rid in PROMPTS:
        assert out.get(rid, []) == solo(rid)
    assert s.free_slots == slots and s.active == 0 and s.queued == 0


def test_length_stop_and_context():
    s = Scheduler(slots=1, context=8, eos_ids=frozenset())
    s.submit("a", "m1", [1, 2, 3], 100)  # clipped to the context: 5 new
    out, done = drive(s, FakeRing(1))
    assert len(out["a"]) == 5 and done["a"] == "length"
    with pytest.raises(SchedulerError, match="context is 8"):
        s.submit("b", "m1", list(range(8)), 1)
    with pytest.raises(SchedulerError, match="empty"):
        s.submit("c", "m1", [], 1)


def test_eos_stops_without_emitting_it():
    s = Scheduler(slots=1, context=64, eos_ids=frozenset({7}))
    s.submit("a", "m1", [1], 10)
    (step,) = s.steps()
    assert s.complete("a", 7) == [Finished("a", "m1", "stop"), SlotFreed(0, parked=True)]  # its KV kept


def test_cancel_in_flight_waits_for_the_step():
    s = Scheduler(slots=1, context=64)
    s.submit("a", "m1", [1, 2], 10)
    s.submit("b", "m1", [3], 10)
    (step,) = s.steps()
    assert step.req_id == "a"
    assert s.cancel("a") == []  # its activation is still round the ring
    assert s.steps() == []  # the slot is not reused under it
    events = s.complete("a", 5)
    assert Finished("a", "m1", "cancelled") in events and SlotFreed(0, parked=True) in events
    (step,) = s.steps()
    assert step.req_id == "b" and step.cache_len == 0
    assert s.cancel("nope") == []


def test_fail_all_names_the_reason_and_frees_everything():
    s = Scheduler(slots=2, context=64)
    for r in "abc":
        s.submit(r, "m2", [1], 10)
    s.steps()
    events = s.fail_all("member m3 left the session", 503)
    assert sorted(e.req_id for e in events if isinstance(e, Finished)) == ["a", "b", "c"]
    assert all(e.error == "member m3 left the session" for e in events if isinstance(e, Finished))
    assert s.free_slots == 2 and s.queued == 0
    assert s.complete("a", 1) == []  # a late step is ignored


def test_decode_steps_track_positions():
    s = Scheduler(slots=1, context=64)
    s.submit("a", "m1", [5, 6, 7], 3)
    (st,) = s.steps()
    assert (st.cache_len, st.pos0, st.tokens.tolist()) == (0, 0, [5, 6, 7])
    s.complete("a", 9)
    (st,) = s.steps()
    assert (st.cache_len, st.pos0, st.tokens.tolist()) == (3, 3, [9])


def test_queue_bound():
    """max_queue counts the requests waiting for a slot, not one a free slot is about to take."""
    s = Scheduler(slots=1, context=64, max_queue=2)
    s.submit("a", "m", [1], 1)  # takes the free slot at the next steps()
    s.submit("b", "m", [1], 1)
    s.submit("c", "m", [1], 1)
    with pytest.raises(SchedulerError) as e:
        s.submit("d", "m", [1], 1)
    assert e.value.status == 429  # the API answers Too Many Requests, with Retry-After
    assert s.queued == 3 and [st.req_id for st in s.steps()] == ["a"]


@pytest.mark.parametrize("prompt_cache", [True, False])
def test_a_hybrids_prompt_end_is_kept_and_a_next_prompt_that_reaches_it_goes_back_there(prompt_cache):
    """Recurrent (hybrid) models: the step that ends a prompt (its last chunk) asks every stage
    to keep the state after it (Step.keep); a later prompt that repeats that prompt, with another
    answer after it, starts there. Without prompt caching nothing is kept."""
    s = Scheduler(slots=1, context=64, chunk_tokens=4, recurrent=True, prompt_cache=prompt_cache)
    prompt = list(range(1, 11))  # 10 tokens: chunks of 4, 1 (a quarter of 4) ... the last ends it
    s.submit("a", "m1", prompt, 3, stop_at_eos=False)
    keeps, cache_lens = [], []
    while steps := s.steps():
        for st in steps:
            keeps.append(st.keep)
            cache_lens.append(st.cache_len)
            s.complete(st.req_id, 5 if st.pos0 + len(st.tokens) >= len(prompt) else None)
    assert keeps.count(True) == (1 if prompt_cache else 0)
    if not prompt_cache:
        return
    assert cache_lens[keeps.index(True)] + 1 == len(prompt)  # the last chunk (here one token) is kept
    s.submit("b", "m1", prompt + [9, 9, 9], 2, stop_at_eos=False)  # the answer rendered otherwise
    step = s.steps()[0]
    assert (step.cache_len, step.pos0, step.tokens.tolist()) == (len(prompt), len(prompt), [9])  # a later chunk


@pytest.mark.parametrize("recurrent", [True, False])
def test_a_prompt_chunk_ends_where_a_hybrids_state_is_kept_and_nowhere_else(recurrent):
    """keep_at (where a chat's messages end): a hybrid's prefill chunk stops there and that step
    keeps the state; any other model feeds the prompt in its usual chunks, nothing kept."""
    s = Scheduler(slots=1, context=64, chunk_tokens=16, recurrent=recurrent)
    s.submit("a", "m1", list(range(1, 11)), 2, stop_at_eos=False, keep_at=7)
    st = s.steps()[0]
    assert (len(st.tokens), st.keep) == ((7, True) if recurrent else (10, False))
