"""Issue 38 items 2-4 through the real CLI: a stranger who scans nameplates and guesses once, a
stranger who hogs the pending slots, and floods of bad HTTP requests and idle connections at a
desktop fd limit. Each runs `kafila host` (its embedded rendezvous) and real `kafila join`s on
127.0.0.1; strangers connect from other loopback addresses (127.0.0.2...), as machines on the LAN
would, so per-address limits apply to them and not to the household's joiners."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from kafila.net.code import make_code
from kafila.tooling.launch import free_ports
from rendezvous import messages as m
from rendezvous.limits import UNKNOWN_JOIN_BURST, UNKNOWN_JOINS_PER_S
from tests.default_model import needs_default_model

pytestmark = [pytest.mark.session, pytest.mark.slow, pytest.mark.timeout(300)]
KAFILA = [sys.executable, "-m", "kafila"]
JOIN_WITHIN_S = 30.0  # issue 38 item 3: a real join while the hog runs


class Procs:
    def __init__(self, tmp_path) -> None:
        self.items: list[subprocess.Popen] = []
        self.tmp = tmp_path

    def start(self, *args: str, **kw) -> subprocess.Popen:
        err = open(self.tmp / f"{len(self.items)}.err", "w")
        p = subprocess.Popen([*KAFILA, *args], stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                             text=True, start_new_session=True, **kw)
        p.err_path = err.name  # type: ignore[attr-defined]
        self.items.append(p)
        return p

    def stop(self) -> None:
        for p in self.items:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGINT)
        for p in self.items:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    yield ps
    ps.stop()


def stderr_of(p: subprocess.Popen) -> str:
    with open(p.err_path) as f:  # type: ignore[attr-defined]
        return f.read()


def lines(proc: subprocess.Popen, timeout: float):
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if sel.select(max(0.0, end - time.monotonic())):
            line = proc.stdout.readline()
            if not line:
                return
            yield line.strip()
    raise AssertionError("no output in time")


def start_host(procs: Procs, tmp_path, *extra: str, expect: int = 3, **kw):
    rv, api = free_ports(2)
    code_file = tmp_path / "code"
    host = procs.start("host", "--expect", str(expect), "--name", "m1", "--listen", f"127.0.0.1:{rv}",
                       "--bind", "127.0.0.1", "--api", f"127.0.0.1:{api}", "--code-file", str(code_file),
                       "--context", "128", *extra, **kw)  # fmt: skip
    code = next(lines(host, 120))
    assert code.count("-") == 3, code
    return host, code, rv, api, code_file


def join(procs: Procs, rv: int, *code_args: str, name: str = "m2") -> subprocess.Popen:
    return procs.start("join", *code_args, "--rendezvous", f"127.0.0.1:{rv}", "--name", name,
                       "--bind", "127.0.0.1", "--api", "off", "--json-events")  # fmt: skip


async def ask(port: int, nameplate: int, source: str) -> str:
    """One stranger's join: the rendezvous' answer (a code of its Error, or the message's name)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(m.encode(m.Join(nameplate)))
        [answer, *_] = m.FrameReader().feed(await asyncio.wait_for(reader.read(4096), 5))
        return answer.code if isinstance(answer, m.Error) else type(answer).__name__
    finally:
        writer.close()


def test_a_scan_and_one_wrong_guess_leave_a_fresh_code_that_admits(procs, tmp_path) -> None:
    """Issue 38 item 2: scanning is slowed per address and logged; one wrong guess closes that
    code, the host writes a fresh one to --code-file, and a real join with it succeeds."""
    host, code, rv, api, code_file = start_host(procs, tmp_path)
    nameplate = int(code.split("-")[0])

    async def scan():
        return [await ask(rv, n, "127.0.0.2") for n in range(1, 301) if n != nameplate]

    began = time.monotonic()
    answers = asyncio.run(scan())
    # a burst, then one every 2 s: what the scan's own duration allows (a loaded machine scans slower)
    allowed = UNKNOWN_JOIN_BURST + 1 + int((time.monotonic() - began) * UNKNOWN_JOINS_PER_S)
    assert answers.count("unknown-nameplate") <= allowed, (allowed, answers[:20])
    assert answers.count("rate-limited") >= len(answers) - allowed, answers[:20]
    assert asyncio.run(ask(rv, nameplate, "127.0.0.2")) == "rate-limited"  # the live one is hidden too
    wrong = make_code(nameplate)
    while wrong == code:
        wrong = make_code(nameplate)
    guess = join(procs, rv, wrong, name="eve")
    assert guess.wait(60) == 3 and "wrong code" in stderr_of(guess), stderr_of(guess)
    fresh = next(lines(host, 60))  # the host prints the fresh code (and writes it first)
    assert fresh.count("-") == 3 and fresh != code and fresh.split("-")[0] != code.split("-")[0]
    assert code_file.read_text().strip() == fresh
    old = join(procs, rv, code, name="late")
    assert old.wait(60) == 3 and "check the code" in stderr_of(old), stderr_of(old)
    member = join(procs, rv, "--code-file", str(code_file))
    assert '"joined"' in next(lines(member, 60))
    # the host asks for a new code on its local API (loopback, its own Host): printed and written too
    assert post(api, "/admin/new-code", {"Origin": "http://evil.example"})[0] == 403  # a web page cannot
    status, answer = post(api, "/admin/new-code")
    assert status == 200 and answer["code"] == next(lines(host, 30)) == code_file.read_text().strip() != fresh
    with urllib.request.urlopen(f"http://127.0.0.1:{api}/status", timeout=10) as r:
        assert json.loads(r.read())["code"] == answer["code"]
    assert member.poll() is None  # members already in are unaffected
    log = stderr_of(host)
    assert "joins to nameplates that do not exist" in log and "127.0.0.2" in log, log[-2000:]
    assert "wrong code" in log and "Traceback" not in log, log[-2000:]


def post(api: int, path: str, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{api}{path}", b"", headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def hog(port: int, nameplate: int, stop: threading.Event, counts: dict) -> None:
    """Issue 38 item 3's stranger: 4 addresses x 3 connections, each joining again at once when
    dropped, never starting a PAKE."""
    async def one(source: str) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.write(m.encode(m.Join(nameplate)))
            frames = m.FrameReader()
            with contextlib.suppress(OSError, ValueError):  # a reset, or a frame cut short
                while not stop.is_set():
                    try:
                        data = await asyncio.wait_for(reader.read(4096), 0.5)
                    except TimeoutError:
                        continue  # holding its slot (or its place in line)
                    if not data:
                        break
                    for msg in frames.feed(data):
                        key = msg.code if isinstance(msg, m.Error) else type(msg).__name__
                        counts[key] = counts.get(key, 0) + 1
            writer.close()
            await asyncio.sleep(0.02)

    async def main():
        await asyncio.gather(*(one(f"127.0.0.{2 + i % 4}") for i in range(12)))

    asyncio.run(main())


def test_a_join_gets_in_while_a_stranger_hogs_the_pending_slots(procs, tmp_path) -> None:
    host, code, rv, _, _ = start_host(procs, tmp_path, expect=4)
    t = time.monotonic()
    assert '"joined"' in next(lines(join(procs, rv, code, name="m2"), JOIN_WITHIN_S))
    unhogged_s = time.monotonic() - t
    stop, counts = threading.Event(), {}
    thread = threading.Thread(target=hog, args=(rv, int(code.split("-")[0]), stop, counts), daemon=True)
    thread.start()
    try:
        time.sleep(2.0)  # the hog holds every pending slot
        assert counts.get("Joined", 0) >= 4, counts
        t = time.monotonic()
        member = join(procs, rv, code, name="m3")
        assert '"joined"' in next(lines(member, JOIN_WITHIN_S)), stderr_of(member)
        print(f"joined in {time.monotonic() - t:.1f} s while hogged ({unhogged_s:.1f} s before); hog saw {counts}")
    finally:
        stop.set()
        thread.join(10)
    assert counts.get("no-pake", 0) >= 4 and counts.get("busy", 0) >= 1, counts  # dropped, capped
    for _ in range(50):  # the host hears of the refusals (once a minute, first at once)
        if "joins refused from 127.0.0." in stderr_of(host):
            break
        time.sleep(0.2)
    log = stderr_of(host)
    assert "joins refused from 127.0.0." in log and "Traceback" not in log, log[-2000:]


BAD_REQUESTS = [
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n",
]


async def bad_requests(port: int, n: int) -> int:
    answered = 0
    for i in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(BAD_REQUESTS[i % len(BAD_REQUESTS)])
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            answered += (await asyncio.wait_for(reader.read(64), 5)).split(b" ")[1:2] in ([b"400"], [b"431"])
        writer.close()
    return answered


async def idle_connections(port: int, n: int, source: str) -> list:
    held = []
    for _ in range(n):
        with contextlib.suppress(OSError):
            held.append(await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)))
    return held


