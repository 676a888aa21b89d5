"""The HTTP API every member serves, over any `kafila.engine.Engine`.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions
(both with `stream: true` → server-sent events ending `data: [DONE]`), GET /status; the
session page at GET / (`_page`); Ollama's /api/tags, /api/chat, /api/generate, /api/show and
/api/version (`_ollama_routes`). Requests are validated in `_validate` and `_ollama` (pure);
every request passes `_guard` (Host and Origin; a browser's POST must be JSON) first; this
module only moves bytes and tokens. Connections are bounded in number (`max_connections`: one
more gets a 503) and in how long their request headers may take (`header_timeout_s`).
Errors leave in the shape of the route family: OpenAI's JSON, or Ollama's `{"error": "..."}`
under /api/.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from kafila.api._errors import ApiError, error_body
from kafila.api._format import Shapes, model_card, model_list, sse
from kafila.api._guard import content_type_refusal, own_names, refusal
from kafila.api._limits import DEFAULT_API_HOST, DEFAULT_API_PORT, ApiLimits
from kafila.api._names import ModelNames, names_for
from kafila.api._text import TextStream, chat_prompt, tool_calls_for
from kafila.api._think import think_mode
from kafila.api._tools import ToolCalls
from kafila.api._pieces import _END, text_pieces
from kafila.api._validate import (
    Sampling,
    bad,
    decode_json,
    parse_chat,
    parse_completion,
    token_budget,
)
from backends.errors import BadInput, KafilaError
from kafila.engine import Engine, EngineError, GenerationRequest, GenerationStats
from rendezvous.quiet import BoundedLog, fd_share, quiet_accept_errors

log = logging.getLogger("kafila.api")

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
NOT_READY_RETRY_S = 5
# a full queue (429): a slot frees when any request ends, which on a home ring is seconds away
QUEUE_FULL_RETRY_S = 2
RETRY_AFTER_S = {503: NOT_READY_RETRY_S, 429: QUEUE_FULL_RETRY_S}


def _json(body: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.json_response(
        body, status=status, headers=headers, dumps=lambda o: json.dumps(o, ensure_ascii=False)
    )


def _error_response(
    status: int, code: str, message: str, param: str | None = None, ollama: bool = False
) -> web.Response:
    retry = RETRY_AFTER_S.get(status)
    headers = {"Retry-After": str(retry)} if retry is not None else None
    body = {"error": message} if ollama else error_body(status, code, message, param)
    return _json(body, status=status, headers=headers)


def _is_ollama(request: web.Request) -> bool:
    return request.path.startswith("/api/")


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
FULL_LINGER_S = 2.0  # a connection over the cap: how long its 503 waits for the client to close
FD_SHARE = 0.25  # of the fds above quiet.FD_RESERVE (the embedded rendezvous takes half)
# connections that have sent nothing yet may hold at most this share of the slots: the rest stay
# for requests in progress, and a new connection evicts the oldest silent one past it
SILENT_SHARE = 0.75  # "sent nothing": no whole request yet (a slowloris' half header included)


class _Counted(asyncio.Protocol):
    """aiohttp's handler for one connection, counted while it is open (ApiServer.connections)."""

    def __init__(self, inner: asyncio.Protocol, server: ApiServer) -> None:
        self.inner, self.server = inner, server
        self.transport = None
        server.connections += 1

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.silent[id(transport)] = self
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self.server.connections -= 1
        self.server.silent.pop(id(self.transport), None)
        self.inner.connection_lost(exc)


