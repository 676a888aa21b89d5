"""The tool-call forms whose calls close the answer (sans-I/O): Mistral's `[TOOL_CALLS]`, DeepSeek's
`<｜tool▁calls▁begin｜>` and DSML blocks, and Gemma 4's `<|tool_call>call:`. Each is read as
llama.cpp's parser for the family reads it (common/parsers/ministral3.cpp, deepseek.cpp,
gemma4.cpp): the text before the opener is the reply, and from the opener on the answer is calls
until it ends. `parse(fmt, text)` gives [(name, arguments)] for the text from the opener, or None
when it is not calls in that form (then the text is the reply, as the model wrote it).
"""

from __future__ import annotations

import json
import re

GEMMA_QUOTE = '<|"|>'
OPENERS: dict[str, tuple[str, ...]] = {
    # Mistral Small 3.x / Ministral 3 / Devstral: [TOOL_CALLS]NAME[CALL_ID]ID?[ARGS]{…}, one per call;
    # Mistral Nemo: [TOOL_CALLS][{"name", "arguments", "id"}, …]
    "mistral": ("[TOOL_CALLS]",),
    # DeepSeek R1 (function<｜tool▁sep｜>NAME then a ```json fence) and V3.1 (NAME<｜tool▁sep｜>{…})
    "deepseek": ("<｜tool▁calls▁begin｜>",),
    # DeepSeek V3.2 (function_calls) and V4 (tool_calls): invoke/parameter elements
    "dsml": ("<｜DSML｜function_calls>", "<｜DSML｜tool_calls>"),
    "gemma4": ("<|tool_call>",),
}
# every token of a form's syntax, shown by the decoder though a vocabulary may mark it a control
# token (llama.cpp's preserved tokens)
MARKERS: dict[str, tuple[str, ...]] = {
    "mistral": ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"),
    "deepseek": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁sep｜>"),
    "dsml": ("｜DSML｜",),
    "gemma4": ("<|tool_call>", "<tool_call|>", GEMMA_QUOTE),
}
CALL_IDS_OF_NINE = frozenset({"mistral"})  # Mistral's templates refuse any other call id

_DECODER = json.JSONDecoder()
DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
DS_FENCE = re.compile(r"^\s*```(?:json)?\s*\n(.*?)\n?\s*```\s*$", re.DOTALL)
DSML_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"\n]{1,64})">(.*?)</｜DSML｜invoke>', re.DOTALL)
DSML_PARAM = re.compile(r'<｜DSML｜parameter name="([^"\n]{1,128})" string="(true|false)">(.*?)</｜DSML｜parameter>',
                        re.DOTALL)  # fmt: skip

Calls = list[tuple[str, object]]


def parse(fmt: str, text: str) -> Calls | None:
    try:
        return _PARSERS[fmt](text)
    except (ValueError, IndexError, TypeError):  # not calls in that form (_after, _tiled, JSON)
        return None


def _after(text: str, mark: str) -> str:
    """`text` past its leading `mark`; ValueError when it does not start so."""
    if not text.startswith(mark):
        raise ValueError(f"expected {mark}")
    return text[len(mark):]


def _tiled(pattern: re.Pattern, text: str) -> list[re.Match]:
    """The matches of `pattern` that make up all of `text` but whitespace; ValueError when
    anything else stands between or around them."""
    found, at = [], 0
    for m in pattern.finditer(text):
        if text[at:m.start()].strip():
            raise ValueError("text between the elements")
        found.append(m)
        at = m.end()
    if text[at:].strip():
        raise ValueError("text after the elements")
    return found


def _mistral(text: str) -> Calls:
    calls: Calls = []
    rest = text.strip()
    while rest:
        rest = _after(rest, "[TOOL_CALLS]").lstrip()
        if rest.startswith("["):  # Nemo's list
            listed, end = _DECODER.raw_decode(rest)
            if not isinstance(listed, list) or not all(isinstance(c, dict) for c in listed):
                raise ValueError("not a list of calls")
            calls += [(c.get("name"), c.get("arguments", {})) for c in listed]
        else:
            head, args_sep, after = rest.partition("[ARGS]")
            if not args_sep:
                raise ValueError("no [ARGS]")
            rest = after.lstrip()
            args, end = _DECODER.raw_decode(rest)
            calls.append((head.partition("[CALL_ID]")[0].strip(), args))
        rest = rest[end:].lstrip()
    return calls


