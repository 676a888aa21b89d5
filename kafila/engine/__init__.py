"""What prompt entry (HTTP API, chat, `kafila run`) needs from whatever generates tokens.

Two engines implement it: a local chain of shards in one process, and a ring session whose
head may be another machine. The HTTP layer only sees this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

MAX_NEW_TOKENS_LIMIT = 4096


class EngineError(Exception):
    """A request that failed after it was accepted (a member gone, the session degraded).

    `status` is the HTTP status the API answers with when nothing was streamed yet.
    """

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]  # already templated and tokenized
    max_new_tokens: int
    stop_at_eos: bool = True
    temperature: float = 0.0  # 0 = greedy (the only mode the ring must reproduce exactly)
    seed: int | None = None
    top_p: float = 1.0  # nucleus sampling when temperature > 0; 1 = the whole distribution
    speculate: bool = True  # False: never speculate for this request (a ring session's drafter)
    # hybrid models' prompt cache: the prompt position (0 < keep_at < len(prompt_ids)) whose state
    # the stages keep, the end of a chat's messages before the template's answer prefix (the next
    # turn repeats those, not always the prefix: Qwen3.5's drops its `<think>`); 0: the prompt's end
    keep_at: int = 0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_ms: float | None = None
    tok_s: float | None = None
    finish_reason: str = "length"  # "stop" | "length" | "error"
    extra: dict = field(default_factory=dict)
    started_s: float = 0.0  # perf_counter() when the request was accepted
    first_token_s: float | None = None

    def count_token(self, now_s: float) -> None:
        """Account one new token produced at `now_s` (time to first token, decode tok/s)."""
        if self.first_token_s is None:
            self.first_token_s = now_s
            self.ttft_ms = (now_s - self.started_s) * 1e3
        self.new_tokens += 1
        if self.new_tokens > 1:
            self.tok_s = (self.new_tokens - 1) / max(now_s - self.first_token_s, 1e-9)


class Engine(Protocol):
    model_name: str
    context_length: int  # the most positions (prompt + new) one request may use

    @property
    def ready(self) -> bool:
        """False while the session is forming or degraded (the API answers 503)."""

    def tokenizer(self):  # kafila.models.Tokenizer
        ...

    def generate(self, request: GenerationRequest, stats: GenerationStats) -> AsyncIterator[int]:
        """Yield new token ids as they are produced; fill `stats` as it goes.

        Raises EngineError when the request fails (before or during generation).
        """

    def status(self) -> dict:
        """The JSON body of GET /status."""
