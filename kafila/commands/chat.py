"""`kafila chat [--api HOST:PORT]`: a terminal chat that streams answers from a member's API.

Keeps the conversation and sends all of it each turn. Empty line: nothing; `/reset`: a new
conversation; `/exit`, Ctrl-D or Ctrl-C at the prompt: leave. Ctrl-C during an answer stops
that answer (the server cancels its generation) and forgets the turn.
"""

from __future__ import annotations

import http.client
import json
import sys
from collections.abc import Iterator
from typing import TextIO

from backends.errors import EXIT_OK, BadInput, Refused
from kafila.api import DEFAULT_API_HOST, DEFAULT_API_PORT, parse_hostport

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a long queue or a slow ring: the first token may take a while
MAX_ERROR_BODY_BYTES = 64 * 1024
THINKING_FIELD = "reasoning_content"  # where a thinking model's thinking comes (gpt-oss's analysis channel)


class AnswerWriter:
    """An answer as it streams to a person: a thinking model's thinking first, dim in a terminal,
    under "thinking:", then the reply from a new line (`kafila chat`, `kafila run`)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.shown = ""  # the field written last
        self.dim, self.plain = ("\x1b[2m", "\x1b[0m") if out.isatty() else ("", "")

    def write(self, field: str, piece: str) -> None:
        """`piece` of `field` (THINKING_FIELD, or anything else for the reply)."""
        if not piece:
            return
        if field == THINKING_FIELD:
            self.out.write(("" if self.shown == THINKING_FIELD else f"{self.dim}thinking: ") + piece)
        else:
            self.out.write(("\n" + self.plain if self.shown == THINKING_FIELD else "") + piece)
        self.shown = field
        self.out.flush()

    def close(self) -> None:
        """The answer's end: back to plain text, on a new line."""
        if self.shown:
            self.out.write((self.plain if self.shown == THINKING_FIELD else "") + "\n")
            self.out.flush()


class ChatError(Exception):
    """One line for the person: the API is unreachable, refused the request or failed."""


class ApiClient:
    """The few calls `kafila chat` makes to a member's OpenAI-compatible API (stdlib only)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def _connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=CONNECT_TIMEOUT_S)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise ChatError(
                f"cannot reach the Kafila API at {self.url} ({reason.lower()}): start `kafila serve`, "
                "`kafila host` or `kafila join` there, or pass --api HOST:PORT"
            ) from None
        conn.sock.settimeout(READ_TIMEOUT_S)
        return conn

    def _request(self, method: str, path: str, body: dict | None = None):
        conn = self._connect()
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ChatError(
                f"the Kafila API at {self.url} dropped the connection ({exc})"
            ) from None
        if resp.status != 200:
            message = _error_message(resp.read(MAX_ERROR_BODY_BYTES), resp.status)
            conn.close()
            raise ChatError(message)
        return conn, resp

    def models(self) -> list[str]:
        conn, resp = self._request("GET", "/v1/models")
        try:
            return [m["id"] for m in json.loads(resp.read())["data"]]
        except (ValueError, KeyError, TypeError, OSError):
            raise ChatError(
                f"{self.url} does not answer like a Kafila API (GET /v1/models)"
            ) from None
        finally:
            conn.close()

    def stream_chat(
        self, model: str, messages: list[dict], max_tokens: int | None
    ) -> Iterator[tuple[str, str]]:
        """The answer's pieces as they arrive, each (field, text): field "content", or
        "reasoning_content" for a thinking model's thinking; closing the iterator hangs up."""
        body: dict = {"model": model, "messages": messages, "stream": True}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        conn, resp = self._request("POST", "/v1/chat/completions", body)
        try:
            for event in _sse_data(resp):
                if event == "[DONE]":
                    return
                chunk = json.loads(event)
                if "error" in chunk:
                    raise ChatError(chunk["error"].get("message", "the answer failed"))
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    for field in THINKING_FIELD, "content":
                        if delta.get(field):
                            yield field, delta[field]
            raise ChatError(f"the Kafila API at {self.url} ended the answer early")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise ChatError(f"the connection to {self.url} broke mid-answer ({exc})") from None
        finally:
            conn.close()


