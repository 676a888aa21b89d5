"""The session's context from the model and the memory (issue 37 item 4), through the real CLI
processes: by default the model's own context (capped by what the members' memory holds at the
session's concurrency), so a 4k-context model answers a 3,000-token prompt with default flags
(a fixed 2048 gave HTTP 400); a --context the memory cannot hold is refused before serving,
exit 3, with the largest that fits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kafila.tooling.launch import LocalSession, stream_chat
from tests.synthetic_gguf import write_llama_gguf

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_4k_model_answers_a_3000_token_prompt_with_default_flags(tmp_path: Path) -> None:
    model = write_llama_gguf(tmp_path / "ctx4k.gguf", context_length=4096)
    (tmp_path / "logs").mkdir()
    session = LocalSession(members=2, model=model, cache_root=str(tmp_path / "cache"), log_dir=str(tmp_path / "logs"))
    session.start(timeout_s=300)
    try:
        prompt = "xyz " * 750  # byte-level tokens: one a byte, 3,000 and the template's few
        answer = stream_chat(session.api("m2"), prompt, 4, timeout_s=300)
        assert 3000 <= answer["prompt_tokens"] < 4096 and answer["tokens"] >= 1
    finally:
        session.stop()
    host_log = Path(session.proc("m1").log_path).read_text(errors="replace")
    assert "context 4096: ctx4k's own" in host_log  # the host says what it chose and why


@pytest.mark.slow
def test_a_context_memory_cannot_hold_is_refused_with_the_largest_that_fits(tmp_path: Path) -> None:
    """16M positions × 64 requests of this model's KV (512 B a position) is ~550 GB: no machine
    running the suite holds it, so the host refuses before serving and names what fits."""
    model = write_llama_gguf(tmp_path / "ctx16m.gguf", context_length=1 << 24)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "kafila", "host", "--model", model, "--expect", "1",
                          "--context", str(1 << 24), "--concurrency", "64", "--listen", "127.0.0.1:0",
                          "--api", "127.0.0.1:0", "--cache-dir", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=240, env=env, stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == 3, out.stderr[-2000:]
    line = [x for x in out.stderr.splitlines() if "does not fit" in x]
    assert line and f"--context {1 << 24} does not fit the members' memory at 64 requests at once" in line[-1]
    fits = int(line[-1].split("the largest that fits is ")[1].split()[0])
    assert 2 <= fits < 1 << 24
    assert "Traceback" not in out.stderr
