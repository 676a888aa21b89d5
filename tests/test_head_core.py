"""HeadCore (session/ring/head.py) paired with fake stages over an in-memory link, without sockets,
threads or clocks (as aioquic's tests pair two connections): a `Rig` plays the ring node's part
(the head's forwards, the stages, the wire) by hand, one hop at a time, with a fake `now`.

Every frame crosses the link as bytes (frames.encode → FrameDecoder), and the fake stages keep
real per-slot state that honours the mask (a running sum over visible positions), so a wrong
slot, mask, ordering or rewind changes the tokens."""

from __future__ import annotations

import ast
import inspect
from collections import defaultdict

import numpy as np
import pytest

from kafila import sampling
from kafila.session.wire import fields
from kafila.session.wire import frames
from kafila.session.ring import head
from kafila.session.ring import microbatch
from kafila.session.ring import scheduler
from kafila.session.ring import slots
from kafila.session.ring.speculation import speculate
from kafila.session.ring import timing
from kafila.session.wire.frames import Activation, FrameDecoder, Free, Limits, Request, Tokens, encode
from kafila.session.ring.head import (
    Deliver,
    Ended,
    Forward,
    ForwardRows,
    FreeSlot,
    HeadCore,
    Send,
)  # fmt: skip
from kafila.session.ring.picks import pick_tokens
from kafila.session.ring.local_slots import LocalSlots
from kafila.session.ring.scheduler import SchedulerError
from tests.test_session_ring import H, V, FakeShard

NAMES = ["m1", "m2", "m3"]
STAGE_US = 100  # every fake stage's compute, as its trace reports it
HOP_S = 0.001  # the fake link: one hop takes 1 ms of `now`


