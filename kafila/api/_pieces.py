"""The text of a generation, token by token, shared by the OpenAI and Ollama routes."""

from __future__ import annotations

from collections.abc import AsyncIterator

_END = object()  # what anext() returns when a generation has no more tokens


async def text_pieces(token, gen, text, on_token=None) -> AsyncIterator[tuple[str, str]]:
    """(reply, thinking) text of each token that has any, from `token` (already read, or _END)
    on, until the generation ends or a stop sequence finishes the reply (OpenAI and Ollama
    routes alike; thinking is only ever non-empty for a harmony model's chat)."""
    while token is not _END:
        if on_token is not None:
            on_token()
        reply, thinking = text.push(token)
        if reply or thinking:
            yield reply, thinking
        if text.finish:
            return
        token = await anext(gen, _END)
