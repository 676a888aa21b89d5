"""Prompt caching in `kafila serve` (kafila/engine/prompt_cache.py): on the real default model at
f32, through the unchanged openai client — conversations whose later turns find their earlier
turns cached answer exactly as with the cache off, a question asked again finds all of its prompt
but the last token, more conversations than slots evict, and the KV held stays within --slots."""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest

from kafila.api import start_api
from kafila.engine.local import LocalEngine
from tests.api_fixtures import LoopThread, tokenizer  # noqa: F401 (fixture)

pytestmark = [pytest.mark.model]

CONTEXT, N_NEW, SLOTS = 512, 10, 2
USERS = ["Name a fruit.", "Name a colour.", "What is two plus two?"]  # one more than the slots


def served(chain, tokenizer, prompt_cache: bool):  # noqa: F811
    engine = LocalEngine.over_chain(chain, tokenizer, "smollm2-135m", CONTEXT, max_slots=SLOTS,
                                    prompt_cache=prompt_cache)  # fmt: skip
    loop = LoopThread()
    server = loop.run(start_api(engine, "127.0.0.1", 0))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    return engine, loop, server, client


def ask(client, messages):
    r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=N_NEW, temperature=0)
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content, (details.cached_tokens if details is not None else None), r.usage.prompt_tokens


def conversations(client):
    """A conversation of two turns and its second turn asked again; then two new users, one
    more than the slots left, and the last one's question again: each answer, the prompt
    tokens it found cached, and its prompt's tokens."""
    first = [{"role": "user", "content": USERS[0]}]
    out = [ask(client, first)]
    second = [*first, {"role": "assistant", "content": out[0][0]}, {"role": "user", "content": "And another one?"}]
    out += [ask(client, second), ask(client, second)]
    out += [ask(client, [{"role": "user", "content": u}]) for u in USERS[1:]]
    out += [ask(client, [{"role": "user", "content": USERS[-1]}]), ask(client, second)]
    return [a for a, _, _ in out], [(c, n) for _, c, n in out]


def test_serve_caches_prompts_and_answers_as_without(chain_factory, tokenizer):  # noqa: F811
    chain = chain_factory("openvino", 2, "f32")
    results = {}
    for on in (False, True):
        engine, loop, server, client = served(chain, tokenizer, on)
        try:
            results[on] = conversations(client)
            if on:
                deadline = time.monotonic() + 10  # the last cursor parks on the worker after its answer
                while engine.status()["slots"]["parked"] < SLOTS and time.monotonic() < deadline:
                    time.sleep(0.01)
                status = engine.status()["slots"]
                assert status["parked"] == SLOTS and status["active"] == 0  # never more cursors than slots

                def sampled():  # a seed makes it repeatable, cached or not
                    r = client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=6,
                                                  temperature=1.2, seed=5)  # fmt: skip
                    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

                (a, cached_a), (b, cached_b) = sampled(), sampled()
                assert a == b and cached_b == cached_a + (0 if cached_a else 3)  # 4 prompt tokens, the last fed
                # Ollama's shape: prompt_eval_count counts the whole prompt, prompt_eval_cached_count what was found
                body = json.dumps({"model": "smollm2-135m", "messages": [{"role": "user", "content": USERS[0]}],
                                   "stream": False, "options": {"num_predict": 3}}).encode()  # fmt: skip
                asks = [json.load(urllib.request.urlopen(urllib.request.Request(f"{server.url}/api/chat", body)))
                        for _ in range(2)]  # fmt: skip
                n = asks[1]["prompt_eval_count"]
                assert asks[0]["prompt_eval_count"] == n and asks[1]["prompt_eval_cached_count"] == n - 1
        finally:
            loop.run(server.close())
            loop.run(engine.aclose())
            loop.close()
    (off, cached_off), (got, cached) = results[False], results[True]
    assert got == off
    assert {c for c, _ in cached_off} == {0}  # the cache off finds nothing
    (c1, n1), (c2, n2), (c3, n3), _, _, (c6, n6), (c7, n7) = cached
    assert c1 == 0 and c2 >= n1 - 1  # the second turn finds the first in its slot
    assert c3 == n3 - 1 and c6 == n6 - 1  # asked again: all but the last token
    assert c7 < n1  # the conversation's slot went to the third user (2 slots): fed again
