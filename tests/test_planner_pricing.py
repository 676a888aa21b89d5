"""The cost model's terms beyond bandwidth (issue 37): a block's and the head's measured fixed
cost, members sharing a machine priced as sharing it, the context memory holds, and the
prediction beside the measurement as /status and `kafila demo --json` give it."""

from __future__ import annotations

import pytest

from backends.errors import Refused
from kafila.session.control.pricing import choose_context, predictions, probe_fields
from planner import Plan, largest_context, make_plan, parse_fleet
from tests.test_planner_support import GB, SMALL_MODEL, device, fleet


def test_a_blocks_fixed_cost_and_the_heads_are_priced() -> None:
    bare = parse_fleet(fleet(device("a", 100, 100.0), device("b", 100, 100.0)))
    timed = parse_fleet(fleet(device("a", 100, 100.0, block_us=500.0, head_us=2000.0),
                              device("b", 100, 100.0, block_us=500.0, head_us=2000.0)))  # fmt: skip
    p0, p1 = make_plan(bare), make_plan(timed)
    assert p0.blocks == p1.blocks
    for i, n in enumerate(p1.blocks):  # each block 0.5 ms more, the head 2 ms more
        assert p1.stage_ms[i] - p0.stage_ms[i] == pytest.approx(0.5 * n + (2.0 if i == 0 else 0.0))


def test_head_reads_only_the_lm_head() -> None:
    model = {**SMALL_MODEL, "head_bytes": 2 * GB, "head_read_bytes": 0.5 * GB}
    plan = make_plan(parse_fleet(fleet(device("a", 100, 100.0, overhead_us=0.0), model=model)))
    assert plan.stage_ms[0] == pytest.approx((10 * GB + 0.5 * GB) / 100e6)


def test_members_of_one_machine_are_priced_as_sharing_it() -> None:
    """Two members on machine X and one alone on Y, all alike: alone, each would get a third of the
    blocks; sharing, X's two compute one at a time, so Y takes about half and the bottleneck is
    X's sum."""
    devices = [device("a", 100, 100.0, machine="X"), device("b", 100, 100.0, machine="X"),
               device("c", 100, 100.0, machine="Y")]  # fmt: skip
    model = {**SMALL_MODEL, "head_bytes": 0}
    apart = [{k: v for k, v in d.items() if k != "machine"} for d in devices]
    alone = make_plan(parse_fleet(fleet(*apart, model=model)))
    shared = make_plan(parse_fleet(fleet(*devices, model=model)))
    assert alone.machines is None and shared.machines == ("X", "X", "Y")
    stages = dict(zip(shared.ring, shared.stage_ms, strict=True))
    assert shared.bottleneck_ms == pytest.approx(max(stages["a"] + stages["b"], stages["c"]))
    # the real bottleneck of the division made as if alone: machine X runs a's and b's blocks
    per_ms = 1 * GB / 100e6
    alone_x = sum(n for name, n in zip(alone.ring, alone.blocks, strict=True) if name in "ab") * per_ms
    assert shared.bottleneck_ms < 0.8 * alone_x
    assert dict(zip(shared.ring, shared.blocks, strict=True))["c"] > max(alone.blocks[2], 3)
    back = Plan.from_json(shared.to_json())  # what the host sends each member
    assert back.machines == shared.machines and back.bottleneck_ms == pytest.approx(shared.bottleneck_ms)


def test_probe_fields_pass_what_was_measured() -> None:
    d = {"bandwidth_gbps": 5.0, "overhead_us": None, "block_us": 80.0, "machine": "abc", "memory_gb": 3}
    assert probe_fields(d) == {"bandwidth_gbps": 5.0, "block_us": 80.0, "machine": "abc"}