def _sse_data(resp) -> Iterator[str]:
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith("data:"):
            yield line[5:].strip()


def _error_message(raw: bytes, status: int) -> str:
    try:
        return f"{json.loads(raw)['error']['message']} (HTTP {status})"
    except (ValueError, KeyError, TypeError):
        return f"the API answered HTTP {status}"


class Chat:
    """One conversation: the history, and one turn at a time streamed to `out`."""

    def __init__(self, client: ApiClient, model: str, system: str | None, max_tokens: int | None):
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.start = [{"role": "system", "content": system}] if system else []
        self.history: list[dict] = list(self.start)

    def reset(self) -> None:
        self.history = list(self.start)

    def turn(self, prompt: str, out: TextIO) -> str:
        """Ask `prompt`, write the answer as it streams (a thinking model's thinking first, dim in
        a terminal, under "thinking:"); the history keeps only whole turns and only the replies."""
        messages = [*self.history, {"role": "user", "content": prompt}]
        pieces: list[str] = []
        writer = AnswerWriter(out)
        stream = self.client.stream_chat(self.model, messages, self.max_tokens)
        try:
            for field, piece in stream:
                writer.write(field, piece)
                if field != THINKING_FIELD:
                    pieces.append(piece)
        finally:
            stream.close()  # on Ctrl-C: hang up, so the server frees the slot
            writer.close()
        answer = "".join(pieces)
        self.history = [*messages, {"role": "assistant", "content": answer}]
        return answer


def run_chat(chat: Chat, lines: Iterator[str], out: TextIO, err: TextIO, interactive: bool) -> int:
    """The read-answer loop. Interactive: errors are shown and the chat goes on; otherwise
    (a script feeding stdin) the first failed turn ends it (Refused, exit 3)."""
    for line in lines:
        prompt = line.strip()
        if not prompt:
            continue
        if prompt in ("/exit", "/quit"):
            break
        if prompt == "/reset":
            chat.reset()
            err.write("(a new conversation)\n")
            continue
        try:
            chat.turn(prompt, out)
        except ChatError as exc:
            message = str(exc)
            if "context" in message and interactive:
                message += " — type /reset to start a new conversation"
            if not interactive:
                raise Refused(message) from None
            err.write(f"kafila chat: {message}\n")
        except KeyboardInterrupt:
            err.write("(stopped)\n")
    return EXIT_OK


def _prompt_lines(err: TextIO) -> Iterator[str]:
    """Lines typed at a terminal (with line editing); ends on Ctrl-D or Ctrl-C."""
    try:
        import readline  # noqa: F401 (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            yield input("you> ")
        except (EOFError, KeyboardInterrupt):
            err.write("\n")
            return


def handle(args) -> int:
    host, port = parse_hostport(args.api)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise BadInput("--max-tokens must be at least 1")
    client = ApiClient(host, port)
    try:
        models = client.models()
    except ChatError as exc:
        raise Refused(str(exc)) from None
    if not models:
        raise Refused(f"the API at {client.url} serves no model")
    chat = Chat(client, models[0], args.system, args.max_tokens)
    interactive = sys.stdin.isatty()
    if interactive:
        sys.stderr.write(
            f"chatting with {models[0]} at {client.url} — /reset starts over, Ctrl-D leaves\n"
        )
        lines: Iterator[str] = _prompt_lines(sys.stderr)
    else:
        lines = iter(sys.stdin)
    try:
        return run_chat(chat, lines, sys.stdout, sys.stderr, interactive)
    except KeyboardInterrupt:
        return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat in the terminal with the model a member serves",
        description="A terminal chat that streams answers from a member's HTTP API.",
    )
    p.add_argument(
        "--api",
        default=f"{DEFAULT_API_HOST}:{DEFAULT_API_PORT}",
        metavar="HOST:PORT",
        help=f"the member's API (default {DEFAULT_API_HOST}:{DEFAULT_API_PORT})",
    )
    p.add_argument("--system", metavar="TEXT", help="a system message that starts the conversation")
    p.add_argument(
        "--max-tokens", type=int, metavar="N", help="the most tokens one answer may have"
    )
    p.set_defaults(handler=handle)


__all__ = ["ApiClient", "Chat", "ChatError", "register", "run_chat"]
