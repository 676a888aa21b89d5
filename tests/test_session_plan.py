"""Pure pieces of the lifecycle: a member's role from the plan, the host's tables."""

import os

import pytest

from backends.errors import Refused
from kafila.session.control.host import members_table, plan_table, predicted_tok_s
from kafila.session.control.participant import role_of

PLAN = {"feasible": True, "tier": "full", "policy": "kafila", "head": "m1", "ring": ["m1", "m3", "m2"],
        "blocks": {"m1": 8, "m3": 12, "m2": 10}, "stage_ms": {"m1": 4.0, "m3": 4.0, "m2": 4.0},
        "bottleneck_ms": 4.0, "edges": [{"from": "m1", "to": "m3", "kind": "direct", "ms": 1.0},
                                         {"from": "m3", "to": "m2", "kind": "relay", "ms": 2.0},
                                         {"from": "m2", "to": "m1", "kind": "direct", "ms": 1.0}],
        "refused": []}


def test_roles_follow_the_ring_order_from_the_head():
    r1, r3, r2 = (role_of(PLAN, n) for n in ("m1", "m3", "m2"))
    assert (r1.first, r1.last, r3.first, r3.last, r2.first, r2.last) == (0, 8, 8, 20, 20, 30)
    assert r1.successor("m1") == "m3" and r1.predecessor("m1") == "m2"
    assert r2.successor("m2") == "m1"
    with pytest.raises(Refused, match="leaves this member"):
        role_of(PLAN, "m9")


def test_tables_and_prediction():
    assert predicted_tok_s(PLAN) == pytest.approx(1000 / 16)
    assert predicted_tok_s({**PLAN, "stage_ms": {"m1": None, "m2": None, "m3": None}}) is None
    t = plan_table(PLAN, {"m1": (0, 8), "m3": (8, 20), "m2": (20, 30)})
    assert t.row_count == 3
    rows = [{"name": "m1", "nat": "ordinary", "rtt_ms": 3.0, "bandwidth_gbps": None, "memory_gb": 8.0, "state": "joined"}]
    assert members_table(rows, "t").row_count == 1


def test_plan_preview_names_the_bottleneck_with_its_tok_s():
    """The host's preview, `kafila status` and the demo share plan_summary: the member with the
    largest predicted stage time is named, with the tok/s its stage alone allows."""
    from rich.console import Console

    from kafila.commands.status import render
    from kafila.session.control.preview import bottleneck, plan_summary

    plan = {**PLAN, "stage_ms": {"m1": 4.0, "m3": 5.0, "m2": 3.0}, "bottleneck_ms": 5.0}
    assert bottleneck(plan) == "m3"
    line = plan_summary(plan)
    assert line == "predicted 62.5 tok/s, bottleneck m3 (5.00 ms) → at most 200.0 tok/s with the ring full"
    assert plan_summary({**PLAN, "stage_ms": {"m1": None, "m3": None, "m2": None}}) == (
        "predicted – tok/s, bottleneck – (the plan has no stage times)")
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(plan_table(plan, {"m1": (0, 8), "m3": (8, 20), "m2": (20, 30)}))
    console.print(render({"session": {"name": "m2", "state": "planned"}, "plan": plan}))
    out = console.export_text()
    assert "5.00 ◀ bottleneck" in out and out.count("◀ bottleneck") == 1  # the plan table marks it
    assert line in out  # `kafila status` says the same as the host's preview


def test_kafila_status_says_what_carries_each_edges_frames():
    from rich.console import Console

    from kafila.commands.status import render

    edges = [{"from": "m1", "to": "m3", "kind": "direct", "rtt_ms": 0.3, "lane": "tcp"},
             {"from": "m3", "to": "m2", "kind": "relay", "rtt_ms": 9.0, "lane": "quic",
              "lane_note": "cannot reach 10.2.0.2 port 40475: no answer within 1.5 s"}]  # fmt: skip
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render({"session": {"name": "m1", "state": "serving"}, "plan": PLAN, "edges": edges}))
    out = console.export_text()
    assert "frames over" in out
    lines = {ln.split("│")[1].strip(): ln for ln in out.splitlines() if "→" in ln and "│" in ln}
    assert "TCP" in lines["m1 → m3"] and "QUIC" in lines["m3 → m2"] and "–" in lines["m2 → m1"], out
