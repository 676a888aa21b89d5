"""Many users at once, without sockets or the model: slots from memory, the bounded fair queue,
and the /status `load` (its checks on what other members report, and its rendering)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from backends.errors import BadInput
from kafila.session.ring.load import clean_head, clean_request, clean_stage, ring_load
from kafila.session.ring.scheduler import Scheduler, SchedulerError, TokenOut
from kafila.session.ring.slots import AUTO_MAX_SLOTS, auto_slots, parse_concurrency, parse_max_queued
from planner import block_limit, make_plan, parse_fleet, slots_that_fit
from tests.test_planner_support import GB, device, fleet

# 10 blocks of 1 GB, a 2 GB head, 1 MB of KV per token per block: at context 1000 one slot
# costs 1 GB per block held
KV_MODEL = {"name": "kv", "blocks": 10, "block_bytes": 1 * GB, "head_bytes": 2 * GB,
            "kv_bytes_per_token_per_block": 1e6}  # fmt: skip


def kv_fleet(*devices: dict, concurrency: int = 1) -> dict:
    data = fleet(*devices, model=KV_MODEL)
    data["context"], data["concurrency"] = 1000, concurrency
    return data


# --- slots from memory ----------------------------------------------------------------------------


@pytest.mark.parametrize(("memories", "blocks", "want"), [
    ((40, 40), {"a": 5, "b": 5}, 6),    # a (head): (40 − 2 − 5) / 5 = 6.6; b: (40 − 5) / 5 = 7
    ((12, 100), {"a": 2, "b": 8}, 4),   # a: (12 − 2 − 2) / 2 = 4; b: (100 − 8) / 8 = 11.5
    ((9, 9), {"a": 3, "b": 7}, 0),      # b cannot hold even one slot beside its 7 GB of weights
    ((4000, 4000), {"a": 5, "b": 5}, AUTO_MAX_SLOTS),  # a big machine: the cap
])  # fmt: skip
def test_slots_that_fit_counts_each_members_room_after_its_weights(memories, blocks, want) -> None:
    f = parse_fleet(kv_fleet(*(device(n, m) for n, m in zip("ab", memories))))
    assert slots_that_fit(f, blocks, "a", AUTO_MAX_SLOTS) == want


def test_slots_that_fit_agrees_with_admission_for_every_count() -> None:
    """Brute force: c slots fit a division exactly when admission at concurrency c accepts it."""
    for mem_a, mem_b, n_a in itertools.product((8, 13, 27, 60), (9, 20, 41), range(1, 10)):
        blocks = {"a": n_a, "b": 10 - n_a}
        fit = slots_that_fit(parse_fleet(kv_fleet(device("a", mem_a), device("b", mem_b))), blocks, "a", 64)
        for c in range(1, 66):
            f = parse_fleet(kv_fleet(device("a", mem_a), device("b", mem_b), concurrency=c))
            ok = blocks["a"] <= block_limit(f.device("a"), f, True) and blocks["b"] <= block_limit(
                f.device("b"), f, False)  # fmt: skip
            assert ok == (c <= fit), (mem_a, mem_b, n_a, c, fit)


def test_a_model_without_kv_gets_the_cap() -> None:
    f = parse_fleet(fleet(device("a", 20), device("b", 20)))  # SMALL_MODEL: no KV bytes
    assert slots_that_fit(f, {"a": 5, "b": 5}, "a", 32) == 32


def test_auto_plans_for_one_request_then_counts_slots() -> None:
    data = kv_fleet(device("a", 30), device("b", 30))
    plan = make_plan(parse_fleet(data)).to_json()
    assert plan["feasible"]
    slots = auto_slots(data, plan)
    assert 1 < slots < AUTO_MAX_SLOTS

    def admitted(c: int) -> bool:  # the plan's own division, checked at concurrency c
        f = parse_fleet({**data, "concurrency": c})
        return all(n <= block_limit(f.device(name), f, name == plan["head"]) for name, n in plan["blocks"].items())

    assert admitted(slots) and not admitted(slots + 1)


@pytest.mark.parametrize("text", ["0", "-1", "-4", "x", "1.5", "65", "", "4 slots", "1e3", "99999999999999"])
def test_bad_concurrency_is_one_line_of_bad_input(text) -> None:
    with pytest.raises(BadInput) as e:
        parse_concurrency(text)
    assert "--concurrency" in str(e.value) and "\n" not in str(e.value)


def test_concurrency_auto_and_numbers() -> None:
    assert parse_concurrency("auto") is None and parse_concurrency("AUTO") is None and parse_concurrency(None) is None
    assert parse_concurrency("4") == 4 and parse_concurrency(64) == 64 and parse_concurrency(" 2 ") == 2
    assert parse_max_queued("0") == 0 and parse_max_queued("64") == 64
    for bad in ("-1", "x", "5000", True):
        with pytest.raises(BadInput):
            parse_max_queued(bad)


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_kafila_host_with_a_bad_concurrency_exits_2_with_one_line(value, tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "kafila", "host", "--expect", "3", "--concurrency", value,
                        "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--concurrency" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""  # no session code: nothing started


# --- the queue: bounded, FIFO, nobody starves ------------------------------------------------------


def test_slots_go_in_arrival_order_and_every_active_request_steps_each_round() -> None:
    s = Scheduler(slots=2, context=64, max_queue=8)
    for i in range(6):
        s.submit(f"r{i}", "m", [1, 2], 3, stop_at_eos=False)
    admitted, rounds = [], 0
    while s.active or s.queued:
        rounds += 1
        assert rounds < 50
        steps = s.steps()
        active = [v.req_id for v in s.views() if v.state != "queued"]
        assert {st.req_id for st in steps} == set(active)  # every active request has its step
        admitted += [r for r in active if r not in admitted]
        for st in steps:
            s.complete(st.req_id, 7)
    assert admitted == [f"r{i}" for i in range(6)]


def test_a_full_queue_refuses_with_429_and_keeps_what_it_admitted() -> None:
    s = Scheduler(slots=1, context=64, max_queue=1)
    s.submit("a", "m1", [1, 2], 2, stop_at_eos=False)
    s.submit("b", "m2", [3], 2, stop_at_eos=False)
    for rid in ("c", "d"):
        with pytest.raises(SchedulerError) as e:
            s.submit(rid, "m3", [4], 2)
        assert e.value.status == 429 and "waiting" in str(e.value)
    got: dict[str, list[int]] = {}
    for _ in range(20):
        for st in s.steps():
            for ev in s.complete(st.req_id, 5):
                if isinstance(ev, TokenOut):
                    got.setdefault(ev.req_id, []).append(ev.token)
    assert got == {"a": [5, 5], "b": [5, 5]} and s.active == 0 and s.queued == 0


def test_no_queue_still_serves_the_free_slots() -> None:
    s = Scheduler(slots=2, context=64, max_queue=0)
    s.submit("a", "m", [1], 1)
    s.submit("b", "m", [1], 1)
    with pytest.raises(SchedulerError):
        s.submit("c", "m", [1], 1)
    assert sorted(st.req_id for st in s.steps()) == ["a", "b"]


def test_views_show_queued_prefill_and_decode() -> None:
    s = Scheduler(slots=1, context=64, chunk_tokens=2)
    s.submit("a", "m1", [1, 2, 3], 4)
    s.submit("b", "m2", [1], 4)
    (st,) = s.steps()
    assert [(v.req_id, v.state) for v in s.views()] == [("a", "prefill"), ("b", "queued")]
    s.complete("a", None)
    (st,) = s.steps()
    s.complete("a", 9)
    v = s.views()[0]
    assert (v.state, v.prompt_tokens, v.generated, v.max_new, v.origin) == ("decode", 3, 1, 4, "m1")


# --- /status load: what other members report is checked -----------------------------------------


def test_clean_stage_keeps_only_bounded_counts() -> None:
    assert clean_stage({"active": 2, "batch_rows": 1, "steps": 40, "extra": "x"}) == {
        "active": 2, "batch_rows": 1, "steps": 40}  # fmt: skip
    for bad in (None, [], {"active": -1, "batch_rows": 1, "steps": 0}, {"active": 1, "batch_rows": 1},
                {"active": True, "batch_rows": 1, "steps": 0}, {"active": 10**6, "batch_rows": 1, "steps": 0},
                {"active": 1, "batch_rows": "1", "steps": 0}):  # fmt: skip
        assert clean_stage(bad) is None, bad


def test_clean_head_drops_bad_requests_and_bounds_the_list() -> None:
    good = {"id": "m2:1", "origin": "m2", "state": "decode", "prompt_tokens": 9, "tokens": 3, "max_tokens": 24,
            "tok_s": 12.5}  # fmt: skip
    raw = {"slots": 8, "active": 1, "queued": 0, "max_queued": 64,
           "requests": [good, {**good, "state": "flying"}, {**good, "tok_s": float("nan")}, {**good, "id": "x" * 500},
                        *[good] * 100]}  # fmt: skip
    out = clean_head(raw)
    assert out is not None and out["slots"] == 8 and len(out["requests"]) == 61  # 64 looked at, 3 bad
    assert clean_request(good) == good
    assert clean_head({**raw, "slots": 0}) is None and clean_head({**raw, "requests": "no"}) is None
    assert clean_head("x") is None
    # slots keeping a finished request's KV (prompt caching): a count in 0..64, else 0
    assert out["parked"] == 0 and clean_head({**raw, "parked": 3})["parked"] == 3
    assert clean_head({**raw, "parked": 999})["parked"] == 0 and clean_head({**raw, "parked": "3"})["parked"] == 0
    # how the head sizes its micro-batches: kept when valid, dropped (None) when not
    assert out["batching"] is None
    fit = {"groups": 2, "c_ms": 20.5, "beta_ms": 2.0}
    assert clean_head({**raw, "batching": fit})["batching"] == fit
    assert clean_head({**raw, "batching": {"groups": 3}})["batching"] == {"groups": 3}
    for bad in ({"groups": 0}, {"groups": 999}, {"groups": 2, "c_ms": float("inf")}, {"groups": 2, "beta_ms": -1},
                {"groups": 2, "c_ms": True}, {"groups": "2"}, [2]):  # fmt: skip
        assert clean_head({**raw, "batching": bad})["batching"] is None, bad


def test_ring_load_puts_this_stage_live_and_the_others_as_reported() -> None:
    head = {"slots": 4, "active": 1, "queued": 2, "max_queued": 8, "requests": []}
    own = {"active": 1, "batch_rows": 1, "steps": 9}
    load = ring_load(["m1", "m2", "m3"], "m2", own, {"m1": {"active": 0, "batch_rows": 1, "steps": 3},
                                                    "m2": {"active": 5, "batch_rows": 1, "steps": 1}}, head)  # fmt: skip
    assert load["stages"] == {"m1": {"active": 0, "batch_rows": 1, "steps": 3}, "m2": own, "m3": None}
    assert (load["slots"], load["active"], load["queued"], load["max_queued"]) == (4, 1, 2, 8)
    assert ring_load(["m1"], "m1", None, {}, None)["slots"] is None


def test_kafila_status_renders_the_load() -> None:
    import os

    from rich.console import Console

    from kafila.commands.status import render

    st = {"session": {"name": "m1", "state": "serving"}, "plan": {"ring": ["m1", "m2"], "head": "m1"},
          "load": {"slots": 8, "active": 2, "queued": 1, "max_queued": 64,
                   "stages": {"m1": {"active": 2, "batch_rows": 1, "steps": 70}, "m2": None},
                   "micro_batches": [2], "batching": {"groups": 2, "c_ms": 20.5, "beta_ms": 2.25},
                   "requests": [{"id": "m2:4", "origin": "m2", "state": "decode", "prompt_tokens": 9,
                                 "tokens": 5, "max_tokens": 24, "tok_s": 11.25}]}}  # fmt: skip
    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render(st))
    text = console.export_text()
    assert "slots: 2 of 8 busy, 1 queued" in text and "load per stage" in text
    assert "m2:4" in text and "11.2" in text and "5 / 24" in text
    assert "micro-batches: 2 kept in flight, rows now [2]" in text and "20.5 + 2.25 ms a position" in text


def test_the_many_users_bound_is_the_busier_of_the_machine_and_a_trip():
    """bench/ring_bound.py: N users in g micro-batches of ⌈N/g⌉ rows; one machine computes one
    stage at a time, so a round takes max(g·C(b), C(b) + H), and the best g is taken."""
    from bench.ring_bound import bound, ring_compute_ms

    costs = [{1: 10.0, 2: 12.0, 4: 16.0}, {1: 5.0, 2: 6.0, 4: 8.0}]  # ms of a b-row step, per stage
    assert ring_compute_ms(costs, 3) == 24.0  # 3 rows cost what the 4-row step costs
    assert ring_compute_ms(costs, 8) == 48.0  # past the largest measured: linear in rows
    # no network: one batch of all rows keeps the machine busiest for the fewest steps
    assert bound(costs, 4, 0.0) == {"tok_s": 4 / 24.0 * 1000, "groups": 1, "rows": 4, "compute_ms": 24.0}
    # 100 ms a trip on the wire: one batch waits for it; 4 batches of one row fill it
    b = bound(costs, 4, 100.0)
    assert (b["groups"], b["rows"]) == (4, 1) and b["tok_s"] == pytest.approx(4 / 115.0 * 1000)
    assert bound(costs, 1, 100.0)["tok_s"] == pytest.approx(1000 / 115.0)


def test_the_speculating_bound_prices_drafts_on_the_same_cores():
    """bench/ring_bound.py's spec_bound: l drafts a user make each batch b·(l+1) rows and yield
    u(l) tokens a user; the machine also computes every draft, so a round takes
    max(g·C(b·(l+1)) + N·l·d, C(b·(l+1)) + H). Without drafts it is bound(N)."""
    from bench.ring_bound import bound, spec_bound

    costs = [{1: 10.0, 2: 12.0, 4: 16.0}, {1: 5.0, 2: 6.0, 4: 8.0}]
    # acceptance 0: a draft never yields a token, so the best is plain decoding's bound
    plain = bound(costs, 1, 100.0)
    none = spec_bound(costs, 1, 100.0, alpha=0.0, draft_ms=1.0)
    assert none["draft"] == 0 and none["tok_s"] == pytest.approx(plain["tok_s"])
    # one user, 100 ms a trip, free drafts accepted at 0.9: 8 drafts, 9 rows (past the measured
    # 4: linear, 54 ms) wait for the trip (154 ms) and yield (1 − 0.9⁹) / 0.1 tokens
    free = spec_bound(costs, 1, 100.0, alpha=0.9, draft_ms=0.0)
    assert free["draft"] == 8 and free["tok_s"] == pytest.approx((1 - 0.9**9) / 0.1 / 154.0 * 1000)
    # drafts that cost more than the trip they hide in: the machine's time bounds the round
    slow = spec_bound(costs, 1, 0.0, alpha=0.5, draft_ms=50.0)
    assert slow["draft"] == 0 and slow["tok_s"] == pytest.approx(1000 / 15.0)


def test_a_sessions_ring_for_the_bound_is_its_block_ranges_and_network_time():
    """bench/ring_bound.py's session_ring: the head's /status gives the stages' block ranges in
    ring order (the head's first) and H, its measured network time, else the edges' RTT/2."""
    from bench.ring_bound import session_ring

    status = {"plan": {"ring": ["m2", "m1", "m3"]}, "stages": {"m1": {"blocks": 12}, "m2": {"blocks": 6},
                                                                "m3": {"blocks": 12}},
              "network_ms": 61.5, "edges": [{"rtt_ms": 40.0}]}  # fmt: skip
    assert session_ring(status) == ([(0, 6), (6, 18), (18, 30)], 61.5)
    status["network_ms"] = None  # none measured yet: half of every edge's round trip
    assert session_ring(status)[1] == 20.0
