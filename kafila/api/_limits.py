"""Explicit bounds on everything a client can send (see ARCHITECTURE.md, Security)."""

from __future__ import annotations

from dataclasses import dataclass

from kafila.engine import MAX_NEW_TOKENS_LIMIT

DEFAULT_API_HOST = "127.0.0.1"  # loopback unless the person says otherwise
DEFAULT_API_PORT = 8740


@dataclass(frozen=True)
class ApiLimits:
    max_body_bytes: int = 1 << 20  # a request body larger than this is refused (413)
    max_messages: int = 256  # messages in one chat request
    max_content_chars: int = 200_000  # all message contents (or the prompt) together
    max_stop_sequences: int = 4  # as OpenAI
    max_stop_chars: int = 256  # one stop sequence
    max_new_tokens: int = MAX_NEW_TOKENS_LIMIT  # also never more than the engine's context
    default_chat_max_tokens: int = 1024  # when a chat request names none (clamped to the context)
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions
    max_inflight_requests: int = 64  # generation requests admitted at once (queued or running)
    max_prompt_token_ids: int = 65_536  # a /v1/completions prompt given as token ids
    body_timeout_s: float = 30.0  # a whole request body, once its headers are in (else 408)
    # a connection's request headers, from its opening or its last answer (else it is closed):
    # a client that sends half a request, or none, holds no connection for ever
    header_timeout_s: float = 20.0
    max_connections: int = 128  # open at once; one more gets a 503 and is closed
