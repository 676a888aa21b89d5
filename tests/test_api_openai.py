"""The `openai` Python client, unchanged, against the API (scripted engine, no model)."""

from __future__ import annotations

import openai
import pytest

from kafila.api import chat_prompt_ids, start_api
from tests.api_fixtures import LoopThread, ScriptedEngine, tokenizer  # noqa: F401 (fixture)

MSGS = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture
def client(tokenizer):  # noqa: F811
    loop = LoopThread()
    engine = ScriptedEngine(tokenizer, context_length=512)
    server = loop.run(start_api(engine, "127.0.0.1", 0))
    yield (
        engine,
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30),
    )
    loop.run(server.close())
    loop.close()


def test_openai_client_models_chat_and_completions(client, tokenizer):  # noqa: F811
    engine, api = client
    assert [m.id for m in api.models.list()] == ["scripted"]
    want = tokenizer.decode(ScriptedEngine.answer(chat_prompt_ids(tokenizer, MSGS), 8))

    r = api.chat.completions.create(
        model="scripted", messages=MSGS, max_tokens=8, temperature=0, seed=1
    )
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8

    stream = api.chat.completions.create(
        model="scripted",
        messages=MSGS,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 8

    ids = tokenizer.encode("Once")
    r = api.completions.create(model="scripted", prompt="Once", max_tokens=4, stop=["\n\n"])
    assert r.choices[0].text == tokenizer.decode(ScriptedEngine.answer(ids, 4))
    text = "".join(
        c.choices[0].text
        for c in api.completions.create(model="scripted", prompt="Once", max_tokens=4, stream=True)
    )
    assert text == r.choices[0].text
    assert engine.requests[0].temperature == 0 and engine.requests[0].seed == 1


def test_openai_client_raises_the_right_errors(client):
    engine, api = client
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.chat.completions.create(model="gpt-4o", messages=MSGS)
    with pytest.raises(openai.BadRequestError, match="context"):
        api.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "go " * 600}]
        )
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.chat.completions.create(model="scripted", messages=MSGS, max_tokens=0)
    engine.fail_after = 2
    with pytest.raises(openai.APIError, match="m2 is gone"):
        list(
            api.chat.completions.create(model="scripted", messages=MSGS, max_tokens=8, stream=True)
        )
    engine.fail_after, engine.is_ready = None, False
    with pytest.raises(openai.InternalServerError, match="not ready"):
        api.chat.completions.create(model="scripted", messages=MSGS)


def test_openai_client_sends_a_prompt_of_token_ids(client, tokenizer):  # noqa: F811
    """OpenAI's `prompt` as a list of token ids reaches the engine as those ids exactly (no BOS
    added, nothing re-tokenized), plain and streamed, also as a batch of one; ids outside the
    vocabulary, non-integers and an empty list are 400s."""
    engine, api = client
    ids = [tokenizer.vocab_size - 1, 0, *tokenizer.encode("Once upon", add_special=False)]
    r = api.completions.create(model="scripted", prompt=ids, max_tokens=5)
    assert list(engine.requests[-1].prompt_ids) == ids
    assert r.choices[0].text == tokenizer.decode(ScriptedEngine.answer(ids, 5))
    assert r.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model="scripted", prompt=[ids], max_tokens=5, stream=True))  # fmt: skip
    assert streamed == r.choices[0].text and list(engine.requests[-1].prompt_ids) == ids
    asked = len(engine.requests)
    for bad_prompt in ([tokenizer.vocab_size], [-1, 5], [1.5, 2], [True, 3], [], [[1, 2], [3]]):
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model="scripted", prompt=bad_prompt, max_tokens=2)
        assert err.value.body["param"] == "prompt", bad_prompt
    assert len(engine.requests) == asked  # none of them reached the engine