def chat(api: int) -> tuple[int, float]:
    url = f"http://127.0.0.1:{api}"
    with urllib.request.urlopen(url + "/status", timeout=10) as r:
        model = json.loads(r.read())["session"]["model"]
    body = {"model": model, "temperature": 0, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, time.monotonic() - t
    except urllib.error.HTTPError as exc:
        return exc.code, time.monotonic() - t


def _desktop_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


@pytest.mark.model
@needs_default_model
def test_floods_add_a_few_log_lines_and_the_chat_answers(procs, tmp_path) -> None:
    """Issue 38 item 4: at `ulimit -n 1024`, 500 malformed HTTP requests and 2,000 idle connections
    to the rendezvous add a few log lines (not 1,800, not 14,000) and a chat still answers. The
    chat's time is printed, not asserted (the issue's "under 2 s" is a figure for a bench)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.skip(f"this test holds 2,000 connections; the hard fd limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        host, code, rv, api, _ = start_host(procs, tmp_path, "--json-events", expect=1, preexec_fn=_desktop_fd_limit)
        for line in lines(host, 240):
            if line.startswith("{") and json.loads(line).get("event") == "serving":
                break
        assert chat(api)[0] == 200
        before = stderr_of(host).count("\n")
        assert asyncio.run(bad_requests(api, 500)) == 500
        after_http = stderr_of(host).count("\n")

        async def flood():
            held = await idle_connections(rv, 2000, "127.0.0.2")
            status, seconds = await asyncio.to_thread(chat, api)
            for _, w in held:
                w.close()
            return len(held), status, seconds

        held, status, seconds = asyncio.run(flood())
        time.sleep(1.0)
        log = stderr_of(host)
        after = log.count("\n")
        print(f"malformed HTTP: {after_http - before} lines; 2000 idle connections ({held} opened): "
              f"{after - after_http} lines; chat {seconds:.2f} s")
        assert status == 200 and host.poll() is None
        assert after_http - before <= 4, log[-3000:]
        assert after - after_http <= 4, log[-3000:]
        assert "Traceback" not in log and "out of system resource" not in log, log[-3000:]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
