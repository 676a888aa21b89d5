"""A session that cannot form says what failed, with whom and within how long, in one line on
every side (issue 18 item 2): never a bare TimeoutError or an empty reason.

A host and one member in one process over a real embedded rendezvous on 127.0.0.1; no shard is
built (load_shard is a stand-in), the member uses its local copy of the model (no transfer), and
the ring-edge timeout is 0 s, so the edge between them cannot be up in time: a few seconds."""

import asyncio
import os

import pytest

from backends.errors import KafilaError, describe_error
from kafila import __version__
from kafila.session.control.messages import PROTOCOL
from kafila.session.control import ring_forming
from kafila.session.control.host import HostParticipant
from kafila.session.control.participant import Participant, SessionConfig
from kafila.session.control.stage import Stage
from kafila.tooling.launch import free_ports
from tests.default_model import MODEL, needs_default_model

pytestmark = [needs_default_model, pytest.mark.timeout(120)]
DEVICE = {"backend": "openvino", "memory_gb": 8.0, "bandwidth_gbps": 10.0, "overhead_us": 100.0, "tflops": 1.0,
          "protocol": PROTOCOL, "version": __version__}


def _quiet():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"))  # noqa: SIM115


def _host_and_member(tmp_path, host_console=None, host_ends=True):
    """A host (m1) and one member (m2) on a real embedded rendezvous: each one's end, raised or
    returned (host_ends False: the member's end, and whether the host was still running then)."""
    (rv,) = free_ports(1)
    common = {"api": None, "bind_host": "127.0.0.1", "cache_dir": str(tmp_path)}
    host = HostParticipant(SessionConfig(name="m1", rendezvous=None, model_path=MODEL, expect=2,
                                         embedded_listen=("127.0.0.1", rv), **common),
                           host_console or _quiet())  # fmt: skip
    member = Participant(SessionConfig(name="m2", rendezvous=("127.0.0.1", rv), local_model=MODEL, **common),
                         _quiet())  # fmt: skip

    async def run():
        await host.stage.start_api()  # no HTTP (api None): the engine a serving host hands requests to
        await member.stage.start_api()
        h = asyncio.create_task(host.lifecycle())
        while host.net is None and not h.done():
            await asyncio.sleep(0.05)
        member.code = host.net.code
        m = asyncio.create_task(member.lifecycle())
        results = await asyncio.wait_for(asyncio.gather(*((h, m) if host_ends else (m,)), return_exceptions=True), 90)
        if not host_ends:  # the host plans again without the member: give it time to serve
            for _ in range(300):
                if h.done() or host.core.phase.value == "serving":
                    break
                await asyncio.sleep(0.1)
            results = (results[0], not h.done())
            h.cancel()
            await asyncio.gather(h, return_exceptions=True)
        await member.close()
        await host.close()
        return results

    return asyncio.run(run())


def test_a_ring_edge_not_up_in_time_drops_the_member_in_one_line_and_the_host_serves_on(tmp_path, monkeypatch):
    """Issue 38: the ring edge between host and member is not up in time; the host drops the
    member (one line naming the edge, with whom and within how long) and serves on without it;
    the member ends with one line saying it was dropped and why."""
    import io

    import backends
    from rich.console import Console

    monkeypatch.setattr(Stage, "descriptor", lambda self: dict(DEVICE))
    monkeypatch.setattr(backends, "load_shard", lambda *a, **k: object())  # no shard: the edge is the point
    monkeypatch.setattr(ring_forming, "RING_EDGE_TIMEOUT_S", 0.0)  # a real peer, no time to reach it
    said = io.StringIO()
    member_exc, host_alive = _host_and_member(tmp_path, Console(file=said, width=400), host_ends=False)
    assert isinstance(member_exc, KafilaError), repr(member_exc)  # the CLI prints it as one line
    line = describe_error(member_exc)
    assert line.strip() and "\n" not in line and "TimeoutError" not in line, line
    assert "dropped this member" in line and "kafila join again" in line, line
    assert host_alive, said.getvalue()[-2000:]
    host_said = said.getvalue()
    # what did not happen, with whom (name and address), within how long
    assert "member m2 is dropped" in host_said and "ring edge from m" in host_said, host_said[-2000:]
    assert "(127.0.0.1)" in host_said and "within 0 s" in host_said, host_said[-2000:]
    assert "m1: serving" in host_said, host_said[-2000:]


def test_a_member_of_an_older_kafila_is_left_out_in_one_line(tmp_path, monkeypatch):
    """Mixed versions (a member from before session protocols, as an older `kafila join` sends its
    descriptor): the host leaves it out of the plan and tells it why in one line, which it ends
    with; the host serves on without it. No ring edge waits for an answer the member never gives."""
    import io

    from rich.console import Console

    older = {k: v for k, v in DEVICE.items() if k not in ("protocol", "version")}
    monkeypatch.setattr(Stage, "descriptor", lambda self: dict(DEVICE if self.is_host else older))
    said = io.StringIO()
    member_exc, host_alive = _host_and_member(tmp_path, Console(file=said, width=400), host_ends=False)
    assert isinstance(member_exc, KafilaError), repr(member_exc)
    line = describe_error(member_exc)
    assert "\n" not in line and "member m2 runs an older Kafila" in line, line
    assert "install the same Kafila version on every machine" in line, line
    assert host_alive, said.getvalue()[-2000:]
    assert "member m2 runs an older Kafila" in said.getvalue() and "left out of the session" in said.getvalue()
