"""The host leaving ends the session on every member with a clear message, no hang (issue 14,
item 1's last part): a 3-member session of separate processes; SIGINT to the host; every member
says the session is over and exits 0 within seconds, and a request that was streaming at a
member ends with an error naming the host instead of hanging."""

import os
import signal
import threading
import time

import pytest

from bench.churn import wait_decoding
from kafila.tooling.launch import LocalSession, Refused, stream_chat
from tests.default_model import needs_default_model

pytestmark = [pytest.mark.session, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(300),
              needs_default_model]


def test_the_hosts_exit_ends_every_member_cleanly(tmp_path):
    s = LocalSession(members=3, log_dir=str(tmp_path), cache_root=str(tmp_path / "cache"), latency_ms=20)
    s.start(timeout_s=240)
    try:
        outcome: dict = {}

        def ask() -> None:
            try:
                # a long answer (this one's first 64 tokens are a story, no end in sight): still
                # streaming when the host leaves, however fast the ring is
                outcome["answer"] = stream_chat(s.api("m3"), "Write a long story about a lighthouse keeper.", 400)
            except Refused as exc:
                outcome["error"] = str(exc)

        t = threading.Thread(target=ask)
        t.start()
        wait_decoding(s, 1)  # the head holds the request, and it has decoded for a second
        host = s.procs[0]
        os.killpg(host.popen.pid, signal.SIGINT)
        codes = {p.name: p.popen.wait(timeout=30) for p in s.procs}  # a member still up after 30 s fails here
        t.join(30)
        assert codes == {"m1": 0, "m2": 0, "m3": 0}, codes
        assert "m1" in outcome.get("error", ""), outcome  # the stream ended naming the host
        for p in s.procs[1:]:
            log = open(p.log_path).read()
            assert "the session is over" in log and "Traceback" not in log, log[-2000:]
    finally:
        s.stop()


def test_status_keeps_the_membership_history(tmp_path):
    """Who joined and left, when and why (issue 14 item 5): the host's /status and, through its
    status messages, every member's; `kafila status` prints it."""
    from kafila.commands.status import history_line
    from kafila.tooling.launch import get_json

    s = LocalSession(members=3, log_dir=str(tmp_path), cache_root=str(tmp_path / "cache"))
    s.start(timeout_s=240)
    try:
        os.killpg(s.procs[2].popen.pid, signal.SIGKILL)  # m3 vanishes
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            host = get_json(s.api("m1"), "/status")["history"]
            member = get_json(s.api("m2"), "/status")["history"]
            if any(h["event"] == "left" for h in host) and any(h["event"] == "left" for h in member):
                break
            time.sleep(0.5)
        events = [(h["event"], h.get("name")) for h in host]
        assert ("joined", "m2") in events and ("joined", "m3") in events, events
        assert ("left", "m3") in events and "plan" in dict(events) and "serving" in dict(events), events
        left = next(h for h in host if h["event"] == "left")
        assert left["reason"] and left["at"].endswith("Z")
        assert any(h["event"] == "left" and h.get("name") == "m3" for h in member), member
        assert "left m3" in history_line(left)
    finally:
        s.stop()
