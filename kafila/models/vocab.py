"""llama.cpp's tokenization algorithms over a GGUF vocabulary: no I/O, no third-party tokenizer.

Theory of operation (the same steps as llama.cpp's `llama_vocab::tokenize`, so that the ids agree):

1. Special-token partition: the text is cut around every occurrence of a special token's text,
   longest tokens first. Control and unknown tokens take part only when `parse_special` is on;
   user-defined tokens always do (as in Hugging Face `tokenizers` and llama.cpp).
2. Each remaining text fragment goes through the vocabulary's model:
   - byte-level BPE (`tokenizer.ggml.model = "gpt2"`): the pre-tokenizer that
     `tokenizer.ggml.pre` names splits the fragment with its regexes (each regex splits the pieces
     the previous one left; text a regex does not match stays a piece of its own), every piece is
     mapped byte by byte to GPT-2's printable characters, then merged pair by pair by merge rank
     (lowest first, leftmost on ties). Llama 3's family looks a whole piece up first
     (`ignore_merges`).
   - SentencePiece (`"llama"`): spaces become "▁", a "▁" is prepended to a fragment that starts
     the text or follows a special token (`add_space_prefix`), then characters are merged pair by
     pair by the merged token's score (highest first, leftmost on ties); characters that never
     form a token fall back to `<0xXX>` byte tokens.
3. BOS/EOS are added around the result when `add_special` is on and the vocabulary asks for them.

The regexes run on the `regex` module; its Unicode tables are newer than llama.cpp's, so letters
and digits assigned by the latest Unicode versions (rare scripts, new CJK extensions) may split
differently.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import regex

# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*).
TYPE_UNDEFINED, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = range(7)
SPECIAL_TYPES = (TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNKNOWN)  # split out of the text before the model runs
HIDDEN_TYPES = (TYPE_CONTROL, TYPE_UNKNOWN)  # not parsed without parse_special, not shown without special

SPACE_ESCAPE = "\u2581"  # SentencePiece's "▁"
C_SPACE = " \t\n\v\f\r"  # C isspace(), for the lstrip/rstrip attributes

# Token texts llama.cpp marks as control and end-of-generation (llama-vocab.cpp, by text).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})  # fmt: skip
# Fill-in-the-middle tokens by key, else by text (the first text found is marked control);
# llama.cpp treats the pad/repo/file-separator ones as end-of-generation too.
FIM_TEXTS = (
    ("tokenizer.ggml.fim_pre_token_id", False, ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
     "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")),
    ("tokenizer.ggml.fim_suf_token_id", False, ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
     "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")),
    ("tokenizer.ggml.fim_mid_token_id", False, ("<|fim_middle|>", "<fim-middle>", "<fim_middle>",
     "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>")),
    ("tokenizer.ggml.fim_pad_token_id", True, ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    ("tokenizer.ggml.fim_rep_token_id", True, ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    ("tokenizer.ggml.fim_sep_token_id", True, ("<|file_sep|>",)),
)  # fmt: skip
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: user-defined


# ---- pre-tokenizers (llama.cpp's regexes per tokenizer.ggml.pre) -----------------------------

CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # (?i:'s|…) without Unicode case folding
GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_RE = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_RE = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# GPT-4o / o200k (gpt-oss, Llama 4, …): llama.cpp's own form of tokenizer.json's regex, case runs
# written as "a letter not a-z" / "a letter not A-Z" (so non-ASCII letters count as either case)
GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + CONTRACTIONS + "?"
            r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + CONTRACTIONS + "?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
QWEN35_RE = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip


CJK_RUNS = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # deepseek's [一-龥ࠀ-一가-퟿]+
DEEPSEEK_LLM_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
# deepseek-llm's letters: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, … as llama.cpp lists them.
DEEPSEEK_LLM_LETTERS = (
    "\\s?["
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370"
    "-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-"
    "\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
    "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-"
    "\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a"
    "-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-"
    "\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-"
    "\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-"
    "\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-"
    "\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
    "]+"
)  # fmt: skip


@dataclass(frozen=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` value splits text before BPE (llama.cpp's llm_tokenizer_bpe)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is taken whole
    add_bos: bool = False  # BOS default when tokenizer.ggml.add_bos_token is absent
    # Gemma 4's SentencePiece-style BPE: spaces become "▁", merges run on the raw characters (no
    # GPT-2 byte map), a run of newlines that is a token is taken whole, and a symbol that is no
    # token falls back to <0xXX> byte tokens
    sentencepiece_style: bool = False


_LLAMA3 = PreTokenizer((LLAMA3_RE,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2_RE,))
_STARCODER = PreTokenizer((r"\p{N}", GPT2_RE))  # digits one by one, then GPT-2's regex
_GPT2 = PreTokenizer((GPT2_RE,))
PRETOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((LLAMA3_RE,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open", "grok-2"), _QWEN2),
    "qwen35": PreTokenizer((QWEN35_RE,)),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizer((GPT4O_RE,))),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
                     "mellum2"), _STARCODER),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"), _GPT2),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2_RE, r"[0-9][0-9][0-9]")),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_RUNS,
                                    r"\p{N}")),
    "deepseek-llm": PreTokenizer((r"[\r\n]", DEEPSEEK_LLM_LETTERS, DEEPSEEK_LLM_PUNCTUATION, r"\s+\Z", CJK_RUNS,
                                  r"\p{N}+")),
    # llama.cpp's fallback when tokenizer.ggml.pre is absent too (GPT-2's regex without its last "|\s+")
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_RE.removesuffix(r"|\s+"), r"\p{N}+", r"[0-9][0-9][0-9]")),
    # set by tokenizer.ggml.model = "gemma4" (llama.cpp ignores the file's pre then)
    "gemma4": PreTokenizer((r"[^\n]+|[\n]+",), add_bos=True, sentencepiece_style=True),
}  # fmt: skip


@lru_cache(maxsize=None)
def _compiled(pattern: str):
    return regex.compile(pattern)


def split_words(text: str, regexes: tuple[str, ...]) -> list[str]:
    """Cut `text` with each regex in turn; text between matches stays a piece (llama.cpp's split)."""
    pieces = [text]
    for pattern in regexes:
        rx = _compiled(pattern)
        out: list[str] = []
        for piece in pieces:
            at = 0
            for m in rx.finditer(piece):
                if m.start() > at:
                    out.append(piece[at:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                at = max(at, m.end())
            if at < len(piece):
                out.append(piece[at:])
        pieces = out
    return pieces


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (its byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


# ---- pair merging (one priority queue over a linked list of symbols) ------------------------


def _merge(symbols: list[str], priority) -> list[str]:
    """Merge adjacent symbols while `priority(left, right)` is not None, smallest (priority, left) first."""
    n = len(symbols)
    if n < 2:
        return symbols
    text = list(symbols)
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap: list[tuple[object, int, int, str, str]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        p = priority(text[left], text[right])
        if p is not None:
            heapq.heappush(heap, (p, left, right, text[left], text[right]))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, ltext, rtext = heapq.heappop(heap)
        if text[left] != ltext or text[right] != rtext or nxt[left] != right:
            continue  # stale: one side merged since this pair was queued
        text[left] = ltext + rtext
        text[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    out, i = [], 0
    while i != -1:
        out.append(text[i])
        i = nxt[i]
    return out


PAIR_SHIFT = 32  # a merge's key: left id << 32 | right id (token ids are below 2^32)


class BpeModel:
    """Byte-level BPE over a GGUF vocabulary (llama.cpp's llm_tokenizer_bpe_session)."""

    def __init__(self, token_to_id: dict[str, int], merges: list[str], pre: PreTokenizer) -> None:
        self.token_to_id = token_to_id
        self.pre = pre
        # A merge's rank by its two sides' token ids packed in one int: Llama 3's 280k merges
        # keyed by pairs of strings held 70 MB in every member process, by ids about a third of
        # it. A merge whose side is not a token (none in the vocabularies tested) keeps its strings.
        self.ranks: dict[int, int] = {}
        self.odd_ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            cut = merge.find(" ", 1)
            left, right = (merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", "")
            a, b = token_to_id.get(left), token_to_id.get(right)
            if a is None or b is None:
                self.odd_ranks.setdefault((left, right), rank)
            else:
                self.ranks.setdefault(a << PAIR_SHIFT | b, rank)
        self._word = lru_cache(maxsize=1 << 16)(self._encode_word)

    def rank(self, left: str, right: str) -> int | None:
        """The rank of merging `left` and `right` (None: no such merge)."""
        a, b = self.token_to_id.get(left), self.token_to_id.get(right)
        if a is None or b is None:
            return self.odd_ranks.get((left, right)) if self.odd_ranks else None
        return self.ranks.get(a << PAIR_SHIFT | b)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        if self.pre.sentencepiece_style:
            for word in split_words(text.replace(" ", SPACE_ESCAPE), self.pre.regexes):
                ids.extend(self._word(word))
            return ids
        for word in split_words(text, self.pre.regexes):
            ids.extend(self._word("".join(BYTE_TO_CHAR[b] for b in word.encode("utf-8"))))
        return ids

    def _encode_word(self, word: str) -> tuple[int, ...]:
        if self.pre.ignore_merges and word in self.token_to_id:
            return (self.token_to_id[word],)
        if self.pre.sentencepiece_style and word.strip("\n") == "" and word in self.token_to_id:
            return (self.token_to_id[word],)  # llama.cpp's Gemma 4 newline fix (its PR 21343)
        ids: list[int] = []
        for symbol in _merge(list(word), self.rank):
            token = self.token_to_id.get(symbol)
            if token is not None:
                ids.append(token)
            elif self.pre.sentencepiece_style:  # byte tokens <0xXX> of the symbol's UTF-8 bytes, where they exist
                ids.extend(t for t in (self.token_to_id.get(f"<0x{b:02X}>") for b in symbol.encode("utf-8"))
                           if t is not None)
            else:  # llama.cpp looks each byte of the symbol up alone; only ASCII ones can exist
                ids.extend(self.token_to_id[c] for c in symbol if c < "\x80" and c in self.token_to_id)
        return tuple(ids)


class SpmModel:
    """SentencePiece by score-ordered pair merges with byte fallback (llama.cpp's llm_tokenizer_spm)."""

    def __init__(self, token_to_id: dict[str, int], scores: list[float]) -> None:
        self.token_to_id = token_to_id
        self.scores = scores

    def encode(self, text: str) -> list[int]:
        tokens, scores = self.token_to_id, self.scores

        def priority(a: str, b: str):
            token = tokens.get(a + b)
            return None if token is None else -scores[token]  # highest score first

        ids: list[int] = []
        for symbol in _merge(list(text.replace(" ", SPACE_ESCAPE)), priority):
            token = tokens.get(symbol)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(self.byte_token(b) for b in symbol.encode("utf-8"))
        return ids

    def byte_token(self, byte: int) -> int:
        token = self.token_to_id.get(f"<0x{byte:02X}>")
        if token is None:
            token = self.token_to_id.get(chr(byte)) if byte < 0x80 else None
        if token is None:
            raise KeyError(f"the vocabulary has no byte token <0x{byte:02X}>")
        return token


# ---- special tokens ------------------------------------------------------------------------


def partition_special(text: str, specials: list[tuple[str, int, bool, bool]]) -> list[str | int]:
    """Cut `text` around special tokens: [(token text, id, lstrip, rstrip)], longest first.

    Returns the text fragments (str) and special token ids (int) in order; empty fragments are dropped.
    """
    parts: list[str | int] = [text] if text else []
    for token_text, token_id, lstrip, rstrip in specials:
        if not any(isinstance(p, str) and token_text in p for p in parts):
            continue
        out: list[str | int] = []
        for part in parts:
            if isinstance(part, int) or token_text not in part:
                out.append(part)
                continue
            pieces = part.split(token_text)
            for i, piece in enumerate(pieces):
                if i > 0:
                    out.append(token_id)
                    if rstrip:
                        piece = piece.lstrip(C_SPACE)
                if i < len(pieces) - 1 and lstrip:
                    piece = piece.rstrip(C_SPACE)
                if piece:
                    out.append(piece)
        parts = out
    return parts
