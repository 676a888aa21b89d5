"""The session's control messages (kafila.session.control.messages): every kind goes through encode and
decode unchanged, and what is malformed or out of bounds is one ControlError. No sockets."""

from __future__ import annotations

import msgpack
import pytest

from kafila.session.control import messages as c
from planner import Plan, PlanInputError

PLAN_JSON = {"feasible": True, "tier": "full", "policy": "kafila", "head": "a", "ring": ["a", "b", "c"],
             "blocks": {"a": 3, "b": 4, "c": 5}, "stage_ms": {"a": 1.5, "b": 2.0, "c": 2.5}, "bottleneck_ms": 2.5,
             "edges": [{"from": "a", "to": "b", "kind": "direct", "ms": 1.0},
                       {"from": "b", "to": "c", "kind": "relay", "ms": None},
                       {"from": "c", "to": "a", "kind": "direct", "ms": 0.5}],
             "refused": []}  # fmt: skip
PLAN = Plan.from_json(PLAN_JSON)
TERMS = c.SessionTerms(context=2048, concurrency=4, precision="serving", speculate="ngram", max_queued=8,
                       batch_rows=False, concurrency_from="memory", model="M", sha256="ab" * 32)  # fmt: skip

MESSAGES = [
    c.PlanMessage(1, PLAN, TERMS, {"sha256": "x", "tensors": [["t", 0, 10, "h"]]}, None),
    c.PlanMessage(7, PLAN, TERMS, None, "member b left the session (bye)"),
    c.Ready(1),
    c.Ready(12),
    c.Failed("could not build", 3),
    c.Serving(2),
    c.Refusal("the model does not fit"),
    c.Wait("plan 2 leaves d out"),
    c.Degraded("edge closed", 4),
    c.Gone("b", "bye"),
    c.EdgeReport({"peer": "b", "rtt_ms": 1.25, "kind": "direct", "bytes_sent": 10}),
    c.EdgeReport({"rtt_ms": 1.0}, {"active": 1, "batch_rows": 2}, (("stage:a", 1.5), ("tok_s", 9.0)),
                 {"slots": 4, "requests": [{"id": "r1", "tok_s": 3.0}], "micro_batches": [1]}),
    c.Status(),
    c.Status({"a": {"rtt_ms": 1.0}}, {"a": {"name": "a", "state": "serving"}}, (("step_ms", 4.0),),
             ({"at": "2026-01-01T00:00:00Z", "event": "plan", "ring": ["a", "b"]},), {"b": {"active": 0}},
             {"slots": 1}),
]  # fmt: skip


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_the_wire(msg) -> None:
    body = c.encode(msg)
    assert body["t"] == msg.T
    wire = msgpack.unpackb(msgpack.packb(body), raw=False)  # what the net layer does with it
    assert c.decode(wire) == msg


def test_every_kind_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == set(c.KINDS.values())


def test_the_wire_keeps_the_old_maps() -> None:
    assert c.encode(c.Ready(3)) == {"t": "ready", "epoch": 3}
    assert c.encode(c.Failed("x", 2)) == {"t": "failed", "reason": "x", "epoch": 2}
    assert c.encode(c.Serving(2)) == {"t": "serving", "epoch": 2}
    assert c.encode(c.Refusal("r")) == {"t": "refused", "reason": "r"}
    assert c.encode(c.Degraded("d", 1)) == {"t": "degraded", "reason": "d", "epoch": 1}
    body = c.encode(MESSAGES[1])
    assert set(body) == {"t", "epoch", "reason", "plan", "session", "manifest"}
    assert body["plan"] == PLAN_JSON and body["session"]["context"] == 2048


def test_fields_an_older_peer_leaves_out_take_the_old_defaults() -> None:
    assert c.decode({"t": "ready"}) == c.Ready(1)
    assert c.decode({"t": "serving"}) == c.Serving(1)
    msg = c.decode({"t": "plan", "plan": PLAN_JSON, "session": {"context": 64, "concurrency": 1}})
    assert isinstance(msg, c.PlanMessage) and msg.epoch == 1 and msg.manifest is None and msg.reason is None
    assert msg.session.speculate == "off" and msg.session.batch_rows is True
    # unknown session keys (a newer host) are ignored; so are unknown fields of a message
    assert c.decode({"t": "plan", "plan": PLAN_JSON, "session": {"context": 64, "concurrency": 1, "x": 1}}).epoch == 1
    assert c.decode({"t": "ready", "epoch": 2, "extra": True}) == c.Ready(2)