def _deepseek(text: str) -> Calls:
    body = _after(text.strip(), "<｜tool▁calls▁begin｜>").removesuffix("<｜tool▁calls▁end｜>")
    calls: Calls = []
    for m in _tiled(DS_CALL, body):
        head, tail = m.group(1).strip(), m.group(2)
        if head == "function" and "\n" in tail:  # R1: the name, then the arguments fenced
            name, _, args = tail.partition("\n")
            fenced = DS_FENCE.match(args)
            args = fenced.group(1) if fenced else args
        else:  # V3.1: the name before the separator
            name, args = head, tail
        calls.append((name.strip(), json.loads(args)))
    return calls


def _dsml(text: str) -> Calls:
    text = text.strip()
    block = "function_calls" if text.startswith("<｜DSML｜function_calls>") else "tool_calls"  # V3.2, V4
    body, _, after = _after(text, f"<｜DSML｜{block}>").partition(f"</｜DSML｜{block}>")
    if after.strip():
        raise ValueError("text after the block")
    calls: Calls = []
    for m in _tiled(DSML_INVOKE, body):
        args = {}
        for p in _tiled(DSML_PARAM, m.group(2)):
            key, is_string, value = p.groups()
            args[key] = value if is_string == "true" else json.loads(value)
        calls.append((m.group(1), args))
    return calls


def _gemma4(text: str) -> Calls:
    calls: Calls = []
    rest = text.strip()
    while rest:
        rest = _after(rest, "<|tool_call>call:")
        brace = rest.index("{")
        name = rest[:brace]
        args, end = _GemmaValue(rest, brace).dict()
        rest = _after(rest[end:], "<tool_call|>").strip()
        calls.append((name, args))
    return calls


class _GemmaValue:
    """Gemma 4's argument syntax (its template's format_argument): strings between <|"|> marks,
    bare (or marked) keys, JSON numbers, true, false and null, {…} and […]."""

    def __init__(self, text: str, at: int) -> None:
        self.text, self.at = text, at

    def dict(self) -> tuple[dict, int]:
        return self._dict(), self.at

    def _value(self) -> object:
        self._space()
        t = self.text
        if t.startswith(GEMMA_QUOTE, self.at):
            return self._string()
        if t[self.at] == "{":
            return self._dict()
        if t[self.at] == "[":
            self.at += 1
            items = []
            while not self._take("]"):
                if items and not self._take(","):
                    raise ValueError("expected , or ]")
                items.append(self._value())
            return items
        value, self.at = _DECODER.raw_decode(t, self.at)  # a number, true, false or null
        if isinstance(value, (dict, list, str)):
            raise ValueError("JSON text where Gemma 4 writes its own")
        return value

    def _dict(self) -> dict:
        if not self._take("{"):
            raise ValueError("expected {")
        out: dict = {}
        while not self._take("}"):
            if out and not self._take(","):
                raise ValueError("expected , or }")
            self._space()
            if self.text.startswith(GEMMA_QUOTE, self.at):
                key = self._string()
            else:
                end = min(i for i in (self.text.find(":", self.at), self.text.find("}", self.at)) if i >= 0)
                key, self.at = self.text[self.at:end].strip(), end
            if not key or not self._take(":"):
                raise ValueError("expected key:")
            out[key] = self._value()
        return out

    def _string(self) -> str:
        start = self.at + len(GEMMA_QUOTE)
        end = self.text.index(GEMMA_QUOTE, start)
        self.at = end + len(GEMMA_QUOTE)
        return self.text[start:end]

    def _take(self, mark: str) -> bool:
        self._space()
        if self.text.startswith(mark, self.at):
            self.at += len(mark)
            return True
        return False

    def _space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1


_PARSERS = {"mistral": _mistral, "deepseek": _deepseek, "dsml": _dsml, "gemma4": _gemma4}
