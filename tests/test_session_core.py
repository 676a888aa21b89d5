"""The session lifecycle's sans-I/O cores (kafila.session.control.lifecycle), driven event by event with
fake times: no sockets, no model, no event loop. The plans are written by hand (the planner's
choice of head and division does not matter here)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from kafila.session.control import messages as c
from kafila.session.control import lifecycle as lc
from kafila.session.control.lifecycle import Phase
from planner import Plan, Refusal

TERMS = c.SessionTerms(context=256, concurrency=2, protocol=c.PROTOCOL, version="0.1.0")


def plan(*ring: str, epoch: int = 1, reason: str | None = None) -> c.PlanMessage:
    p = Plan.from_json({"ring": list(ring), "head": ring[0], "blocks": {n: 2 for n in ring}})
    return c.PlanMessage(epoch, p, TERMS, {"tensors": []} if "m2" in ring else None, reason)


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def received(sender: str, msg) -> lc.Received:
    return lc.Received(sender, msg)


# --- a member -------------------------------------------------------------------------------------


def member() -> lc.MemberCore:
    core = lc.MemberCore("m2")
    core.on(lc.Joined("m1"), 0.0)
    assert core.phase is Phase.FORMING and core.status_name == "waiting"
    return core


def test_member_forms_serves_degrades_and_serves_again_after_a_replan() -> None:
    core = member()
    acts = core.on(received("m1", plan("m1", "m2", "m3")), 1.0)
    assert kinds(acts) == ["Prepare"] and core.phase is Phase.PLANNED and core.epoch == 1
    for step in ("fetching", "building", "ring"):
        core.on(lc.Step(step), 2.0)
        assert core.phase is Phase.LOADING and core.status_name == step
    assert core.on(received("m1", c.Serving(1)), 3.0) == []  # not ready yet: no news
    assert core.on(lc.Prepared(1), 3.0) == [lc.Send("m1", c.Ready(1))]
    assert core.on(lc.Prepared(1), 3.0) == []  # said once
    assert core.on(received("m1", c.Serving(2)), 3.0) == []  # another plan's
    assert core.on(received("m1", c.Serving(1)), 4.0) == [lc.ServePlan(first=True)]
    assert core.phase is Phase.SERVING and core.status_name == "serving" and core.served

    acts = core.on(lc.RingBroke("m2", "the edge to m3 closed", 1), 5.0)
    assert kinds(acts) == ["Say", "Record", "Send"] and acts[-1] == lc.Send("m1", c.Degraded("the edge to m3 closed", 1))
    assert core.phase is Phase.DEGRADED and core.degraded == "the edge to m3 closed"
    assert kinds(core.on(lc.RingBroke("m2", "again", 1), 5.1)) == ["Send"]  # told again, said once
    assert core.on(lc.RingBroke("m2", "an old ring", 0), 5.2) == []

    acts = core.on(received("m1", plan("m1", "m2", epoch=2, reason="member m3 left")), 6.0)
    assert kinds(acts) == ["Say", "Record", "Prepare"] and core.phase is Phase.REPLANNING
    assert "member m3 left" in acts[0].text and core.status_name == "planned"
    core.on(lc.Step("building"), 6.5)
    assert core.phase is Phase.REPLANNING and core.status_name == "building"
    assert core.on(received("m1", plan("m1", "m2", epoch=2)), 6.6) == []  # the same plan again
    assert core.on(lc.Prepared(1), 7.0) == []  # the replaced preparation
    assert core.on(lc.Prepared(2), 7.0) == [lc.Send("m1", c.Ready(2))]
    assert core.on(received("m1", c.Serving(2)), 8.0) == [lc.ServePlan(first=False)]
    assert core.phase is Phase.SERVING and core.degraded is None


def test_member_takes_reports_and_the_hosts_news_while_serving() -> None:
    core = member()
    core.on(received("m1", plan("m1", "m2")), 0.0)
    core.on(lc.Prepared(1), 0.0)
    core.on(received("m1", c.Serving(1)), 0.0)
    status = c.Status(measured=(("step_ms", 3.0),))
    assert core.on(received("m1", status), 1.0) == [lc.Apply("m1", status)]
    acts = core.on(received("m1", c.Gone("m3", "bye")), 2.0)
    assert kinds(acts) == ["Say", "Record", "DegradeNode", "Record"] and core.phase is Phase.DEGRADED
    assert kinds(core.on(received("m1", c.Degraded("more")), 2.0)) == ["DegradeNode"]
    assert kinds(core.on(received("m1", c.Wait("later")), 2.0)) == ["Say"]


def test_member_whose_preparation_fails_tells_the_host_and_ends() -> None:
    core = member()
    core.on(received("m1", plan("m1", "m2")), 0.0)
    acts = core.on(lc.Prepared(1, "m2 could not build blocks [2, 4)"), 1.0)
    assert acts == [lc.Send("m1", c.Failed("m2 could not build blocks [2, 4)", 1)),
                    lc.EndEngine("m2 could not build blocks [2, 4)"), lc.Abort("m2 could not build blocks [2, 4)")]
    assert core.phase is Phase.ENDED
    assert core.on(received("m1", c.Serving(1)), 2.0) == []  # over is over


@pytest.mark.parametrize(("protocol", "version", "says"), [
    (None, None, "the host runs an older Kafila (from before session protocols were numbered)"),
    (c.PROTOCOL + 1, "9.0", f"the host runs Kafila 9.0 (session protocol {c.PROTOCOL + 1})"),
])  # fmt: skip
def test_member_of_another_session_protocol_tells_the_host_and_ends(protocol, version, says) -> None:
    """Mixed versions: one line naming both and what to do, not a ring edge that times out."""
    core = member()
    terms = dataclasses.replace(TERMS, protocol=protocol, version=version)
    acts = core.on(received("m1", dataclasses.replace(plan("m1", "m2"), session=terms)), 0.0)
    assert kinds(acts) == ["Send", "EndEngine", "Abort"]
    assert isinstance(acts[0].msg, c.Failed) and acts[0].msg.reason == acts[2].reason
    assert acts[2].reason.startswith(says) and "install the same Kafila version on every machine" in acts[2].reason
    assert core.phase is Phase.ENDED


@pytest.mark.parametrize(("event", "says"), [
    (received("m1", c.Refusal("the model does not fit")), "the host refused the session: the model does not fit"),
    (lc.MemberLeft("m1", "bye"), "the host m1 left the session before planning (bye)"),
])  # fmt: skip
def test_member_before_the_plan_ends_when_refused_or_the_host_leaves(event, says) -> None:
    core = member()
    assert core.on(event, 1.0) == [lc.Abort(says)] and core.phase is Phase.ENDED


def test_member_waits_when_the_host_says_so_and_ignores_what_is_not_for_it_yet() -> None:
    core = member()
    assert kinds(core.on(received("m1", c.Wait("the session is serving")), 0.0)) == ["Say", "Record"]
    assert core.on(received("m1", c.Serving(1)), 0.0) == [] and core.on(received("m1", c.Status()), 0.0) == []
    assert core.on(lc.MemberLeft("m9", "not the host"), 0.0) == [] and core.phase is Phase.FORMING


def test_member_while_forming_ends_on_a_refusal_or_a_break() -> None:
    core = member()
    core.on(received("m1", plan("m1", "m2")), 0.0)
    acts = core.on(received("m1", c.Degraded("m3 is gone")), 1.0)
    assert acts == [lc.Abort("the session could not form: m3 is gone")]
    core = member()
    core.on(received("m1", plan("m1", "m2")), 0.0)
    assert kinds(core.on(lc.MemberLeft("m1", "lost"), 1.0)) == ["Abort"]
    core = member()
    core.on(received("m1", plan("m1", "m2")), 0.0)
    acts = core.on(received("m1", c.Refusal("no")), 1.0)
    assert acts == [lc.EndEngine("the host refused the session: no"), lc.Abort("the host refused the session: no", 0.0)]


def test_member_when_the_host_leaves_a_serving_session() -> None:
    core = member()
    core.on(received("m1", plan("m1", "m2")), 0.0)
    core.on(lc.Prepared(1), 0.0)
    core.on(received("m1", c.Serving(1)), 0.0)
    lost = core.on(lc.MemberLeft("m1", "signaling lost: timeout"), 1.0)
    assert kinds(lost) == ["Say", "Record"] and core.phase is Phase.SERVING  # the ring keeps serving
    acts = core.on(lc.MemberLeft("m1", "bye"), 2.0)
    assert kinds(acts) == ["EndEngine", "Say", "Record", "DegradeNode", "Say", "Record", "Finish"]
    assert acts[-1] == lc.Finish(0.2) and core.phase is Phase.ENDED and core.status_name == "degraded"


def test_a_refusal_while_serving_lets_the_api_say_so_first() -> None:
    core = member()
    core.on(received("m1", plan("m1", "m2")), 0.0)
    core.on(lc.Prepared(1), 0.0)
    core.on(received("m1", c.Serving(1)), 0.0)
    acts = core.on(received("m1", c.Refusal("over")), 1.0)
    assert acts[-1] == lc.Abort("the host refused the session: over", 0.2)


# --- the host -------------------------------------------------------------------------------------


def made(epoch: int, *ring: str, reason: str | None = None, feasible: bool = True) -> lc.PlanMade:
    p = plan(*ring, epoch=epoch).plan
    if not feasible:
        p = dataclasses.replace(p, feasible=False, refused=(Refusal("m3", 5_000_000),))
    return lc.PlanMade(epoch, p, reason)


def serving_host(auto_replan: bool = False) -> lc.HostCore:
    core = lc.HostCore("m1", auto_replan)
    assert core.status_name == "joining"  # opening the model and the session
    core.on(lc.Step("waiting"), 0.0)
    assert core.status_name == "waiting"
    core.on(lc.Step("hashing"), 0.0)
    assert core.status_name == "hashing"
    assert core.on(made(1, "m1", "m2", "m3"), 1.0) == [] and core.phase is Phase.PLANNED and core.forming
    assert core.on(lc.Prepared(1), 2.0) == []  # the host's own stage
    acts = core.on(received("m2", c.Ready(1)), 3.0)
    assert kinds(acts) == ["Apply", "Say"]
    assert core.on(received("m3", c.Ready(9)), 3.0) == []  # another plan's
    acts = core.on(received("m3", c.Ready(1)), 4.0)
    assert kinds(acts) == ["Apply", "Say", "Formed"] and core.phase is Phase.SERVING and not core.forming
    return core


def test_host_forms_serves_and_replans_when_a_ring_member_leaves() -> None:
    core = serving_host()
    assert core.on(lc.MemberLeft("m9", "not in the ring"), 5.0) == []
    assert core.on(lc.MemberLeft("m3", "bye"), 5.0) == [lc.Replan("member m3 left the session (bye)")]
    assert core.on(made(2, "m1", "m2", reason="member m3 left the session (bye)"), 6.0) == []
    assert core.phase is Phase.REPLANNING
    core.on(lc.Step("ring"), 6.5)
    assert core.status_name == "ring"
    core.on(lc.Prepared(2), 7.0)
    assert kinds(core.on(received("m2", c.Ready(2)), 8.0))[-1] == "Formed" and core.phase is Phase.SERVING


def test_host_waits_for_the_grace_after_a_reported_break_then_replans() -> None:
    core = serving_host()
    acts = core.on(received("m2", c.Degraded("edge to m3 closed", 1)), 10.0)
    assert kinds(acts) == ["Say", "Record"] and core.timer() == pytest.approx(10.0 + lc.BREAK_GRACE_S)
    assert core.on(received("m3", c.Degraded("again", 1)), 10.1) == []  # one break at a time
    assert core.on(received("m2", c.Degraded("old", 0 + 5)), 10.1) == []  # another plan's
    assert core.on(lc.Tick(), 10.5) == []
    assert core.on(lc.Tick(), 11.0) == [lc.Replan("the ring broke at m2 (edge to m3 closed)")]
    assert core.pending_break is None


def test_a_member_gone_during_the_grace_replans_at_once() -> None:
    core = serving_host()
    core.on(received("m2", c.Degraded("edge to m3 closed", 1)), 10.0)
    assert core.on(lc.MemberLeft("m3", "lost"), 10.2) == [lc.Replan("member m3 left the session (lost)")]
    assert core.timer() is None


def test_the_hosts_own_ring_break_is_said_as_its_own() -> None:
    core = serving_host()
    acts = core.on(lc.RingBroke("m1", "a bad frame", 1), 3.0)
    assert kinds(acts) == ["Say", "Record", "Say", "Record"] and core.degraded == "a bad frame"
    assert core.phase is Phase.DEGRADED and core.status_name == "degraded"


def test_host_adds_joiners_at_once_with_auto_replan_or_on_enter() -> None:
    core = serving_host(auto_replan=True)
    assert core.on(lc.MemberJoined("m4"), 5.0) == [lc.Replan("m4 joined (--auto-replan)")]
    core = serving_host()
    assert core.on(lc.MemberJoined("m4"), 5.0) == [] and core.on(lc.Tick(), 5.0) == []
    assert core.on(lc.EnterPressed(), 6.0) == [lc.Replan("m4 joined (Enter at the host)")]
    assert core.on(lc.EnterPressed(), 7.0) == []  # nobody waits now


def test_a_joiner_while_forming_with_auto_replan_is_planned_in_right_after() -> None:
    core = lc.HostCore("m1", auto_replan=True)
    core.on(made(1, "m1", "m2"), 0.0)
    assert core.on(lc.MemberJoined("m3"), 0.5) == []  # forming: not now
    core.on(lc.Prepared(1), 1.0)
    core.on(received("m2", c.Ready(1)), 1.0)
    assert core.on(lc.Tick(), 1.1) == [lc.Replan("m3 joined (--auto-replan)")]


def test_host_reports_are_applied_only_while_serving() -> None:
    core = lc.HostCore("m1")
    core.on(made(1, "m1", "m2"), 0.0)
    report = c.EdgeReport({"rtt_ms": 1.0})
    assert core.on(received("m2", report), 0.5) == []
    core.on(lc.Prepared(1), 1.0)
    core.on(received("m2", c.Ready(1)), 1.0)
    assert core.on(received("m2", report), 2.0) == [lc.Apply("m2", report)]


# --- the host's refusals ---------------------------------------------------------------------------


def test_an_infeasible_first_plan_is_refused_to_everyone() -> None:
    core = lc.HostCore("m1")
    acts = core.on(made(1, "m1", "m2", "m3", feasible=False), 0.0)
    why = "the model does not fit: m3 (short by 5.0 MB) cannot hold its share"
    assert acts == [lc.SendAll(c.Refusal(why)), lc.EndEngine(why), lc.Abort(why)] and core.phase is Phase.ENDED


def test_an_infeasible_replan_ends_the_session_saying_why() -> None:
    core = serving_host()
    acts = core.on(made(2, "m1", "m2", reason="member m3 left", feasible=False), 5.0)
    assert "member m3 left, and the members left cannot hold the model" in acts[-1].reason
    assert kinds(acts) == ["SendAll", "EndEngine", "Abort"]


def test_a_member_that_fails_or_leaves_while_forming_is_dropped_and_the_rest_replan() -> None:
    """Issue 38: a member that cannot prepare its stage, or leaves while the first plan forms, is
    dropped (named, with the reason) and the rest are planned again: never the session's end."""
    core = lc.HostCore("m1")
    core.on(made(1, "m1", "m2", "m3"), 0.0)
    acts = core.on(received("m2", c.Failed("no memory", 1)), 1.0)
    why = "it could not prepare its stage: no memory"
    assert acts == [lc.Drop("m2", why), lc.Say(f"m1: member m2 is dropped: {why}"),
                    lc.Record("dropped", (("name", "m2"), ("reason", why))), lc.Replan(f"m2 dropped ({why})")]
    assert core.phase is not Phase.ENDED and not core.forming
    assert core.on(lc.MemberLeft("m2", "removed: " + why), 1.5) == []  # the drop's own echo is no news
    core.on(made(2, "m1", "m3", reason=f"m2 dropped ({why})"), 2.0)
    core.on(lc.Prepared(2), 3.0)
    assert kinds(core.on(received("m3", c.Ready(2)), 3.0))[-1] == "Formed" and core.phase is Phase.SERVING
    core = lc.HostCore("m1")
    core.on(made(1, "m1", "m2", "m3"), 0.0)
    acts = core.on(lc.MemberLeft("m3", "bye"), 1.0)
    assert acts == [lc.Replan("member m3 left while the session was forming (bye)")] and core.phase is not Phase.ENDED


