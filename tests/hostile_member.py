"""A member that does not play by the rules, for tests/test_member_inputs.py: run as a script
(`python -m tests.hostile_member CODE HOST PORT`), it joins the session behind CODE once per bad
descriptor field (its own checks skipped, as a hostile build would) and once per malformed or
forbidden control message, and prints one JSON line per try: what it sent and what it saw."""

from __future__ import annotations

import asyncio
import json
import sys

GOOD = {"backend": "openvino", "probed_on": "test", "memory_gb": 4.0, "bandwidth_gbps": 10.0, "overhead_us": 100.0,
        "tflops": 0.5, "machine": "hostile"}
BAD_FIELDS = [("bandwidth_gbps", "fast"), ("memory_gb", "lots"), ("memory_gb", 1e308), ("overhead_us", -5.0),
              ("tflops", [1, 2]), ("backend", 42), ("protocol", "three")]
BAD_MESSAGES = [
    {"t": "degraded", "reason": "made up", "epoch": 1},  # a waiting member: a ring it is not in
    {"t": "serving", "epoch": 1},  # only the host says serving
    {"t": "plan", "epoch": 9, "plan": {}},  # only the host plans (and this one is no plan)
    {"t": "ready", "epoch": "soon"},
    {"t": "edge", "stats": [1, 2, 3]},
    {"t": "no-such-kind"},
    "not a map at all",
]


async def bad_descriptor(code: str, rv: tuple[str, int], i: int, key: str, value) -> dict:
    from kafila.net import Member

    try:
        member = await Member.join(code, rv, f"bad{i}", {**GOOD, key: value}, bind_host="127.0.0.1")
    except Exception as exc:  # noqa: BLE001 (the refusal is what this prints)
        return {"field": key, "refused": str(exc)}
    await member.close()
    return {"field": key, "admitted": True}


async def bad_message(code: str, rv: tuple[str, int], i: int, body) -> dict:
    from kafila.net import Member, MemberLeft

    member = await Member.join(code, rv, f"rude{i}", dict(GOOD), bind_host="127.0.0.1")
    host = next(n for n, info in member.roster().items() if info.peer_id == 0)
    try:
        await member.send(host, body)
        end = asyncio.get_running_loop().time() + 30
        while (left := end - asyncio.get_running_loop().time()) > 0:
            try:
                ev = await asyncio.wait_for(member.recv(), left)
            except TimeoutError:
                break
            if isinstance(ev, MemberLeft) and ev.name == host:
                return {"sent": body, "name": member.name, "removed": ev.reason}
        return {"sent": body, "name": member.name, "still_in": True}
    finally:
        await member.close()


async def main(code: str, host: str, port: int) -> None:
    import kafila.net.member as member_mod

    member_mod.own_entry_problem = lambda name, descriptor: None  # a hostile build sends anything
    rv = (host, port)
    for i, (key, value) in enumerate(BAD_FIELDS):
        print(json.dumps(await bad_descriptor(code, rv, i, key, value)), flush=True)
    for i, body in enumerate(BAD_MESSAGES):
        print(json.dumps(await bad_message(code, rv, i, body)), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
