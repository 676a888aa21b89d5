"""Request bodies → typed, bounded parameters; anything else → ApiError. No I/O, no model.

OpenAI's request fields that change nothing here (user, presence/frequency penalties, …) are
accepted and ignored so that ordinary clients work unchanged; fields asking for something the
API cannot do (n > 1, logprobs, images, a forced tool call) are refused with a 400 that says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kafila.api._errors import ApiError, bad
from kafila.api._limits import ApiLimits
from kafila.api._tools import add_message_calls, parse_tools

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_SEED = 2**63


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: the endpoint's default, clamped to the context
    temperature: float  # 0 = greedy (the default here, unlike OpenAI's 1)
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carrying usage
    speculate: bool = True  # Kafila's own field: false turns speculative decoding off for this request


@dataclass(frozen=True)
class ChatParams:
    model: str
    messages: tuple[dict, ...]  # each {"role", "content": str}, and an assistant's "tool_calls" (_tools.py)
    sampling: Sampling
    tools: tuple[dict, ...] = ()  # the tools offered (_tools.parse_tools)


@dataclass(frozen=True)
class CompletionParams:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids
    sampling: Sampling


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


MAX_JSON_DEPTH = 32  # nested arrays/objects in a request body (chat messages need about 5)


def _depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether brackets nest deeper than `limit` (outside strings), before any parsing: a body of
    100,000 '[' would otherwise reach the parser's recursion limit (a 500, not a 400)."""
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return False


