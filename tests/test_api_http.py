"""The HTTP API over real sockets (127.0.0.1, port 0) with a scripted engine: formats,
streaming, errors and their status codes, slots freed when a client leaves. No model runs.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import pytest

from kafila.api import ApiLimits, chat_prompt_ids, start_api
from tests.api_fixtures import ScriptedEngine, tokenizer  # noqa: F401 (fixture)

MSGS = [{"role": "user", "content": "Say something."}]


def serve(engine, test, limits=None):
    """Run `await test(server, http)` against a server on a free port, then stop it."""

    async def main():
        server = await start_api(engine, "127.0.0.1", 0, limits)
        try:
            async with aiohttp.ClientSession(base_url=server.url) as http:
                return await asyncio.wait_for(test(server, http), 30)
        finally:
            await server.close()

    return asyncio.run(main())


async def sse_events(resp) -> list:
    """The `data:` payloads of a server-sent event stream, JSON-decoded except [DONE]."""
    events = []
    async for line in resp.content:
        line = line.decode().rstrip("\n")
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def expected_text(tok, messages, n):
    ids = chat_prompt_ids(tok, messages)
    return tok.decode(ScriptedEngine.answer(ids, n)), len(ids)


def test_models(tokenizer):  # noqa: F811
    async def test(server, http):
        async with http.get("/v1/models") as r:
            assert r.status == 200
            body = await r.json()
        assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["scripted"]
        async with http.get("/v1/models/scripted") as r:
            assert r.status == 200 and (await r.json())["id"] == "scripted"
        async with http.get("/v1/models/gpt-4") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        async with http.get("/status") as r:
            body = await r.json()
            assert body["ready"] is True and body["api"]["inflight_requests"] == 0

    serve(ScriptedEngine(tokenizer), test)


def test_chat_whole_and_streamed_agree(tokenizer):  # noqa: F811
    want, n_prompt = expected_text(tokenizer, MSGS, 7)

    async def test(server, http):
        req = {"model": "scripted", "messages": MSGS, "max_tokens": 7}
        async with http.post("/v1/chat/completions", json=req) as r:
            assert r.status == 200
            body = await r.json()
        assert body["object"] == "chat.completion"
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": want}
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": n_prompt,
            "completion_tokens": 7,
            "total_tokens": n_prompt + 7,
        }

        stream = {**req, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post("/v1/chat/completions", json=stream) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = await sse_events(r)
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]
        assert all(
            c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks
        )
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert len(chunks) > 3  # streamed piece by piece, not in one go
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7

    serve(ScriptedEngine(tokenizer), test)


def test_completions(tokenizer):  # noqa: F811
    ids = tokenizer.encode("Once upon a time")
    want = tokenizer.decode(ScriptedEngine.answer(ids, 16))

    async def test(server, http):
        req = {"model": "scripted", "prompt": "Once upon a time"}
        async with http.post("/v1/completions", json=req) as r:
            body = await r.json()
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == want  # 16 tokens: OpenAI's default max_tokens
        assert body["usage"]["prompt_tokens"] == len(ids)
        async with http.post("/v1/completions", json={**req, "stream": True}) as r:
            events = await sse_events(r)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
        async with http.post(
            "/v1/completions", json={"model": "scripted", "prompt": ids, "max_tokens": 3}
        ) as r:
            assert (await r.json())["choices"][0]["text"] == tokenizer.decode(
                ScriptedEngine.answer(ids, 3)
            )

    serve(ScriptedEngine(tokenizer), test)


def test_eos_and_stop_sequences_end_the_answer(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, eos_after=3)
    want, _ = expected_text(tokenizer, MSGS, 3)

    async def test(server, http):
        req = {"model": "scripted", "messages": MSGS, "max_tokens": 50}
        async with http.post("/v1/chat/completions", json=req) as r:
            choice = (await r.json())["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (want, "stop")

        engine.eos_after = None
        full, _ = expected_text(tokenizer, MSGS, 12)
        stop = full.split()[4]  # a word in the middle of the answer
        for stream in (False, True):
            async with http.post(
                "/v1/chat/completions", json={**req, "stop": [stop], "stream": stream}
            ) as r:
                if stream:
                    events = await sse_events(r)
                    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
                    finish = events[-2]["choices"][0]["finish_reason"]
                else:
                    choice = (await r.json())["choices"][0]
                    text, finish = choice["message"]["content"], choice["finish_reason"]
            assert (text, finish) == (full[: full.index(stop)], "stop")
        assert engine.open_slots == 0  # the rest of the generation was cancelled

    serve(engine, test)


async def post_raw(http, path, data, headers=None):
    async with http.post(
        path, data=data, headers=headers or {"Content-Type": "application/json"}
    ) as r:
        body = await r.json(content_type=None)
        return r.status, body


def test_bad_requests_get_the_right_status_and_error_json(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, context_length=64)
    limits = ApiLimits(max_body_bytes=4096)
    cases = [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", b"", 400, "invalid_json"),
        ("/v1/chat/completions", json.dumps({"messages": MSGS}), 400, "missing_field"),
        ("/v1/chat/completions", json.dumps({"model": "scripted"}), 400, "missing_field"),
        ("/v1/completions", json.dumps({"model": "scripted"}), 400, "missing_field"),
        ("/v1/chat/completions", json.dumps({"model": "gpt-4o", "messages": MSGS}), 404, "model_not_found"),
        ("/v1/completions", json.dumps({"model": "gpt-4o", "prompt": "x"}), 404, "model_not_found"),
        ("/v1/chat/completions", json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "x" * 5000}]}), 413, "body_too_large"),
        ("/v1/chat/completions", json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "word " * 200}]}), 400, "context_length_exceeded"),
        ("/v1/completions", json.dumps({"model": "scripted", "prompt": [5] * 64}), 400, "context_length_exceeded"),
        ("/v1/completions", json.dumps({"model": "scripted", "prompt": "hi", "max_tokens": 64}), 400, "context_length_exceeded"),
        ("/v1/completions", json.dumps({"model": "scripted", "prompt": "hi", "max_tokens": 0}), 400, "invalid_value"),
        ("/v1/completions", json.dumps({"model": "scripted", "prompt": "hi", "max_tokens": 10**6}), 400, "invalid_value"),
        ("/v1/completions", json.dumps({"model": "scripted", "prompt": [10**7]}), 400, "invalid_value"),
        ("/v1/completions", json.dumps({"model": "scripted", "prompt": ""}), 400, "empty_prompt"),
        ("/v1/nothing", b"{}", 404, "not_found"),
    ]  # fmt: skip

    async def test(server, http):
        for path, data, status, code in cases:
            got_status, body = await post_raw(http, path, data)
            assert (got_status, body["error"]["code"]) == (status, code), (path, data[:80])
            assert set(body["error"]) >= {"message", "type", "code"} and body["error"]["message"]
        _, body = await post_raw(
            http, "/v1/completions", json.dumps({"model": "scripted", "prompt": [5] * 64})
        )
        assert "64 tokens" in body["error"]["message"] and "64" in body["error"]["message"]
        async with http.get("/v1/chat/completions") as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
        assert engine.requests == []  # nothing bad reached the engine

    serve(engine, test, limits)


def test_not_ready_is_503(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer)
    engine.is_ready = False

    async def test(server, http):
        for stream in (False, True):
            req = {"model": "scripted", "messages": MSGS, "stream": stream}
            async with http.post("/v1/chat/completions", json=req) as r:
                assert r.status == 503 and r.headers["Retry-After"]
                assert (await r.json())["error"]["code"] == "not_ready"
        async with http.get("/v1/models") as r:
            assert r.status == 200  # what is served is known before the session is ready

    serve(engine, test)


def test_engine_failure_before_and_during_generation(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer)

    async def test(server, http):
        req = {"model": "scripted", "messages": MSGS, "max_tokens": 10}
        engine.fail_after = 0
        for stream in (False, True):  # nothing streamed yet: a plain HTTP error
            async with http.post("/v1/chat/completions", json={**req, "stream": stream}) as r:
                assert r.status == 503
                assert "m2 is gone" in (await r.json())["error"]["message"]
        engine.fail_after = 3
        async with http.post("/v1/chat/completions", json={**req, "stream": True}) as r:
            assert r.status == 200
            events = await sse_events(r)
        assert "m2 is gone" in events[-1]["error"]["message"] and "[DONE]" not in events
        assert engine.open_slots == 0 and server.inflight == 0

    serve(engine, test)


def test_client_leaving_mid_stream_frees_its_slot(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, context_length=4096, token_delay_s=0.02)

    async def test(server, http):
        req = {"model": "scripted", "messages": MSGS, "max_tokens": 1000, "stream": True}
        for _ in range(2):
            engine.slot_freed.clear()
            async with http.post("/v1/chat/completions", json=req) as r:
                await r.content.readline()  # the stream has begun
                await r.content.readline()
                assert engine.open_slots == 1
                r.connection.transport.abort()  # hang up as a killed client would
            await asyncio.wait_for(engine.slot_freed.wait(), 5)
            assert engine.open_slots == 0
        await asyncio.sleep(0.05)
        assert server.inflight == 0
        async with http.get("/status") as r:
            assert (await r.json())["open_slots"] == 0

    serve(engine, test)


def test_client_leaving_a_whole_request_frees_its_slot(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, context_length=4096, token_delay_s=0.02)

    async def test(server, http):
        req = {"model": "scripted", "messages": MSGS, "max_tokens": 1000}
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(http.post("/v1/chat/completions", json=req), 0.2)
        await asyncio.wait_for(engine.slot_freed.wait(), 5)
        assert engine.open_slots == 0

    serve(engine, test)


def test_too_many_requests_in_flight_is_429(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, context_length=4096, token_delay_s=0.02)

    async def test(server, http):
        req = {"model": "scripted", "messages": MSGS, "max_tokens": 20, "stream": True}
        async with http.post("/v1/chat/completions", json=req) as first:
            await first.content.readline()
            async with http.post("/v1/chat/completions", json=req) as second:
                assert second.status == 429 and second.headers["Retry-After"] == "2"
                assert (await second.json())["error"]["type"] == "rate_limit_error"
            await sse_events(first)
        async with http.post("/v1/chat/completions", json=req) as third:
            assert third.status == 200

    serve(engine, test, ApiLimits(max_inflight_requests=1))


def test_concurrent_requests_each_get_their_own_answer(tokenizer):  # noqa: F811
    engine = ScriptedEngine(tokenizer, token_delay_s=0.005)
    prompts = [[{"role": "user", "content": f"Question number {i}"}] for i in range(6)]

    async def one(http, messages, stream):
        req = {"model": "scripted", "messages": messages, "max_tokens": 9, "stream": stream}
        async with http.post("/v1/chat/completions", json=req) as r:
            if stream:
                events = await sse_events(r)
                return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
            return (await r.json())["choices"][0]["message"]["content"]

    async def test(server, http):
        got = await asyncio.gather(*(one(http, m, i % 2 == 0) for i, m in enumerate(prompts)))
        assert got == [expected_text(tokenizer, m, 9)[0] for m in prompts]

    serve(engine, test)


def test_deeply_nested_json_is_400_not_500(tokenizer):  # noqa: F811
    """100,000 '[' once reached the JSON parser's recursion limit: a 500 from a bad request."""

    async def test(server, http):
        for raw in (b"[" * 100_000, b'{"model": "scripted", "messages": ' + b"[" * 40 + b"]" * 40 + b"}"):
            async with http.post("/v1/chat/completions", data=raw,
                                 headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                assert r.status == 400, await r.text()
                assert "nests deeper" in (await r.json())["error"]["message"]

    serve(ScriptedEngine(tokenizer), test)


def test_a_body_that_never_arrives_is_408_and_frees_the_handler(tokenizer):  # noqa: F811
    """Headers announce a body that is never sent: the handler gives up (408), not for ever."""

    async def test(server, http):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        assert b" 408 " in status_line, status_line
        async with http.get("/v1/models") as r:  # the server still answers
            assert r.status == 200

    serve(ScriptedEngine(tokenizer), test, ApiLimits(body_timeout_s=0.5))


# --- issue 15 item 5: what a web page, a slow client and a crowd of connections can do ----------

CHAT = json.dumps({"model": "scripted", "messages": MSGS, "max_tokens": 3}).encode()


def test_a_browser_post_must_be_json_while_curl_and_the_sdks_still_work(tokenizer):  # noqa: F811
    """A page could post a prompt as text/plain (no CORS preflight); a browser's POST (Origin or
    Sec-Fetch-Site) must now be application/json. Plain clients are not browsers: the README's
    `curl ... -d '{...}'` (x-www-form-urlencoded), the openai and the ollama clients all pass."""
    import ollama
    import openai

    async def test(server, http):
        own = f"http://127.0.0.1:{server.port}"  # the member's own page passes the Origin guard
        refused = [{"Origin": own, "Content-Type": "text/plain"},
                   {"Origin": own, "Content-Type": "multipart/form-data; boundary=x"},
                   {"Origin": own, "Content-Type": "application/x-www-form-urlencoded"},
                   {"Origin": own},  # fetch() with a Blob body sends no type, and no preflight
                   {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"}]  # fmt: skip
        for path in ("/v1/chat/completions", "/api/chat"):
            for headers in refused:
                async with http.post(path, data=CHAT, headers=headers, skip_auto_headers=["Content-Type"]) as r:
                    body = await r.json()
                    assert r.status == 415, (path, headers, body)
                    msg = body["error"] if path.startswith("/api/") else body["error"]["message"]
                    assert "application/json" in msg
            for headers in ({"Origin": own, "Content-Type": "application/json; charset=utf-8"},
                            {"Sec-Fetch-Site": "same-origin", "Content-Type": "application/json"},
                            {"Content-Type": "application/x-www-form-urlencoded"},
                            {"Content-Type": "text/plain"}, {}):  # fmt: skip
                async with http.post(path, data=CHAT, headers=headers, skip_auto_headers=["Content-Type"]) as r:
                    assert r.status == 200, (path, headers, await r.text())
        for path in ("/v1/chat/completions", "/api/chat"):  # as the README writes it
            curl = await asyncio.create_subprocess_exec(
                "curl", "-s", "-w", "\n%{http_code}", f"{server.url}{path}", "-d", CHAT.decode(),
                stdout=asyncio.subprocess.PIPE)  # fmt: skip
            out, _ = await curl.communicate()
            assert out.decode().rsplit("\n", 1)[1] == "200", out

        def sdks():
            openai_text = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").chat.completions.create(
                model="scripted", messages=MSGS, max_tokens=3).choices[0].message.content  # fmt: skip
            ollama_text = ollama.Client(host=server.url).chat(
                model="scripted", messages=MSGS, options={"num_predict": 3}).message.content
            return openai_text, ollama_text

        openai_text, ollama_text = await asyncio.to_thread(sdks)
        assert openai_text == ollama_text == expected_text(tokenizer, MSGS, 3)[0]

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    serve(ScriptedEngine(tokenizer), test)


def test_request_headers_that_never_complete_are_cut_off(tokenizer):  # noqa: F811
    """Half a request line, then nothing: the connection was held for ever (aiohttp waits
    an hour); now it is closed after header_timeout_s, and the server goes on answering."""

    async def test(server, http):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0")
        await writer.drain()
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        assert 0.4 <= asyncio.get_running_loop().time() - t0 < 5
        writer.close()
        async with http.get("/v1/models") as r:
            assert r.status == 200

    serve(ScriptedEngine(tokenizer), test, ApiLimits(header_timeout_s=0.5))


def test_connections_past_the_cap_get_a_503_and_the_rest_are_served(tokenizer):  # noqa: F811
    """Connections that sent a whole request fill the cap: one more gets a 503."""
    async def test(server, http):
        busy = []
        for _ in range(3):  # each with a request in progress (a body that has not come yet)
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{")
            busy.append((r, w))
        for _ in range(200):
            if server.connections == 3 and not server.silent:
                break
            await asyncio.sleep(0.01)
        assert server.connections == 3 and not server.silent
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head, _, body = (await asyncio.wait_for(reader.read(), 5)).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After" in head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        writer.close()
        assert server.connections == 3  # the refused one was never counted
        for _, w in busy:
            w.close()
        for _ in range(100):
            if server.connections == 0:
                break
            await asyncio.sleep(0.01)
        async with http.get("/v1/models") as r:  # room again
            assert r.status == 200

    serve(ScriptedEngine(tokenizer), test, ApiLimits(max_connections=3))


def test_silent_connections_make_room_for_a_request(tokenizer):  # noqa: F811
    """Connections that never sent a whole request hold at most SILENT_SHARE of the slots: a new
    connection evicts the oldest of them, so idle sockets cannot keep a client out."""
    async def test(server, http):
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(8)]
        for _ in range(200):
            if server.evicted >= 5:
                break
            await asyncio.sleep(0.01)
        assert server.connections == len(server.silent) == 3 and server.evicted == 5  # 4 slots, 3 silent at most
        async with http.get("/v1/models") as r:  # served, not refused
            assert r.status == 200
        closed = [await asyncio.wait_for(r.read(), 2) == b"" for r, _ in idle[:5]]
        assert all(closed), closed  # the oldest silent ones were closed
        for _, w in idle:
            w.close()
        # at the cap, with two requests in progress and two silent connections: a new one still gets in
        busy = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        for _, w in busy:
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{")
        for _ in range(200):
            if server.connections == 2 and not server.silent:
                break
            await asyncio.sleep(0.01)
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        for _ in range(200):
            if server.connections == 4:
                break
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200 ")
        for _, w in [*busy, *idle, (reader, writer)]:
            w.close()

    serve(ScriptedEngine(tokenizer), test, ApiLimits(max_connections=4))
