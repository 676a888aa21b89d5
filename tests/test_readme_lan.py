"""The README's LAN flow on one machine, with the defaults a person gets: `kafila host` (embedded
rendezvous on 0.0.0.0:7473, API on 127.0.0.1:8740), members running `kafila join CODE`, once with
no terminal (`--expect 3`) and once with the host in a pseudo-terminal where a person watches the
members' table and presses Enter. Both failed before the rendezvous answered from the address it
was asked on (the host's own member talked to "0.0.0.0" and dropped every relay acknowledgement)."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios

import pytest

from tests.readme_flow import API_LINE, JOIN_COMMAND, SERVING_TIMEOUT_S, Output, ask

pytestmark = [pytest.mark.session, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

KAFILA = os.path.join(os.path.dirname(sys.executable), "kafila")
JOINERS = ("laptop", "pi")  # one machine has one host name: members need --name here


def _kafila(*args: str) -> list[str]:
    return [KAFILA, *args] if os.path.exists(KAFILA) else [sys.executable, "-m", "kafila", *args]


@pytest.fixture
def processes(tmp_path):
    """Start processes with one HOME (the weight cache) and stop them all, SIGINT first."""
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    started: list[subprocess.Popen] = []

    def start(argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen(argv, env=env, start_new_session=True, **kw)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for proc in started:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _join(start, code: str, *extra: str) -> dict[str, Output]:
    outs = {}
    for name in JOINERS:
        proc = start(_kafila("join", code, *extra, "--name", name))
        outs[name] = Output(lambda fd=proc.stderr.fileno(): os.read(fd, 4096))
    return outs


def _answered(answer: dict) -> None:
    text = answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0 and text.strip(), answer


def test_defaults_without_a_terminal_127_joins_0000(processes):
    """`kafila host --expect 3` and `kafila join CODE` (its default rendezvous 127.0.0.1:7473)."""
    host = processes(_kafila("host", "--expect", "3"))
    host_out = Output(lambda: os.read(host.stderr.fileno(), 4096))
    code = host.stdout.readline().decode().strip()
    assert code, f"the host printed no code\n{host_out.text}"
    joiners = _join(processes, code)
    everyone = [host_out, *joiners.values()]
    apis = {}
    for name, out in [("host", host_out), *joiners.items()]:
        found = out.wait_for(API_LINE, SERVING_TIMEOUT_S, f"{name} serving", everyone)
        apis[found.group(1)] = found.group(2)
    assert len(set(apis.values())) == 3, apis  # each member found its own API port
    _answered(ask(apis["pi"]))


def test_host_in_a_terminal_lists_members_and_plans_on_enter(processes):
    """The host in a pty: the printed join command, the live table, Enter, serving; then a late
    joiner, which the person at the host adds with Enter (churn issue: the host confirms)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    host = processes(_kafila("host"), stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    host_out = Output(lambda: os.read(master, 4096))
    try:
        printed = host_out.wait_for(JOIN_COMMAND, 180, "the join command the host prints")
        joiners = _join(processes, printed.group(1), "--rendezvous", printed.group(2))
        everyone = [host_out, *joiners.values()]
        for name in JOINERS:
            host_out.wait_for(rf"\b{name}\b", 180, f"{name} in the host's table", everyone)
        os.write(master, b"\r")  # Enter: plan now
        host_api = host_out.wait_for(API_LINE, SERVING_TIMEOUT_S, "the host serving", everyone).group(2)
        for name, out in joiners.items():
            out.wait_for(API_LINE, SERVING_TIMEOUT_S, f"{name} serving", everyone)
        _answered(ask(host_api))
        # a machine that joins the serving session waits until the person at the host says so
        late = processes(_kafila("join", printed.group(1), "--rendezvous", printed.group(2), "--name", "desk"))
        late_out = Output(lambda: os.read(late.stderr.fileno(), 4096))
        everyone.append(late_out)
        host_out.wait_for(r"desk joined the serving session[\s\S]*?press Enter here", 180, "the host asking", everyone)
        os.write(master, b"\r")  # Enter: replan with it
        host_out.wait_for(r"desk joined \(Enter at the host\)", 180, "the replan", everyone)
        late_out.wait_for(API_LINE, SERVING_TIMEOUT_S, "desk serving", everyone)
        _answered(ask(host_api))
    finally:  # leave as a person does (Ctrl-C), then close the terminal
        host.send_signal(signal.SIGINT)
        try:
            host.wait(timeout=20)
        finally:
            os.close(master)
