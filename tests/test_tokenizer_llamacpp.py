"""Kafila's tokenizer against llama.cpp: its own test vectors, its chat templates, and llama-cpp-python.

llama.cpp ships, per vocabulary, a vocabulary-only GGUF and strings with the ids its
`test-tokenizer-0` expects (produced with add_special=false, parse_special=false); tests/llamacpp_files
fetches them once from the pinned llama-cpp-python sdist. llama-bpe, qwen2 and llama-spm go through
the real `kafila tokenize` command (one process per vocabulary, `--batch`); the other vocabularies
Kafila reads are checked in process. Where llama-cpp-python is installed, special-token parsing and
BOS handling are compared with it directly, and so is the default model's tokenizer.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tarfile

import pytest

from backends.errors import BadInput
from kafila.models.vocab import PRETOKENIZERS
from tests import llamacpp_files

KAFILA = os.path.join(os.path.dirname(sys.executable), "kafila")
CLI_VOCABS = ("llama-bpe", "qwen2", "llama-spm")
OTHER_VOCABS = ("gpt-2", "starcoder", "refact", "command-r", "mpt", "qwen35", "phi-3", "falcon",
                "deepseek-coder", "deepseek-llm", "gemma-4")  # fmt: skip
# vocabularies llama.cpp ships without test vectors, and without tokenizer.ggml.pre: llama.cpp's
# own tokenization (llama-cpp-python) of every other vocabulary's test strings is the yardstick
NO_PRE_VOCABS = ("aquila", "gpt-neox")
EXTRA_TEXTS = ("3333333 12345678 \u0661\u0662\u0663", "a  b\n\n c\t\td", "<|endoftext|>x<|padding|>",
               "Hello, world! $5+3=8 <tag>|~^")  # fmt: skip


def kafila(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    cmd = [KAFILA] if os.path.exists(KAFILA) else [sys.executable, "-m", "kafila.cli"]
    return subprocess.run([*cmd, *args], input=stdin, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def vocab_dir():
    try:
        return llamacpp_files.vocab_dir()
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        pytest.skip(f"llama.cpp's tokenizer test vectors are not available: {exc}")


@functools.cache
def tokenizer(name: str):
    from kafila.models.tokenizer import load_tokenizer_file

    return load_tokenizer_file(str(llamacpp_files.vocab_file(name)))


def mismatches(cases, got_ids) -> list[str]:
    return [f"{text!r}: llama.cpp {want}, Kafila {got}" for (text, want), got in zip(cases, got_ids) if got != want]


@pytest.mark.parametrize("name", CLI_VOCABS)
def test_kafila_tokenize_gives_llamacpp_ids(vocab_dir, name):
    cases = llamacpp_files.vocab_cases(name)
    r = kafila("tokenize", "--model", str(llamacpp_files.vocab_file(name)), "--batch", "--no-bos",
               "--no-parse-special", stdin=json.dumps([text for text, _ in cases]))  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == len(cases) >= 40
    assert not mismatches(cases, [line["ids"] for line in lines])
    for line in lines:
        assert len(line["pieces"]) == len(line["ids"])


@pytest.mark.parametrize("name", CLI_VOCABS + OTHER_VOCABS)
def test_encode_gives_llamacpp_ids_and_round_trips(vocab_dir, name):
    tok = tokenizer(name)
    cases = llamacpp_files.vocab_cases(name)
    got = [tok.encode(text, add_special=False, parse_special=False) for text, _ in cases]
    assert not mismatches(cases, got)
    assert [tok.decode(ids) for ids in got] == [text for text, _ in cases]


def test_one_text_readable_and_json(vocab_dir):
    path = str(llamacpp_files.vocab_file("llama-bpe"))
    r = kafila("tokenize", "--model", path, "--json", "Hello world<|eot_id|>")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1
    # Llama 3 adds BOS (128000) by default; special-token text is parsed like llama-tokenize does
    assert json.loads(r.stdout) == {"ids": [128000, 9906, 1917, 128009],
                                    "pieces": ["<|begin_of_text|>", "Hello", " world", "<|eot_id|>"]}  # fmt: skip
    r = kafila("tokenize", "--model", path, "--no-bos", "--no-parse-special", "-", stdin="a\n<|eot_id|>")
    assert r.returncode == 0, r.stderr
    ids = [int(line.split()[0]) for line in r.stdout.splitlines()]
    assert ids == tokenizer("llama-bpe").encode("a\n<|eot_id|>", add_special=False, parse_special=False)
    assert 128009 not in ids


def test_sentencepiece_prefix_bytes_and_decode(vocab_dir):
    tok = tokenizer("llama-spm")
    assert tok.add_bos and tok.add_space_prefix
    ids = tok.encode("Hello")
    assert ids[0] == tok.bos_id == 1 and tok.piece(ids[1]) == b" Hello"
    assert tok.decode(ids) == "Hello"  # BOS hidden, the added space dropped
    emoji = tok.encode("🦙", add_special=False)
    assert [tok.tokens[i] for i in emoji[1:]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]  # byte fallback
    # a "▁" follows every special token too: "</s>" then " x"
    assert tok.encode("</s>x", add_special=False) == [2, *tok.encode("x", add_special=False)]


def test_end_of_generation_ids(vocab_dir):
    llama3, qwen, spm = tokenizer("llama-bpe"), tokenizer("qwen2"), tokenizer("llama-spm")
    assert {128001, 128009} <= llama3.eos_ids  # <|end_of_text|>, <|eot_id|> (Llama 3.0: no <|eom_id|>)
    assert {qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")} <= qwen.eos_ids
    assert 2 in spm.eos_ids


# ---- bad input: one line, exit 2 -------------------------------------------------------------


def write_vocab(path, model: str, pre: str | None) -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", model)
    if pre is not None:
        w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    w.add_array("tokenizer.ggml.merges", ["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize(("model", "pre", "message"), [
    ("gpt2", "made-up-pre", "pre-tokenizer 'made-up-pre' is not supported; Kafila supports: a.x-4.0, "),
    ("wordpiece-ish", "default", "tokenizer model 'wordpiece-ish' is not supported"),
])  # fmt: skip
def test_unsupported_tokenizer_is_one_line_exit_2(tmp_path, model, pre, message):
    path = write_vocab(tmp_path / "vocab.gguf", model, pre)
    r = kafila("tokenize", "--model", path, "--json", "ab")
    assert r.returncode == 2
    assert r.stdout == ""
    assert message in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def llamacpp_tokenizations(path: str, texts: list[str], special: bool) -> list[list[int]]:
    """llama.cpp's ids of each text (one vocab-only llama-cpp-python model for all of them)."""
    import contextlib

    import llama_cpp

    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    try:
        return [list(llm.tokenize(t.encode(), add_bos=special, special=special)) for t in texts]
    finally:
        llm.close()


