"""gpt-oss's harmony answers on the API: the analysis channel is the reply's thinking
(`reasoning_content`, Ollama's `thinking`), the final channel its content, as llama-server returns them.

The tokenizer is llama.cpp's qwen2 vocabulary with o200k_harmony's markers added as control tokens
(`<|return|>` the EOS), so the end-of-generation rules are the tokenizer's own: `<|end|>` ends a
message, not the answer. A scripted engine (tests/api_fixtures.py) speaks a fixed harmony answer:
the API's routing of tokens is the thing under test, not a model.
"""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from kafila.api import TextStream, start_api
from tests import llamacpp_files
from tests.api_fixtures import LoopThread, ScriptedEngine

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")  # fmt: skip
THINKING = "The user asks for the capital of France. It is Paris."
REPLY = "The capital of France is Paris."
ANSWER = (f"<|channel|>analysis<|message|>{THINKING}<|end|>"
          f"<|start|>assistant<|channel|>final<|message|>{REPLY}<|return|>")  # fmt: skip
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def harmony_tokenizer():
    from kafila.models.tokenizer import read_tokenizer_metadata, tokenizer_from_metadata

    try:
        md = dict(read_tokenizer_metadata(str(llamacpp_files.vocab_file("qwen2")), prefixes=("tokenizer.",)))
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"llama.cpp's vocabularies are not available: {exc}")
    n = len(md["tokenizer.ggml.tokens"])
    md["tokenizer.ggml.tokens"] = list(md["tokenizer.ggml.tokens"]) + list(MARKERS)
    md["tokenizer.ggml.token_type"] = list(md["tokenizer.ggml.token_type"]) + [3] * len(MARKERS)  # control
    md["tokenizer.ggml.eos_token_id"] = n + MARKERS.index("<|return|>")
    md["tokenizer.chat_template"] = TEMPLATE
    return tokenizer_from_metadata(md, "harmony")


def _answer_ids(tokenizer) -> list[int]:
    return tokenizer.encode(ANSWER, add_special=False, parse_special=True)


def _stream(tokenizer, ids, channels: bool, stops=()) -> tuple[str, str, str | None]:
    from kafila.engine import GenerationStats

    text = TextStream(tokenizer, stops, channels)
    reply, thinking = [], []
    for token in ids:
        r, t = text.push(token)
        reply.append(r)
        thinking.append(t)
        if text.finish:
            break
    tail, finish = text.end(GenerationStats(prompt_tokens=1))
    return "".join(reply) + tail, "".join(thinking), finish


def test_the_tokenizer_ends_a_harmony_answer_at_return_not_at_end(harmony_tokenizer):
    tok = harmony_tokenizer
    ids = _answer_ids(tok)
    assert tok.token_to_id("<|return|>") in tok.eos_ids and tok.token_to_id("<|end|>") not in tok.eos_ids
    assert ids[-1] == tok.token_to_id("<|return|>") and ids.count(tok.token_to_id("<|end|>")) == 1


def test_channels_split_thinking_from_the_reply(harmony_tokenizer):
    tok = harmony_tokenizer
    assert _stream(tok, _answer_ids(tok), channels=True) == (REPLY, THINKING, "stop")
    cut = _answer_ids(tok)[:-4]  # out of tokens mid-reply
    reply, thinking, finish = _stream(tok, cut, channels=True)
    assert REPLY.startswith(reply) and reply and thinking == THINKING and finish == "length"
    # without channels (a raw completion) the text is what the tokens spell, markers and all
    reply, thinking, _ = _stream(tok, _answer_ids(tok), channels=False)
    assert thinking == "" and THINKING in reply and REPLY in reply and "final" in reply
    # a stop sequence ends the reply only: thinking that contains it is not cut
    reply, thinking, finish = _stream(tok, _answer_ids(tok), channels=True, stops=("Paris",))
    assert (reply, thinking, finish) == ("The capital of France is ", THINKING, "stop")


def test_a_model_that_never_opens_a_channel_still_gets_its_text_out(harmony_tokenizer):
    """A header is bounded: text that never reaches <|message|> is the reply, not swallowed."""
    tok = harmony_tokenizer
    for plain in ("no channels here " * 40, "short"):  # past the header's bound, and ended inside it
        reply, thinking, _ = _stream(tok, tok.encode(plain, add_special=False), channels=True)
        assert (reply, thinking) == (plain, "")


@pytest.fixture
def served(harmony_tokenizer):
    loop = LoopThread()
    engine = ScriptedEngine(harmony_tokenizer, context_length=512, model_name="gpt-oss")
    ids = _answer_ids(harmony_tokenizer)
    engine.answer = lambda prompt_ids, n: ids[:n]
    server = loop.run(start_api(engine, "127.0.0.1", 0))
    yield server.url
    loop.run(server.close())
    loop.close()


def test_openai_chat_returns_reasoning_content_and_content(served):
    api = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=30)
    r = api.chat.completions.create(model="gpt-oss", messages=MSGS, max_tokens=200)
    message = r.choices[0].message
    assert (message.content, message.reasoning_content, r.choices[0].finish_reason) == (REPLY, THINKING, "stop")
    chunks = list(api.chat.completions.create(model="gpt-oss", messages=MSGS, max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == REPLY
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THINKING
    first_reply = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_reply:])  # thinking came first


def test_ollama_chat_returns_thinking(served):
    body = json.dumps({"model": "gpt-oss", "messages": MSGS, "stream": False}).encode()
    req = urllib.request.Request(f"{served}/api/chat", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        message = json.load(resp)["message"]
    assert (message["content"], message["thinking"]) == (REPLY, THINKING)


def test_kafila_chat_shows_the_thinking_then_the_reply_and_keeps_only_the_reply(served):
    import io

    from kafila.commands.chat import ApiClient, Chat, run_chat

    host, port = served.removeprefix("http://").rsplit(":", 1)
    chat = Chat(ApiClient(host, int(port)), "gpt-oss", None, 200)
    out = io.StringIO()
    assert run_chat(chat, iter(["What is the capital of France?\n"]), out, io.StringIO(), interactive=False) == 0
    assert out.getvalue() == f"thinking: {THINKING}\n{REPLY}\n"
    assert chat.history[-1] == {"role": "assistant", "content": REPLY}


def test_kafila_run_shows_the_thinking_then_the_reply(harmony_tokenizer):
    """`kafila run`'s answer (kafila/commands/run.py Answer) splits as `kafila chat` does; raw
    (--raw, --prompt-ids) it is what the tokens spell."""
    import io

    from kafila.commands.run import Answer

    out = io.StringIO()
    answer = Answer(harmony_tokenizer, channels=True, out=out)
    ids = _answer_ids(harmony_tokenizer)
    for token in ids[:-1]:  # the loop stops before the EOS (<|return|>)
        answer.push(token)
    answer.close()
    assert out.getvalue() == f"thinking: {THINKING}\n{REPLY}\n"
    assert (answer.text(), answer.thinking(), answer.tokens) == (REPLY, THINKING, ids[:-1])
    raw = Answer(harmony_tokenizer, channels=False, out=None)
    for token in ids[:-1]:
        raw.push(token)
    raw.close()
    assert raw.thinking() is None and raw.text() == harmony_tokenizer.decode(ids[:-1])
