"""Tokenizer and chat template from GGUF metadata, tokenizing as llama.cpp does (no hub).

`tokenizer_from_metadata(md)` builds a `Tokenizer` from the `tokenizer.*` keys of a GGUF file:
byte-level BPE (`tokenizer.ggml.model = "gpt2"`, with the pre-tokenizer `tokenizer.ggml.pre`
names, or llama.cpp's 'default' one where that key is absent), SentencePiece (`"llama"`) or
Gemma 4's BPE over SentencePiece-style text (`"gemma4"`); the algorithms are in `kafila.models.vocab`. Anything else
is refused with BadInput rather than approximated. `load_tokenizer(index)` serves an opened
model; `load_tokenizer_file(path)` reads only the metadata, so a vocabulary-only GGUF is enough.
"""

from __future__ import annotations

import collections.abc
import datetime
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backends.errors import BadInput
from backends.gguf.header import read_header
from backends.memory import trim_heap
from kafila.models import vocab as V

# A file without a chat template (base models): llama-server's fallback, ChatML, not a made-up form
CHATML_TEMPLATE = ("{%- for message in messages -%}{{- '<|im_start|>' + message.role + '\\n' + message.content "
                   "+ '<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}"
                   "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")  # fmt: skip
SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")  # byte-level BPE, SentencePiece, Gemma 4's BPE over "▁" text
# llama.cpp's (bos, eos) when the keys are absent (gemma4: none)
DEFAULT_SPECIAL_IDS = {"llama": (1, 2), "gpt2": (11, 11), "gemma4": (None, None)}


