"""kafila.models: the GGUF index, exact quant formats, refusals, block ranges and the tokenizer."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from backends.errors import BadInput
from backends.gguf import open_model
from backends.gguf.quant import split_blocks
from kafila.models import resolve_model
from tests.synthetic_gguf import write_llama_gguf, write_not_gguf, write_truncated


def test_default_model_index(default_index):
    h = default_index.hparams
    assert (h.arch, h.n_blocks, h.hidden, h.n_heads, h.n_kv_heads, h.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (h.ffn, h.vocab, h.tied_embeddings) == (1536, 49152, True)
    types = {}
    for t in default_index.tensors.values():
        types[t.qtype] = types.get(t.qtype, 0) + 1
    assert types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert len(default_index.block_tensors(7)) == 9
    # β values: every block alike; the head is the embedding (tied) + final norm
    assert default_index.block_bytes == sum(t.n_bytes for t in default_index.block_tensors(0))
    assert default_index.head_bytes == (default_index.tensors["token_embd.weight"].n_bytes
                                        + default_index.tensors["output_norm.weight"].n_bytes)
    ranges = sorted(t.byte_range for t in default_index.tensors.values())
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # no overlap
    assert ranges[-1][1] <= default_index.file_bytes


def test_sha256_matches_hashlib(synthetic_index, synthetic_model):
    with open(synthetic_model, "rb") as f:
        assert synthetic_index.sha256 == hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0"])
def test_dequantize_matches_gguf_package(tmp_path, qtype):
    from gguf import GGMLQuantizationType, quants

    path = write_llama_gguf(tmp_path / "m.gguf", qtype=qtype)
    index = open_model(path)
    name = "blk.1.ffn_down.weight"
    ours = index.dequantize(name)
    theirs = quants.dequantize(np.asarray(index.raw(name)).reshape(index.tensors[name].shape[0], -1),
                               getattr(GGMLQuantizationType, qtype))
    np.testing.assert_array_equal(ours, theirs.astype(np.float64))


def test_q4_1_nibble_order():
    # one row, one block: d = 1, m = 0, q[j] = j % 16 packed as GGML does (j low nibbles, j+16 high)
    q = np.arange(32) % 16
    packed = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    raw = np.concatenate([np.array([1.0, 0.0], np.float16).view(np.uint8), packed])
    w = split_blocks("Q4_1", raw, 1, 32).dequantize()
    np.testing.assert_array_equal(w[0], q.astype(np.float64))


def test_split_blocks(synthetic_index, default_index):
    assert synthetic_index.split_blocks(1) == [(0, 4)]
    assert default_index.split_blocks(3) == [(0, 10), (10, 20), (20, 30)]
    assert default_index.split_blocks(4) == [(0, 8), (8, 15), (15, 22), (22, 30)]
    with pytest.raises(BadInput, match="stages"):
        synthetic_index.split_blocks(5)
    with pytest.raises(BadInput):
        synthetic_index.check_range(3, 3)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: str(p / "missing.gguf"), "not found"),
        (lambda p: write_not_gguf(p / "zip.gguf"), "not a GGUF"),
        (lambda p: write_truncated(p / "cut.gguf"), "truncated"),
        (lambda p: write_llama_gguf(p / "gpt2.gguf", arch="gpt2"), "unsupported architecture 'gpt2'"),
        (lambda p: write_llama_gguf(p / "q5.gguf", odd_tensor=("blk.2.ffn_up.weight", "Q8_1")),
         "blk.2.ffn_up.weight has quant type Q8_1"),
    ],
    ids=["missing", "not-gguf", "truncated", "arch", "quant-type"],
)
def test_refusals_are_one_line(tmp_path, make, match):
    with pytest.raises(BadInput, match=match) as err:
        open_model(make(tmp_path))
    assert "\n" not in str(err.value)


def test_resolve_model(default_model_path):
    assert resolve_model("smollm2-135m") == default_model_path
    assert resolve_model("some/where.gguf") == "some/where.gguf"
    with pytest.raises(BadInput, match="unknown model"):
        resolve_model("no-such-alias")


def test_tokenizer_round_trip_and_chat(default_tokenizer):
    tok = default_tokenizer
    text = "Héllo, wörld! 12345 — ünïcode ✓"
    assert tok.decode(tok.encode(text)) == text
    rendered = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = tok.encode(rendered)
    assert ids.count(tok.token_to_id("<|im_start|>")) >= 2
    assert tok.token_to_id("<|im_end|>") in tok.eos_ids


def test_tokenizer_matches_openvino_genai(default_model_path, default_tokenizer):
    import openvino_genai as ov_genai  # a dependency (pyproject.toml)
    theirs = ov_genai.Tokenizer(default_model_path)
    for text in ("The capital of France is", "def f(x):\n    return x**2  # 42", "Ünïcödé ✓ 日本語"):
        assert default_tokenizer.encode(text) == list(theirs.encode(text, add_special_tokens=False).input_ids.data[0])
