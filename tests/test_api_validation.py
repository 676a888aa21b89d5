"""The API's pure parts: request validation, token budgets, stop sequences, --api parsing.

No sockets, no model: these run in milliseconds.
"""

from __future__ import annotations

import pytest

from backends.errors import BadInput
from kafila.api import ApiError, ApiLimits, StopScanner, parse_hostport
from kafila.api._validate import decode_json, parse_chat, parse_completion, token_budget

LIMITS = ApiLimits()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields):
    return parse_chat({**CHAT, **fields}, LIMITS)


def refused(fn, *args, status=400) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    assert info.value.status == status
    body = info.value.body()["error"]
    assert set(body) >= {"message", "type", "code"} and body["message"]
    return info.value


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"a": NaN}'])
def test_bad_json_is_400(raw):
    assert refused(decode_json, raw).code == "invalid_json"


def test_chat_defaults_are_greedy_and_unbounded():
    p = chat()
    assert p.messages == ({"role": "user", "content": "hi"},)
    s = p.sampling
    assert (s.temperature, s.top_p, s.max_tokens, s.stop, s.stream, s.seed) == (
        0.0,
        1.0,
        None,
        (),
        False,
        None,
    )


def test_chat_accepts_what_the_openai_client_sends():
    p = chat(temperature=0.7, top_p=0.9, seed=3, stop=["\n", ""], max_tokens=5, stream=True,
             stream_options={"include_usage": True}, n=1, user="u", presence_penalty=0.5,
             frequency_penalty=0, logprobs=False, response_format={"type": "text"}, tools=[])  # fmt: skip
    s = p.sampling
    assert (s.temperature, s.top_p, s.seed, s.stop, s.max_tokens, s.stream, s.include_usage) == (
        0.7, 0.9, 3, ("\n",), 5, True, True)  # fmt: skip
    assert chat(max_tokens=5, max_completion_tokens=7).sampling.max_tokens == 7


def test_chat_content_parts_and_developer_role():
    p = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                       {"role": "assistant", "content": None}, {"role": "user", "content": "x"}])  # fmt: skip
    assert p.messages == ({"role": "system", "content": "be brief"}, {"role": "assistant", "content": ""},
                          {"role": "user", "content": "x"})  # fmt: skip


@pytest.mark.parametrize(
    "body, code",
    [
        ({"messages": CHAT["messages"]}, "missing_field"),
        ({"model": "m"}, "missing_field"),
        ({"model": 3, "messages": CHAT["messages"]}, "invalid_value"),
        ({**CHAT, "messages": []}, "invalid_value"),
        ({**CHAT, "messages": "hi"}, "invalid_value"),
        ({**CHAT, "messages": [{"content": "hi"}]}, "missing_field"),
        ({**CHAT, "messages": [{"role": "user"}]}, "missing_field"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "invalid_value"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "invalid_value"),
        (
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            },
            "unsupported",
        ),
        (
            {**CHAT, "messages": [{"role": "user", "content": "x"}] * (LIMITS.max_messages + 1)},
            "invalid_value",
        ),
        (
            {
                **CHAT,
                "messages": [{"role": "user", "content": "x" * (LIMITS.max_content_chars + 1)}],
            },
            "content_too_long",
        ),
        ({**CHAT, "max_tokens": 0}, "invalid_value"),
        ({**CHAT, "max_tokens": LIMITS.max_new_tokens + 1}, "invalid_value"),
        ({**CHAT, "max_tokens": 2.5}, "invalid_value"),
        ({**CHAT, "max_tokens": True}, "invalid_value"),
        ({**CHAT, "temperature": 3}, "invalid_value"),
        ({**CHAT, "temperature": "hot"}, "invalid_value"),
        ({**CHAT, "top_p": 1.5}, "invalid_value"),
        ({**CHAT, "stream": "yes"}, "invalid_value"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "invalid_value"),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "invalid_value"),
        ({**CHAT, "stop": [1]}, "invalid_value"),
        ({**CHAT, "stop": "x" * (LIMITS.max_stop_chars + 1)}, "invalid_value"),
        ({**CHAT, "n": 2}, "unsupported"),
        ({**CHAT, "logprobs": True}, "unsupported"),
        ({**CHAT, "tools": [{"type": "function"}]}, "invalid_value"),  # no function named
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "invalid_value"),
        ({**CHAT, "tools": [{"function": {"name": "f"}}, {"function": {"name": "f"}}]}, "invalid_value"),
        ({**CHAT, "tools": [{"function": {"name": "f"}}], "tool_choice": "required"}, "unsupported"),
        ({**CHAT, "functions": [{"name": "f"}]}, "unsupported"),
        ({**CHAT, "messages": [{"role": "assistant", "content": None,
                                "tool_calls": [{"function": {"name": "f", "arguments": "{no"}}]}]}, "invalid_value"),
        ({**CHAT, "response_format": {"type": "json_object"}}, "unsupported"),
        ({**CHAT, "presence_penalty": 9}, "invalid_value"),
    ],
)
def test_bad_chat_requests_are_400(body, code):
    assert refused(parse_chat, body, LIMITS).code == code


