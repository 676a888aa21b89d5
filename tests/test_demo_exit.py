"""`kafila demo`'s exit status when its member processes end with errors (no model, no processes:
the session is a stand-in that reports the exit codes a real one would)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from kafila.cli import main
from kafila.commands.demo import member_failures

PLAN = {"head": "m1", "ring": ["m1", "m2"], "blocks": {"m1": 15, "m2": 15}}


@dataclass
class FakeProc:
    log_path: str


class FakeSession:
    codes: dict[str, int] = {}

    def __init__(self, members: int, **_options) -> None:
        self.names = [f"m{i + 1}" for i in range(members)]
        self.plan = PLAN

    def start(self, timeout_s: float = 300.0) -> FakeSession:
        return self

    def api(self, name: str) -> str:
        return f"http://{name}"

    def proc(self, name: str) -> FakeProc:
        return FakeProc(f"/logs/{name}.log")

    def stop(self) -> dict[str, int]:
        return dict(self.codes)


@pytest.fixture
def fake_demo(monkeypatch):
    import backends.gguf
    import kafila.commands.join
    import kafila.models
    import kafila.tooling.launch

    answer = {"text": "red, green, blue", "tokens": 5, "tok_s": 10.0, "ttft_ms": 50.0}
    monkeypatch.setattr(kafila.tooling.launch, "LocalSession", FakeSession)
    monkeypatch.setattr(kafila.tooling.launch, "stream_chat", lambda *a, **k: answer)
    monkeypatch.setattr(kafila.tooling.launch, "get_json", lambda *a: {"stages": {}})
    monkeypatch.setattr(kafila.models, "resolve_model", lambda name: name)
    index = SimpleNamespace(name="m", hparams=SimpleNamespace(context_length=8192))  # what demo reads
    monkeypatch.setattr(backends.gguf, "open_model", lambda path: index)
    monkeypatch.setattr(kafila.commands.join, "check_backend", lambda name: None)

    def run(codes: dict[str, int]) -> int:
        monkeypatch.setattr(FakeSession, "codes", codes)
        return main(["demo", "--members", "2", "--json", "--cache-dir", "/nonexistent"])

    return run


def test_demo_exits_0_when_every_member_stopped_cleanly(fake_demo, capsys) -> None:
    assert fake_demo({"m1": 0, "m2": -2}) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "red, green, blue"


def test_demo_fails_naming_the_member_that_ended_with_an_error(fake_demo, capsys) -> None:
    assert fake_demo({"m1": 0, "m2": 1}) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["tokens"] == 5  # the answer is still printed
    err = out.err.strip().splitlines()
    assert err[-1] == "kafila demo: member m2 ended with exit code 1 (its log: /logs/m2.log)"


def test_member_failures_names_each_one() -> None:
    logs = {"m1": "/l/m1.log", "m2": "/l/m2.log", "m3": "/l/m3.log"}
    assert member_failures({"m1": 0, "m2": 130, "m3": -2}, logs) is None
    line = member_failures({"m1": -9, "m2": 0, "m3": 3}, logs)
    assert line is not None and "member m1 ended with exit code -9" in line
    assert "member m3 ended with exit code 3 (its log: /l/m3.log)" in line and "m2" not in line