def _plan_body(**over):
    return {"t": "plan", "epoch": 2, "plan": PLAN_JSON, "session": TERMS.to_json(), "manifest": None, **over}


BAD = [
    ("not a map", ["ready"]),
    ("no kind", {"epoch": 1}),
    ("kind not text", {"t": 5}),
    ("unknown kind", {"t": "dance"}),
    ("epoch zero", {"t": "ready", "epoch": 0}),
    ("epoch bool", {"t": "ready", "epoch": True}),
    ("epoch text", {"t": "serving", "epoch": "2"}),
    ("epoch huge", {"t": "ready", "epoch": 1 << 40}),
    ("reason missing", {"t": "refused"}),
    ("reason not text", {"t": "wait", "reason": 5}),
    ("reason too long", {"t": "failed", "reason": "x" * (c.MAX_REASON_CHARS + 1), "epoch": 1}),
    ("member too long", {"t": "gone", "member": "m" * 65}),
    ("plan not a map", _plan_body(plan=[1])),
    ("plan without ring", _plan_body(plan={**PLAN_JSON, "ring": []})),
    ("plan head not first", _plan_body(plan={**PLAN_JSON, "head": "b"})),
    ("plan blocks mismatch", _plan_body(plan={**PLAN_JSON, "blocks": {"a": 1}})),
    ("plan blocks negative", _plan_body(plan={**PLAN_JSON, "blocks": {"a": -1, "b": 1, "c": 1}})),
    ("plan edge kind", _plan_body(plan={**PLAN_JSON, "edges": [{"from": "a", "to": "b", "kind": "carrier pigeon"}]})),
    ("session missing", _plan_body(session=None)),
    ("session without context", _plan_body(session={"concurrency": 1})),
    ("session context zero", _plan_body(session={**TERMS.to_json(), "context": 0})),
    ("session slots too many", _plan_body(session={**TERMS.to_json(), "concurrency": c.MAX_SLOTS + 1})),
    ("session batch_rows text", _plan_body(session={**TERMS.to_json(), "batch_rows": "yes"})),
    ("manifest not a map", _plan_body(manifest=[1, 2])),
    ("manifest without tensors", _plan_body(manifest={"sha256": "x"})),
    ("stats not a map", {"t": "edge", "stats": [1]}),
    ("stats too many entries", {"t": "edge", "stats": {str(i): i for i in range(c.MAX_REPORT_ITEMS + 1)}}),
    ("stats too deep", {"t": "edge", "stats": {"a": {"b": {"c": {"d": {"e": 1}}}}}}),
    ("stats holding bytes", {"t": "edge", "stats": {"a": b"raw"}}),
    ("text too long", {"t": "edge", "stats": {"peer": "x" * (c.MAX_REPORT_TEXT_CHARS + 1)}}),
    ("measured not a list", {"t": "edge", "measured": {"a": 1}}),
    ("measured too long", {"t": "status", "measured": [["a", 1.0]] * (c.MAX_REPORT_ITEMS + 1)}),
    ("edges not a map", {"t": "status", "edges": [1]}),
    ("members too many", {"t": "status", "members": {f"m{i}": {} for i in range(c.MAX_MEMBERS + 1)}}),
    ("history not a list", {"t": "status", "history": {"a": 1}}),
]  # fmt: skip


@pytest.mark.parametrize(("why", "body"), BAD, ids=[b[0] for b in BAD])
def test_malformed_or_out_of_bounds_is_one_control_error(why, body) -> None:
    with pytest.raises(c.ControlError) as err:
        c.decode(body)
    line = str(err.value)
    assert line and "\n" not in line, why


