"""Drafting at the origin member in a real session (`kafila host --speculate origin`): three
member processes on 127.0.0.1 with the default model at --precision f32. Grounded prompts typed at
every member (the two that are not the head among them), first each alone without speculation,
then all together speculating: every answer is the same text and length as without, and drafts
made at the requests' own members were used (origin steps > 0 in the answers' usage and in the
head's /status)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.default_model import needs_default_model
from tests.test_session_multiuser import at_once, status

pytestmark = [pytest.mark.session, pytest.mark.model, pytest.mark.slow, needs_default_model]

MAX_NEW = 40
GROUNDED = json.loads((Path(__file__).resolve().parents[1] / "bench" / "spec_prompts.json").read_text())["grounded"]


def chat(api: str, prompt: str, speculate: bool) -> dict:
    body = {"model": status(api)["session"]["model"], "temperature": 0, "max_tokens": MAX_NEW,
            "messages": [{"role": "user", "content": prompt}], "speculate": speculate}  # fmt: skip
    req = urllib.request.Request(api + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=240) as r:
        assert r.status == 200
        out = json.loads(r.read())
    return {"text": out["choices"][0]["message"]["content"], "tokens": out["usage"]["completion_tokens"],
            "speculation": out["usage"].get("speculation")}  # fmt: skip


def test_origin_drafts_are_used_and_the_answers_are_plain_decodings(tmp_path):
    from kafila.tooling.launch import LocalSession

    (tmp_path / "logs").mkdir()
    s = LocalSession(members=3, context=512, precision="f32", speculate="origin", latency_ms=40,
                     cache_root=str(tmp_path / "caches"), log_dir=str(tmp_path / "logs"))  # fmt: skip
    s.start(timeout_s=300)
    try:
        head = status(s.api("m1"))["plan"]["head"]
        others = [n for n in s.names if n != head]
        asks = [(others[i % 2] if i < 3 else head, GROUNDED[i]) for i in range(4)]  # m2/m3-side first
        plain = [chat(s.api(name), text, False) for name, text in asks]
        spec = at_once([(chat, s.api(name), text, True) for name, text in asks])
        session = status(s.api(head))["speculation"]
    finally:
        codes = s.stop()
    assert all(c in (0, -9) for c in codes.values()), codes
    assert [p["speculation"] for p in plain] == [None] * 4  # nothing speculated when asked not to
    for (name, _), a, b in zip(asks, plain, spec):
        assert (b["text"], b["tokens"]) == (a["text"], a["tokens"]), name
    away = [b["speculation"] for (name, _), b in zip(asks, spec) if name != head]
    assert sum(x.get("origin_steps", 0) for x in away) > 0, away  # drafts from m2/m3 were used
    assert sum(x["drafted"] for x in away) > 0
    assert session["mode"] == "origin" and session.get("origin_steps", 0) > 0, session
