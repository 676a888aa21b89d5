"""`kafila chat` against real API servers: a scripted engine, and `kafila serve` on the default model."""

from __future__ import annotations

import io
import socket
import subprocess
import sys

import pytest

from backends.errors import Refused
from kafila.api import chat_prompt_ids, start_api
from kafila.commands.chat import ApiClient, Chat, ChatError, run_chat
from tests.api_fixtures import LoopThread, ScriptedEngine, tokenizer  # noqa: F401 (fixture)


@pytest.fixture
def served(tokenizer):  # noqa: F811
    loop = LoopThread()
    engine = ScriptedEngine(tokenizer, context_length=4096)
    server = loop.run(start_api(engine, "127.0.0.1", 0))
    yield engine, server
    loop.run(server.close())
    loop.close()


def test_chat_streams_answers_and_keeps_the_history(served, tokenizer):  # noqa: F811
    engine, server = served
    client = ApiClient("127.0.0.1", server.port)
    assert client.models() == ["scripted"]
    chat = Chat(client, "scripted", system="Be brief.", max_tokens=5)
    out, err = io.StringIO(), io.StringIO()
    lines = iter(["Hello?\n", "\n", "And then?\n", "/reset\n", "Hi again\n", "/exit\n", "never\n"])
    assert run_chat(chat, lines, out, err, interactive=False) == 0

    history = [{"role": "system", "content": "Be brief."}]
    answers = []
    for request, question in zip(engine.requests, ["Hello?", "And then?"]):
        history.append({"role": "user", "content": question})
        assert request.prompt_ids == tuple(chat_prompt_ids(tokenizer, history))
        answers.append(tokenizer.decode(ScriptedEngine.answer(request.prompt_ids, 5)))
        history.append({"role": "assistant", "content": answers[-1]})
    after_reset = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi again"},
    ]
    assert engine.requests[2].prompt_ids == tuple(chat_prompt_ids(tokenizer, after_reset))
    assert len(engine.requests) == 3  # the blank line asked nothing; /exit ended the chat
    assert out.getvalue().splitlines()[:2] == answers
    assert "new conversation" in err.getvalue()


def test_chat_reports_api_errors_in_one_line(served):
    engine, server = served
    chat = Chat(ApiClient("127.0.0.1", server.port), "scripted", None, 5)
    engine.is_ready = False
    err = io.StringIO()
    run_chat(chat, iter(["Hello?\n"]), io.StringIO(), err, interactive=True)
    assert err.getvalue().count("\n") == 1 and "not ready" in err.getvalue()
    assert chat.history == []  # the failed turn is forgotten
    with pytest.raises(Refused, match="not ready"):
        run_chat(chat, iter(["Hello?\n"]), io.StringIO(), err, interactive=False)

    engine.is_ready, engine.fail_after = True, 2  # a member gone mid-answer
    with pytest.raises(ChatError, match="m2 is gone"):
        chat.turn("Hello?", io.StringIO())
    assert engine.open_slots == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_api_is_one_line_and_exit_3():
    port = free_port()
    with pytest.raises(ChatError, match=f"cannot reach the Kafila API at http://127.0.0.1:{port}"):
        ApiClient("127.0.0.1", port).models()
    proc = subprocess.run(
        [sys.executable, "-m", "kafila", "chat", "--api", f"127.0.0.1:{port}"],
        check=False, input="hi\n", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3
    assert proc.stderr.count("\n") == 1 and "cannot reach the Kafila API" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.model
def test_chat_against_kafila_serve_on_the_default_model(default_model_path):
    """`kafila chat` against a real engine: `kafila serve` on the default model. Each printed answer
    is what the server answers (greedy, non-streamed, through the OpenAI client) to the whole
    conversation so far, so the chat streamed it whole and sent the history; the second turn's
    answer without the history differs, so a chat that dropped the history would fail here."""
    import os
    import re
    import signal

    import openai

    turns = ["Name one fruit that is red.", "Which fruit did you just name? Answer in one word."]
    max_tokens = 16
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "kafila", "serve", "--api", "127.0.0.1:0", "--context", "512", "--slots", "1"]
    serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = serve.stdout.readline()  # printed once the API listens
        match = re.search(r"at http://(127\.0\.0\.1:\d+)/v1", line)
        assert match, (line, serve.stderr.read() if serve.poll() is not None else "")
        chat = subprocess.run([sys.executable, "-m", "kafila", "chat", "--api", match.group(1), "--max-tokens",
                               str(max_tokens)], input="\n".join(turns) + "\n", capture_output=True, text=True,
                              timeout=300, env=env)  # fmt: skip
        assert chat.returncode == 0, chat.stderr
        client = openai.OpenAI(base_url=f"http://{match.group(1)}/v1", api_key="none", max_retries=0, timeout=120)

        def answer(messages):
            r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=max_tokens)
            return r.choices[0].message.content

        history, want = [], []
        for turn in turns:
            history.append({"role": "user", "content": turn})
            want.append(answer(history))
            history.append({"role": "assistant", "content": want[-1]})
        assert chat.stdout == "".join(a + "\n" for a in want), (chat.stdout, want)
        alone = answer([{"role": "user", "content": turns[1]}])
        assert alone != want[1], "the second turn's answer does not need the history: choose other turns"
        serve.send_signal(signal.SIGINT)
        assert serve.wait(30) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
