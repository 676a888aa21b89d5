"""The text of a generation, token by token, shared by the OpenAI and Ollama routes."""

from __future__ import annotations

from collections.abc import AsyncIterator

_END = object()  # what anext() returns when a generation has no more tokens


async def text_pieces(token, gen, text, on_token=None) -> AsyncIterator[str]:
    """The non-empty text of each token, from `token` (already read, or _END) on, until the
    generation ends or a stop sequence finishes the text (OpenAI and Ollama routes alike)."""
    while token is not _END:
        if on_token is not None:
            on_token()
        piece = text.push(token)
        if piece:
            yield piece
        if text.finish:
            return
        token = await anext(gen, _END)
