"""Speculation's bad input (issue 12), as a person meets it: `kafila host`/`kafila demo` with a
draft model that is missing, not a GGUF or of another vocabulary, `--speculate draft` without one,
and `"speculate": "maybe"` over HTTP — one line, exit 2 / HTTP 400. And a 3-member session that
drafts with a draft model answers exactly what it answers without speculation (f32)."""

import json
import subprocess
import sys

import pytest

from tests.api_fixtures import ScriptedEngine, tokenizer  # noqa: F401 (fixture)
from tests.default_model import needs_default_model
from tests.synthetic_gguf import write_llama_gguf, write_not_gguf
from tests.test_api_http import MSGS, serve

KAFILA = [sys.executable, "-m", "kafila"]


def _kafila(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*KAFILA, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def _one_line_exit_2(p: subprocess.CompletedProcess, *words: str) -> None:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@needs_default_model
@pytest.mark.model
@pytest.mark.parametrize("command", ["host", "demo"])
def test_bad_draft_models_are_one_line_and_exit_2(command, tmp_path):
    other = write_llama_gguf(tmp_path / "other-vocab.gguf")  # a byte-level vocabulary, not SmolLM2's
    junk = write_not_gguf(tmp_path / "junk.gguf")
    extra = ["--expect", "2"] if command == "host" else []
    _one_line_exit_2(_kafila(command, "--speculate", "draft", *extra), "--draft")
    _one_line_exit_2(_kafila(command, "--speculate", "draft", "--draft", str(tmp_path / "nope.gguf"), *extra),
                     "not found")  # fmt: skip
    _one_line_exit_2(_kafila(command, "--speculate", "draft", "--draft", junk, *extra), "junk.gguf")
    _one_line_exit_2(_kafila(command, "--speculate", "draft", "--draft", other, *extra), "vocabulary")


def test_a_speculate_that_is_not_a_boolean_is_a_400_over_http(tokenizer):  # noqa: F811
    async def test(server, http):
        for bad in ("maybe", 1, [True]):
            req = {"model": "scripted", "messages": MSGS, "max_tokens": 4, "speculate": bad}
            async with http.post("/v1/chat/completions", json=req) as r:
                assert r.status == 400
                assert "speculate" in (await r.json())["error"]["message"]
        req = {"model": "scripted", "messages": MSGS, "max_tokens": 4, "speculate": False}
        async with http.post("/v1/chat/completions", json=req) as r:
            assert r.status == 200

    serve(ScriptedEngine(tokenizer), test)


def _demo(*args: str) -> dict:
    p = _kafila("demo", "--members", "3", "--precision", "f32", "--max-tokens", "48", "--json",
                "--prompt", "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox.",
                *args, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_default_model
@pytest.mark.model
@pytest.mark.session
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["ngram", "draft", "origin"])
def test_a_speculating_session_answers_as_without(mode, tmp_path):
    """`kafila demo --speculate ngram`, `origin` and `--speculate draft --draft smollm2-135m` (the model
    drafting for itself: an upper bound on acceptance), 3 processes at f32, answer exactly what
    `--speculate off` answers."""
    plain = _demo("--speculate", "off", "--cache-dir", str(tmp_path / "a"))
    extra = ["--draft", "smollm2-135m"] if mode == "draft" else []
    spec = _demo("--speculate", mode, *extra, "--cache-dir", str(tmp_path / "b"))
    assert spec["text"] == plain["text"] and spec["tokens"] == plain["tokens"]
    s = spec["speculation"]
    assert s["drafted"] > 0 and s["accepted"] > 0, s