def test_what_a_member_should_not_send_drops_that_member_only() -> None:
    core = serving_host()
    # a host-only message from a ring member: dropped, and the ring planned again without it
    acts = core.on(received("m3", c.Serving(1)), 5.0)
    assert kinds(acts) == ["Drop", "Say", "Record", "Replan"] and acts[0].member == "m3"
    assert "only the host sends" in acts[0].reason
    core = serving_host()
    core.on(lc.MemberJoined("m4"), 5.0)  # waiting for the next plan
    acts = core.on(received("m4", c.Degraded("made up", 1)), 6.0)  # a break of a ring it is not in
    assert kinds(acts) == ["Drop", "Say", "Record"] and core.pending_break is None and core.phase is Phase.SERVING
    acts = core.on(lc.Malformed("m2", "epoch must be an integer 1..2147483648", "ready"), 7.0)
    assert kinds(acts) == ["Drop", "Say", "Record", "Replan"] and "no control message" in acts[0].reason


def test_a_member_not_ready_in_time_or_unreachable_is_dropped() -> None:
    core = lc.HostCore("m1")
    core.on(made(1, "m1", "m2", "m3"), 0.0)
    core.on(received("m2", c.Ready(1)), 1.0)
    acts = core.on(lc.Tick(), lc.READY_TIMEOUT_S)
    assert [a.member for a in acts if isinstance(a, lc.Drop)] == ["m3"] and kinds(acts)[-1] == "Replan"
    core = lc.HostCore("m1")
    core.on(made(1, "m1", "m2"), 0.0)
    acts = core.on(lc.Prepared(1, "the ring edge from m1 to m2 was not up within 60 s", ("m2",)), 1.0)
    assert kinds(acts) == ["Drop", "Say", "Record", "Replan"] and "not up within 60 s" in acts[0].reason


