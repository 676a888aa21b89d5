"""Reproductions of network-core problems the NAT lab found (loopback; no root needed).

Edge setup race (found in the lab's pair matrix, 1-5 of 25 concurrent edges failed with
"edge to X failed: no answer within 10 s"): the responder learns of a new edge from
EdgeAllocated on its TCP signaling connection, while the initiator's first QUIC Initial reaches it
over UDP (relay DATA). Under load the Initial often wins the race; the responder drops DATA for an
edge id it does not know yet. The initiator retransmits the Initial after its PTO, but by then the
punch has usually succeeded, so the retransmission goes over the direct path, where
Member._on_quic routes only by registered connection ids: the client's original (random)
destination connection id is never registered, so every retransmitted Initial is dropped too and
the edge never forms. Here the race is forced by delaying the responder's EdgeAllocated.
(Fixed in 2485423.)

OpenVINO telemetry stopping an offline member: see the second test.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from natlab_tests import nat, session

pytestmark = [pytest.mark.session, pytest.mark.timeout(120)]

ALLOCATION_DELAY_S = 0.3


async def _late_allocation_edge() -> tuple[str, float | None]:
    from kafila.net import Member
    from rendezvous import Rendezvous

    rv = await Rendezvous.start("127.0.0.1", 0)
    members = []
    try:
        a = await Member.host(rv.address, "a", {})
        members.append(a)
        b = await Member.join(a.code, rv.address, "b", {})
        members.append(b)
        original = b._edge_allocated

        def late(message):  # the responder processes EdgeAllocated after the first Initial
            asyncio.get_running_loop().call_later(ALLOCATION_DELAY_S, original, message)

        b._edge_allocated = late
        edge, _ = await asyncio.wait_for(asyncio.gather(a.connect("b"), b.accept()), 30)
        return edge.kind, edge.time_to_data_s
    finally:
        for member in members:
            await member.close()
        await rv.close()


def test_edge_forms_when_its_allocation_reaches_the_responder_late():
    kind, time_to_data_s = asyncio.run(_late_allocation_edge())
    assert kind in ("direct", "relay")
    assert time_to_data_s is not None and time_to_data_s < ALLOCATION_DELAY_S + 1.0


OFFLINE_WATCH_S = 25.0  # start + `import openvino` in the probe + the telemetry's 3 s timeout


@pytest.mark.natlab
@pytest.mark.model
def test_member_without_internet_is_not_stopped_by_openvino_telemetry(lab, tmp_path):
    """`import openvino` (done by the device probe in a worker thread) makes openvino.tools.ovc
    send a telemetry event from a forked multiprocessing.Process, and terminate() it (SIGTERM)
    after 3 s when the internet is unreachable (DNS times out: the lab, an air-gapped LAN). The
    forked child inherits the asyncio loop's signal wakeup fd, so the SIGTERM the child receives
    is reported to the parent's loop, whose SIGTERM handler makes the member print
    "leaving the session" and quit. Found in the lab: `kafila host` quit before printing its code
    in 3 of 4 runs. Fixed in kafila/cli.py (`import_openvino_without_telemetry`): the telemetry
    is declined at import, for the process only, so no sender is forked; this guards it."""
    rendezvous = session.start_rendezvous(lab, port=3600)
    node = lab.add_member(nat.ORDINARY_APDF)
    host = lab.spawn(
        node,
        [
            sys.executable,
            "-m",
            "kafila",
            "host",
            "--expect",
            "2",
            "--name",
            "offline",
            "--rendezvous",
            rendezvous.address,
            "--api",
            "off",
            "--json-events",
            "--cache-dir",
            str(tmp_path),
        ],
        env={"CI": ""},  # telemetry on, as on a user's machine
    )
    deadline = time.monotonic() + OFFLINE_WATCH_S
    while time.monotonic() < deadline and host.popen.poll() is None:
        time.sleep(0.5)
    left = "leaving the session" in host.stderr()
    assert host.popen.poll() is None and not left, (
        f"the host stopped by itself (exit {host.popen.returncode}): {host.stderr()[-800:]}"
    )