@pytest.mark.parametrize("name", NO_PRE_VOCABS)
def test_missing_pre_tokenizer_falls_back_as_llamacpp_does(vocab_dir, name):
    """No tokenizer.ggml.pre: llama.cpp's 'default' pre-tokenizer, its BOS and special handling."""
    path = str(llamacpp_files.vocab_file(name))
    tok = tokenizer(name)
    assert tok.model.pre is PRETOKENIZERS["default"]
    texts = [t for v in ("llama-bpe", "deepseek-llm") for t, _ in llamacpp_files.vocab_cases(v)] + list(EXTRA_TEXTS)
    for special in (False, True):
        want = llamacpp_tokenizations(path, texts, special)
        got = [tok.encode(t, add_special=special, parse_special=special) for t in texts]
        assert not mismatches(list(zip(texts, want)), got), special


def test_gemma4_tokenizer(vocab_dir):
    """Gemma 4's BPE over "▁" text: BOS always added (llama.cpp overrides the file), byte fallback,
    newline runs, its end-of-turn tokens; and llama-cpp-python agrees with special tokens parsed."""
    tok = tokenizer("gemma-4")
    assert tok.kind == "gemma4" and tok.add_bos and tok.bos_id == 2
    assert {tok.token_to_id("<eos>"), tok.token_to_id("<turn|>")} <= tok.eos_ids
    texts = ["<|turn>user\nHi there<turn|>\n<|turn>model\n", "\n\n\n  spaced   out \U0001F999 \u0915\u093f", ""]
    want = llamacpp_tokenizations(str(llamacpp_files.vocab_file("gemma-4")), texts, True)
    assert [tok.encode(t) for t in texts] == want
    assert tok.decode(tok.encode(texts[1])) == texts[1]


def test_supported_synthetic_vocab_works(tmp_path):
    path = write_vocab(tmp_path / "vocab.gguf", "gpt2", "gpt-2")
    r = kafila("tokenize", "--model", path, "--json", "ab")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ids": [2], "pieces": ["ab"]}


