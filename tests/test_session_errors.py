"""Sessions that cannot form: wrong code, unreachable rendezvous, host gone before planning,
bad arguments. Real processes on 127.0.0.1; none of them builds a shard."""

import os
import signal
import subprocess
import sys
import time

import pytest

from kafila.tooling.launch import free_ports

pytestmark = [pytest.mark.session, pytest.mark.timeout(180)]
KAFILA = [sys.executable, "-m", "kafila"]


class Procs:
    def __init__(self):
        self.items = []

    def start(self, *args, **kw):
        p = subprocess.Popen([*KAFILA, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True, start_new_session=True, **kw)
        self.items.append(p)
        return p

    def kill_all(self):
        for p in self.items:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.kill_all()


def wait_line(proc, timeout=60):
    """The first stdout line (the host prints its code first, a --json-events member its events);
    stdout holds nothing else, so anything else fails here, with the process's stderr."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError("no output in time")
    line = proc.stdout.readline()
    if not line.strip():  # closed stdout (it exited), or printed a blank line: show why
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise AssertionError(f"rc {proc.returncode}, first line {line!r}; stderr: {proc.stderr.read()[-3000:]}")
    return line.strip()


def start_host(procs, expect=3):
    rv, api = free_ports(2)
    host = procs.start("host", "--expect", str(expect), "--name", "m1", "--listen", f"127.0.0.1:{rv}",
                       "--bind", "127.0.0.1", "--api", f"127.0.0.1:{api}")
    code = wait_line(host)
    assert code.count("-") == 3, code
    return host, code, rv


def finish(proc, timeout=30):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def test_wrong_code_and_unreachable_rendezvous_fail_fast(procs):
    host, code, rv = start_host(procs)
    from kafila.net.code import make_code

    nameplate = int(code.split("-")[0])
    wrong = make_code(nameplate)
    while wrong == code:
        wrong = make_code(nameplate)
    t = time.monotonic()
    bad = procs.start("join", wrong, "--rendezvous", f"127.0.0.1:{rv}",
                      "--name", "m2", "--bind", "127.0.0.1", "--api", "off")
    rc, err = finish(bad)
    assert rc == 3, err
    assert "code" in err.lower() and "Traceback" not in err, err
    assert time.monotonic() - t < 30
    (closed,) = free_ports(1)
    t = time.monotonic()
    nowhere = procs.start("join", code, "--rendezvous", f"127.0.0.1:{closed}", "--name", "m3",
                          "--bind", "127.0.0.1", "--api", "off")
    rc, err = finish(nowhere)
    assert rc == 3 and "cannot reach the rendezvous" in err, err
    assert "Traceback" not in err
    assert time.monotonic() - t < 30
    host.send_signal(signal.SIGINT)
    assert finish(host)[0] == 0


def test_host_gone_before_planning_ends_the_member_with_a_clear_error(procs):
    host, code, rv = start_host(procs)
    member = procs.start("join", code, "--rendezvous", f"127.0.0.1:{rv}", "--name", "m2",
                         "--bind", "127.0.0.1", "--api", "off", "--json-events")
    assert '"joined"' in wait_line(member)
    os.killpg(host.pid, signal.SIGKILL)  # the host's machine vanished (its rendezvous with it)
    host.wait()
    t = time.monotonic()
    rc, err = finish(member)
    assert rc == 3, err
    assert "host" in err and "Traceback" not in err, err
    assert time.monotonic() - t < 15


def test_member_ctrl_c_while_waiting_leaves_cleanly(procs):
    host, code, rv = start_host(procs)
    member = procs.start("join", code, "--rendezvous", f"127.0.0.1:{rv}", "--name", "m2",
                         "--bind", "127.0.0.1", "--api", "off", "--json-events")
    assert '"joined"' in wait_line(member)
    member.send_signal(signal.SIGINT)
    assert finish(member)[0] == 0
    host.send_signal(signal.SIGINT)
    rc, err = finish(host)
    assert rc == 0, err


@pytest.mark.parametrize("args,needle", [
    (["host", "--model", "/nonexistent.gguf"], "not found"),
    (["host", "--expect", "-1"], "--expect"),
    (["host"], "--expect"),
    (["join", "not-a-code", "--api", "off"], "code"),
    (["demo", "--members", "0"], "--members"),
    (["demo", "--throttle", "m2"], "--throttle"),
    (["demo", "--throttle", "m7=0.5"], "m7"),
    (["host", "--latency-ms", "-3"], "--latency-ms"),
])
def test_bad_arguments_exit_2_with_one_line(procs, args, needle):
    p = procs.start(*args)
    rc, err = finish(p)
    assert rc == 2, err
    assert needle in err and "Traceback" not in err, err


def test_a_member_gone_while_forming_is_dropped_and_the_rest_serve(procs):
    """A member killed after the plan, before the ring serves, is dropped with its reason and the
    two left are planned again and serve (issue 38: a member never ends the session)."""
    import json

    from tests.test_member_inputs import serves_within, status

    rv, api = free_ports(2)
    host = procs.start("host", "--expect", "3", "--name", "m1", "--listen", f"127.0.0.1:{rv}",
                       "--bind", "127.0.0.1", "--api", f"127.0.0.1:{api}", "--json-events")
    code = wait_line(host)
    common = ["--rendezvous", f"127.0.0.1:{rv}", "--bind", "127.0.0.1", "--api", "off"]
    m2 = procs.start("join", code, "--name", "m2", *common)
    m3 = procs.start("join", code, "--name", "m3", *common)
    while True:  # the host's events until it has planned
        event = json.loads(wait_line(host, 90))
        if event["event"] == "joined" and event.get("name") == "m3":
            # frozen once it is in: it cannot finish forming before it is killed (a small
            # model's shards arrive and compile within the time the test takes to read a line)
            os.killpg(m3.pid, signal.SIGSTOP)
        if event["event"] == "plan":
            assert "m3" in event["plan"]["ring"], event
            break
    os.killpg(m3.pid, signal.SIGKILL)
    m3.wait()
    url = f"http://127.0.0.1:{api}"
    serves_within(url, 120)
    assert host.poll() is None and m2.poll() is None
    st = status(url)
    assert "m3" not in st["plan"]["ring"] and set(st["plan"]["ring"]) == {"m1", "m2"}, st["plan"]
    assert any(h.get("name") == "m3" and h["event"] in ("left", "dropped") for h in st["history"]), st["history"]


def test_a_busy_api_port_fails_before_joining(procs):
    import socket

    from kafila.net.code import make_code

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = procs.start("join", make_code(1), "--rendezvous", "127.0.0.1:9", "--name", "m2",
                        "--api", f"127.0.0.1:{port}")
        rc, err = finish(p)
    assert rc == 2 and "--api" in err and "Traceback" not in err, err


@pytest.mark.timeout(600)
def test_a_member_that_dies_while_the_session_forms_ends_the_start_with_its_log(tmp_path):
    """`kafila demo` and the session tests start members with LocalSession: one that dies before
    the session forms (it crashed in its probe, say) ends start() naming it, with its log, instead
    of leaving it waiting for the host, which waits for that member, until the deadline."""
    import threading

    from backends.errors import Refused
    from kafila.tooling.launch import LocalSession

    s = LocalSession(members=3, cache_root=str(tmp_path / "cache"), log_dir=str(tmp_path))
    outcome: list[BaseException | None] = []

    def start():
        try:
            s.start(timeout_s=540)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001  (what the test asserts on)
            outcome.append(exc)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    while not any(p.name == "m2" for p in s.procs) and t.is_alive():
        time.sleep(0.05)
    m2 = next(p for p in s.procs if p.name == "m2")
    os.killpg(m2.popen.pid, signal.SIGKILL)  # as a segfault would: no word from it
    t.join()
    exc = outcome[0]
    assert isinstance(exc, Refused), exc
    assert "m2 exited with -9 while the session formed" in str(exc), exc
    assert all(p.popen.poll() is not None for p in s.procs)  # start() stopped the rest