def test_a_dropped_member_ends_saying_why_and_a_plan_it_cannot_read_too() -> None:
    core = member()
    core.on(received("m1", plan("m1", "m2")), 0.0)
    core.on(lc.Prepared(1), 0.0)
    core.on(received("m1", c.Serving(1)), 0.0)
    acts = core.on(lc.MemberLeft("m1", "removed: it froze", dropped=True), 9.0)
    assert kinds(acts) == ["EndEngine", "Say", "Record", "Abort"] and core.phase is Phase.ENDED
    assert "dropped this member" in acts[-1].reason and "kafila join again" in acts[-1].reason
    core = member()
    acts = core.on(lc.Malformed("m1", "plan has no ring", "plan"), 1.0)
    assert kinds(acts) == ["Send", "EndEngine", "Abort"] and isinstance(acts[0].msg, c.Failed)
    assert "plan cannot be read: plan has no ring" in acts[-1].reason
    assert member().on(lc.Malformed("m1", "junk", "status"), 1.0) == []  # anything else: logged, ignored


def test_a_member_that_leaves_while_replanning_makes_another_replan() -> None:
    core = serving_host()
    core.on(made(2, "m1", "m2", "m3", reason="m4 joined"), 5.0)
    assert core.on(lc.MemberLeft("m2", "bye"), 6.0) == [
        lc.Replan("member m2 left the session while it replanned (bye)")]