def test_a_member_on_the_hosts_machine_is_priced_by_the_probe_the_host_calibrated_against() -> None:
    """The host timed the model's blocks against its own probe: a member of its machine takes
    those timing figures; one elsewhere, probed on another backend or under a CPU quota, its own."""
    host = {"bandwidth_gbps": 20.0, "overhead_us": 20.0, "block_us": 90.0, "block_gbps": 15.0, "head_us": 50.0,
            "machine": "abc", "probed_on": "openvino CPU"}  # fmt: skip
    own = {"bandwidth_gbps": 18.0, "overhead_us": 25.0, "block_us": 110.0, "block_gbps": 13.0, "head_us": 60.0,
           "machine": "abc", "probed_on": "openvino CPU"}  # fmt: skip
    same = probe_fields(own, host)
    assert same == {k: v for k, v in host.items() if k != "probed_on"}
    assert probe_fields({**own, "machine": "xyz"}, host)["block_us"] == 110.0
    assert probe_fields({**own, "probed_on": "mlx CPU"}, host)["block_us"] == 110.0
    quota = probe_fields({**own, "cpu_quota": 0.25, "cpu_period_ms": 10.0, "cpu_burst": 4.0}, host)
    assert quota["block_us"] == 110.0 and quota["cpu_burst"] == 4.0
    assert probe_fields(own, {**host, "cpu_quota": 0.5})["block_us"] == 110.0


KV_MODEL = {**SMALL_MODEL, "block_bytes": 0.1 * GB, "head_bytes": 0.1 * GB, "kv_bytes_per_token_per_block": 1e5}


def _session(memory_gb: float) -> dict:
    return fleet(device("a", memory_gb, 100.0), device("b", memory_gb, 100.0), model=KV_MODEL)


def test_largest_context_is_the_edge_of_feasibility() -> None:
    parsed = parse_fleet(_session(3.0))
    most = largest_context(parsed, 1 << 20)
    assert 0 < most < 1 << 20
    from dataclasses import replace

    assert make_plan(replace(parsed, context=most)).feasible
    assert not make_plan(replace(parsed, context=most + 1)).feasible


def test_default_context_is_the_models_capped_by_memory() -> None:
    roomy, _ = choose_context(_session(100.0), None, 4096, "m", "kafila", None)
    assert roomy == 4096  # the model's own: memory holds it
    ctx, why = choose_context(_session(3.0), None, 1 << 20, "m", "kafila", None)
    assert ctx < 1 << 20 and "memory holds" in why and str(ctx) in why
    parsed = parse_fleet({**_session(3.0), "concurrency": 4})
    assert ctx == largest_context(parsed, 1 << 20)  # room for 4 requests at once under auto


def test_an_explicit_context_memory_cannot_hold_is_refused_with_the_largest_that_fits() -> None:
    fits, _ = choose_context(_session(3.0), None, 1 << 20, "m", "kafila", 2)
    with pytest.raises(Refused, match=rf"--context {fits + 1} does not fit .* the largest that fits is {fits}\b"):
        choose_context(_session(3.0), fits + 1, 1 << 20, "m", "kafila", 2)
    assert choose_context(_session(3.0), fits, 1 << 20, "m", "kafila", 2)[0] == fits


def test_predictions_side_by_side() -> None:
    plan = make_plan(parse_fleet(fleet(device("a", 100, 100.0), device("b", 100, 100.0)))).to_json()
    a, b = plan["stage_ms"]["a"], plan["stage_ms"]["b"]
    assert plan["head_ms"] == pytest.approx(2 * GB / 100e6)  # the head's lm_head bytes
    a -= plan["head_ms"]  # the head's stage without its pick: what its member times
    got = predictions(plan, {"a": a * 2, "b": b}, 1000.0 / (plan["stage_ms"]["a"] + b))
    assert got["stages"]["a"]["error"] == pytest.approx(0.5) and got["stages"]["b"]["error"] == 0
    assert got["tok_s"]["error"] == pytest.approx(0.0, abs=1e-3)
    assert predictions(None, {}, None)["stages"] == {}
    assert predictions(None, {}, None)["tok_s"] == {"predicted": None, "measured": None, "error": None}


