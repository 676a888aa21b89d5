"""Issue 15 at process level: `kafila rendezvous` + `kafila host` + two `kafila join` on
127.0.0.1, and an attacker who knows only the nameplate. Before admission, one run of the
attack ended the session (the host's Kick of a ghost id crashed the rendezvous' handling of
the host's connection) and every request got 503; now the session forms and answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kafila.tooling.launch import free_ports
from rendezvous import messages as m
from tests.default_model import needs_default_model

pytestmark = [pytest.mark.session, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(420),
              needs_default_model]
KAFILA = [sys.executable, "-m", "kafila"]


async def attack(rendezvous: tuple[str, int], nameplate: int) -> dict:
    """What a stranger with the nameplate can try: junk PAKE + heartbeat floods (ghost ids),
    pending EdgeRequests, body floods, squatting every pending slot."""
    answers: dict[str, int] = {}

    async def one(payload: bytes) -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*rendezvous), 5)
        except (OSError, asyncio.TimeoutError):
            answers["connect-failed"] = answers.get("connect-failed", 0) + 1
            return
        frames = m.FrameReader()
        writer.write(m.encode(m.Join(nameplate)) + payload)
        with contextlib.suppress(Exception):
            while True:
                data = await asyncio.wait_for(reader.read(65536), 2)
                if not data:
                    break
                for message in frames.feed(data):
                    key = message.code if isinstance(message, m.Error) else type(message).__name__
                    answers[key] = answers.get(key, 0) + 1
        writer.close()

    payloads = [
        m.encode(m.Send(0, b"P-junk")) + m.encode(m.Heartbeat()) * 450,
        m.encode(m.EdgeRequest(0)),
        m.encode(m.Send(0, b"S" + b"x" * 60_000)) * 40,
        m.encode(m.Kick(0)) + m.encode(m.CloseNameplate()),
        m.encode(m.Send(0, b"P" + os.urandom(32))),  # a random group element: junk or a guess
    ]
    for _ in range(3):
        await asyncio.gather(*(one(p) for p in payloads[:4]))
    return answers


def _lines(proc: subprocess.Popen, timeout: float):
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


def _chat(api: str) -> int:
    with urllib.request.urlopen(api + "/status", timeout=10) as r:
        model = json.loads(r.read())["session"]["model"]
    body = {"model": model, "temperature": 0, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    req = urllib.request.Request(api + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_nameplate_only_attacker_does_not_break_the_session(tmp_path) -> None:
    rv_port, api_port = free_ports(2)
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        log = open(tmp_path / f"{len(procs)}.err", "w")
        p = subprocess.Popen([*KAFILA, *args], stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                             text=True, start_new_session=True)
        procs.append(p)
        return p

    try:
        rv = start("rendezvous", "--listen", f"127.0.0.1:{rv_port}")
        next(_lines(rv, 30))
        code_file = tmp_path / "code"
        common = ["--rendezvous", f"127.0.0.1:{rv_port}", "--bind", "127.0.0.1"]
        host = start("host", "--expect", "3", "--name", "m1", *common, "--api", f"127.0.0.1:{api_port}",
                     "--json-events", "--context", "128", "--code-file", str(code_file))
        events = _lines(host, 300)
        code = next(events)
        assert stat.S_IMODE(os.stat(code_file).st_mode) == 0o600
        nameplate = int(code.split("-")[0])
        answers = asyncio.run(attack(("127.0.0.1", rv_port), nameplate))  # before anyone joined
        assert "Joined" in answers and "not-admitted" in answers, answers
        for name in ("m2", "m3"):  # the code from a 0600 file: never in `ps`
            start("join", "--code-file", str(code_file), "--name", name, *common, "--api", "off")
        for line in events:
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("event") == "serving":
                break
        api = f"http://127.0.0.1:{api_port}"
        assert _chat(api) == 200
        answers = asyncio.run(attack(("127.0.0.1", rv_port), nameplate))  # and while it serves
        time.sleep(1.0)
        assert _chat(api) == 200
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        for p in procs[1:]:
            os.killpg(p.pid, signal.SIGINT)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for i in range(len(procs)):
        err = (tmp_path / f"{i}.err").read_text()
        assert "Traceback" not in err, err[-3000:]
