"""Ollama-compatible routes (/api/tags, /api/chat, /api/generate, /api/show, /api/version) over
real sockets with the scripted engine: the `ollama` Python client unchanged, NDJSON streaming,
and malformed requests answered with Ollama's `{"error": "..."}` and the right status.
The same client against a real 3-member session, at a member that is not the head, is in
tests/test_page.py (one session serves both)."""

from __future__ import annotations

import asyncio
import json

import ollama
import pytest

from kafila.api import ApiLimits, chat_prompt_ids, start_api
from tests.api_fixtures import LoopThread, ScriptedEngine, tokenizer  # noqa: F401 (fixture)
from tests.test_api_http import serve

MSGS = [{"role": "user", "content": "Tell me a story."}]
TIMING_FIELDS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
                 "eval_count", "eval_duration")  # fmt: skip


@pytest.fixture
def client(tokenizer):  # noqa: F811
    loop = LoopThread()
    engine = ScriptedEngine(tokenizer, context_length=512)
    server = loop.run(start_api(engine, "127.0.0.1", 0))
    yield engine, ollama.Client(host=server.url, timeout=30)
    loop.run(server.close())
    loop.close()


def answer(tok, messages, n):
    return tok.decode(ScriptedEngine.answer(chat_prompt_ids(tok, messages), n))