@dataclass
class Tokenizer:
    """A GGUF vocabulary: encode/decode as llama.cpp does, chat template, end-of-generation ids."""

    model: V.BpeModel | V.SpmModel
    kind: str  # tokenizer.ggml.model: "gpt2", "llama" or "gemma4"
    tokens: list[str] = field(repr=False)
    types: list[int] = field(repr=False)  # GGUF token types, after llama.cpp's by-text overrides
    specials: list[tuple[str, int, bool, bool]] = field(repr=False)  # (text, id, lstrip, rstrip), longest first
    eos_ids: frozenset[int]  # end-of-generation: eos, eot, <|im_end|>, <|eot_id|>, … (llama.cpp's EOG set)
    bos_token: str
    eos_token: str
    chat_template: str | None
    add_bos: bool
    bos_id: int | None
    add_eos: bool = False
    eos_id: int | None = None
    add_space_prefix: bool = False  # SentencePiece: "▁" before the text and after each special token

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`: BOS/EOS as the model asks when `add_special`; special-token text
        (`<|im_start|>`…) becomes its token when `parse_special` (user-defined tokens always do)."""
        specials = self.specials
        if not parse_special:
            specials = [s for s in specials if self.types[s[1]] not in V.HIDDEN_TYPES]
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        prev_special = True  # SentencePiece prefixes the first fragment with a space
        for part in V.partition_special(text, specials):
            if isinstance(part, int):
                ids.append(part)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                part = " " + part
            ids.extend(self.model.encode(part))
            prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def piece(self, token: int, special: bool = True) -> bytes:
        """The bytes one token stands for (llama.cpp's token_to_piece); b"" for hidden special tokens."""
        if not 0 <= token < len(self.tokens):
            raise BadInput(f"token id {token} is outside the vocabulary (0..{len(self.tokens) - 1})")
        text, kind = self.tokens[token], self.types[token]
        if kind in V.HIDDEN_TYPES:
            return text.encode() if special else b""
        if kind == V.TYPE_USER_DEFINED:
            return text.encode()
        if kind == V.TYPE_BYTE:
            return bytes([int(text[3:5], 16)])
        if kind != V.TYPE_NORMAL:
            return b""  # unused/undefined tokens render as nothing
        if self.kind in ("llama", "gemma4"):  # "▁" stands for a space
            return text.replace(V.SPACE_ESCAPE, " ").encode()
        out = bytearray()
        for c in text:
            b = V.CHAR_TO_BYTE.get(c)
            if b is None:
                out += f"[UNK_BYTE_0x{c.encode().hex()}{text}]".encode()
            else:
                out.append(b)
        return bytes(out)

    def decode_bytes(self, ids: list[int], *, special: bool = False, shown: frozenset[int] = frozenset()) -> bytes:
        """The bytes of `ids`, token pieces joined (llama.cpp's llama_detokenize, two choices apart).

        SentencePiece's added leading space is removed from the first token even after a BOS (as
        llama-cpp-python and Hugging Face do; llama.cpp keeps it there), so decode∘encode round-trips;
        and the lossy "clean_spaces" pass llama.cpp applies to some BPE vocabularies (" ," → ",")
        is not applied: the text is exactly what the tokens spell.
        """
        pieces = [self.piece(t, special or t in shown) for t in ids]
        if self.add_space_prefix and pieces:
            first = 1 if ids[0] == self.bos_id and len(pieces) > 1 else 0
            if pieces[first].startswith(b" "):
                pieces[first] = pieces[first][1:]
        return b"".join(pieces)

    def decode(self, ids: list[int], *, special: bool = False) -> str:
        """Text of `ids` (see decode_bytes); control tokens are left out unless `special`."""
        return self.decode_bytes(ids, special=special).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_to_id(self, text: str) -> int | None:
        return self.model.token_to_id.get(text)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The chat template applied to `messages` ([{"role", "content"}]); `extra` reaches the
        template as variables (`tools`, `enable_thinking`, …). A leading BOS text is dropped when
        encode adds BOS itself (llama.cpp does the same), so the prompt never starts with two."""
        try:
            template = _compiled(self.chat_template or CHATML_TEMPLATE)
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise BadInput(f"the model's chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            # the template's own Python-level operations on these messages (a dict added to a string, …)
            raise BadInput(f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}") from None
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


class _TemplateError(jinja2.TemplateError):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False) -> str:
    # Hugging Face's tojson: plain JSON (jinja2's own escapes <, >, & and ' for HTML); a filter's
    # sequence (`tools | map(attribute='function')` is a generator in jinja2) as the list it is
    # in llama.cpp's template engine
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys,
                      default=_listed)  # fmt: skip


def _listed(value):
    if isinstance(value, collections.abc.Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _Generation(jinja2.ext.Extension):
    """Hugging Face's `{% generation %}…{% endgeneration %}` (it marks the assistant's tokens for
    training masks): its body, as is."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """A chat template compiled once (every request renders the same model's template)."""
    return _chat_environment().from_string(template)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox chat templates run in, with what Hugging Face's renderer provides."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _Generation])  # fmt: skip
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: Tokenizer, shown: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.shown = shown  # control tokens shown as their text (a tool-call form's markers)
        self.ids: list[int] = []
        self.emitted = ""
        self._bytes = b""  # decode_bytes(ids), grown a piece at a time (not re-joined per token)

    def push(self, token: int) -> str:
        self.ids.append(token)
        if len(self.ids) <= 2:  # the leading-space rule looks at the first two tokens only
            self._bytes = self.tokenizer.decode_bytes(self.ids, shown=self.shown)
        else:
            self._bytes += self.tokenizer.piece(token, token in self.shown)
        text = self._bytes.decode("utf-8", errors="replace")
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character still incomplete
        piece, self.emitted = text[len(self.emitted):], text
        return piece


# ---- building a Tokenizer from metadata ------------------------------------------------------


def _supported_pre() -> str:
    return ", ".join(sorted(V.PRETOKENIZERS))


def tokenizer_from_metadata(md: Mapping[str, object], name: str = "the model") -> Tokenizer:
    """A Tokenizer from GGUF metadata (`tokenizer.*` keys; `general.name` for phi-3's strip rule)."""
    kind = md.get("tokenizer.ggml.model")
    if kind is None:
        raise BadInput(f"{name} has no tokenizer (no tokenizer.ggml.model key)")
    if kind not in SUPPORTED_MODELS:
        raise BadInput(f"{name}: tokenizer model {kind!r} is not supported "
                       f"(Kafila reads 'gpt2' byte-level BPE, 'llama' SentencePiece and 'gemma4' BPE)")  # fmt: skip
    if "tokenizer.ggml.tokens" not in md:
        raise BadInput(f"{name} lacks tokenizer.ggml.tokens")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(md["tokenizer.ggml.tokens"])]  # type: ignore[arg-type]
    n = len(tokens)
    types = [int(t) for t in md.get("tokenizer.ggml.token_type") or [V.TYPE_NORMAL] * n]  # type: ignore[union-attr]
    if len(types) < n:
        raise BadInput(f"{name}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    types = types[:n]
    token_to_id = {t: i for i, t in enumerate(tokens)}

    add_space_prefix = False
    if kind in ("gpt2", "gemma4"):
        # no tokenizer.ggml.pre: llama.cpp takes its 'default' pre-tokenizer (with a warning that
        # output may degrade: the model's own was not recorded); gemma4 sets its own
        pre_name = "gemma4" if kind == "gemma4" else md.get("tokenizer.ggml.pre", "default")
        pre = V.PRETOKENIZERS.get(str(pre_name))
        if pre is None:
            raise BadInput(f"{name}: pre-tokenizer {pre_name!r} is not supported; Kafila supports: {_supported_pre()}")
        if "tokenizer.ggml.merges" not in md:
            raise BadInput(f"{name} lacks tokenizer.ggml.merges (needed by BPE)")
        merges = list(md["tokenizer.ggml.merges"])  # type: ignore[call-overload]
        model: V.BpeModel | V.SpmModel = V.BpeModel(token_to_id, merges, pre)
        add_bos, add_eos = pre.add_bos, False
    else:
        scores = [float(s) for s in md.get("tokenizer.ggml.scores") or [0.0] * n]  # type: ignore[union-attr]
        if len(scores) < n:
            raise BadInput(f"{name}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
        model = V.SpmModel(token_to_id, scores)
        add_bos, add_eos, add_space_prefix = True, False, True
    add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos)) or kind == "gemma4"  # llama.cpp forces it (its PR 21500)
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", add_eos))

    def special_id(key: str, default: int | None) -> int | None:
        value = md.get(key)
        if value is not None and 0 <= int(value) < n:  # type: ignore[call-overload]
            return int(value)  # type: ignore[call-overload]
        return default if default is not None and 0 <= default < n else None

    bos_default, eos_default = DEFAULT_SPECIAL_IDS[str(kind)]
    bos = special_id("tokenizer.ggml.bos_token_id", bos_default)
    eos = special_id("tokenizer.ggml.eos_token_id", eos_default)
    eos_ids = _mark_special(tokens, token_to_id, types, eos, special_id)
    rstrip = _phi3_rstrip(md, tokens, token_to_id, types)
    special_ids = sorted((i for i, ty in enumerate(types) if ty in V.SPECIAL_TYPES), key=lambda i: -len(tokens[i]))
    specials = [(tokens[i], i, False, i in rstrip) for i in special_ids]
    template = md.get("tokenizer.chat_template")
    return Tokenizer(
        model=model, kind=str(kind), tokens=tokens, types=types, specials=specials,
        eos_ids=frozenset(eos_ids),
        bos_token=tokens[bos] if bos is not None else "",
        eos_token=tokens[eos] if eos is not None else "",
        chat_template=str(template) if template else None,
        add_bos=add_bos and bos is not None, bos_id=bos,
        add_eos=add_eos and eos is not None, eos_id=eos,
        add_space_prefix=add_space_prefix,
    )  # fmt: skip


def _mark_special(tokens, token_to_id, types, eos, special_id) -> set[int]:
    """llama.cpp's by-text fix-ups of token types, and its end-of-generation (EOG) set.

    Fill-in-the-middle and end-of-turn tokens become control tokens; EOG is eos, eot, eom, the FIM
    pad/repo/separator tokens and the end-of-turn tokens by text (`<|eot_id|>`, `<|im_end|>`, …).
    Mutates `types`.
    """
    eog: set[int] = set()
    for key, ends, texts in V.FIM_TEXTS:
        found = special_id(key, None)
        if found is None:
            found = next((token_to_id[t] for t in texts if t in token_to_id), None)
            if found is not None:
                types[found] = V.TYPE_CONTROL
        if found is not None and ends:
            eog.add(found)
    for t, i in token_to_id.items():
        if t in V.EOG_TEXTS:
            eog.add(i)
            types[i] = V.TYPE_CONTROL
    for t in V.ALWAYS_RENDERED:
        if t in token_to_id:
            types[token_to_id[t]] = V.TYPE_USER_DEFINED
    eot, eom = special_id("tokenizer.ggml.eot_token_id", None), special_id("tokenizer.ggml.eom_token_id", None)
    for found in (eos, eot, eom):
        if found is not None:
            eog.add(found)
    texts = {tokens[i]: i for i in eog}
    if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                               or ("<|calls|>" in texts and "<|flush|>" in texts)):  # fmt: skip
        eog.discard(texts["<|end|>"])  # o200k_harmony / solar-open: <|end|> ends a message, not generation
        types[texts["<|end|>"]] = V.TYPE_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])  # gemma4 and plamo have a normal </s>
        types[texts["</s>"]] = V.TYPE_NORMAL
    return eog


def _phi3_rstrip(md, tokens, token_to_id, types) -> set[int]:
    """Phi-3's special tokens swallow the whitespace after them (llama.cpp keys this on general.name)."""
    model_name = str(md.get("general.name") or "").lower()
    if "phi-3" not in model_name and "phi3" not in model_name:
        return set()
    ids = {i for i, ty in enumerate(types) if ty in V.SPECIAL_TYPES}
    ids |= {token_to_id["</s>"]} if "</s>" in token_to_id else set()
    return ids - {token_to_id[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in token_to_id}


def load_tokenizer(index) -> Tokenizer:
    """The tokenizer of an opened model (kafila.models.ModelIndex). Its metadata is read apart,
    not kept on the index: the vocabulary's arrays as Python objects (Llama 3: 408k strings) are
    not needed once the tokenizer is built, and every member process loads one."""
    return load_tokenizer_file(index.path)


def load_tokenizer_file(path: str) -> Tokenizer:
    """The tokenizer of any GGUF file, reading only its metadata (a vocabulary-only GGUF is enough)."""
    tokenizer = tokenizer_from_metadata(read_tokenizer_metadata(path), name=path)
    trim_heap()  # the metadata's strings are garbage now: their pages go back
    return tokenizer


# ---- reading the metadata of a GGUF file -------------------------------------------------------


def read_tokenizer_metadata(path: str, prefixes: tuple[str, ...] = ("tokenizer.", "general.")) -> dict[str, object]:
    """The metadata keys of a GGUF file that start with `prefixes`, values as Python objects
    (backends.gguf.header: the others are skipped, tensors are never read)."""
    return read_header(path, lambda key: key.startswith(prefixes), tensors=False).metadata
