"""Tool calls (OpenAI's `tools`, Ollama's too): what a request offers the model, and which of its
answer's text calls them (sans-I/O).

The model's chat template shows the tools to the model (the template's own `tools` variable) and
the model answers a call in its family's own form; as llama-server does, the call is taken out of
the reply and returned as `tool_calls`, with finish_reason "tool_calls". Two forms are read:

- harmony (gpt-oss): a commentary message addressed `to=functions.NAME`, its body the arguments'
  JSON, ended by `<|call|>` (an end of generation: one call an answer). _harmony.py routes its
  tokens here by their header.
- Hermes (Qwen 2.5, Qwen 3 and the templates that copy them): `<tool_call>{"name": …,
  "arguments": {…}}</tool_call>` in the reply's text, any number of them; inside the tags also
  Qwen3-Coder's and Qwen 3.5's XML, `<function=NAME><parameter=KEY>value</parameter></function>`.
- JSON (Llama 3.x): a reply that is one `{"name": …, "parameters": {…}}` (after `<|python_tag|>`).
- the forms whose calls close the answer, from an opener on (_tool_forms.py): Mistral's
  `[TOOL_CALLS]`, DeepSeek's `<｜tool▁calls▁begin｜>` and DSML blocks, Gemma 4's `<|tool_call>`.

A template that shows no tools in either form is refused with a 400 that says so: a model never
told of the tools would answer as if there were none. Text that only looks like a call (JSON that
does not parse, a name that was not offered) stays in the reply, as the model wrote it.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid

from kafila.api import _tool_forms
from kafila.api._errors import bad
from kafila.api._stops import partial_suffix

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's opening of a call
XML_FUNCTION = re.compile(r"<function=([A-Za-z0-9_.\-]{1,64})>(.*)</function>", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]{1,128})>(.*?)</parameter>", re.DOTALL)
HARMONY_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128
MAX_CALL_CHARS = 64 << 10  # one call's text: past it, the text is the reply's (a model run away)


def tool_format(tokenizer) -> str | None:
    """"harmony", "hermes" (`<tool_call>` around JSON or Qwen3's XML), "json" (Llama 3.x: the reply
    is one JSON call), a form of _tool_forms.OPENERS, or None when the model's chat template shows
    no tools in a form Kafila reads."""
    from kafila.api._harmony import Harmony

    if Harmony.of(tokenizer) is not None:
        return "harmony"
    template = tokenizer.chat_template or ""
    if "tools" not in template:
        return None
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|tool_call>call:" in template:
        return "gemma4"
    if "DSML" in template:
        return "dsml"
    if _tool_forms.OPENERS["deepseek"][0] in template:
        return "deepseek"
    if HERMES_OPEN in template:
        return "hermes"
    if '"parameters"' in template:
        return "json"
    return None


def parse_tools(body: dict) -> tuple[dict, ...]:
    """The request's `tools`, each {"type": "function", "function": {"name", "description"?,
    "parameters"?}}; () when there are none or `tool_choice` is "none"."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad("unsupported", "functions and function_call are the old form: give tools", "functions")
    if choice not in ("auto", "none"):
        raise bad("unsupported", 'tool_choice "auto" and "none" are supported (Kafila cannot force a call)',
                  "tool_choice")  # fmt: skip
    if tools is None or choice == "none":
        return ()
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad("invalid_value", f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise bad("invalid_value", f'{where} must be {{"type": "function", "function": {{"name", …}}}}', "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad("invalid_value", f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'", "tools")
        if name in names:
            raise bad("invalid_value", f"{where}: the tool {name!r} is offered twice", "tools")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad("invalid_value", f"{where}.function.parameters must be a JSON Schema object", "tools")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise bad("invalid_value", f"{where}.function.description must be a string", "tools")
        out.append({"type": "function", "function": {"name": name, "description": description, "parameters": params}})
    return tuple(out)


def parse_message_calls(message: dict, index: int) -> list[dict] | None:
    """An assistant message's `tool_calls` as templates read them (arguments as an object, not
    the JSON text the API carries), or None when it has none."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    where = f"messages[{index}].tool_calls"
    if message.get("role") != "assistant" or not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise bad("invalid_value", f"{where}: only an assistant message calls tools, as a list", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad("invalid_value", f"{where}[{j}] must be {{\"function\": {{\"name\", \"arguments\"}}}}", "messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad("invalid_value", f"{where}[{j}].function.arguments is not JSON", "messages") from None
        if not isinstance(args, dict):
            raise bad("invalid_value", f"{where}[{j}].function.arguments must be a JSON object", "messages")
        call_id = call.get("id")
        out.append({"id": call_id if isinstance(call_id, str) else new_call_id(), "type": "function",
                    "function": {"name": name, "arguments": args}})  # fmt: skip
    return out


def add_message_calls(message: dict, body: dict, index: int) -> int:
    """An assistant message's calls (parse_message_calls) put into `message`, the parsed form a
    template reads; the characters their arguments hold (they count toward the request's bound)."""
    calls = parse_message_calls(body, index)
    if calls is None:
        return 0
    message["tool_calls"] = calls
    return sum(len(json.dumps(c["function"]["arguments"])) for c in calls)


def new_call_id(fmt: str = "") -> str:
    if fmt in _tool_forms.CALL_IDS_OF_NINE:  # nine letters and digits, as llama-server gives Mistral
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCalls:
    """One answer's calls: `reply(text)` passes the reply's text on with its calls taken out
    (text that may be a call is held until that is known); `harmony(name, text)` takes a harmony
    call's arguments; `finish()` gives the text still held and the calls, in OpenAI's shape.

    The Hermes form is read as llama.cpp reads it: `<tool_call>{…}</tool_call>` anywhere in the
    reply, or a reply that is one JSON call (`{"name": …, "arguments": …}`, bare or in a ```json
    fence: small models answer so), held whole until the answer ends."""

    def __init__(self, fmt: str, names: frozenset[str], schemas: dict[str, dict] | None = None) -> None:
        self.fmt, self.names = fmt, names
        self.schemas = schemas or {}  # name → its parameters' JSON Schema (XML values are typed by it)
        self.calls: list[dict] = []
        self._held = ""  # reply text not passed on yet: a call's, or what may open one
        self._whole = None  # the reply opens as JSON (True: held whole), as text (False), not yet known
        self._harmony: dict[str, list[str]] = {}

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts a reader of this form must see though they may be control tokens (llama.cpp's
        preserved tokens): the decoder shows them."""
        return _tool_forms.MARKERS.get(self.fmt, ())

    def reply(self, text: str) -> str:
        if self.fmt in _tool_forms.OPENERS:
            return self._closing(text)
        if self.fmt not in ("hermes", "json"):
            return text
        self._held += text
        if self._whole is None:
            self._whole = _opens_call(self._held.lstrip())
            if self._whole is None:
                return ""
        if self._whole:
            if len(self._held) <= MAX_CALL_CHARS:
                return ""
            self._whole = False  # too long for a call: the model's text
        if self.fmt == "json":  # no tags in this form: the text as it came
            out, self._held = self._held, ""
            return out
        return self._tagged()

    def harmony(self, name: str, text: str) -> None:
        self._harmony.setdefault(name, []).append(text)

    def finish(self) -> tuple[str, list[dict]]:
        """(text still held, now the reply's; the calls made)."""
        held, self._held = self._held, ""
        if self._whole and self.fmt in _tool_forms.OPENERS:
            calls = _tool_forms.parse(self.fmt, held)
            if calls and all(self._offered(name, args) for name, args in calls):
                self.calls += [self._call(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]
                held = ""
        elif self._whole and self._take_hermes(_unfenced(held)):
            held = ""
        elif self._whole:  # not one call: read it as text, tags and all
            self._held, self._whole = held, False
            held = self._tagged()
            held, self._held = held + self._held, ""
        for name, parts in self._harmony.items():
            args = "".join(parts).strip()
            if name in self.names and _json_object(args) is not None:
                self.calls.append(self._call(name, args))
            else:  # not a call after all: what the model wrote is the reply's
                held += "".join(parts)
        self._harmony = {}
        return held, self.calls

    def _closing(self, text: str) -> str:
        """A form whose calls close the answer: the text up to an opener is the reply's; from it on
        all is held (`_whole`) for finish() to read, up to the bound of a call's text."""
        self._held += text
        if self._whole is False:  # a call ran past its bound: the rest is text
            out, self._held = self._held, ""
            return out
        if self._whole:
            if len(self._held) <= MAX_CALL_CHARS:
                return ""
            self._whole = False
            out, self._held = self._held, ""
            return out
        openers = _tool_forms.OPENERS[self.fmt]
        starts = [i for i in (self._held.find(o) for o in openers) if i >= 0]
        if starts:
            out, self._held = self._held[: min(starts)], self._held[min(starts):]
            self._whole = True
            return out
        keep = partial_suffix(self._held, openers)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        return out

    def _offered(self, name: object, args: object) -> bool:
        return isinstance(name, str) and name in self.names and isinstance(args, dict)

    def _call(self, name: str, arguments: str) -> dict:
        return {"id": new_call_id(self.fmt), "type": "function", "function": {"name": name, "arguments": arguments}}

    def _tagged(self) -> str:
        """The held text with its whole `<tool_call>` calls taken out, up to what may open one."""
        out = []
        while True:
            start = self._held.find(HERMES_OPEN)
            if start < 0:
                keep = partial_suffix(self._held, (HERMES_OPEN,))
                out.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            end = self._held.find(HERMES_CLOSE, start)
            if end < 0:
                out.append(self._held[:start])
                self._held = self._held[start:]
                if len(self._held) > MAX_CALL_CHARS:  # never closed: the model's text after all
                    out.append(self._held)
                    self._held = ""
                break
            body = self._held[start + len(HERMES_OPEN):end]
            out.append(self._held[:start] if self._take_hermes(body) else self._held[: end + len(HERMES_CLOSE)])
            self._held = self._held[end + len(HERMES_CLOSE):]
        return "".join(out)

    def _take_hermes(self, body: str) -> bool:
        body = body.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].strip()
        call = _json_object(body) if not body.startswith("<function=") else self._xml_call(body)
        if call is None or call.get("name") not in self.names:
            return False
        args = call.get("arguments", call.get("parameters", {}))
        if isinstance(args, str):
            args = _json_object(args)
        if not isinstance(args, dict):
            return False
        self.calls.append(self._call(call["name"], json.dumps(args, ensure_ascii=False)))
        return True


    def _xml_call(self, body: str) -> dict | None:
        """`<function=NAME><parameter=KEY>value</parameter>…</function>` as {"name", "arguments"}:
        a value is JSON where its schema says it is not a string and it parses, else the text."""
        m = XML_FUNCTION.fullmatch(body)
        if m is None:
            return None
        name, inner = m.group(1), m.group(2)
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args = {}
        for key, value in XML_PARAMETER.findall(inner):
            value = value.removeprefix("\n").removesuffix("\n")
            kind = (props.get(key) or {}).get("type") if isinstance(props.get(key), dict) else None
            if kind != "string":
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            args[key] = value
        return {"name": name, "arguments": args}


FENCE = re.compile(r"^\s*```(?:json|xml)?\s*\n(.*?)\n?\s*```\s*$", re.DOTALL)


def _opens_call(lead: str) -> bool | None:
    """Whether a reply beginning `lead` may be one JSON call (None: not known yet)."""
    if not lead:
        return None
    if lead.startswith("{") or lead.startswith(PYTHON_TAG):
        return True
    if PYTHON_TAG.startswith(lead):
        return None
    if not lead.startswith("`"):
        return False
    line, newline, rest = lead.partition("\n")
    if not newline:
        return None if any(fence.startswith(line) for fence in ("```json", "```xml")) else False
    if line.strip() not in ("```", "```json", "```xml"):
        return False
    rest = rest.lstrip()
    return None if not rest else rest.startswith("{")


def _unfenced(text: str) -> str:
    m = FENCE.match(text)
    return m.group(1) if m else text


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