def test_ollama_client_lists_chats_and_generates(client, tokenizer):  # noqa: F811
    engine, api = client
    assert [m.model for m in api.list().models] == ["scripted"]
    want = answer(tokenizer, MSGS, 8)
    options = {"num_predict": 8, "temperature": 0, "seed": 3}

    r = api.chat(model="scripted", messages=MSGS, options=options)
    assert r.message.role == "assistant" and r.message.content == want
    assert r.done and r.done_reason == "length" and r.eval_count == 8
    assert r.prompt_eval_count == len(chat_prompt_ids(tokenizer, MSGS))
    assert engine.requests[-1].seed == 3 and engine.requests[-1].temperature == 0

    chunks = list(api.chat(model="scripted", messages=MSGS, options=options, stream=True))
    assert len(chunks) > 2 and not any(c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == want
    assert chunks[-1].message.content == "" and chunks[-1].eval_count == 8

    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once"}]
    g = api.generate(model="scripted", prompt="Once", system="Be brief.", options=options)
    assert g.response == answer(tokenizer, system, 8) and g.done_reason == "length"
    raw = "".join(c.response for c in api.generate(model="scripted", prompt="Once", raw=True,
                                                    options={"num_predict": 4}, stream=True))  # fmt: skip
    assert raw == tokenizer.decode(ScriptedEngine.answer(tokenizer.encode("Once"), 4))

    shown = api.show("scripted")
    assert shown.details.format == "gguf" and shown.modelinfo["kafila.context_length"] == 512


def test_streamed_ndjson_has_ollamas_shape(tokenizer):  # noqa: F811
    async def test(server, http):
        req = {"model": "scripted", "messages": MSGS, "options": {"num_predict": 5, "stop": ["zzz"]}}
        async with http.post("/api/chat", json=req) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("application/x-ndjson")
            lines = [json.loads(line) async for line in r.content if line.strip()]
        *pieces, last = lines
        for p in pieces:
            assert set(p) == {"model", "created_at", "message", "done"} and p["done"] is False
            assert p["message"]["role"] == "assistant" and p["created_at"].endswith("Z")
        assert last["done"] is True and last["done_reason"] == "length"
        assert all(isinstance(last[k], int) and last[k] >= 0 for k in TIMING_FIELDS)
        assert last["eval_count"] == 5
        assert "".join(p["message"]["content"] for p in pieces) == answer(tokenizer, MSGS, 5)
        async with http.get("/api/version") as r:
            v = await r.json()
        assert v["version"].count(".") == 2 and "kafila" in v
        # an empty conversation or prompt only "loads" the model, as Ollama answers
        async with http.post("/api/chat", json={"model": "scripted", "messages": []}) as r:
            body = await r.json()
        assert body["done"] is True and body["done_reason"] == "load"
        async with http.post("/api/generate", json={"model": "scripted"}) as r:
            assert (await r.json())["done_reason"] == "load"

    serve(ScriptedEngine(tokenizer), test)


def test_stop_sequences_and_eos_end_with_stop(tokenizer):  # noqa: F811
    full = answer(tokenizer, MSGS, 6)
    stop = full.split()[2]  # a word in the middle of the answer

    async def test(server, http):
        req = {"model": "scripted", "messages": MSGS, "stream": False,
               "options": {"num_predict": 6, "stop": [stop]}}  # fmt: skip
        async with http.post("/api/chat", json=req) as r:
            body = await r.json()
        assert body["done_reason"] == "stop" and stop not in body["message"]["content"]
        assert full.startswith(body["message"]["content"])

    serve(ScriptedEngine(tokenizer), test)


BAD = [  # (path, raw body, status, words the error names)
    ("/api/chat", b"", 400, "empty"),
    ("/api/chat", b"{not json", 400, "not valid JSON"),
    ("/api/chat", b"[1, 2]", 400, "JSON object"),
    ("/api/chat", {"messages": MSGS}, 400, "model is required"),
    ("/api/chat", {"model": 7, "messages": MSGS}, 400, "model must be a string"),
    ("/api/chat", {"model": "scripted", "messages": "hi"}, 400, "messages must be a list"),
    ("/api/chat", {"model": "scripted", "messages": [{"role": "bot", "content": "x"}]}, 400, "role"),
    ("/api/chat", {"model": "scripted", "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("/api/chat", {"model": "scripted", "messages": MSGS, "options": []}, 400, "options must be an object"),
    ("/api/chat", {"model": "scripted", "messages": MSGS, "options": {"num_predict": 0}}, 400, "num_predict"),
    ("/api/chat", {"model": "scripted", "messages": MSGS, "options": {"temperature": "hot"}}, 400,
     "options.temperature"),
    ("/api/chat", {"model": "scripted", "messages": MSGS, "options": {"stop": [1]}}, 400, "options.stop"),
    ("/api/chat", {"model": "scripted", "messages": MSGS, "stream": "yes"}, 400, "stream"),
    ("/api/chat", {"model": "scripted", "messages": MSGS, "format": "json"}, 400, "format"),
    ("/api/chat", {"model": "scripted", "messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/api/chat", {"model": "scripted", "messages": MSGS, "think": True}, 400, "thinking"),
    ("/api/chat", {"model": "scripted", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     400, "images"),
    ("/api/chat", {"model": "scripted", "messages": [{"role": "user", "content": "go " * 600}]}, 400,
     "context"),
    ("/api/generate", {"prompt": "hi"}, 400, "model is required"),
    ("/api/generate", {"model": "scripted", "prompt": ["hi"]}, 400, "prompt must be a string"),
    ("/api/generate", {"model": "scripted", "prompt": "hi", "context": [1, 2]}, 400, "context"),
    ("/api/generate", {"model": "scripted", "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("/api/generate", {"model": "scripted", "prompt": "hi", "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {"model": "scripted", "prompt": "hi", "options": {"num_predict": 1 << 20}}, 400,
     "num_predict"),
    ("/api/show", {}, 400, "model is required"),
    ("/api/chat", {"model": "nope", "messages": MSGS}, 404, "'scripted'"),
    ("/api/pull", {"model": "scripted"}, 404, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_malformed_requests_get_ollama_errors(tokenizer, path, body, status, words):  # noqa: F811
    async def test(server, http):
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.post(path, **kw) as r:
            assert r.status == status
            assert r.headers["Content-Type"].startswith("application/json")
            err = await r.json()
        assert set(err) == {"error"} and isinstance(err["error"], str), err
        assert words in err["error"], err
        assert engine.open_slots == 0 and not engine.requests

    engine = ScriptedEngine(tokenizer)
    serve(engine, test)


def test_method_size_and_readiness_errors_are_ollama_shaped(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer)

    async def test(server, http):
        async with http.get("/api/chat") as r:
            assert r.status == 405 and set(await r.json()) == {"error"}
        async with http.post("/api/chat", data=b"x" * 2048) as r:
            assert r.status == 413 and "larger than" in (await r.json())["error"]
        engine.is_ready = False
        async with http.post("/api/chat", json={"model": "scripted", "messages": MSGS}) as r:
            assert r.status == 503 and "not ready" in (await r.json())["error"]
            assert r.headers["Retry-After"]

    serve(engine, test, ApiLimits(max_body_bytes=1024))


def test_engine_failures_before_and_during_the_stream(client):
    engine, api = client
    engine.fail_after = 0  # fails before the first token: the HTTP status carries it
    with pytest.raises(ollama.ResponseError) as e:
        list(api.chat(model="scripted", messages=MSGS, stream=True))
    assert e.value.status_code == 503 and "m2 is gone" in e.value.error
    engine.fail_after = 2  # mid-stream: one {"error": ...} line, which the client raises
    with pytest.raises(ollama.ResponseError, match="m2 is gone"):
        list(api.chat(model="scripted", messages=MSGS, stream=True, options={"num_predict": 8}))
    with pytest.raises(ollama.ResponseError) as e:
        api.chat(model="gpt-4o", messages=MSGS)
    assert e.value.status_code == 404 and "not served here" in e.value.error


def test_a_client_that_leaves_mid_stream_frees_its_slot(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, context_length=4096, token_delay_s=0.02)

    async def test(server, http):
        req = {"model": "scripted", "messages": MSGS, "options": {"num_predict": 1000}}
        engine.slot_freed.clear()
        async with http.post("/api/chat", json=req) as r:
            assert r.status == 200
            await r.content.readline()  # the stream has begun
            assert engine.open_slots == 1
            r.connection.transport.abort()  # hang up as a killed client would
        await asyncio.wait_for(engine.slot_freed.wait(), 5)
        assert engine.open_slots == 0
        await asyncio.sleep(0.05)
        assert server.inflight == 0

    serve(engine, test)
