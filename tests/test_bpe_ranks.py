"""Byte-level BPE merge ranks keyed by the two sides' token ids (kafila.models.vocab.BpeModel):
the same merges as keyed by strings, and a merge whose side is no token still applies.
llama.cpp's own vectors (tests/test_tokenizer_llamacpp.py) check whole vocabularies; none of
them has such a merge, so it is built here."""

import subprocess
import sys

from kafila.models import vocab as V
from tests import llamacpp_files

PRE = V.PreTokenizer((V.GPT2_RE,))


def model(tokens: list[str], merges: list[str]) -> V.BpeModel:
    return V.BpeModel({t: i for i, t in enumerate(tokens)}, merges, PRE)


def test_merges_apply_by_rank_through_token_ids():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    m = model(tokens, ["a b", "ab c", "b c"])
    assert m.encode("abc") == [5]  # a+b first (rank 0), then ab+c
    assert model(tokens, ["b c", "a b", "ab c"]).encode("abc") == [0, 4]  # b+c first: a, bc
    assert not m.odd_ranks and len(m.ranks) == 3 and all(isinstance(k, int) for k in m.ranks)
    assert m.rank("a", "b") == 0 and m.rank("ab", "c") == 1 and m.rank("c", "a") is None
    assert model(tokens, ["a b", "a b"]).rank("a", "b") == 0  # a repeated merge keeps its first rank


def test_a_merge_whose_side_is_no_token_still_applies():
    tokens = ["d", "e", "f", "def"]  # "de" is no token, yet "de f" merges
    m = model(tokens, ["d e", "de f"])
    assert m.odd_ranks == {("de", "f"): 1} and m.rank("de", "f") == 1
    assert m.encode("def") == [3]
    assert m.encode("de") == [0, 1]  # the merge happens, its product is no token: its bytes


def test_the_planners_tokenizer_term_holds_llama_3s_vocabulary():
    """Every member loads the tokenizer: what it holds is priced per vocabulary entry
    (backends.memory.TOKENIZER_BYTES_PER_VOCAB). Measured in a fresh process on Llama 3's
    vocabulary (llama.cpp's llama-bpe test file: 128,256 tokens, 280,147 merges): the resident
    growth of building it stays within the term (merges keyed by strings took 800 B an entry)."""
    from backends.memory import TOKENIZER_BYTES_PER_VOCAB

    path = str(llamacpp_files.vocab_file("llama-bpe"))
    script = (
        "import gc, sys\n"
        "def rss():\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024\n"
        "from kafila.models.tokenizer import load_tokenizer_file, read_tokenizer_metadata\n"
        "gc.collect(); before = rss()\n"
        "t = load_tokenizer_file(sys.argv[1])\n"
        "gc.collect(); print(rss() - before, len(t.tokens), len(t.model.ranks))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=120, check=True)
    grown, vocab, merges = map(int, out.stdout.split())
    assert (vocab, merges) == (128256, 280147)
    assert grown <= TOKENIZER_BYTES_PER_VOCAB * vocab, f"{grown / 2**20:.1f} MB for {vocab} tokens"
