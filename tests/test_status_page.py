"""`/status` is a contract (the page, `kafila status`, scripts): the typed StatusPage must give
exactly the keys the nested dict it replaced gave, at a member and at the host (which adds
`transfers`), before any plan and after one."""

from __future__ import annotations

import asyncio

from kafila.session.control.config import SessionConfig
from kafila.session.control.host import HostParticipant
from kafila.session.control.participant import Participant

TOP = {"session", "members", "plan", "stages", "edges", "network_ms", "step_ms", "tok_s", "prediction", "weights", "memory",
       "requests", "speculation", "history", "signaling", "load"}
SESSION = {"name", "host", "state", "degraded", "model", "backend", "context", "concurrency", "concurrency_from",
           "uptime_s"}
PLAN = {"ring": ["m1", "m2"], "head": "m1", "blocks": {"m1": 3, "m2": 5}, "stage_ms": {"m1": 1.5, "m2": 2.25}}


def test_a_members_status_has_the_contracted_shape_before_and_after_a_plan() -> None:
    async def main():
        member = Participant(SessionConfig(name="m2", rendezvous=None, api=None))
        before = member.status()
        member.stage.set_plan(1, PLAN, {"context": 256, "concurrency": 2, "model": "x"})
        member.stage.event("dropped", name="m3", reason="it froze")
        return before, member.status()

    before, after = asyncio.run(main())
    for st in (before, after):
        assert set(st) == TOP and set(st["session"]) == SESSION
        assert st["session"]["host"] is None and st["session"]["state"] == "joining"
    assert after["stages"] == {"m1": {"blocks": 3, "predicted_ms": 1.5, "compute_ms": None},
                               "m2": {"blocks": 5, "predicted_ms": 2.25, "compute_ms": None}}
    assert after["plan"]["ring"] == ["m1", "m2"] and after["session"]["context"] == 256
    assert after["history"][-1]["event"] == "dropped" and after["history"][-1]["name"] == "m3"
    assert after["history"][-1]["reason"] == "it froze"


def test_the_hosts_status_adds_each_members_transfer() -> None:
    async def main():
        host = HostParticipant(SessionConfig(name="m1", rendezvous=None, api=None))
        host.weights.expect("m2", 1000, 0.0)
        return host.status()

    st = asyncio.run(main())
    assert set(st) == TOP | {"transfers"} and st["session"]["host"] is True
    assert st["transfers"]["m2"]["total_bytes"] == 1000 and st["transfers"]["m2"]["lane"] == "quic"
