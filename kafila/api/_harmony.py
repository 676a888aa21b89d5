"""gpt-oss's harmony answers: which of an answer's tokens are thinking, which the reply (sans-I/O).

A harmony model answers in messages, each a header and a body:

    <|channel|>analysis<|message|>…thinking…<|end|><|start|>assistant<|channel|>final<|message|>…reply…<|return|>

The chat template's generation prompt ends with `<|start|>assistant`, so the first header begins
at the channel. As llama-server returns it, the analysis channel's text is the reply's
`reasoning_content` (Ollama: `thinking`) and the other channels' text (final, and commentary
meant for the user) its `content`; markers and headers are neither. A commentary message addressed
`to=functions.NAME` is a tool call: its body goes to _tools.py. Tokens are routed by id, not
by text: the markers are control tokens that decoding drops. `<|return|>` and `<|call|>` end the
generation (the tokenizer's end-of-generation set); `<|end|>` only ends a message.
"""

from __future__ import annotations

START, CHANNEL, MESSAGE, END, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
THINKING_CHANNEL = "analysis"
MAX_HEADER_TOKENS = 64  # a header longer than this is not a header: its text is the reply's


class Harmony:
    """One answer's router: `feed(token)` gives the tokens whose text is now known to be thinking
    or reply, each with where it goes ("reasoning" or "content")."""

    def __init__(self, marker_ids: dict[str, int], piece) -> None:
        self.ids = marker_ids
        self._piece = piece  # token id -> its text (for a header's channel name)
        self._header: list[int] | None = []  # the tokens of the header being read; None: in a body
        self.channel = ""
        self.recipient = ""  # the function a commentary message calls ("to=functions.NAME"), or ""

    @classmethod
    def of(cls, tokenizer) -> Harmony | None:
        """A router when the tokenizer has harmony's markers (gpt-oss), else None."""
        ids = {marker: tokenizer.token_to_id(marker) for marker in MARKERS}
        if any(i is None for i in ids.values()):
            return None
        return cls(ids, lambda t: tokenizer.piece(t, False).decode("utf-8", errors="replace"))

    def feed(self, token: int) -> list[tuple[str, int]]:
        ids = self.ids
        if token == ids[MESSAGE]:
            self.channel = self._channel_name()
            self.recipient = self._recipient()
            self._header = None
            return []
        if token in (ids[END], ids[START]):
            self._header = []  # the next message's header
            return []
        if self._header is None:
            if self.recipient:
                return [("tool", token)]
            return [("reasoning" if self.channel == THINKING_CHANNEL else "content", token)]
        self._header.append(token)
        if len(self._header) <= MAX_HEADER_TOKENS:
            return []
        # not a header after all (a model that left harmony): its text is the reply's
        held = [t for t in self._header if t not in ids.values()]
        self._header, self.channel, self.recipient = None, "", ""
        return [("content", t) for t in held]

    def flush(self) -> list[int]:
        """At the answer's end: a header still open that never named a channel was text, the reply's."""
        header, self._header = self._header or [], []
        if self.ids[CHANNEL] in header:
            return []
        return [t for t in header if t not in self.ids.values()]

    def _channel_name(self) -> str:
        """The word after <|channel|> in the header ("analysis", "final", "commentary")."""
        header = self._header or []
        if self.ids[CHANNEL] not in header:
            return ""
        after = header[header.index(self.ids[CHANNEL]) + 1:]
        words = "".join(self._piece(t) for t in after if t not in self.ids.values()).split()
        return words[0] if words else ""

    def _recipient(self) -> str:
        """The function the header addresses (`to=functions.NAME`, before or after the channel)."""
        from kafila.api._tools import HARMONY_RECIPIENT

        text = "".join(self._piece(t) for t in self._header or () if t not in self.ids.values())
        m = HARMONY_RECIPIENT.search(text)
        return m.group(1) if m else ""