class MaskedShard(FakeShard):
    """FakeShard whose context sums only the positions the mask keeps (a masked-out draft is
    gone, as on a real stage), with forward_batch row by row; it counts what the head asks of it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []
        self.greedy_rows_calls: list[int] = []

    def forward(self, slot, x, positions, mask):
        kv = self.kv[slot]
        assert len(mask) == len(kv) + len(positions)
        x = self.emb[x] if self.emb is not None else x
        out = []
        for row, p in zip(x, positions):
            kv.append(row)
            visible = np.asarray(mask[: len(kv)]) != 0
            ctx = np.sum(np.asarray(kv)[visible], axis=0)
            out.append(np.tanh(row @ self.w + 0.1 * ctx + 0.01 * p))
        return np.array(out, dtype=np.float32)

    def forward_batch(self, slots, xs, positions, masks):
        assert len(set(slots)) == len(slots)
        self.batches.append(len(slots))
        return [self.forward(*row) for row in zip(slots, xs, positions, masks)]

    def greedy_rows(self, hiddens):
        self.greedy_rows_calls.append(len(hiddens))
        return super().greedy_rows(hiddens)


class Rig:
    """A head (HeadCore + its shard) and two fake stages on an in-memory link."""

    def __init__(self, slots: int = 2, batch: bool = False, one_machine: bool = False, **options) -> None:
        self.lim = Limits(hidden=H, context=64, slots=slots, vocab=V)
        self.shards = {n: MaskedShard(i, embed=i == 0, head=i == 0) for i, n in enumerate(NAMES)}
        self.slots = {n: LocalSlots(s) for n, s in self.shards.items()}
        machines = {n: "a" for n in NAMES} if one_machine else None
        options.setdefault("eos_ids", frozenset({0}))
        self.core = HeadCore("m1", NAMES, self.lim, batch=batch, machines=machines, **options)
        self.now = 100.0
        self.wire: list[tuple[int, bytes]] = []  # (index of the member it reaches next, frames)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.done: dict[str, Tokens] = {}
        self.sent: list[Tokens] = []  # Send actions: tokens for another member
        self.freed: list[int] = []
        self.ended: list[str] = []
        self.work: list[tuple[str, ...]] = []  # the req_ids of every forward the head ran, in order
        self.solves: list = []  # the live optimiser's problems, in order

    # --- the ring node's part, by hand --------------------------------------------------------

    def submit(self, req_id: str, prompt, max_new: int = 12, origin: str = "m1", stop_at_eos: bool = True,
               **kw) -> None:  # fmt: skip
        req = Request(req_id, origin, "m1", max_new, stop_at_eos, np.asarray(prompt, dtype=np.int32), **kw)
        self.carry(self.core.on_request(req))

    def pump(self) -> None:
        for w in self.core.pump(self.now):
            if isinstance(w, head.SolveDipsd):  # the live optimiser, solved inline (the node: on a thread)
                self.solves.append(w.problem)
                self.core.dipsd_solved(head.Solved(w.problem, self.core.dipsd.solve(w.problem)), self.now)
                continue
            steps = [w.step] if isinstance(w, Forward) else list(w.steps)
            assert isinstance(w, (Forward, ForwardRows))
            self.core.starting([s.req_id for s in steps], self.now, [len(s.tokens) for s in steps])
            self.work.append(tuple(s.req_id for s in steps))
            shard, slots = self.shards["m1"], self.slots["m1"]
            if isinstance(w, Forward):
                st = w.step
                h = shard.forward(slots.get(st.slot, st.cache_len, len(st.tokens)), st.tokens, st.positions(), st.mask())
                acts = [self.core.forwarded(st, h, STAGE_US)]
            else:
                hs = shard.forward_batch([slots.get(st.slot, st.cache_len, len(st.tokens)) for st in steps], [st.tokens for st in steps],
                                         [st.positions() for st in steps], [st.mask() for st in steps])  # fmt: skip
                acts = self.core.forwarded_rows(steps, hs, STAGE_US)
            self.wire.append((1, b"".join(encode(a, self.lim) for a in acts)))

    def hop(self) -> None:
        """Every trip on the link moves one member on; then the head pumps."""
        self.now += HOP_S
        moving, self.wire = self.wire, []
        for at, data in moving:
            got = FrameDecoder(self.lim).feed(data)
            if at == len(NAMES):  # back at the head
                if isinstance(got[0], Activation):
                    tokens = pick_tokens(self.shards["m1"], self.core.picks(got))
                    self.carry(self.core.complete(got, tokens, self.now))
                continue
            name = NAMES[at]
            shard, slots = self.shards[name], self.slots[name]
            if isinstance(got[0], Free):
                slots.free(got[0].slot)
                self.wire.append((at + 1, data))
                continue
            if len(got) == 1:
                a = got[0]
                hs = [shard.forward(slots.get(a.slot, a.cache_len, a.n), a.hidden, a.positions(), a.mask())]
            else:
                hs = shard.forward_batch([slots.get(a.slot, a.cache_len, a.n) for a in got], [a.hidden for a in got],
                                         [a.positions() for a in got], [a.mask() for a in got])  # fmt: skip
            out = [Activation(a.req_id, a.slot, a.cache_len, a.pos0, a.zeros, h, a.trace + ((name, STAGE_US),),
                              a.rows, a.row) for a, h in zip(got, hs)]  # fmt: skip
            self.wire.append((at + 1, b"".join(encode(a, self.lim) for a in out)))
        self.pump()

    def carry(self, actions) -> None:
        for a in actions:
            if isinstance(a, (Deliver, Send)):
                t = a.tokens if isinstance(a, Deliver) else a.frame
                assert isinstance(a, Deliver) == (t.dst == "m1")
                if isinstance(a, Send):
                    self.sent.append(t)
                self.tokens[t.req_id] += list(t.ids)
                if t.done:
                    self.done[t.req_id] = t
            elif isinstance(a, FreeSlot):
                self.freed.append(a.slot)
                self.slots["m1"].free(a.slot)
                self.wire.append((1, encode(Free(a.slot), self.lim)))
            elif isinstance(a, Ended):
                self.ended.append(a.req_id)
            else:
                raise AssertionError(f"unknown action {a!r}")

    def run(self, until=None, rounds: int = 2000) -> None:
        """Hop until the link is quiet (or `until()` holds), within a bound."""
        self.pump()
        for _ in range(rounds):
            if (until is not None and until()) or (until is None and not self.wire):
                return
            self.hop()
        raise AssertionError(f"not done within {rounds} hops")


PROMPTS = {"a": [3, 4, 5], "b": [7], "c": [9, 9, 9, 9], "d": [1, 2], "e": [11, 12, 13]}


def solo(req_id: str, prompt, **kw) -> list[int]:
    rig = Rig()
    rig.submit(req_id, prompt, **kw)
    rig.run()
    return rig.tokens[req_id]


def test_requests_interleave_and_each_gets_its_solo_tokens():
    alone = {r: solo(r, p) for r, p in PROMPTS.items()}
    rig = Rig(slots=2)
    for r, p in PROMPTS.items():
        rig.submit(r, p)
    rig.run()
    assert dict(rig.tokens) == alone
    assert all(rig.done[r].finish in ("stop", "length") for r in PROMPTS)
    order = [w[0] for w in rig.work]
    last = {r: max(i for i, x in enumerate(order) if x == r) for r in PROMPTS}
    first = {r: order.index(r) for r in PROMPTS}
    assert first["b"] < last["a"] and first["a"] < last["b"]  # a and b take turns on the ring
    assert first["c"] > min(last["a"], last["b"])  # 2 slots: c waited for one
    assert rig.core.scheduler.free_slots == 2 and sorted(rig.ended) == sorted(PROMPTS)
    assert all(not s.slots for s in rig.slots.values()), "every stage freed every slot"


def test_tokens_for_another_member_are_sent_its_way_and_timing_follows_now():
    rig = Rig()
    rig.submit("m2:1", [3, 4, 5], origin="m2")
    rig.run()
    assert rig.tokens["m2:1"] == solo("a", [3, 4, 5])
    assert rig.sent and all(t.dst == "m2" for t in rig.sent)
    m = rig.core.measured
    assert m.stage_ms == {"m1": 0.1, "m2": 0.1, "m3": 0.1}
    assert m.step_ms == pytest.approx(3 * HOP_S * 1000)  # three hops of the fake link
    assert m.network_ms == pytest.approx(3.0 - 0.3)
    assert dict(rig.done["m2:1"].stats)["step_ms"] == pytest.approx(3.0)


def test_cancel_frees_its_slot_on_every_stage_and_its_row_in_the_micro_batch():
    alone = {r: solo(r, PROMPTS[r], max_new=30) for r in "bcd"}
    rig = Rig(slots=4, batch=True, one_machine=True)
    rig.submit("a", PROMPTS["a"], max_new=30, stop_at_eos=False)
    for r in "bcd":
        rig.submit(r, PROMPTS[r], max_new=30)
    rig.run(until=lambda: len(rig.tokens["a"]) >= 3)
    assert rig.core.batches.sizes == [4]  # one machine: one micro-batch of every request
    in_flight = "a" in rig.core.scheduler.in_flight()
    assert rig.core.cancel("a") == []  # in flight: it ends when its step is back
    assert in_flight
    rig.run()
    assert "a" not in rig.done and "a" in rig.ended  # a cancelled request gets no answer
    assert {r: rig.tokens[r] for r in "bcd"} == alone
    assert rig.core.scheduler.free_slots == 4 and rig.core.batches.sizes == []
    assert all(not s.slots for s in rig.slots.values())
    # a queued request cancels at once: no slot to free
    rig = Rig(slots=1)
    rig.submit("x", [1, 2])
    rig.submit("y", [3])
    rig.pump()
    assert rig.core.cancel("y") == [Ended("y")]
    rig.run()
    assert "y" not in rig.tokens and rig.done["x"].finish in ("stop", "length")


def test_each_request_samples_its_own_stream_and_greedy_rows_equal_solo():
    sampled = dict(temperature=1.5, seed=7)
    a_alone = solo("a", [3, 4, 5], max_new=10, stop_at_eos=False, **sampled)
    b_alone = solo("b", [3, 4, 5], max_new=10, stop_at_eos=False, temperature=1.5, seed=8)
    greedy = {r: solo(r, PROMPTS[r]) for r in "cde"}
    rig = Rig(slots=5, batch=True, one_machine=True)
    rig.submit("a", [3, 4, 5], max_new=10, stop_at_eos=False, **sampled)
    rig.submit("b", [3, 4, 5], max_new=10, stop_at_eos=False, temperature=1.5, seed=8)
    for r in "cde":
        rig.submit(r, PROMPTS[r])
    rig.run()
    assert rig.tokens["a"] == a_alone and rig.tokens["b"] == b_alone  # each seed its own stream
    assert a_alone != b_alone
    assert {r: rig.tokens[r] for r in "cde"} == greedy  # greedy rows of a micro-batch: as solo
    assert max(rig.shards["m1"].greedy_rows_calls) > 1  # one lm_head over several rows
    assert max(rig.shards["m2"].batches) > 1 and rig.shards["m2"].batches == rig.shards["m3"].batches


def test_micro_batches_group_decode_steps_and_keep_their_rows():
    rig = Rig(slots=4, batch=True, one_machine=True)
    for r in "abcd":
        rig.submit(r, PROMPTS[r], max_new=20, stop_at_eos=False)
    rig.run()
    rows = [w for w in rig.work if len(w) > 1]
    assert rows and all(len(set(w)) == len(w) for w in rows)
    assert rig.work[0] == tuple("abcd")  # the four prompts, ready together, go round as one batch
    # membership is stable: a group's rows keep their order while it lasts
    full = [w for w in rows if len(w) == 4]
    assert full and len(set(full)) == 1
    assert rig.core.load(8)["micro_batches"] == []  # every request over: no groups left
    # three machines, no measurements yet: one group per machine
    three = Rig(slots=4, batch=True)
    assert three.core.batches.groups == 3


def test_prompts_in_chunks_go_as_batches_within_the_chunk_and_give_solo_tokens():
    """Chunks of 8 positions: prompts ready together go round as batches of at most 8 padded
    positions (3 + 1 together; 8 and 8 apart), the long prompts' last chunks (2 + 2) together
    again, and every request still gets its solo tokens."""
    prompts = {"a": [3, 4, 5], "b": [7], "c": [9] * 10, "d": [2] * 10}
    alone = {r: solo(r, p, max_new=8) for r, p in prompts.items()}
    rig = Rig(slots=4, batch=True, one_machine=True, prefill_chunk=8)
    for r, p in prompts.items():
        rig.submit(r, p, max_new=8)
    rig.run()
    assert dict(rig.tokens) == alone
    assert rig.work[:3] == [("a", "b"), ("c",), ("d",)] and ("c", "d") in rig.work
    assert all(not s.slots for s in rig.slots.values())


@pytest.mark.parametrize("machines, rtt_ms, depth", [
    ({"m1": "a", "m2": "b", "m3": "c"}, 0.0, 3),
    ({"m1": "a", "m2": "a", "m3": "a"}, 0.0, 1),
    # 20 ms a hop: a trip of 90 ms over 30 of compute, at most ¾ of a round on a shared machine
    ({"m1": "a", "m2": "a", "m3": "a"}, 40.0, 2),
    ({"m1": "a", "m2": "b", "m3": "c"}, 40.0, 9),
])  # fmt: skip
def test_pipeline_depth_is_a_function_of_stages_machines_and_rtts(machines, rtt_ms, depth):
    core = HeadCore("m1", NAMES, Limits(hidden=H, context=64, slots=4, vocab=V), machines=machines)
    assert core.pipeline_depth({}) == len(set(machines.values()))  # not measured yet
    core.measured.stage_ms.update({"m1": 10.0, "m2": 10.0, "m3": 10.0})
    assert core.pipeline_depth({n: rtt_ms for n in NAMES}) == depth
    assert core.depth_due(5.0) and not core.depth_due(5.5) and core.depth_due(6.1)


def test_the_depth_follows_the_measured_batch_cost_once_two_sizes_were_seen():
    """One machine, 20 ms a hop: one-row stage times alone say 2 groups (a trip of 90 ms over 30
    of compute, the machine busy at most ¾ of a round); one batch size measured takes the prior
    slope (a row ≈ ROW_PRIOR_SLOPE of a trip); batches of 2 and 4 rows measured at 24 and 28 ms
    say that 8 requests go round fastest as 2 groups of 4 (3 groups would keep the shared machine
    computing for the whole round), and newcomers are placed for that before they join."""
    one = {n: "a" for n in NAMES}
    core = HeadCore("m1", NAMES, Limits(hidden=H, context=64, slots=8, vocab=V), machines=one)
    core.measured.stage_ms.update({"m1": 10.0, "m2": 10.0, "m3": 10.0})
    rtts = {n: 40.0 for n in NAMES}
    assert core.pipeline_depth(rtts) == 2
    core.serial_cost.observe(1, 22.0)  # one size: a row is the prior's share of a trip
    assert core._groups_for(8) == 2 and core._groups_for(1) == 1
    core.serial_cost.observe(2, 24.0)
    core.serial_cost.observe(4, 28.0)
    assert core._groups_for(8) == 2 and core._groups_for(1) == 1
    assert core.pipeline_depth(rtts) == 1  # nobody decoding now: one group for the next one


def test_ngram_speculation_gives_the_plain_tokens():
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = solo("p", prompt, max_new=24, stop_at_eos=False)
    rig = Rig(speculate="ngram", adaptive_k=False)
    rig.submit("s", prompt, max_new=24, stop_at_eos=False)
    rig.run()
    assert rig.tokens["s"] == plain
    spec = dict(rig.done["s"].stats)
    assert spec["spec:drafted"] > 0 and spec["spec:trips"] < 24  # drafts rode along and were verified


def test_refusals_failures_and_the_watchdog():
    rig = Rig(slots=1, max_queued=1)
    rig.submit("m2:1", [1, 2], origin="m2")
    rig.submit("m2:2", [3], origin="m2")  # one may wait for the slot
    rig.submit("m2:3", [3], origin="m2")
    assert [(t.req_id, t.status) for t in rig.sent] == [("m2:3", 429)]
    rig.submit("m3:1", [V], origin="m3")  # an id outside the vocabulary
    assert rig.sent[-1].status == 400 and "0..49" in rig.sent[-1].error
    rig.pump()
    assert rig.core.late(rig.now + 1.0, lambda rows: 2.0) is None
    assert rig.core.late(rig.now + 3.0, lambda rows: 2.0) == 2.0
    assert rig.core.late(rig.now + 3.0, lambda rows: 2.0 * rows) is None  # the prompt's step feeds 2
    # a frame of ours too big to send: that request alone fails, its slot is free again
    out = rig.core.send_failed(["m2:1"], "too big")
    assert any(isinstance(a, FreeSlot) for a in out)
    (fail,) = [a.frame for a in out if isinstance(a, Send)]
    assert fail.status == 500 and "too big" in fail.error
    # the ring breaks: nothing leaves, every request ends with the reason, new ones are refused
    rig.core.halt("member m3 left")
    assert rig.core.pump(rig.now) == []
    out = rig.core.fail_all("member m3 left")
    assert [a.frame.status for a in out if isinstance(a, Send)] == [503]
    with pytest.raises(SchedulerError, match="degraded") as err:
        rig.core.submit(Request("m1:9", "m1", "m1", 4, True, np.array([1], np.int32)))
    assert err.value.status == 503


def test_cores_do_no_io():
    """The head's core and what it is built of import no asyncio, socket, time, threading, os or
    subprocess (the ring node does the I/O)."""
    banned = {"asyncio", "socket", "time", "threading", "os", "subprocess"}
    for mod in (head, timing, scheduler, microbatch, speculate, frames, fields, slots, sampling):
        tree = ast.parse(inspect.getsource(mod))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & banned, (mod.__name__, names & banned)
