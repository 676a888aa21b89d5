"""Tokenizer and chat template from GGUF metadata, with the `tokenizers` library (no hub)."""

from __future__ import annotations

from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kafila.errors import BadInput
from kafila.models.gguf_index import ModelIndex

TOKEN_TYPE_CONTROL = 3  # GGUF token_type for special tokens
DIGIT_SPLIT_PRETOKENIZERS = ("smollm", "qwen2", "llama-bpe")  # pre-tokenizers that isolate digits


@dataclass
class Tokenizer:
    backend: object  # tokenizers.Tokenizer
    eos_ids: frozenset[int]
    bos_token: str
    eos_token: str
    chat_template: str | None
    add_bos: bool
    bos_id: int | None

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` ([{"role", "content"}])."""
        if not self.chat_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise BadInput(f"the model's chat template failed: {exc}") from None


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character still incomplete
        piece, self.emitted = text[len(self.emitted):], text
        return piece


def load_tokenizer(index: ModelIndex) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    md = index.metadata
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise BadInput(f"tokenizer model {kind!r} is not supported (Kafila reads byte-level BPE, 'gpt2')")
    tokens = list(md["tokenizer.ggml.tokens"])
    types = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if md.get("tokenizer.ggml.pre") in DIGIT_SPLIT_PRETOKENIZERS:
        pre.insert(0, pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"))
    hf.pre_tokenizer = pre_tokenizers.Sequence(pre)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL]
    )
    eos = md.get("tokenizer.ggml.eos_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos_ids = {int(eos)} if eos is not None else set()
    im_end = vocab.get("<|im_end|>")  # chat models end turns with it even when eos differs
    if im_end is not None:
        eos_ids.add(im_end)
    return Tokenizer(
        backend=hf,
        eos_ids=frozenset(eos_ids),
        bos_token=tokens[int(bos)] if bos is not None else "",
        eos_token=tokens[int(eos)] if eos is not None else "",
        chat_template=md.get("tokenizer.chat_template"),
        add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)),
        bos_id=int(bos) if bos is not None else None,
    )
