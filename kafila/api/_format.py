"""OpenAI's response and stream-chunk shapes (chat.completion, text_completion, model list)."""

from __future__ import annotations

import json
import time
import uuid

from kafila.api._names import ModelNames
from kafila.engine import GenerationStats


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def timings(stats: GenerationStats) -> dict:
    """Kafila's own extension field: time to first token and decode speed."""
    return {"ttft_ms": stats.ttft_ms, "tok_s": stats.tok_s}


def _usage_of(prompt_tokens: int, new_tokens: int, stats: GenerationStats) -> dict:
    """usage, with the prompt tokens found cached (OpenAI's `prompt_tokens_details`) and
    Kafila's `speculation` counts when the request speculated on a ring."""
    body = usage(prompt_tokens, new_tokens)
    if "cached_tokens" in stats.extra:
        body["prompt_tokens_details"] = {"cached_tokens": stats.extra["cached_tokens"]}
    if "speculation" in stats.extra:
        body["speculation"] = stats.extra["speculation"]
    return body


def model_card(names: ModelNames) -> dict:
    """The served model as OpenAI lists it, with the other names it answers to (`aliases`)."""
    return {"id": names.id, "object": "model", "created": 0, "owned_by": "kafila",
            "aliases": list(names.aliases)}  # fmt: skip


def model_list(names: ModelNames) -> dict:
    return {"object": "list", "data": [model_card(names)]}


class Shapes:
    """Builds the bodies of one response: `chat` selects chat.completion or text_completion."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now_s()

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}  # fmt: skip

    def complete(
        self, text: str, finish: str, prompt_tokens: int, new_tokens: int, stats: GenerationStats,
        thinking: str = "", tool_calls: list[dict] | None = None,
    ) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text or (None if tool_calls else text)}
            if thinking:  # llama-server's field for a model's thinking (gpt-oss's analysis channel)
                message["reasoning_content"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = self._envelope("text_completion", [choice])
        body["usage"] = _usage_of(prompt_tokens, new_tokens, stats)
        body["kafila"] = timings(stats)
        return body

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False,
              thinking: str = "", tool_calls: list[dict] | None = None) -> dict:  # fmt: skip
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            if thinking:
                delta["reasoning_content"] = thinking
            if tool_calls:  # whole calls, in the last chunk (a delta may carry a call at once)
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, new_tokens: int, stats: GenerationStats) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = _usage_of(prompt_tokens, new_tokens, stats)
        body["kafila"] = timings(stats)
        return body


def sse(obj: dict | str) -> bytes:
    """One server-sent event carrying a JSON object (or the literal `[DONE]`)."""
    data = (
        obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    )
    return f"data: {data}\n\n".encode()
