"""Issue 38 items 1 and 5, through the real CLI: members are inputs, and no member ends the
session. A hostile joiner (tests/hostile_member.py) with each malformed descriptor field is
refused at the door and with each malformed or forbidden control message is dropped, while the
session keeps answering; a joiner frozen (SIGSTOP) before it builds its stage is dropped and the
session serves again; a member frozen past the watchdog and then woken (SIGCONT) ends with one
line saying why instead of answering 503 forever."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kafila.tooling.launch import free_ports
from tests.default_model import needs_default_model
from tests.test_harden_process import lines  # one reader of a process's lines for both

pytestmark = [pytest.mark.session, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(400),
              needs_default_model]
KAFILA = [sys.executable, "-m", "kafila"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Session:
    """Processes on 127.0.0.1 (each in its own group; stderr to a file), ended at the test's end."""

    def __init__(self, tmp_path) -> None:
        self.tmp, self.procs, self.errs = tmp_path, [], []

    def start(self, *args: str, module: list[str] | None = None) -> subprocess.Popen:
        err = self.tmp / f"{len(self.procs)}.err"
        p = subprocess.Popen([*(module or KAFILA), *args], stdout=subprocess.PIPE, stderr=open(err, "w"),  # noqa: SIM115
                             stdin=subprocess.DEVNULL, text=True, start_new_session=True, cwd=ROOT)
        self.procs.append(p)
        self.errs.append(err)
        return p

    def host(self, *extra: str) -> tuple[subprocess.Popen, str, int, str]:
        rv, api = free_ports(2)
        host = self.start("host", "--name", "m1", "--listen", f"127.0.0.1:{rv}", "--bind", "127.0.0.1",
                          "--api", f"127.0.0.1:{api}", "--context", "128", "--json-events", *extra)
        code = next(lines(host, 120))
        return host, code, rv, f"http://127.0.0.1:{api}"

    def join(self, code: str, rv: int, name: str) -> subprocess.Popen:
        return self.start("join", code, "--rendezvous", f"127.0.0.1:{rv}", "--name", name, "--bind", "127.0.0.1",
                          "--api", "off")

    def end(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def session(tmp_path):
    s = Session(tmp_path)
    yield s
    s.end()


def until_event(proc: subprocess.Popen, kind: str, timeout: float, **match) -> dict:
    for line in lines(proc, timeout):
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("event") == kind and all(event.get(k) == v for k, v in match.items()):
            return event
    raise AssertionError(f"the host ended before {kind}")


def status(api: str) -> dict:
    with urllib.request.urlopen(api + "/status", timeout=10) as r:
        return json.loads(r.read())


def answer(api: str, timeout: float = 60.0) -> int:
    body = {"model": status(api)["session"]["model"], "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0}
    req = urllib.request.Request(api + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def serves_within(api: str, seconds: float) -> float:
    """Seconds until a completion is answered 200 (requests waiting for a replan count)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        with contextlib.suppress(OSError):
            if answer(api, timeout=max(1.0, seconds - (time.monotonic() - t0))) == 200:
                return time.monotonic() - t0
        time.sleep(1.0)
    raise AssertionError(f"no answer within {seconds:g} s")


def test_malformed_descriptors_are_refused_and_malformed_messages_dropped_while_the_session_answers(session):
    from tests.hostile_member import BAD_FIELDS, BAD_MESSAGES

    host, code, rv, api = session.host("--expect", "1")
    until_event(host, "serving", 180)
    assert answer(api) == 200
    hostile = session.start(code, "127.0.0.1", str(rv), module=[sys.executable, "-m", "tests.hostile_member"])
    tries = [json.loads(line) for line in lines(hostile, 300)]
    assert hostile.wait(30) == 0, session.errs[-1].read_text()[-3000:]
    assert len(tries) == len(BAD_FIELDS) + len(BAD_MESSAGES), tries
    for (key, _), seen in zip(BAD_FIELDS, tries, strict=False):
        assert "refused" in seen and key in seen["refused"] and "bad hello" in seen["refused"], seen
    for seen in tries[len(BAD_FIELDS):]:
        assert "removed" in seen, seen  # dropped by the host, told why
    assert host.poll() is None and answer(api) == 200  # the session never noticed
    history = status(api)["history"]
    dropped = {h["name"]: h["reason"] for h in history if h["event"] == "dropped"}
    assert {s["name"] for s in tries[len(BAD_FIELDS):]} <= set(dropped), history
    assert "only the host sends" in dropped["rude1"] and "not in" in dropped["rude0"], dropped
    err = session.errs[0].read_text()
    assert "Traceback" not in err and "member rude1 is dropped" in err, err[-3000:]


def test_a_joiner_frozen_before_it_builds_its_stage_is_dropped_and_the_session_serves(session):
    """--auto-replan plans a joiner in at once; it freezes (SIGSTOP) right after joining: the
    rendezvous' watchdog drops it, the host plans without it, and the session serves within 90 s."""
    host, code, rv, api = session.host("--expect", "1", "--auto-replan")
    until_event(host, "serving", 180)
    frozen = session.join(code, rv, "m2")
    until_event(host, "joined", 120, name="m2")
    os.killpg(frozen.pid, signal.SIGSTOP)
    took = serves_within(api, 90)
    assert host.poll() is None, session.errs[0].read_text()[-3000:]
    history = status(api)["history"]
    assert any(h.get("name") == "m2" and h["event"] in ("left", "dropped") for h in history), history
    print(f"served again {took:.1f} s after the joiner froze")


def test_a_member_frozen_past_the_watchdog_ends_with_its_reason_when_woken(session):
    """SIGSTOP a serving member until the host drops it, then SIGCONT: within 60 s it serves again
    or has exited with one line saying why (here: it exits, code 3); never 503 forever."""
    host, code, rv, api = session.host("--expect", "2")
    member = session.join(code, rv, "m2")
    until_event(host, "serving", 240)
    assert answer(api) == 200
    os.killpg(member.pid, signal.SIGSTOP)
    until_event(host, "left", 60, name="m2")  # the watchdog (MEMBER_SILENT_S)
    serves_within(api, 60)  # the host alone
    os.killpg(member.pid, signal.SIGCONT)
    rc = member.wait(60)
    err = session.errs[1].read_text()
    last = err.strip().splitlines()[-1]
    assert rc == 3 and "dropped this member" in last and "kafila join again" in last, err[-3000:]
    assert "Traceback" not in err
    assert host.poll() is None and answer(api) == 200
