"""Ollama's request and response shapes (/api/chat, /api/generate, /api/tags). No I/O, no model.

Requests → typed, bounded parameters (the same `Sampling` as the OpenAI routes) or an ApiError,
which the server sends as Ollama's `{"error": "..."}`. Field names as Ollama's API has them:
`options.{temperature, top_p, seed, num_predict, stop}` are honoured; other options (`top_k`,
`num_ctx`, `repeat_penalty`, …) and `keep_alive` change nothing here and are ignored; what the
ring cannot do (`format`, `images`, `think`, `suffix`, a custom `template`, `context`) is refused
with a 400 that says so; `tools` reach the model as on the OpenAI routes (_tools.py). As there,
the default temperature is 0 (greedy; Ollama's own default is 0.8) so answers reproduce.
Durations in responses are nanoseconds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from kafila.api._errors import ApiError
from kafila.api._limits import ApiLimits
from kafila.api._tools import add_message_calls, parse_tools
from kafila.api._validate import (
    MAX_SEED,
    Sampling,
    _flag,
    _int,
    _number,
    bad,
)

OLLAMA_ROLES = ("system", "user", "assistant", "tool")
# What GET /api/version reports: clients gate features on Ollama's version, and these routes
# speak the API of this release (chat, generate, tags, show, version).
OLLAMA_COMPAT_VERSION = "0.12.0"
NDJSON_TYPE = "application/x-ndjson"


@dataclass(frozen=True)
class OllamaChat:
    model: str
    messages: tuple[dict, ...]  # each {"role", "content": str}; empty: only "load" the model
    sampling: Sampling
    tools: tuple[dict, ...] = ()  # the tools offered (_tools.parse_tools)


@dataclass(frozen=True)
class OllamaGenerate:
    model: str
    prompt: str  # empty: only "load" the model
    system: str | None
    raw: bool  # True: the prompt goes to the model as is, without the chat template
    sampling: Sampling


def _model(body: dict) -> str:
    model = body.get("model")
    if model is None or model == "":
        raise bad("missing_field", "model is required (see GET /api/tags)", "model")
    if not isinstance(model, str) or len(model) > 256:
        raise bad("invalid_value", "model must be a string (see GET /api/tags)", "model")
    return model


def _refuse(body: dict, keys: tuple[str, ...]) -> None:
    why = {
        "format": "structured output (format) is not supported",
        "tools": "tools are not supported",
        "images": "images are not supported: this model reads text only",
        "suffix": "suffix (fill-in-the-middle) is not supported",
        "template": "a custom template is not supported: the model's own chat template is used",
        "context": "context (token history) is not supported: send the conversation to /api/chat",
    }
    for key in keys:
        if body.get(key) not in (None, "", [], {}):
            raise bad("unsupported", why[key], key)
    if body.get("think") not in (None, False):
        raise bad("unsupported", "this model does not support thinking (think)", "think")


def _options(body: dict, limits: ApiLimits) -> Sampling:
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad("invalid_value", "options must be an object", "options")
    stream = _flag(body, "stream", default=True)  # Ollama streams unless told not to
    predict = options.get("num_predict")
    if predict is not None and (
        not isinstance(predict, int) or isinstance(predict, bool) or predict == 0 or predict < -2
    ):
        raise bad("invalid_value", "options.num_predict must be -1, -2 or a positive integer",
                  "options.num_predict")  # fmt: skip
    max_tokens = None
    if predict is not None and predict > 0:
        if predict > limits.max_new_tokens:
            raise bad("invalid_value", f"options.num_predict is at most {limits.max_new_tokens}",
                      "options.num_predict")  # fmt: skip
        max_tokens = predict  # -1 (no limit) and -2 (fill the context): the route's default
    stop = options.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop if stop is not None else [])
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("invalid_value", "options.stop must be a list of strings", "options.stop")
    if len(stops) > limits.max_stop_sequences or any(len(s) > limits.max_stop_chars for s in stops):
        raise bad("invalid_value", f"options.stop holds at most {limits.max_stop_sequences} "
                  f"sequences of at most {limits.max_stop_chars} characters", "options.stop")  # fmt: skip
    try:
        temperature = _number(options, "temperature", 0.0, 2.0, 0.0)
        top_p = _number(options, "top_p", 0.0, 1.0, 1.0)
        seed = _int(options, "seed", -MAX_SEED, MAX_SEED - 1)
    except ApiError as exc:
        raise bad(exc.code, "options." + exc.message, "options." + (exc.param or "")) from None
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p if top_p > 0 else 1e-9,
                    seed=seed, stop=tuple(s for s in stops if s), stream=stream,
                    include_usage=False)  # fmt: skip


def parse_chat(body: dict, limits: ApiLimits) -> OllamaChat:
    model = _model(body)
    _refuse(body, ("format",))
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise bad("invalid_value", "messages must be a list", "messages")
    if len(messages) > limits.max_messages:
        raise bad("invalid_value", f"at most {limits.max_messages} messages per request", "messages")
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad("invalid_value", f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in OLLAMA_ROLES:
            raise bad("invalid_value", f"messages[{i}].role must be one of {', '.join(OLLAMA_ROLES)}",
                      "messages")  # fmt: skip
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad("invalid_value", f"messages[{i}].content must be a string", "messages")
        if m.get("images"):
            raise bad("unsupported", "images are not supported: this model reads text only", "images")
        chars += len(content)
        message = {"role": role, "content": content}
        chars += add_message_calls(message, m, i)
        if role == "tool" and isinstance(m.get("tool_name"), str):
            message["name"] = m["tool_name"][:256]
        out.append(message)
    if chars > limits.max_content_chars:
        raise bad("content_too_long",
                  f"the messages hold {chars} characters; at most {limits.max_content_chars}",
                  "messages")  # fmt: skip
    return OllamaChat(model, tuple(out), _options(body, limits), parse_tools({"tools": body.get("tools")}))


def parse_generate(body: dict, limits: ApiLimits) -> OllamaGenerate:
    model = _model(body)
    _refuse(body, ("format", "images", "suffix", "template", "context"))
    prompt = body.get("prompt")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise bad("invalid_value", "prompt must be a string", "prompt")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad("invalid_value", "system must be a string", "system")
    if len(prompt) + len(system or "") > limits.max_content_chars:
        raise bad("content_too_long", f"the prompt holds more than {limits.max_content_chars} "
                  "characters", "prompt")  # fmt: skip
    raw = _flag(body, "raw")
    return OllamaGenerate(model, prompt, system or None, raw, _options(body, limits))


def generate_messages(params: OllamaGenerate) -> list[dict]:
    """The chat a templated /api/generate request stands for: the system prompt, then the prompt."""
    messages = [{"role": "system", "content": params.system}] if params.system else []
    return messages + [{"role": "user", "content": params.prompt}]


# --- responses ---------------------------------------------------------------------------------


def created_at(now_s: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes `created_at` and `modified_at`."""
    t = time.time() if now_s is None else now_s
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


