"""`kafila run` and `kafila models` as a person runs them: a subprocess, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.synthetic_gguf import write_llama_gguf, write_not_gguf, write_truncated


def kafila(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kafila", *args], capture_output=True, text=True, timeout=timeout)


def assert_bad_input(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: str(p / "missing.gguf"), "not found"),
        (lambda p: write_not_gguf(p / "zip.gguf"), "not a GGUF"),
        (lambda p: write_truncated(p / "cut.gguf"), "truncated"),
        (lambda p: write_llama_gguf(p / "gpt2.gguf", arch="gpt2"), "unsupported architecture"),
        (lambda p: write_llama_gguf(p / "q5.gguf", odd_tensor=("blk.0.attn_k.weight", "Q8_1")), "Q8_1"),
    ],
    ids=["missing", "not-gguf", "truncated", "arch", "quant-type"],
)
def test_bad_model_files(tmp_path, make, needle):
    assert_bad_input(kafila("run", "--model", make(tmp_path), "Hello"), needle)


def test_empty_prompt(synthetic_model):
    assert_bad_input(kafila("run", "--model", synthetic_model, "   "), "prompt is empty")


def test_too_many_stages(synthetic_model):
    assert_bad_input(kafila("run", "--model", synthetic_model, "--stages", "5", "Hello"), "4 blocks", "5 stages")


def test_bad_backend_list(synthetic_model):
    assert_bad_input(kafila("run", "--model", synthetic_model, "--stages", "2", "--backend", "openvino,nope", "Hi"),
                     "unknown backend 'nope'")
    assert_bad_input(kafila("run", "--model", synthetic_model, "--stages", "3", "--backend", "openvino,reference", "Hi"),
                     "2 backends for 3 stages")


def test_an_option_is_never_read_as_a_longer_one(synthetic_model):
    """argparse would take `--prompt` for `--prompt-ids` and complain of JSON: it is refused as
    the option it is."""
    proc = kafila("run", "--model", synthetic_model, "--prompt", "Hello")
    assert proc.returncode == 2 and "unrecognized arguments: --prompt" in proc.stderr, proc.stderr
    assert "JSON" not in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_alias():
    assert_bad_input(kafila("run", "--model", "no-such-model", "Hi"), "unknown model")


def test_json_on_synthetic_model_mixed_backends(synthetic_model):
    proc = kafila("run", "--model", synthetic_model, "--stages", "2", "--backend", "openvino,reference",
                  "--max-tokens", "6", "--raw", "--json", "abc")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "thinking", "tokens", "tok_s", "stages", "ids", "prompt_ids", "ttft_ms", "memory"}
    assert out["thinking"] is None  # only a harmony model thinks apart (tests/test_api_harmony.py)
    assert out["memory"]["peak_rss_bytes"] >= out["memory"]["rss_bytes"] > 0
    assert len(out["ids"]) == out["tokens"]  # EOS ends the decode and is not among the ids
    assert out["prompt_ids"] == [257]  # "abc" fed raw: merged into one token by the vocab's two merges
    assert out["tokens"] <= 6 and [s["blocks"] for s in out["stages"]] == [[0, 2], [2, 4]]
    assert [s["backend"] for s in out["stages"]] == ["openvino", "reference"]


QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def one_stage_answer(default_model_path) -> dict:
    """`kafila run --json` of the question on one stage, at the defaults."""
    proc = kafila("run", "--model", "smollm2-135m", "--max-tokens", "12", "--json", QUESTION)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.model
def test_default_model_three_stages(one_stage_answer):
    """Three stages answer with one stage's ids."""
    proc = kafila("run", "--model", "smollm2-135m", "--stages", "3", "--max-tokens", "12", "--json", QUESTION)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["stages"]) == 3 and out["ids"] == one_stage_answer["ids"] and out["text"].strip()


@pytest.mark.model
def test_streams_text(one_stage_answer):
    proc = kafila("run", "--stages", "2", "--max-tokens", "12", QUESTION)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == one_stage_answer["text"].strip() and "tok/s" in proc.stderr


@pytest.mark.model
def test_exact_form_at_f32_answers_paris(default_model_path):
    """At --precision f32 the default model computes on its exact weights: "Paris"."""
    proc = kafila("run", "--precision", "f32", "--stages", "2", "--max-tokens", "8", QUESTION)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_models_lists_the_default():
    proc = kafila("models", "--json")
    assert proc.returncode == 0
    rows = json.loads(proc.stdout)
    assert any(r["alias"] == "smollm2-135m" and r["default"] for r in rows)