def test_the_host_that_cannot_prepare_its_own_stage_refuses() -> None:
    core = lc.HostCore("m1")
    core.on(made(1, "m1", "m2"), 0.0)
    acts = core.on(lc.Prepared(1, "no shard"), 1.0)
    assert acts[-1] == lc.Abort("the host m1 could not prepare its stage: no shard") and kinds(acts)[0] == "SendAll"


def test_a_session_whose_host_is_not_ready_in_time_is_refused() -> None:
    core = lc.HostCore("m1")
    core.on(made(1, "m1", "m2", "m3"), 0.0)
    core.on(received("m2", c.Ready(1)), 1.0)
    core.on(received("m3", c.Ready(1)), 1.0)
    assert core.timer() == pytest.approx(lc.READY_TIMEOUT_S)
    assert core.on(lc.Tick(), lc.READY_TIMEOUT_S - 1) == []
    acts = core.on(lc.Tick(), lc.READY_TIMEOUT_S)
    assert acts[-1] == lc.Abort(f"the session did not form within {lc.READY_TIMEOUT_S:g} s: m1 not ready")


# --- the machine itself -----------------------------------------------------------------------------


def test_transitions_are_data_and_a_wrong_one_is_a_bug() -> None:
    assert set(lc.TRANSITIONS) == set(Phase) and lc.TRANSITIONS[Phase.ENDED] == frozenset()
    core = lc.MemberCore("m2")
    with pytest.raises(AssertionError, match="forming → serving"):
        core.go(Phase.SERVING)