def test_completion_prompts():
    assert parse_completion({"model": "m", "prompt": "hi"}, LIMITS).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": ["hi"]}, LIMITS).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}, LIMITS).prompt == (1, 2, 3)
    assert parse_completion({"model": "m", "prompt": [[1, 2]]}, LIMITS).prompt == (1, 2)
    for prompt in (["a", "b"], [], [1, "a"], 5, None, [True]):
        refused(parse_completion, {"model": "m", "prompt": prompt}, LIMITS)
    assert refused(parse_completion, {"model": "m"}, LIMITS).code == "missing_field"
    assert (
        refused(parse_completion, {"model": "m", "prompt": "x", "echo": True}, LIMITS).code
        == "unsupported"
    )


def test_token_budget():
    assert (
        token_budget(10, None, 1024, 100) == 90
    )  # the default clamps to what the context has left
    assert token_budget(10, None, 16, 100) == 16
    assert token_budget(10, 90, 16, 100) == 90
    e = refused(token_budget, 10, 91, 16, 100)
    assert e.code == "context_length_exceeded" and "at most 90" in e.message
    e = refused(token_budget, 100, None, 16, 100)
    assert e.code == "context_length_exceeded" and "100 tokens" in e.message


def scan(stops, pieces):
    s = StopScanner(stops)
    out = [s.feed(p) for p in pieces]
    return "".join(out) + s.flush(), s.stopped, out


@pytest.mark.parametrize(
    "stops, pieces, text, stopped",
    [
        ((), ["ab", "c"], "abc", False),
        (("\n",), ["ab", "c\nd"], "abc", True),
        (("END",), ["xE", "N", "Dy"], "x", True),
        (("END",), ["xE", "N", "o"], "xENo", False),  # a false start is released
        (("END",), ["xEN"], "xEN", False),  # held back, then flushed at the end
        (("ab", "b"), ["xab"], "x", True),  # the earliest stop wins
        (("aab",), ["a", "a", "a", "b"], "a", True),
    ],
)
def test_stop_scanner(stops, pieces, text, stopped):
    assert scan(stops, pieces)[:2] == (text, stopped)


def test_stop_scanner_holds_back_only_possible_starts():
    _, _, out = scan(("END",), ["hello E", "x"])
    assert out == ["hello ", "Ex"]


@pytest.mark.parametrize(
    "text, want",
    [("127.0.0.1:9000", ("127.0.0.1", 9000)), (":0", ("127.0.0.1", 0)), ("9000", ("127.0.0.1", 9000)),
     ("0.0.0.0", ("0.0.0.0", 8740)), ("[::1]:80", ("::1", 80)), ("localhost:1", ("localhost", 1)), ("::1", ("::1", 8740))],
)  # fmt: skip
def test_parse_hostport(text, want):
    assert parse_hostport(text) == want


@pytest.mark.parametrize("text", ["h:x", "h:70000", "[::1", "a:b:c"])
def test_parse_hostport_refuses(text):
    with pytest.raises(BadInput):
        parse_hostport(text)