def decode_json(raw: bytes) -> dict:
    """The body as a JSON object (400 when it is not one)."""
    if not raw:
        raise bad("invalid_json", "the request body is empty; send a JSON object")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth_exceeds(raw, MAX_JSON_DEPTH):
        raise bad("invalid_json", f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad("invalid_json", f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("invalid_json", "the request body must be a JSON object")
    return body


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(body: dict, key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_number(v) or not lo <= v <= hi:
        raise bad("invalid_value", f"{key} must be a number from {lo:g} to {hi:g}", key)
    return float(v)


def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad("invalid_value", f"{key} must be an integer from {lo} to {hi}", key)
    return v


def _flag(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad("invalid_value", f"{key} must be true or false", key)
    return v


def model_of(body: dict) -> str:
    model = body.get("model")
    if model is None:
        raise bad("missing_field", "missing required field 'model' (see GET /v1/models)", "model")
    if not isinstance(model, str) or not model or len(model) > 256:
        raise bad("invalid_value", "model must be a non-empty string (see GET /v1/models)", "model")
    return model


def _stops(body: dict, limits: ApiLimits) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("invalid_value", "stop must be a string or a list of strings", "stop")
    if len(stops) > limits.max_stop_sequences:
        raise bad(
            "invalid_value", f"stop holds at most {limits.max_stop_sequences} sequences", "stop"
        )
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise bad(
            "invalid_value",
            f"a stop sequence is at most {limits.max_stop_chars} characters",
            "stop",
        )
    return tuple(s for s in stops if s)


def _refuse_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("unsupported", "only n=1 is supported", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise bad("unsupported", "logprobs are not supported", "logprobs")
    if body.get("best_of") not in (None, 1):
        raise bad("unsupported", "best_of is not supported", "best_of")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad(
            "unsupported", 'only response_format {"type": "text"} is supported', "response_format"
        )
    for key in ("presence_penalty", "frequency_penalty"):
        _number(body, key, -2.0, 2.0, 0.0)  # accepted and ignored, but must be well-formed


def sampling_of(body: dict, limits: ApiLimits, max_tokens_keys: tuple[str, ...]) -> Sampling:
    _refuse_unsupported(body)
    max_tokens = None
    for key in max_tokens_keys:  # the later key wins (max_completion_tokens over max_tokens)
        v = _int(body, key, 1, limits.max_new_tokens)
        if v is not None:
            max_tokens = v
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("invalid_value", "stream_options must be an object", "stream_options")
    stream = _flag(body, "stream")
    include_usage = _flag(options or {}, "include_usage")
    if include_usage and not stream:
        raise bad(
            "invalid_value", "stream_options is only allowed with stream: true", "stream_options"
        )
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    return Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0, 0.0),
        top_p=top_p if top_p > 0 else 1e-9,
        seed=_int(body, "seed", -MAX_SEED, MAX_SEED - 1),
        stop=_stops(body, limits),
        stream=stream,
        include_usage=include_usage,
        speculate=_flag(body, "speculate", True),
    )


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    where = f"messages[{index}].content"
    if content is None:
        if message.get("role") == "assistant":
            return ""  # an assistant turn that only called tools
        raise bad("missing_field", f"missing required field '{where}'", where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad("unsupported", f"{where}: only text content parts are supported", where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad("invalid_value", f"{where} must be a string or a list of text parts", where)


def parse_chat(body: dict, limits: ApiLimits) -> ChatParams:
    model = model_of(body)
    messages = body.get("messages")
    if messages is None:
        raise bad("missing_field", "missing required field 'messages'", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("invalid_value", "messages must be a non-empty list", "messages")
    if len(messages) > limits.max_messages:
        raise bad(
            "invalid_value", f"at most {limits.max_messages} messages per request", "messages"
        )
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad("invalid_value", f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role is None:
            raise bad("missing_field", f"missing required field 'messages[{i}].role'", "messages")
        if role not in ROLES:
            raise bad(
                "invalid_value", f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages"
            )
        content = _content(m, i)
        chars += len(content)
        message = {"role": "system" if role == "developer" else role, "content": content}
        chars += add_message_calls(message, m, i)
        for key in ("tool_call_id", "name"):  # a tool's result names the call it answers
            if role == "tool" and isinstance(m.get(key), str):
                message[key] = m[key][:256]
        out.append(message)
    if chars > limits.max_content_chars:
        raise bad(
            "content_too_long",
            f"the messages hold {chars} characters; at most {limits.max_content_chars}",
            "messages",
        )
    sampling = sampling_of(body, limits, ("max_tokens", "max_completion_tokens"))
    return ChatParams(model=model, messages=tuple(out), sampling=sampling, tools=parse_tools(body))


def parse_completion(body: dict, limits: ApiLimits) -> CompletionParams:
    model = model_of(body)
    if "prompt" not in body:
        raise bad("missing_field", "missing required field 'prompt'", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if len(prompt) > limits.max_content_chars:
            raise bad(
                "content_too_long",
                f"the prompt holds {len(prompt)} characters; at most {limits.max_content_chars}",
                "prompt",
            )
        parsed: str | tuple[int, ...] = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if len(prompt) > limits.max_prompt_token_ids:
            raise bad(
                "content_too_long",
                f"the prompt holds {len(prompt)} tokens; at most {limits.max_prompt_token_ids}",
                "prompt",
            )
        parsed = tuple(prompt)
    else:
        raise bad(
            "invalid_value",
            "prompt must be a string or a list of token ids (one prompt per request)",
            "prompt",
        )
    if body.get("tools") or body.get("functions"):
        raise bad("unsupported", "tools are offered in a chat (/v1/chat/completions), not a completion", "tools")
    if body.get("echo"):
        raise bad("unsupported", "echo is not supported", "echo")
    if body.get("suffix"):
        raise bad("unsupported", "suffix is not supported", "suffix")
    return CompletionParams(
        model=model, prompt=parsed, sampling=sampling_of(body, limits, ("max_tokens",))
    )


def token_budget(
    prompt_tokens: int, requested: int | None, default: int, context_length: int
) -> int:
    """How many new tokens a request may generate; 400 when the prompt leaves no room.

    An explicit max_tokens must fit beside the prompt (as OpenAI answers); the default is
    clamped to whatever the context has left.
    """
    if prompt_tokens >= context_length:
        raise bad(
            "context_length_exceeded",
            f"the prompt is {prompt_tokens} tokens but the model's context holds {context_length} "
            "(prompt and answer together); shorten the prompt or the conversation",
            "messages",
        )
    room = context_length - prompt_tokens
    if requested is None:
        return min(default, room)
    if requested > room:
        raise bad(
            "context_length_exceeded",
            f"the prompt is {prompt_tokens} tokens and max_tokens asks for {requested}, but the "
            f"model's context holds {context_length}; ask for at most {room} new tokens",
            "max_tokens",
        )
    return requested