class _Full(asyncio.Protocol):
    """A connection past max_connections: a 503 with the error JSON, then closed. What the client
    sends is read and dropped until it closes (closing on unread bytes would reset the 503)."""

    def __init__(self, limit: int) -> None:
        body = json.dumps(error_body(503, "too_many_connections", f"{limit} connections are open "
                                     "already; try again shortly")).encode()  # fmt: skip
        self.response = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                         % (NOT_READY_RETRY_S, len(body), body))  # fmt: skip
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        transport.write(self.response)
        transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(FULL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()


async def _aclose(gen: AsyncIterator[int]) -> None:
    close = getattr(gen, "aclose", None)
    if close is not None:
        await close()


class ApiServer:
    """One member's HTTP API over `engine`; `start()` binds it, `close()` stops it."""

    def __init__(self, engine: Engine, limits: ApiLimits | None = None) -> None:
        self.engine = engine
        self.limits = limits or ApiLimits()
        self.inflight = 0  # generation requests admitted and not yet finished
        self.connections = 0  # open HTTP connections (at most max_connections)
        # the cap: the limits', and never more than a share of the fd limit (accept must not fail)
        self.max_connections = min(self.limits.max_connections, fd_share(FD_SHARE))
        self.silent: dict[int, _Counted] = {}  # connections with no whole request yet, oldest first
        self.evicted = 0
        # a bad request (a URL or header over 8 KB, a bad Content-Length) is refused by aiohttp
        # before any route or guard: one line per cause a minute, tracebacks only with --debug
        self.quiet = BoundedLog(log)
        # the host's session code (kafila.net.host_codes.HostCodes: .code, renew()); None elsewhere
        self.codes = None
        self.host: str | None = None
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._names = ModelNames("", ())
        self.own_names = own_names()  # the Host names (besides IPs and localhost) allowed in

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.limits.max_body_bytes, middlewares=[self._errors]
        )
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/status", self.status)
        app.router.add_post("/admin/new-code", self.new_code)
        from kafila.api._ollama_routes import OllamaRoutes
        from kafila.api._page import add_page_routes

        OllamaRoutes(self).add_to(app.router)
        add_page_routes(app.router)
        return app

    async def start(self, host: str = DEFAULT_API_HOST, port: int = DEFAULT_API_PORT) -> None:
        # handler_cancellation: a client that hangs up cancels its handler, and so its generation;
        # keepalive_timeout: aiohttp closes a connection still waiting for a request's headers
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, logger=self.quiet,
                               keepalive_timeout=self.limits.header_timeout_s)  # fmt: skip
        quiet_accept_errors(asyncio.get_running_loop(), self.quiet)
        await runner.setup()
        self._runner = runner
        try:  # our own listener (aiohttp's low-level server as the protocol): it counts connections
            self._listener = await asyncio.get_running_loop().create_server(self._connection, host, port)
        except OSError as exc:
            await self.close()
            raise BadInput(f"cannot serve the API on {host}:{port}: {exc.strerror or exc}; "
                           "pass --api HOST:PORT with a free port") from None  # fmt: skip
        self.host, self.port = self._listener.sockets[0].getsockname()[:2]
        if not _is_loopback(host):
            log.warning(
                "the API on %s:%s has no authentication: anyone who can reach it can use the model",
                host,
                self.port,
            )

    def _connection(self) -> asyncio.Protocol:
        assert self._runner is not None and self._runner.server is not None
        evict = bool(self.silent) and (self.connections >= self.max_connections
                                       or len(self.silent) >= self.max_connections * SILENT_SHARE)
        if evict:  # the oldest silent connection makes room (its count drops when its close lands)
            oldest = self.silent.pop(next(iter(self.silent)))
            self.evicted += 1
            self.quiet.note("evicted", f"{len(self.silent) + 1} API connections sent no whole request; "
                            "closing the oldest to keep slots for requests", level=logging.INFO)  # fmt: skip
            if oldest.transport is not None:
                oldest.transport.close()
        elif self.connections >= self.max_connections:
            self.quiet.note("full", f"{self.max_connections} API connections are open; refusing more (503)")
            return _Full(self.max_connections)
        return _Counted(self._runner.server(), self)

    async def close(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # --- routes ---------------------------------------------------------------------------

    @property
    def names(self) -> ModelNames:
        """The served model's id and the other names it answers to (alias, file name)."""
        if self._names.id != self.engine.model_name:  # a session names its model once it forms
            self._names = names_for(self.engine.model_name)
        return self._names

    def model_names(self) -> tuple[str, ...]:
        return self.names.all

    async def models(self, request: web.Request) -> web.Response:
        return _json(model_list(self.names))

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return _json(model_card(self.names))

    async def status(self, request: web.Request) -> web.Response:
        body = dict(self.engine.status())
        body.setdefault("api", {"url": self.url, "inflight_requests": self.inflight})
        if self.codes is not None and _from_loopback(request):  # the code is a secret: this machine only
            body["code"] = self.codes.code
        return _json(body)

    async def new_code(self, request: web.Request) -> web.Response:
        """The host closes its session code and opens a fresh one (members stay): this machine only."""
        if self.codes is None:
            raise web.HTTPNotFound()
        if not _from_loopback(request):
            raise ApiError(403, "forbidden", "a new session code is given only to this machine (loopback)")
        try:
            return _json({"code": await self.codes.renew()})
        except KafilaError as exc:
            raise ApiError(503, "not_ready", str(exc)) from None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        params = parse_chat(await self._body(request), self.limits)
        self._check_model(params.model)
        self._check_ready()
        tokenizer = self.engine.tokenizer()
        tools = tool_calls_for(tokenizer, params.tools)
        try:
            ids, keep_at = await asyncio.to_thread(chat_prompt, tokenizer, list(params.messages), params.tools)
        except BadInput as exc:
            raise bad("invalid_messages", str(exc), "messages") from None
        default = self.limits.default_chat_max_tokens
        return await self._generate(
            request, Shapes(True, params.model), ids, params.sampling, default, tools, keep_at
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        params = parse_completion(await self._body(request), self.limits)
        self._check_model(params.model)
        self._check_ready()
        tokenizer = self.engine.tokenizer()
        if isinstance(params.prompt, str):
            ids = await asyncio.to_thread(tokenizer.encode, params.prompt)
        else:
            ids = list(params.prompt)
            vocab = _vocab_size(tokenizer)
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise bad(
                    "invalid_value", f"prompt token ids must be from 0 to {vocab - 1}", "prompt"
                )
        default = self.limits.default_completion_max_tokens
        return await self._generate(
            request, Shapes(False, params.model), ids, params.sampling, default
        )

    # --- the shared path of both generation routes ---------------------------------------------

    async def _body(self, request: web.Request) -> dict:
        if (
            request.content_length is not None
            and request.content_length > self.limits.max_body_bytes
        ):
            raise self._too_large()
        try:
            # a client that sends its body slowly, or never, may not hold a handler for ever
            raw = await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large() from None
        except TimeoutError:
            raise ApiError(408, "body_timeout", f"the request body did not arrive within "
                           f"{self.limits.body_timeout_s:g} s") from None  # fmt: skip
        return decode_json(raw)

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            "body_too_large",
            f"the request body is larger than {self.limits.max_body_bytes} bytes",
        )

    def _check_model(self, name: str) -> None:
        if not self.names.accepts(name):
            raise ApiError(
                404,
                "model_not_found",
                f"model {name!r} is not served here; this session serves {self.names.served()}",
                "model",
            )

    def _check_ready(self) -> None:
        if not self.engine.ready:
            raise ApiError(
                503,
                "not_ready",
                "the session is not ready (forming or degraded); try again shortly",
            )

    @contextlib.asynccontextmanager
    async def generation(self, ids: list[int], sampling: Sampling, default: int, channels: bool = False,
                         tools: ToolCalls | None = None, keep_at: int = 0):  # fmt: skip
        """Admit one generation (bounds, slots) → (token iterator, TextStream, stats); on exit,
        however it ends, the engine stops its work on the request and frees its slot. `keep_at`:
        where a chat's messages end (GenerationRequest.keep_at)."""
        if not ids:
            raise bad("empty_prompt", "the prompt is empty", "prompt")
        budget = token_budget(len(ids), sampling.max_tokens, default, self.engine.context_length)
        if self.inflight >= self.limits.max_inflight_requests:
            raise ApiError(
                429,
                "too_many_requests",
                f"{self.inflight} requests are already waiting or running; try again shortly",
            )
        job = GenerationRequest(
            prompt_ids=tuple(ids), max_new_tokens=budget, stop_at_eos=True,
            temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
            speculate=sampling.speculate, keep_at=keep_at,
        )  # fmt: skip
        stats = GenerationStats(prompt_tokens=len(ids))
        tokenizer = self.engine.tokenizer()
        think = think_mode(tokenizer, ids) if channels else None  # a chat's <think> block apart
        text = TextStream(tokenizer, sampling.stop, channels, tools, think)
        self.inflight += 1
        gen = self.engine.generate(job, stats)
        try:
            yield gen, text, stats
        finally:
            self.inflight -= 1
            await _aclose(gen)

    async def _generate(
        self, request: web.Request, shapes: Shapes, ids: list[int], sampling: Sampling, default: int,
        tools: ToolCalls | None = None, keep_at: int = 0,
    ) -> web.StreamResponse:  # fmt: skip
        async with self.generation(ids, sampling, default, shapes.chat, tools, keep_at) as (gen, text, stats):
            if sampling.stream:
                return await self._stream(
                    request, shapes, gen, text, stats, len(ids), sampling.include_usage
                )
            return await self._whole(shapes, gen, text, stats, len(ids))

    async def _whole(
        self, shapes: Shapes, gen, text: TextStream, stats: GenerationStats, n_prompt: int
    ) -> web.Response:
        # EngineError goes to the middleware with its status
        pieces = [piece async for piece in text_pieces(await anext(gen, _END), gen, text)]
        tail, finish = text.end(stats)
        reply, thinking = ("".join(p[i] for p in pieces) for i in (0, 1))
        return _json(shapes.complete(reply + tail, finish, n_prompt, text.tokens, stats, thinking, text.tool_calls))

    async def _stream(
        self, request: web.Request, shapes: Shapes, gen, text: TextStream, stats: GenerationStats,
        n_prompt: int, include_usage: bool,
    ) -> web.StreamResponse:  # fmt: skip
        # The first token comes before the headers, so an engine that fails at once still
        # answers with its HTTP status rather than a 200 carrying an error event.
        token = await anext(gen, _END)
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            if shapes.chat:
                await resp.write(sse(shapes.chunk(None, first=True)))
            async for reply, thinking in text_pieces(token, gen, text):
                await resp.write(sse(shapes.chunk(reply, thinking=thinking)))
            tail, finish = text.end(stats)
            await resp.write(sse(shapes.chunk(tail or None, finish, tool_calls=text.tool_calls)))
            if include_usage:
                await resp.write(sse(shapes.usage_chunk(n_prompt, text.tokens, stats)))
            await resp.write(sse("[DONE]"))
        except ConnectionResetError:  # the client hung up: _generate's finally frees the slot
            log.debug("client left mid-stream")
            return resp
        except EngineError as exc:
            await self._stream_error(resp, exc.status, "generation_failed", str(exc))
        except Exception as exc:  # after the headers went out, errors travel as an event
            log.exception("generation failed mid-stream")
            await self._stream_error(
                resp, 500, "internal_error", f"internal error: {type(exc).__name__}: {exc}"
            )
        return resp

    async def _stream_error(
        self, resp: web.StreamResponse, status: int, code: str, message: str
    ) -> None:
        try:
            await resp.write(sse(error_body(status, code, message)))
        except ConnectionResetError:
            pass

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every failure leaves as OpenAI's error JSON (Ollama's under /api/), converted here and
        only here; a request from a foreign Host or Origin goes no further (403)."""
        ollama = _is_ollama(request)
        self.silent.pop(id(request.transport), None)  # a whole request: this connection progresses
        try:
            headers = request.headers
            why = refusal(headers.get("Host"), headers.get("Origin"), self.own_names)
            if why is not None:
                raise ApiError(403, "forbidden", why)
            if request.method == "POST":
                why = content_type_refusal(headers.get("Content-Type"), headers.get("Origin"),
                                           headers.get("Sec-Fetch-Site"))  # fmt: skip
                if why is not None:
                    raise ApiError(415, "unsupported_media_type", why)
            return await handler(request)
        except ApiError as exc:
            return _error_response(exc.status, exc.code, exc.message, exc.param, ollama)
        except EngineError as exc:
            code = "queue_full" if exc.status == 429 else "generation_failed"
            return _error_response(exc.status, code, str(exc), None, ollama)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error_response(
                exc.status,
                _HTTP_CODES.get(exc.status, "http_error"),
                f"{exc.reason}: {request.method} {request.path}",
                None,
                ollama,
            )
        except KafilaError as exc:
            return _error_response(400, "bad_request", str(exc), None, ollama)
        except Exception as exc:
            log.exception("request failed: %s %s", request.method, request.path)
            return _error_response(
                500, "internal_error", f"internal error: {type(exc).__name__}: {exc}", None, ollama
            )


def _vocab_size(tokenizer) -> int | None:
    size = getattr(tokenizer, "vocab_size", None)
    return int(size) if size is not None else None


def _from_loopback(request: web.Request) -> bool:
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    return bool(peer) and _is_loopback(peer[0])


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def start_api(
    engine: Engine,
    host: str = DEFAULT_API_HOST,
    port: int = DEFAULT_API_PORT,
    limits: ApiLimits | None = None,
) -> ApiServer:
    """Serve `engine` on host:port (port 0: any free port; see `.port` and `.url`)."""
    server = ApiServer(engine, limits)
    await server.start(host, port)
    return server


def parse_hostport(
    text: str, default_host: str = DEFAULT_API_HOST, default_port: int = DEFAULT_API_PORT
) -> tuple[str, int]:
    """`HOST:PORT`, `HOST`, `:PORT` or `PORT` → (host, port); `[::1]:8740` for IPv6 (BadInput otherwise)."""
    text = text.strip()
    host, port_text = default_host, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise BadInput(f"bad address {text!r}: use HOST:PORT, e.g. 127.0.0.1:{default_port}")
        host, rest = text[1:end], text[end + 1 :]
        port_text = rest.removeprefix(":")
    elif text.isdigit():
        port_text = text
    elif text.count(":") == 1:
        h, port_text = text.split(":")
        host = h or default_host
    elif ":" in text:  # a bare IPv6 address
        try:
            host = str(ipaddress.IPv6Address(text))
        except ValueError:
            raise BadInput(f"bad address {text!r}: use HOST:PORT, or [IPv6]:PORT") from None
    elif text:
        host = text
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise BadInput(f"bad port in {text!r}: use HOST:PORT with a port from 0 to 65535")
    return host, int(port_text)
