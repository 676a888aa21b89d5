"""Prompt entry: the OpenAI-compatible HTTP API every member serves (see CONTRACTS.md)."""

from kafila.api._errors import ApiError, error_body
from kafila.api._limits import DEFAULT_API_HOST, DEFAULT_API_PORT, ApiLimits
from kafila.api._server import ApiServer, parse_hostport, start_api
from kafila.api._text import TextStream, chat_prompt_ids
from kafila.api._stops import StopScanner

__all__ = [
    "DEFAULT_API_HOST", "DEFAULT_API_PORT", "ApiError", "ApiLimits", "ApiServer", "StopScanner",
    "TextStream", "chat_prompt_ids", "error_body", "parse_hostport", "start_api",
]  # fmt: skip
