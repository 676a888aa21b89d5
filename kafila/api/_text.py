"""An answer's tokens → its text for one request (sans-I/O): UTF-8-safe decoding, the end of
generation and stop sequences; a harmony model's thinking apart (_harmony.py); the tools' calls
taken out of the reply (_tools.py). And a chat's prompt ids, the tools shown to the model."""

from __future__ import annotations

from kafila.api._harmony import Harmony
from kafila.api._stops import StopScanner
from kafila.api._think import ThinkSplit
from kafila.api._tools import ToolCalls, tool_format
from kafila.api._validate import bad
from kafila.engine import GenerationStats
from backends.errors import BadInput
from kafila.models import StreamDecoder


def chat_prompt_ids(tokenizer, messages: list[dict], tools: tuple[dict, ...] = ()) -> list[int]:
    """The token ids of a chat: the model's template (shown the tools offered), then the tokenizer
    (as `kafila run` does)."""
    return chat_prompt(tokenizer, messages, tools)[0]


def chat_prompt(tokenizer, messages: list[dict], tools: tuple[dict, ...] = ()) -> tuple[list[int], int]:
    """(the chat's token ids, where its messages end): the ids of the messages rendered without
    the template's answer prefix, when they begin the prompt's ids, else 0. A hybrid model's
    stages keep their state there (GenerationRequest.keep_at): the next turn repeats the
    messages, not always that prefix (Qwen3.5's `<|im_start|>assistant\n<think>\n`)."""
    extra = {"tools": list(tools)} if tools else {}
    ids = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True, **extra))
    try:
        head = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=False, **extra))
    except BadInput:  # a template that cannot end on the messages (some want a user last)
        return ids, 0
    return ids, (len(head) if 0 < len(head) < len(ids) and ids[: len(head)] == head else 0)


def tool_calls_for(tokenizer, tools: tuple[dict, ...]) -> ToolCalls | None:
    """The reader of an answer's calls when tools are offered; 400 when the model cannot take them."""
    if not tools:
        return None
    fmt = tool_format(tokenizer)
    if fmt is None:
        raise bad("unsupported", "this model's chat template shows the model no tools in a form Kafila reads "
                  "(it reads gpt-oss's harmony calls, the <tool_call> forms of Qwen 2.5/3/3.5, Llama 3.x's JSON, "
                  "Mistral's [TOOL_CALLS], DeepSeek's and Gemma 4's)", "tools")  # fmt: skip
    return ToolCalls(fmt, frozenset(t["function"]["name"] for t in tools),
                     {t["function"]["name"]: t["function"]["parameters"] for t in tools})


class TextStream:
    """Token ids → text pieces for one answer: UTF-8-safe decoding, EOS and stop sequences; with
    `channels` and a harmony tokenizer (gpt-oss), its thinking apart from its reply (_harmony.py);
    with `think` (think_mode), a leading <think> block apart (_think.py)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], channels: bool = False, tools: ToolCalls | None = None,
                 think: str | None = None) -> None:  # fmt: skip
        shown = (tokenizer.token_to_id(m) for m in tools.markers) if tools is not None else ()
        self.decoder = StreamDecoder(tokenizer, frozenset(i for i in shown if i is not None))
        self.thinking = StreamDecoder(tokenizer)
        self.called = StreamDecoder(tokenizer)  # a harmony call's arguments
        self.harmony = Harmony.of(tokenizer) if channels else None
        self.think = ThinkSplit(think) if think and self.harmony is None else None
        self.tools = tools  # the calls in the reply, when the request offered tools (_tools.py)
        self.tool_calls: list[dict] = []
        self.scanner = StopScanner(stops)
        self.eos_ids = tokenizer.eos_ids
        self.tokens = 0  # new tokens received, EOS excluded (thinking included, as OpenAI counts)
        self.finish: str | None = None  # "stop" once an EOS or a stop sequence arrived

    def push(self, token: int) -> tuple[str, str]:
        """(reply text, thinking text) that this token completes; stop sequences end the reply."""
        if token in self.eos_ids:
            self.finish = "stop"
            return "", ""
        self.tokens += 1
        routed = [("content", token)] if self.harmony is None else self.harmony.feed(token)
        tools = self.tools
        if tools is None:  # a call nobody offered a tool for is text
            routed = [("content" if where == "tool" else where, t) for where, t in routed]
        reply = "".join(self.decoder.push(t) for where, t in routed if where == "content")
        thinking = "".join(self.thinking.push(t) for where, t in routed if where == "reasoning")
        if self.think is not None and reply:
            reply, thought = self.think.feed(reply)
            thinking += thought
        if tools is not None:
            called = "".join(self.called.push(t) for where, t in routed if where == "tool")
            if called and self.harmony is not None:
                tools.harmony(self.harmony.recipient, called)
            reply = tools.reply(reply) if reply else ""
        piece = self.scanner.feed(reply) if reply else ""
        if self.scanner.stopped:
            self.finish = "stop"
        return piece, thinking

    def end(self, stats: GenerationStats) -> tuple[str, str]:
        """The held-back tail and the finish reason once the generation is over."""
        finish = self.finish or ("stop" if stats.finish_reason == "stop" else "length")
        held = self.harmony.flush() if self.harmony is not None else []
        text = "".join(self.decoder.push(t) for t in held)
        if self.think is not None:  # a block never closed: its thinking went out as it came
            text = self.think.finish()[0] + text
        if self.tools is not None:
            text = self.tools.reply(text) if text else ""
            rest, self.tool_calls = self.tools.finish()
            text += rest
            if self.tool_calls:
                finish = "tool_calls"
        reply = self.scanner.feed(text) if text else ""
        return reply + self.scanner.flush(), finish