def test_the_models_own_block_timing_scales_each_stage_and_sharing_a_machine_adds_the_cold_cost():
    from planner import make_plan, parse_fleet

    dev = {"memory_gb": 16, "bandwidth_gbps": 20, "overhead_us": 10, "block_us": 50, "block_gbps": 10, "head_us": 30}
    model = {"name": "m", "blocks": 12, "block_bytes": 1e6, "head_bytes": 2e6, "kv_bytes_per_token_per_block": 0}
    fleet = {"context": 64, "concurrency": 1, "anchor": "a", "model": model,
             "devices": [{"name": "a", **dev}, {"name": "b", **dev}]}
    plain = make_plan(parse_fleet(fleet))
    tuned = make_plan(parse_fleet({**fleet, "model": {**model, "block_scale": 2.0, "stage_us": 100, "embed_us": 40}}))
    per = 50e-3 + 1e6 / 10e6  # ms a block: its fixed part and its bytes at the probed rate
    b = plain.ring.index("b")
    assert plain.stage_ms[b] == pytest.approx(10e-3 + plain.blocks[b] * per)
    assert tuned.stage_ms[b] == pytest.approx(110e-3 + tuned.blocks[b] * 2 * per)
    assert tuned.head_ms == pytest.approx(plain.head_ms)  # the pick alone: the embedding is the stage's
    # two members of one machine: each pays the shared figures, unless it runs under a CPU quota
    shared = {**model, "shared_scale": 1.5, "shared_us": 200}
    one = [{"name": "a", **dev, "machine": "x"}, {"name": "b", **dev, "machine": "x"}]
    both = make_plan(parse_fleet({**fleet, "model": shared, "devices": one}))
    b = both.ring.index("b")
    assert both.stage_ms[b] == pytest.approx(210e-3 + both.blocks[b] * 1.5 * per)
    quota = [one[0], {**one[1], "cpu_quota": 0.25}]
    q = make_plan(parse_fleet({**fleet, "model": shared, "devices": quota}))
    b = q.ring.index("b")
    assert q.stage_ms[b] == pytest.approx(10e-3 + q.blocks[b] * per)


def test_a_member_under_a_cpu_quota_runs_one_requests_stage_in_a_burst():
    """The probe's figures under a quota are sustained rates; while the quota lets it run the
    member computes cpu_burst× faster. One request's stage runs whole where the period's budget
    holds it (alone_ms), the ring full still gets the sustained time (stage_ms)."""
    from planner import Plan, make_plan, parse_fleet
    from planner.cost import at_burst, quota_alone_ms
    from planner.fleet import Device

    slow = {"memory_gb": 16, "bandwidth_gbps": 5, "overhead_us": 40, "block_us": 200, "block_gbps": 2.5, "head_us": 30}
    fast = {k: (v * 4 if k in ("bandwidth_gbps", "block_gbps") else v / 4 if k.endswith("_us") else v)
            for k, v in slow.items()}  # fmt: skip
    model = {"name": "m", "blocks": 12, "block_bytes": 1e6, "head_bytes": 2e6, "kv_bytes_per_token_per_block": 0}
    fleet = {"context": 64, "concurrency": 1, "anchor": "a", "model": model,
             "devices": [{"name": "a", **fast}, {"name": "b", **slow, "cpu_quota": 0.25, "cpu_period_ms": 10,
                                                 "cpu_burst": 4}]}  # fmt: skip
    plan = make_plan(parse_fleet(fleet))
    a, b = plan.ring.index("a"), plan.ring.index("b")
    unthrottled = make_plan(parse_fleet({**fleet, "devices": [{"name": "a", **fast}, {"name": "b", **fast}]}))
    # at its burst the quota'd member costs what the same device unthrottled costs
    from planner.cost import Tier, stage_cost

    fleet_parsed = parse_fleet(fleet)
    dev_b = next(d for d in fleet_parsed.devices if d.name == "b")
    burst = stage_cost(at_burst(dev_b), fleet_parsed, Tier.FULL, is_head=False).at(plan.blocks[b])
    plain_b = stage_cost(next(d for d in parse_fleet(
        {**fleet, "devices": [{"name": "a", **fast}, {"name": "b", **fast}]}).devices if d.name == "b"),
        fleet_parsed, Tier.FULL, is_head=False).at(plan.blocks[b])  # fmt: skip
    assert burst == pytest.approx(plain_b)
    assert unthrottled.alone_ms is None
    assert plan.alone_ms is not None and plan.alone_ms[a] == plan.stage_ms[a]
    assert plan.alone_ms[b] == pytest.approx(burst) and plan.alone_ms[b] < plan.stage_ms[b]
    assert plan.predicted_tok_s == pytest.approx(1000 / (plan.alone_ms[a] + plan.alone_ms[b]))
    back = Plan.from_json(plan.to_json())
    assert back.alone_ms == pytest.approx(plan.alone_ms) and back.predicted_tok_s == pytest.approx(plan.predicted_tok_s)

    quota = Device("q", 16, 5, 40, cpu_quota=0.25, cpu_period_ms=10, cpu_burst=4)  # budget: 2.5 ms a period
    assert quota_alone_ms(quota, 2.0, 8.0, circuit_ms=10) == 2.0  # fits the period's budget
    assert quota_alone_ms(quota, 2.0, 8.0, circuit_ms=2.5) == 8.0  # 4 tokens a period: the quota paces it
    # 4 ms of burst alone, arriving φ into a period with 2.5 ms to run: 2.5 ms run, then a wait
    # for the period's end (7.5 − φ ms, when the period is not over first), then 1.5 ms run
    # (a second wait when φ > 8.5: 10 − φ run, wait 7.5, the rest): the mean over φ
    waits = [max(0.0, 7.5 - p) + (7.5 if p > 8.5 else 0.0) for p in (10 * (i + 0.5) / 64 for i in range(64))]
    assert quota_alone_ms(quota, 4.0, 16.0, circuit_ms=20) == pytest.approx(4.0 + sum(waits) / 64)
    assert quota_alone_ms(Device("n", 16, 5, 40), 2.0, 8.0, circuit_ms=10) == 8.0  # no quota: sustained
    # the kernel saw a quarter of a 10 ms period spent only at its next tick: runs of 4 ms after a
    # rest, so a 3.5 ms stage runs whole (priced stalled without the measured run)
    ticked = Device("q", 16, 5, 40, cpu_quota=0.25, cpu_period_ms=10, cpu_burst=4, cpu_run_ms=4.0)
    assert quota_alone_ms(ticked, 3.5, 14.0, circuit_ms=20) == 3.5
    assert quota_alone_ms(quota, 3.5, 14.0, circuit_ms=20) > 6.0
    assert quota_alone_ms(ticked, 4.5, 18.0, circuit_ms=20) > 6.0  # beyond the run: stalls again
    short = Device("q", 16, 5, 40, cpu_quota=0.25, cpu_period_ms=10, cpu_burst=4, cpu_run_ms=1.0)
    assert quota_alone_ms(short, 2.0, 8.0, circuit_ms=10) == 2.0  # never less than the share