def test_the_cores_import_no_io() -> None:
    root = Path(__file__).resolve().parents[1] / "kafila" / "session" / "control"
    forbidden = {"asyncio", "socket", "time", "threading", "os", "subprocess"}
    for name in ("lifecycle.py", "lifecycle_events.py", "messages.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & forbidden, f"{name} imports {roots & forbidden}"
        assert len((root / name).read_text().splitlines()) <= 500


def test_a_break_while_loading_stays_degraded_until_a_new_plan_serves() -> None:
    core = member()
    core.on(received("m1", plan("m1", "m2")), 0.0)
    core.on(lc.Step("fetching"), 0.1)
    core.on(lc.RingBroke("m2", "the predecessor closed", 1), 0.2)
    core.on(lc.Step("ring"), 0.3)
    assert core.phase is Phase.DEGRADED and core.status_name == "degraded"
    core.on(received("m1", plan("m1", "m2", epoch=2, reason="the ring broke")), 1.0)
    assert core.phase is Phase.PLANNED
    core.on(lc.Step("building"), 1.1)
    core.on(lc.Prepared(2), 1.2)
    # the first serving keeps a break it saw (the API says so) until the next plan serves
    assert core.on(received("m1", c.Serving(2)), 1.3) == [lc.ServePlan(first=True)]
    assert core.phase is Phase.DEGRADED and core.served


def test_the_hosts_own_break_while_forming_is_kept_when_it_starts_serving() -> None:
    core = lc.HostCore("m1")
    core.on(made(1, "m1", "m2"), 0.0)
    core.on(lc.Step("ring"), 0.1)
    core.on(lc.RingBroke("m1", "a bad frame", 1), 0.2)
    core.on(lc.Prepared(1), 0.3)
    assert kinds(core.on(received("m2", c.Ready(1)), 0.4))[-1] == "Formed"
    assert core.phase is Phase.DEGRADED and core.on(lc.Tick(), 0.5 + lc.BREAK_GRACE_S)[0] == lc.Replan(
        "the ring broke at m1 (a bad frame)")
    assert core.on(made(2, "m1", "m2", reason="the ring broke"), 2.0) == [] and core.phase is Phase.REPLANNING


def test_while_forming_only_the_forming_deadline_is_a_timer() -> None:
    core = lc.HostCore("m1")
    core.on(made(1, "m1", "m2"), 0.0)
    core.on(lc.RingBroke("m1", "a bad frame", 1), 0.1)
    assert core.timer() == pytest.approx(lc.READY_TIMEOUT_S)  # not the break's: nothing to do with it yet
    assert core.on(lc.Tick(), 5.0) == []


# --- a host core and member cores paired over a fake link (aioquic's transfer(), bounded) ---------


class Pair:
    """HostCore m1 and MemberCores, with what a driver does in between: the host's plans go out
    as PlanMessages, Formed as Serving, a member's Prepare comes back Prepared at once."""

    def __init__(self, *members: str) -> None:
        self.host = lc.HostCore("m1")
        self.members = {n: lc.MemberCore(n) for n in members}
        for core in self.members.values():
            core.on(lc.Joined("m1"), 0.0)
        self.now, self.epoch, self.replans = 0.0, 0, []

    def plan(self, ring: tuple[str, ...], reason: str | None = None) -> None:
        self.epoch += 1
        msg = plan(*ring, epoch=self.epoch, reason=reason)
        self.run_host(self.host.on(lc.PlanMade(self.epoch, msg.plan, reason), self.now))
        for n in ring[1:]:
            self.run_member(n, self.members[n].on(received("m1", msg), self.now))
        self.run_host(self.host.on(lc.Prepared(self.epoch), self.now))

    def run_member(self, name: str, actions) -> None:
        for rounds, action in enumerate(actions):
            assert rounds < 10
            if isinstance(action, lc.Prepare):
                self.run_member(name, self.members[name].on(lc.Prepared(action.msg.epoch), self.now))
            elif isinstance(action, lc.Send):
                self.run_host(self.host.on(received(name, action.msg), self.now))

    def run_host(self, actions) -> None:
        for action in actions:
            if isinstance(action, lc.Formed):
                for n in sorted(self.host.ring_members - {"m1"}):
                    self.run_member(n, self.members[n].on(received("m1", c.Serving(action.epoch)), self.now))
            elif isinstance(action, lc.Replan):
                self.replans.append(action.reason)


def test_paired_cores_form_serve_lose_a_member_and_serve_again() -> None:
    pair = Pair("m2", "m3")
    pair.plan(("m1", "m2", "m3"))
    assert pair.host.phase is Phase.SERVING
    assert all(core.phase is Phase.SERVING for core in pair.members.values())
    # m3's edge breaks: m2 tells the host, the grace passes, m3 is gone by then
    pair.now = 10.0
    pair.run_member("m2", pair.members["m2"].on(lc.RingBroke("m2", "the edge to m3 closed", 1), pair.now))
    assert pair.members["m2"].phase is Phase.DEGRADED and pair.host.pending_break is not None
    assert pair.host.phase is Phase.SERVING  # the host's own ring has not broken (yet): as /status says
    pair.run_host(pair.host.on(lc.MemberLeft("m3", "lost"), 10.5))
    assert pair.replans == ["member m3 left the session (lost)"]
    pair.plan(("m1", "m2"), pair.replans[-1])
    assert pair.host.phase is Phase.SERVING and pair.host.epoch == 2 and pair.host.timer() is None
    assert pair.members["m2"].phase is Phase.SERVING and pair.members["m2"].degraded is None
