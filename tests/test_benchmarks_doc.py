"""docs/BENCHMARKS.md is the current record: short, and every section's table comes from a command that runs.

Each `## ` section names one command in a ```sh block — `python -m bench.X …` or `kafila …` —
and the module or subcommand must exist and its parser accept the flags as written. The parser
is the script's own: its `parse_args` is let run and then stopped, so nothing is measured here.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
MAX_LINES = 440  # one section a question (and a CPU kind where speed differs by kind); history lives in git
COMMAND = re.compile(r"```sh\n(.*?)```", re.S)


class Parsed(Exception):
    """Raised by the patched parse_args once the arguments parsed: the command stops there."""


def sections() -> list[tuple[str, str]]:
    text = DOC.read_text()
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return [(p.splitlines()[0], p) for p in parts]


def command_of(body: str) -> list[str]:
    blocks = COMMAND.findall(body)
    assert len(blocks) == 1, f"expected one ```sh block with the section's command, found {len(blocks)}"
    lines = [ln for ln in blocks[0].replace("\\\n", " ").splitlines() if ln.strip()]
    assert len(lines) == 1, f"the ```sh block must hold one command, found {lines}"
    return shlex.split(lines[0])


def parse_only(monkeypatch, main, argv: list[str]) -> argparse.Namespace:
    """Run `main(argv)` up to its parse_args and return what the parser made of argv."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        ns = real(self, args, namespace)
        if self.prog.startswith("pytest"):  # not ours
            return ns
        raise Parsed(ns)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    try:
        main(argv) if inspect.signature(main).parameters else main()
    except Parsed as stop:
        return stop.args[0]
    except SystemExit as exit_:
        pytest.fail(f"the parser refused {argv}: exit {exit_.code}")
    pytest.fail(f"{argv}: main returned without calling parse_args")


def test_record_is_short():
    lines = DOC.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"docs/BENCHMARKS.md has {len(lines)} lines (≤ {MAX_LINES}): history lives in git"
    assert "git log" in DOC.read_text(), "the record says where its history went"


def test_every_section_has_a_table():
    for title, body in sections():
        assert re.search(r"^\|.*\|\n\|[-|: ]+\|$", body, re.M), f"section {title!r} has no markdown table"
        assert re.search(r"^CPU: .*ISA: ", body, re.M), f"section {title!r} does not say which CPU it ran on"
        assert re.search(r"^commit: [0-9a-f]{7}", body, re.M), f"section {title!r} does not say which commit"


@pytest.mark.parametrize("title", [t for t, _ in sections()])
def test_section_command_exists_and_parses(title, monkeypatch):
    body = dict(sections())[title]
    argv = command_of(body)
    if argv[0] == "kafila":
        from kafila.cli import build_parser

        try:
            ns = build_parser().parse_args(argv[1:])
        except SystemExit as exit_:
            pytest.fail(f"kafila refused {argv[1:]}: exit {exit_.code}")
        assert ns.command == argv[1]
        return
    assert argv[:2] == ["python", "-m"] and argv[2].startswith("bench."), \
        f"section {title!r}: the command must be `python -m bench.X …` or `kafila …`, not {argv}"
    module = importlib.import_module(argv[2])
    parse_only(monkeypatch, module.main, argv[3:])


def test_a_wrong_flag_is_caught(monkeypatch):
    """The check above can fail: a flag the script does not take is refused."""
    from bench import before_after

    with pytest.raises(pytest.fail.Exception):
        parse_only(monkeypatch, before_after.main, ["--base", "HEAD", "--no-such-flag"])
    assert parse_only(monkeypatch, before_after.main, ["--base", "HEAD"]).base == "HEAD"


def test_the_doc_is_bench_records():
    """Each section's command is the one bench.record runs to rebuild it, in its order."""
    from bench.record import SECTIONS

    assert [(title, " ".join(command_of(body))) for title, body in sections()] == \
        [(title, command) for title, _, command, _ in SECTIONS]