@pytest.mark.parametrize("content", [b"", b"not a gguf at all", b"GGUF\x03\x00\x00\x00\x00"])
def test_damaged_or_foreign_file_is_one_line_exit_2(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    r = kafila("tokenize", "--model", str(path), "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_batch_wants_a_json_array(tmp_path):
    path = write_vocab(tmp_path / "vocab.gguf", "gpt2", "gpt-2")
    r = kafila("tokenize", "--model", path, "--batch", stdin='{"not": "a list"}')
    assert r.returncode == 2 and "JSON array of strings" in r.stderr


# ---- chat templates of the families Kafila serves ---------------------------------------------

TEMPLATES = {
    "llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-bpe"),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen2"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "qwen2"),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "llama-spm"),
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]  # fmt: skip


@functools.cache
def chat_templates() -> dict[str, str]:
    """Real models' chat templates (TEMPLATES), from the llama.cpp sources in the cached sdist."""
    llamacpp_files.vocab_dir()  # makes sure the sdist is there
    sdist = sorted(llamacpp_files.cache_root().glob("llama_cpp_python-*.tar.gz"))[0]
    wanted = {filename for filename, _ in TEMPLATES.values()}
    found: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for member in tar:
            head, _, filename = member.name.rpartition("/")
            if filename in wanted and head.endswith("vendor/llama.cpp/models/templates"):
                found[filename] = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    assert set(found) == wanted, f"the sdist lacks {wanted - set(found)}"
    return found


def with_template(family: str):
    import dataclasses

    filename, vocab = TEMPLATES[family]
    return dataclasses.replace(tokenizer(vocab), chat_template=chat_templates()[filename])


def test_llama3_template(vocab_dir):
    tok = with_template("llama-3.1")
    text = tok.render_chat(MESSAGES)
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\n")  # BOS left to encode
    assert text.endswith("2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode(text)
    assert ids[0] == 128000 and ids.count(128000) == 1
    assert ids.count(128009) == 4  # one <|eot_id|> per message


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_qwen_templates(vocab_dir, family):
    tok = with_template(family)
    text = tok.render_chat(MESSAGES)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")  # fmt: skip
    ids = tok.encode(text)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 5 and not tok.add_bos
    if family == "qwen2.5":  # its default system prompt when none is given
        assert tok.render_chat(MESSAGES[1:]).startswith("<|im_start|>system\nYou are Qwen")
    else:  # Qwen3: enable_thinking=False closes an empty think block
        assert tok.render_chat(MESSAGES[1:], enable_thinking=False).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_mistral_template(vocab_dir):
    tok = with_template("mistral")
    text = tok.render_chat(MESSAGES)
    assert text == "[INST]Hi[/INST]Hello!</s>[INST]Be brief.\n\n2+2?[/INST]"  # its BOS left to encode
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1  # one <s>, the </s> parsed
    with pytest.raises(BadInput, match="alternate"):  # the template's raise_exception, as one line
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# ---- llama-cpp-python, where installed --------------------------------------------------------

SPECIAL_TEXTS = (
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<s>[INST] Hi [/INST] Hello</s>",
    " leading space, <unk> and\ttabs  ",
    "",
)


def llama_cpp_vocab(path: str):
    """llama-cpp-python's tokenizer for `path` (vocab_only), loaded once for many calls."""
    import contextlib

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the test extra)")
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        return llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)


@pytest.mark.parametrize("name", CLI_VOCABS)
def test_special_parsing_and_bos_match_llama_cpp(vocab_dir, name):
    llm = llama_cpp_vocab(str(llamacpp_files.vocab_file(name)))
    tok = tokenizer(name)
    try:
        for text in SPECIAL_TEXTS:
            for add_special in (False, True):
                for parse_special in (False, True):
                    want = list(llm.tokenize(text.encode(), add_bos=add_special, special=parse_special))
                    got = tok.encode(text, add_special=add_special, parse_special=parse_special)
                    assert got == want, (text, add_special, parse_special)
    finally:
        llm.close()


@pytest.mark.model
def test_default_model_tokenizer_matches_llama_cpp(default_model_path, default_tokenizer):
    from tests.conftest import PROMPTS

    llm = llama_cpp_vocab(default_model_path)
    tok = default_tokenizer
    texts = [*PROMPTS, "def f(x):\n    return x**2  # 42", "Ünïcödé ✓ 日本語 1234567",
             tok.render_chat([{"role": "user", "content": PROMPTS[0]}])]  # fmt: skip
    try:
        for text in texts:
            assert tok.encode(text) == list(llm.tokenize(text.encode(), add_bos=True, special=True)), text
            assert tok.decode(tok.encode(text, parse_special=False)) == text
    finally:
        llm.close()


