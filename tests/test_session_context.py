"""A session's context: the model's own (the plan caps it by memory: test_context_fit.py); an
explicit --context it lacks is one line, exit 2 (issue 10). Through the real CLI parsing, without
forming a session."""

from __future__ import annotations

import pytest

from backends.errors import BadInput, Refused
from kafila.cli import main
from kafila.session.control.host import HostParticipant, session_context
from kafila.tooling.launch import LocalSession
from tests.synthetic_gguf import write_llama_gguf

MODEL_CONTEXT = 512  # write_llama_gguf's context_length


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> str:
    return write_llama_gguf(tmp_path_factory.mktemp("ctx") / "short.gguf")


@pytest.mark.parametrize(
    ("requested", "model_context", "context", "noted"),
    [
        (None, 512, 512, False),  # the default is the model's own
        (None, 2048, 2048, False),
        (None, 131072, 131072, False),  # (the plan caps it by the members' memory)
        (512, 512, 512, False),
        (2, 512, 2, False),
        (4096, 131072, 4096, False),  # above the default, within the model: allowed
    ],
)
def test_session_context_table(requested, model_context, context, noted) -> None:
    got, note = session_context(requested, model_context, "m")
    assert got == context
    assert (note is not None) == noted
    if noted:
        assert str(model_context) in note and "\n" not in note


@pytest.mark.parametrize("requested", [1, 0, -5, 513, 2048])
def test_explicit_context_outside_the_model_is_bad_input(requested) -> None:
    with pytest.raises(BadInput, match=rf"--context {requested}: choose 2\.\.512 for m"):
        session_context(requested, 512, "m")


@pytest.mark.parametrize("command", [["host", "--expect", "1"], ["demo", "--members", "1"]])
def test_cli_refuses_a_context_longer_than_the_model(short_model, command, capsys, monkeypatch) -> None:
    started = []
    monkeypatch.setattr(HostParticipant, "run", lambda self: started.append(self) or 0)
    monkeypatch.setattr(LocalSession, "start", lambda self, *a, **k: started.append(self))
    assert main([command[0], "--model", short_model, "--context", "1024", *command[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kafila {command[0]}: --context 1024: choose 2..512 for short (its own context), "
                   "or leave --context out"]  # fmt: skip
    assert started == []  # refused before anything starts


def test_host_default_context_is_the_models_when_shorter(short_model, monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(HostParticipant, "run", lambda self: seen.append(self.cfg) or 0)
    assert main(["host", "--model", short_model, "--expect", "1"]) == 0
    (cfg,) = seen
    assert cfg.context is None  # not given: the host picks it from the model when it opens it
    assert session_context(cfg.context, MODEL_CONTEXT, "short")[0] == MODEL_CONTEXT


def test_demo_default_passes_no_context(short_model, capsys, monkeypatch, tmp_path) -> None:
    argvs = []

    def spawn(self, name, args, port):
        argvs.append(args)
        raise Refused("stop here")

    monkeypatch.setattr(LocalSession, "_spawn", spawn)
    assert main(["demo", "--model", short_model, "--members", "2", "--cache-dir", str(tmp_path)]) != 0
    assert argvs and "--context" not in argvs[0]  # the host chooses (kafila host's default)


def test_local_session_passes_an_explicit_context(monkeypatch, tmp_path) -> None:
    argvs = []

    def spawn(self, name, args, port):
        argvs.append(args)
        raise Refused("stop here")

    monkeypatch.setattr(LocalSession, "_spawn", spawn)
    with pytest.raises(Refused):
        LocalSession(members=1, context=256, cache_root=str(tmp_path), log_dir=str(tmp_path)).start()
    assert argvs[0][argvs[0].index("--context") + 1] == "256"