@dataclass
class Clock:
    """perf_counter() marks of one generation → Ollama's duration fields (nanoseconds)."""

    start_s: float
    first_s: float | None = None
    last_s: float | None = None

    def token(self, now_s: float) -> None:
        if self.first_s is None:
            self.first_s = now_s
        self.last_s = now_s

    def durations(self, prompt_tokens: int, new_tokens: int, end_s: float, cached: int | None = None) -> dict:
        """`prompt_eval_count` is the whole prompt, cached tokens included, as Ollama counts it;
        `prompt_eval_cached_count` the tokens found in a prompt cache, when the engine says."""
        first = self.first_s if self.first_s is not None else end_s
        last = self.last_s if self.last_s is not None else end_s
        return {"total_duration": _ns(end_s - self.start_s), "load_duration": 0,
                "prompt_eval_count": prompt_tokens, "prompt_eval_duration": _ns(first - self.start_s),
                **({"prompt_eval_cached_count": int(cached)} if cached is not None else {}),
                "eval_count": new_tokens, "eval_duration": _ns(last - first)}  # fmt: skip


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


class OllamaShapes:
    """The bodies of one /api/chat (`chat`) or /api/generate response."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model

    def _text(self, text: str, thinking: str, tool_calls: list[dict] | None = None) -> dict:
        """The text, and the model's thinking where it has any (Ollama's `thinking` field), and
        its calls (Ollama's tool_calls: arguments as an object, no id)."""
        if self.chat:
            message = {"role": "assistant", "content": text} | ({"thinking": thinking} if thinking else {})
            if tool_calls:
                message["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                                       "arguments": json.loads(c["function"]["arguments"])}}
                                         for c in tool_calls]  # fmt: skip
            return {"message": message}
        return {"response": text} | ({"thinking": thinking} if thinking else {})

    def chunk(self, text: str, thinking: str = "", tool_calls: list[dict] | None = None) -> dict:
        return {"model": self.model, "created_at": created_at(), **self._text(text, thinking, tool_calls),
                "done": False}  # fmt: skip

    def final(self, text: str, done_reason: str, durations: dict | None, thinking: str = "",
              tool_calls: list[dict] | None = None) -> dict:  # fmt: skip
        """The last streamed object (text "") or the whole non-streamed answer; a call ends an
        answer as "stop" (Ollama has no "tool_calls" reason)."""
        done_reason = "stop" if done_reason == "tool_calls" else done_reason
        body = {"model": self.model, "created_at": created_at(), **self._text(text, thinking, tool_calls),
                "done": True, "done_reason": done_reason}  # fmt: skip
        if durations:
            body.update(durations)
        return body


def tag(name: str, modified_s: float, details: dict) -> dict:
    """One entry of GET /api/tags."""
    return {"name": name, "model": name, "modified_at": created_at(modified_s),
            "size": int(details.get("size") or 0), "digest": details.get("digest") or "",
            "details": {"parent_model": "", "format": "gguf", "family": details.get("family") or "",
                        "families": [details["family"]] if details.get("family") else None,
                        "parameter_size": details.get("parameter_size") or "",
                        "quantization_level": details.get("quantization_level") or ""}}  # fmt: skip