def test_the_heads_own_per_request_bytes_are_priced_for_each_slot_and_the_parked_ones() -> None:
    """A draft head's KV and rows (--speculate mtp): `head_bytes_per_token` per position of every
    request and of `head_parked` finished ones, at the head only."""
    from planner import member_bytes
    from planner.cost import slots_that_fit

    per_token, parked = 5e5, 4
    plain = parse_fleet({**_session(30.0), "concurrency": 2})
    drafting = parse_fleet({**_session(30.0), "concurrency": 2,
                            "model": {**KV_MODEL, "head_bytes_per_token": per_token, "head_parked": parked}})  # fmt: skip
    m0, m1 = plain.model, drafting.model
    for head in (True, False):
        grown = member_bytes(m1, 5, head, 1000 * 2, requests=2) - member_bytes(m0, 5, head, 1000 * 2, requests=2)
        assert grown == pytest.approx(per_token * 1000 * (2 + parked) if head else 0.0)
    blocks = {"a": 10, "b": 10}
    wide = slots_that_fit(plain, blocks, "a", 10_000)
    narrow = slots_that_fit(drafting, blocks, "a", 10_000)
    assert narrow < wide  # the head's room goes to its draft KV too
    assert slots_that_fit(drafting, blocks, "b", 10_000) == narrow  # whichever member heads
    # the head's limit is its bytes at that many requests, the parked ones included
    ctx = plain.context

    def fits(n: int) -> bool:
        return member_bytes(m1, 10, True, ctx * n, requests=n) <= 30.0 * GB

    assert fits(narrow) and not fits(narrow + 1)
    with pytest.raises(Exception, match="head_parked"):
        parse_fleet({**_session(3.0), "model": {**KV_MODEL, "head_parked": -1}})