FUZZ_PIECES = (
    *"abcXYZ \t\n\r", "'s", "'S", "'ll", "'RE", "'x", "\v", "\f", "\x85", "\xa0", "\u3000", "\u2028", "  ",
    "\n\n", " \n ", "123", "4567", "٣٤", "²", "Ⅻ", "½", "日本語", "한국어", "Привет", "e\u0301", "\u0300", "🦙",
    "👩\u200d👩\u200d👧", "🇫🇷", "!!!", "?!", "$", "+=", "<", "|", "`", "~", "^", "\\", "\x00", "\x7f", "\u200b",
    "\ufeff", "ـ", "ＡＢ", "！", "。", "ß", "İ", "ﬁ", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "<|eot_id|>", "<|begin_of_text|>", "[INST]", "▁", "<0x41>", "𝔘𝔫𝔦",
)  # fmt: skip


@pytest.mark.parametrize("name", ("llama-bpe", "qwen2", "llama-spm", "gpt-2", "qwen35", "phi-3", "deepseek-llm"))
def test_random_mixtures_match_llama_cpp(vocab_dir, name):
    """Random strings of awkward pieces (Unicode whitespace, digits of other scripts, combining
    marks, emoji sequences, special-token text) give llama.cpp's ids with every flag combination."""
    import random

    llm = llama_cpp_vocab(str(llamacpp_files.vocab_file(name)))
    tok = tokenizer(name)
    rng = random.Random(20261201)
    failures = []
    try:
        for _ in range(150):
            text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(0, 12)))
            for add_special in (False, True):
                for parse_special in (False, True):
                    want = list(llm.tokenize(text.encode(), add_bos=add_special, special=parse_special))
                    if tok.encode(text, add_special=add_special, parse_special=parse_special) != want:
                        failures.append((text, add_special, parse_special))
    finally:
        llm.close()
    assert not failures


@pytest.mark.parametrize("source,pre", [("gpt-neox", "default"), ("qwen2", "gpt-4o")])
def test_pretokenizer_without_vectors_matches_llama_cpp(vocab_dir, tmp_path, source, pre):
    """Pre-tokenizers no vocabulary llama.cpp ships uses: "default" (GPT-NeoX's vocabulary names
    none) and "gpt-4o" (gpt-oss's o200k_harmony, Llama 4). A shipped vocabulary is rewritten to
    name it, and both sides tokenize the vectors and random mixtures."""
    import random

    import gguf

    from kafila.models.tokenizer import load_tokenizer_file, read_tokenizer_metadata

    md = read_tokenizer_metadata(str(llamacpp_files.vocab_file(source)), prefixes=("tokenizer.",))
    path = str(tmp_path / f"{source}-{pre}.gguf")
    w = gguf.GGUFWriter(path, "gptneox")
    w.add_string("tokenizer.ggml.model", md["tokenizer.ggml.model"])
    w.add_string("tokenizer.ggml.pre", pre)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        w.add_array(key, md[key])
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id"):
        if key in md:
            w.add_uint32(key, md[key])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()

    llm, tok = llama_cpp_vocab(path), load_tokenizer_file(path)
    assert tok.model.pre is PRETOKENIZERS[pre]
    rng = random.Random(7)
    texts = [t for t, _ in llamacpp_files.vocab_cases("qwen2")]
    texts += ["".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(0, 12))) for _ in range(150)]
    texts += ["HTTPServer's ÑANDÚ niño ŞİŞLİ'LL x/y/\n\n  z", "ǅungla ǈa 12345 ⅷ"]  # case runs, title case
    try:
        failures = [(text, special) for text in texts for special in (False, True)
                    if tok.encode(text, add_special=False, parse_special=special)
                    != list(llm.tokenize(text.encode(), add_bos=False, special=special))]  # fmt: skip
    finally:
        llm.close()
    assert not failures


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe"])
def test_stream_decoding_spells_what_decode_spells(vocab_dir, name):
    """The API's streamed pieces (StreamDecoder, grown a token at a time) join to decode(ids) at
    every length: multi-byte characters held back whole, SentencePiece's leading space removed
    once, after a BOS too."""
    from kafila.models.tokenizer import StreamDecoder

    tok = tokenizer(name)
    text = "Hello world, ça coûte 10 € — 東京タワー 🎉 ok\n  indented"
    for ids in (tok.encode(text, add_special=False), [tok.bos_id, *tok.encode(text, add_special=False)]):
        dec, pieces = StreamDecoder(tok), []
        for i, t in enumerate(ids):
            pieces.append(dec.push(t))
            full = tok.decode(ids[:i + 1])
            if not full.endswith("\ufffd"):
                assert "".join(pieces) == full, (name, i)
        assert "".join(pieces) == tok.decode(ids) and "東京" in "".join(pieces)
