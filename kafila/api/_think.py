"""A reply's leading `<think>…</think>` block apart from the reply (sans-I/O), as llama-server
returns it by default (reasoning_format "deepseek"): the block's text is the answer's
`reasoning_content` (Ollama: `thinking`), what follows it the `content`.

Qwen 3, Qwen 3.5, DeepSeek-R1 and the templates that copy them think so. Only a block that opens
the reply is thinking (text that merely mentions the tags later stays the reply's); a template
whose generation prompt already opened the block (Qwen 3.5 ends it with `<think>\\n`) starts the
answer inside it. Whitespace around the thinking, and between it and the reply, is neither's. A
block never closed (the answer ran out of tokens) is all thinking.
"""

from __future__ import annotations

from kafila.api._stops import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


def think_mode(tokenizer, prompt_ids: list[int]) -> str | None:
    """None when the model's template does not think in tags, "inside" when the prompt ends
    inside an opened block, else "start" (the reply may open one)."""
    template = tokenizer.chat_template or ""
    if OPEN not in template or CLOSE not in template:
        return None
    tail = tokenizer.decode(list(prompt_ids[-4:])) if prompt_ids else ""
    return "inside" if tail.rstrip().endswith(OPEN) else "start"


class ThinkSplit:
    """`feed(text)` → (reply text, thinking text) now known; `finish()` the same for what is held."""

    def __init__(self, mode: str) -> None:
        self.state = "inside" if mode == "inside" else "start"  # start → inside → after
        self.held = ""
        self._lead = True  # at the start of the thinking or of the reply: whitespace is dropped

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reply, thinking = [], []
        while True:
            if self.state == "start":
                lead = self.held.lstrip()
                if lead.startswith(OPEN):
                    self.held, self.state, self._lead = lead[len(OPEN):], "inside", True
                    continue
                if not lead or OPEN.startswith(lead):
                    return "", ""  # may still open a block
                self.state, self._lead = "after", False
                continue
            if self.state == "inside":
                if self._lead:
                    self.held = self.held.lstrip()
                    if not self.held:
                        break
                    self._lead = False
                end = self.held.find(CLOSE)
                if end >= 0:
                    thinking.append(self.held[:end].rstrip())
                    self.held, self.state, self._lead = self.held[end + len(CLOSE):], "after", True
                    continue
                # what may begin the closing tag, and whitespace before it, waits: it may end the block
                body = self.held[: len(self.held) - partial_suffix(self.held, (CLOSE,))].rstrip()
                keep = len(self.held) - len(body)
                thinking.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
            if self._lead:
                self.held = self.held.lstrip()
                if not self.held:
                    break
                self._lead = False
            reply.append(self.held)
            self.held = ""
            break
        return "".join(reply), "".join(thinking)

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "inside":
            return "", held.rstrip()
        return (held.lstrip() if self._lead else held), ""