def test_we_cannot_build_a_message_out_of_bounds_either() -> None:
    with pytest.raises(c.ControlError):
        c.Ready(0)
    with pytest.raises(c.ControlError):
        c.Refusal("x" * (c.MAX_REASON_CHARS + 1))
    assert c.Refusal(c.clip("x" * 5000)).reason == "x" * c.MAX_REASON_CHARS
    with pytest.raises(c.ControlError):
        c.SessionTerms(context=64, concurrency=0)


def test_the_prompt_cache_term_is_a_bool_or_whole_histories() -> None:
    """A hybrid model's host sends "whole" (kafila/session/ring/prefix.py's WHOLE); nothing else
    but true or false goes through."""
    terms = c.SessionTerms.from_json({"context": 64, "concurrency": 1, "prompt_cache": "whole"})
    assert c.SessionTerms.from_json(terms.to_json()).prompt_cache == "whole"
    for bad in ("yes", 1, None):
        with pytest.raises(c.ControlError, match="prompt_cache must be true, false or"):
            c.SessionTerms(context=64, concurrency=1, prompt_cache=bad)


def test_measured_pairs_that_are_not_are_dropped_and_only_the_first_are_kept() -> None:
    msg = c.decode({"t": "edge", "measured": [["a", 1], ["b"], [3, 1.0], ["c", "x"], ["d", True]]})
    assert msg.measured == (("a", 1.0),)
    msg = c.decode({"t": "status", "measured": [[f"s{i}", 1.0] for i in range(100)]})
    assert len(msg.measured) == c.MAX_MEASURED


def test_status_keeps_the_newest_history_and_drops_entries_that_are_not_maps() -> None:
    history = [{"event": "joined", "n": i} for i in range(150)] + ["noise"]
    msg = c.decode({"t": "status", "history": history})
    assert len(msg.history) == c.MAX_HISTORY - 1 and msg.history[-1] == {"event": "joined", "n": 149}


# --- planner.Plan.from_json: the plan the host sends, read back ---------------------------------


def test_plan_from_json_reads_back_to_json_and_derives_ranges_and_neighbours() -> None:
    assert PLAN.to_json() == PLAN_JSON
    assert Plan.from_json(PLAN.to_json()) == PLAN
    ranges = PLAN.block_ranges()
    assert ranges == {"a": (0, 3), "b": (3, 7), "c": (7, 12)}
    assert [PLAN.successor(n) for n in PLAN.ring] == ["b", "c", "a"]
    assert [PLAN.predecessor(n) for n in PLAN.ring] == ["c", "a", "b"]
    assert PLAN.predicted_tok_s == pytest.approx(1000 / (1.5 + 2.0 + 2.5 + 1.0 + 0.5))


def test_a_plan_with_only_its_placement_is_read_with_nothing_priced() -> None:
    plan = Plan.from_json({"ring": ["m1", "m2"], "head": "m1", "blocks": {"m1": 1, "m2": 2}})
    assert plan.feasible and plan.stage_ms is None and plan.predicted_tok_s is None and plan.edges == ()
    assert plan.block_ranges() == {"m1": (0, 1), "m2": (1, 3)}


@pytest.mark.parametrize("bad", [
    {**PLAN_JSON, "ring": ["a", "a", "c"]},
    {**PLAN_JSON, "ring": ["a", "b", "x" * 65]},
    {**PLAN_JSON, "tier": "gold"},
    {**PLAN_JSON, "feasible": "yes"},
    {**PLAN_JSON, "stage_ms": {"a": 1.0, "b": None, "c": 1.0}},
    {**PLAN_JSON, "stage_ms": {"a": -1.0, "b": 1.0, "c": 1.0}},
    {**PLAN_JSON, "refused": [{"device": "a", "short_bytes": -5}]},
    {**PLAN_JSON, "edges": [{"from": "a", "to": "z", "kind": "direct", "ms": 1.0}]},
    {**PLAN_JSON, "blocks": {"a": 100_000, "b": 1, "c": 1}},
    "plan",
])  # fmt: skip
def test_plan_from_json_rejects_what_is_not_a_plan(bad) -> None:
    with pytest.raises(PlanInputError):
        Plan.from_json(bad)
