"""A reply's leading <think> block is the answer's thinking, as llama-server returns it by default:
`reasoning_content` on the OpenAI routes (Ollama: `thinking`), the rest the `content`. The splitter
(kafila/api/_think.py) at every split of a streamed answer; the mode told from llama.cpp's copies
of the real Qwen templates (Qwen 3 may open a block, Qwen 3.5's prompt opens it); and the API over
a scripted engine (the routing is under test, not a model)."""

from __future__ import annotations

import openai
import pytest

from kafila.api import start_api
from kafila.api._think import ThinkSplit, think_mode
from tests.api_fixtures import LoopThread, ScriptedEngine

MSGS = [{"role": "user", "content": "Name a colour."}]


def split(text: str, mode: str, cut: int | None) -> tuple[str, str]:
    s = ThinkSplit(mode)
    pieces = [text] if cut is None else [text[:cut], text[cut:]]
    fed = [s.feed(p) for p in pieces]
    tail, more = s.finish()
    return "".join(r for r, _ in fed) + tail, "".join(t for _, t in fed) + more


@pytest.mark.parametrize("text, mode, reply, thinking", [
    ("<think>\nThe user wants a colour.\n</think>\n\nBlue.", "start", "Blue.", "The user wants a colour."),
    ("The user wants a colour.\n</think>\n\nBlue.", "inside", "Blue.", "The user wants a colour."),
    ("<think>\n\n</think>\n\nBlue.", "start", "Blue.", ""),
    ("Blue, not <think>red</think>.", "start", "Blue, not <think>red</think>.", ""),
    ("<div>Blue</div>", "start", "<div>Blue</div>", ""),
    ("<think>\nStill thinking when the tokens ran out", "start", "", "Still thinking when the tokens ran out"),
    ("  Blue.", "start", "  Blue.", ""),
])  # fmt: skip
def test_the_leading_block_is_thinking_at_every_split(text, mode, reply, thinking):
    for cut in [None, *range(len(text) + 1)]:
        assert split(text, mode, cut) == (reply, thinking), cut


def qwen_tokenizer(template: str):
    from kafila.models.tokenizer import read_tokenizer_metadata, tokenizer_from_metadata
    from tests import llamacpp_files

    md = dict(read_tokenizer_metadata(str(llamacpp_files.vocab_file("qwen2")), prefixes=("tokenizer.",)))
    md["tokenizer.chat_template"] = (llamacpp_files.templates_dir() / f"{template}.jinja").read_text(encoding="utf-8")
    return tokenizer_from_metadata(md, template)


@pytest.mark.parametrize("template, mode", [("Qwen-Qwen3-0.6B", "start"), ("Qwen3.5-4B", "inside"),
                                            ("Qwen-Qwen2.5-7B-Instruct", None)])  # fmt: skip
def test_the_mode_comes_from_the_real_template_and_its_prompt(template, mode):
    from kafila.api import chat_prompt_ids

    tokenizer = qwen_tokenizer(template)
    assert think_mode(tokenizer, chat_prompt_ids(tokenizer, MSGS)) == mode


def test_the_api_returns_the_thinking_apart():
    tokenizer = qwen_tokenizer("Qwen-Qwen3-0.6B")
    ids = tokenizer.encode("<think>\nThe user wants a colour.\n</think>\n\nBlue.", add_special=False)
    engine = ScriptedEngine(tokenizer, context_length=512, model_name="qwen3")
    engine.answer = lambda prompt_ids, n: ids[:n]
    loop = LoopThread()
    server = loop.run(start_api(engine, "127.0.0.1", 0))
    try:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)
        message = api.chat.completions.create(model="qwen3", messages=MSGS, max_tokens=100).choices[0].message
        assert (message.content, message.reasoning_content) == ("Blue.", "The user wants a colour.")
        deltas = [c.choices[0].delta for c in api.chat.completions.create(model="qwen3", messages=MSGS,
                                                                          max_tokens=100, stream=True) if c.choices]  # fmt: skip
        assert "".join(d.content or "" for d in deltas) == "Blue."
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants a colour."
        raw = api.completions.create(model="qwen3", prompt="Name a colour.", max_tokens=100).choices[0].text
        assert raw.startswith("<think>")  # a raw completion is what the tokens spell
    finally:
        loop.run(server.close())
        loop.close()


@pytest.mark.parametrize("template", ["Qwen3.5-4B", "Qwen-Qwen3-0.6B", "Qwen-Qwen2.5-7B-Instruct"])
def test_a_chat_says_where_its_messages_end_and_the_next_turn_repeats_them(template):
    """chat_prompt's second value (GenerationRequest.keep_at, where a hybrid's stages keep their
    state): the ids of the messages without the answer prefix. Qwen3.5's next turn renders the
    answer without its reasoning and without the `<think>` the prompt opened, so it shares the
    messages with the slot's history but not the whole prompt; every template's next turn
    repeats at least the messages."""
    from kafila.api._text import chat_prompt

    tokenizer = qwen_tokenizer(template)
    ids, keep_at = chat_prompt(tokenizer, MSGS)
    assert 0 < keep_at < len(ids) and ids[keep_at - 2] == tokenizer.token_to_id("<|im_end|>")  # then "\n"
    answer = tokenizer.encode("The user wants a colour.\n</think>\n\nBlue.<|im_end|>", add_special=False)
    reply = {"role": "assistant", "content": "Blue.", "reasoning_content": "The user wants a colour."}
    nxt, _ = chat_prompt(tokenizer, [*MSGS, reply, {"role": "user", "content": "Another?"}])
    held = ids + answer
    shared = next((i for i, (a, b) in enumerate(zip(held, nxt)) if a != b), len(held))
    assert keep_at <= shared
    if template == "Qwen3.5-4B":
        assert shared < len(ids)  # the prompt's end is not repeated: only the kept state is reused
