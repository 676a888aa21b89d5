"""Ollama-compatible routes beside the OpenAI ones, on the same server and engine.

GET /api/version, GET /api/tags, POST /api/show, POST /api/chat, POST /api/generate. Streaming
(the default, as in Ollama) sends NDJSON: one object per piece of text with `"done": false`,
then one with `"done": true`, `done_reason` and the duration fields. Errors are Ollama's
`{"error": "..."}` with the HTTP status (400, 404, 503 …); once the stream has begun, an error
travels as one such line. Shapes and validation live in `_ollama` (pure).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

from kafila.api._ollama import (
    NDJSON_TYPE,
    OLLAMA_COMPAT_VERSION,
    Clock,
    OllamaShapes,
    generate_messages,
    parse_chat,
    parse_generate,
    tag,
)
from backends.errors import BadInput
from kafila.api._pieces import _END, text_pieces
from kafila.api._validate import Sampling, bad
from kafila.engine import EngineError

log = logging.getLogger("kafila.api")


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def _json(body: dict) -> web.Response:
    return web.json_response(body, dumps=lambda o: json.dumps(o, ensure_ascii=False))


class OllamaRoutes:
    """The /api/* handlers of one ApiServer (`server`: its engine, limits, slots, model names)."""

    def __init__(self, server) -> None:
        self.server = server
        self.started_s = time.time()  # reported as the model's modified_at

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/api/version", self.version)
        router.add_get("/api/tags", self.tags)
        router.add_post("/api/show", self.show)
        router.add_post("/api/chat", self.chat)
        router.add_post("/api/generate", self.generate)

    async def version(self, request: web.Request) -> web.Response:
        from kafila import __version__

        return _json({"version": OLLAMA_COMPAT_VERSION, "kafila": __version__})

    async def tags(self, request: web.Request) -> web.Response:
        names = self.server.names
        return _json({"models": [tag(names.id, self.started_s, {})] if names.id else []})

    async def show(self, request: web.Request) -> web.Response:
        body = await self.server._body(request)
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise bad("missing_field", "model is required (see GET /api/tags)", "model")
        self.server._check_model(name)
        engine = self.server.engine
        return _json({"modelfile": "", "parameters": "", "template": "",
                      "details": tag(self.server.names.id, self.started_s, {})["details"],
                      "model_info": {"kafila.context_length": engine.context_length,
                                     "kafila.aliases": list(self.server.names.aliases)},
                      "capabilities": ["completion"], "modified_at": tag("", self.started_s, {})["modified_at"]})  # fmt: skip

    async def chat(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        params = parse_chat(await server._body(request), server.limits)
        server._check_model(params.model)
        server._check_ready()
        shapes = OllamaShapes(True, params.model)
        if not params.messages:  # Ollama: "load" the model and answer at once
            return _json(shapes.final("", "load", None))
        from kafila.api._text import chat_prompt, tool_calls_for

        tokenizer = server.engine.tokenizer()
        tools = tool_calls_for(tokenizer, params.tools)
        try:
            ids, keep_at = await asyncio.to_thread(chat_prompt, tokenizer, list(params.messages), params.tools)
        except BadInput as exc:
            raise bad("invalid_messages", str(exc), "messages") from None
        return await self._run(request, shapes, ids, params.sampling, channels=True, tools=tools, keep_at=keep_at)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        params = parse_generate(await server._body(request), server.limits)
        server._check_model(params.model)
        server._check_ready()
        shapes = OllamaShapes(False, params.model)
        if not params.prompt and not params.system:
            return _json(shapes.final("", "load", None))
        tokenizer = server.engine.tokenizer()
        if params.raw:
            ids = await asyncio.to_thread(tokenizer.encode, params.prompt)
        else:
            from kafila.api._text import chat_prompt_ids

            try:
                ids = await asyncio.to_thread(chat_prompt_ids, tokenizer, generate_messages(params))
            except BadInput as exc:
                raise bad("invalid_prompt", str(exc), "prompt") from None
        return await self._run(request, shapes, ids, params.sampling, channels=not params.raw)

    # --- one generation --------------------------------------------------------------------------

    async def _run(
        self, request: web.Request, shapes: OllamaShapes, ids: list[int], sampling: Sampling,
        channels: bool, tools=None, keep_at: int = 0,
    ) -> web.StreamResponse:  # fmt: skip
        """One generation; `channels`: a chat template's answer (a harmony model's thinking apart);
        `tools`: the reader of its calls (_tools.ToolCalls) when tools were offered."""
        clock = Clock(time.perf_counter())
        default = self.server.limits.default_chat_max_tokens
        async with self.server.generation(ids, sampling, default, channels, tools, keep_at) as (gen, text, stats):
            if sampling.stream:
                return await self._stream(request, shapes, gen, text, stats, clock, len(ids))
            tick = lambda: clock.token(time.perf_counter())  # noqa: E731
            # EngineError goes to the middleware with its status
            pieces = [piece async for piece in text_pieces(await anext(gen, _END), gen, text, tick)]
            tail, finish = text.end(stats)
            durations = clock.durations(len(ids), text.tokens, time.perf_counter(), stats.extra.get("cached_tokens"))
            reply, thinking = ("".join(p[i] for p in pieces) for i in (0, 1))
            return _json(shapes.final(reply + tail, finish, durations, thinking, text.tool_calls))

    async def _stream(
        self, request: web.Request, shapes: OllamaShapes, gen, text, stats, clock: Clock, n_prompt: int
    ) -> web.StreamResponse:
        # As on the OpenAI routes: the first token before the headers, so that an engine that
        # fails at once answers with its HTTP status.
        token = await anext(gen, _END)
        resp = web.StreamResponse(headers={"Content-Type": NDJSON_TYPE, "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            async for reply, thinking in text_pieces(token, gen, text, lambda: clock.token(time.perf_counter())):
                await resp.write(_line(shapes.chunk(reply, thinking)))
            tail, finish = text.end(stats)
            if tail or text.tool_calls:
                await resp.write(_line(shapes.chunk(tail, tool_calls=text.tool_calls)))
            durations = clock.durations(n_prompt, text.tokens, time.perf_counter(), stats.extra.get("cached_tokens"))
            await resp.write(_line(shapes.final("", finish, durations)))
        except ConnectionResetError:  # the client hung up: generation()'s exit frees the slot
            log.debug("client left mid-stream")
        except EngineError as exc:
            await self._stream_error(resp, str(exc))
        except Exception as exc:  # after the headers went out, errors travel as a line
            log.exception("generation failed mid-stream")
            await self._stream_error(resp, f"internal error: {type(exc).__name__}: {exc}")
        return resp

    async def _stream_error(self, resp: web.StreamResponse, message: str) -> None:
        try:
            await resp.write(_line({"error": message}))
        except ConnectionResetError:
            pass
