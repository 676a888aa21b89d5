"""`kafila inspect` as a person runs it: the real CLI in a subprocess, on served and refused files."""

from __future__ import annotations

import json
import os
import subprocess

import gguf
import numpy as np
import pytest

from tests.synthetic_gguf import CHATML, _byte_level_vocab, write_llama_gguf, write_not_gguf, write_truncated

KAFILA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "bin", "kafila")
FIELDS = {
    "path", "file_bytes", "name", "architecture", "file_type", "blocks", "mtp_blocks", "hidden", "heads", "kv_heads",
    "head_dim", "ffn", "vocab", "context", "tensors", "tensor_bytes", "quant_types", "tokenizer", "served",
    "why_not", "block_bytes", "head_bytes", "kv_bytes_per_token_per_block",
    "state_bytes_per_request_per_block",
}  # fmt: skip


def inspect(*args: str) -> subprocess.CompletedProcess:
    exe = KAFILA if os.path.exists(KAFILA) else "kafila"
    return subprocess.run([exe, "inspect", *args], capture_output=True, text=True, timeout=120)


def inspect_json(path: str) -> dict:
    proc = inspect("--json", path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    assert set(out) == FIELDS
    return out


def write_vocab_only(path) -> str:
    """A tokenizer-only GGUF (no tensors), as llama.cpp's ggml-vocab-*.gguf files are."""
    tokens, types, merges = _byte_level_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_chat_template(CHATML)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.model
def test_default_model(default_model_path, default_index):
    out = inspect_json(default_model_path)
    assert out["served"] is True and out["why_not"] is None
    shape = (out["architecture"], out["blocks"], out["hidden"], out["heads"], out["kv_heads"])
    assert shape == ("llama", 30, 576, 9, 3)
    assert (out["head_dim"], out["ffn"], out["vocab"], out["context"]) == (64, 1536, 49152, 8192)
    assert out["file_type"] == "MOSTLY_Q4_1"
    assert out["tokenizer"] == {"model": "gpt2", "pre": "smollm", "tokens": 49152}
    assert list(out["quant_types"]) == ["Q4_1", "Q8_0", "F32"]  # largest share first
    assert out["quant_types"]["Q8_0"]["tensors"] == 1  # the embedding (tied lm_head)
    assert sum(q["bytes"] for q in out["quant_types"].values()) == out["tensor_bytes"]
    assert abs(sum(q["share"] for q in out["quant_types"].values()) - 1) < 1e-3
    planner = default_index.planner_model()
    assert (out["block_bytes"], out["head_bytes"]) == (planner["block_bytes"], planner["head_bytes"])
    assert out["kv_bytes_per_token_per_block"] == planner["kv_bytes_per_token_per_block"]
    text = inspect(default_model_path)
    assert text.returncode == 0 and "served        yes" in text.stdout and "β_block 2.2 MB" in text.stdout


def test_synthetic_model(synthetic_model, synthetic_index):
    out = inspect_json(synthetic_model)
    h = synthetic_index.hparams
    assert out["served"] is True
    assert (out["blocks"], out["hidden"], out["heads"], out["kv_heads"], out["head_dim"], out["ffn"]) == (
        h.n_blocks, h.hidden, h.n_heads, h.n_kv_heads, h.head_dim, h.ffn)
    assert out["vocab"] == h.vocab == out["tokenizer"]["tokens"]
    assert set(out["quant_types"]) == {"Q4_1", "Q8_0", "F32"}
    assert out["tensor_bytes"] == sum(t.n_bytes for t in synthetic_index.tensors.values())
    assert out["block_bytes"] == synthetic_index.block_bytes and out["head_bytes"] == synthetic_index.head_bytes


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: write_llama_gguf(p / "gemma.gguf", arch="gemma"), "unsupported architecture 'gemma'"),
        (lambda p: write_llama_gguf(p / "q5.gguf", odd_tensor=("blk.0.attn_k.weight", "Q8_1")), "Q8_1"),
        (lambda p: write_vocab_only(p / "vocab.gguf"), "lacks"),
    ],
    ids=["arch", "quant-type", "vocab-only"],
)
def test_refused_files_are_described(tmp_path, make, needle):
    path = make(tmp_path)
    out = inspect_json(path)
    assert out["served"] is False and needle in out["why_not"], out["why_not"]
    assert out["tokenizer"]["model"] == "gpt2" and out["tokenizer"]["pre"] == "smollm"
    text = inspect(path)
    assert text.returncode == 0 and "served        no: " in text.stdout and needle in text.stdout


def test_unsupported_architecture_still_has_its_shape(tmp_path):
    out = inspect_json(write_llama_gguf(tmp_path / "gemma.gguf", arch="gemma", blocks=3, hidden=64, heads=4,
                                        kv_heads=1, ffn=96))
    assert (out["architecture"], out["blocks"], out["hidden"], out["heads"], out["kv_heads"]) == ("gemma", 3, 64, 4, 1)
    assert (out["head_dim"], out["ffn"], out["context"]) == (16, 96, 512)
    assert out["block_bytes"] > 0 and out["head_bytes"] > 0 and out["kv_bytes_per_token_per_block"] == 2 * 1 * 16 * 2


def test_vocab_only_has_no_tensors(tmp_path):
    out = inspect_json(write_vocab_only(tmp_path / "vocab.gguf"))
    assert out["tensors"] == 0 and out["tensor_bytes"] == 0 and out["quant_types"] == {}
    assert out["blocks"] is None and out["block_bytes"] is None and out["vocab"] == out["tokenizer"]["tokens"] > 256


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: str(p / "missing.gguf"), "not found"),
        (lambda p: write_not_gguf(p / "zip.gguf"), "not a GGUF"),
        (lambda p: write_truncated(p / "cut.gguf"), "truncated"),
    ],
    ids=["missing", "not-gguf", "truncated"],
)
def test_unreadable_files_exit_2(tmp_path, make, needle):
    for args in (("--json",), ()):
        proc = inspect(*args, make(tmp_path))
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr and needle in lines[0], proc.stderr
        assert proc.stdout == ""


def test_float_tensors_only(tmp_path):
    """An all-F32 file: one quant type with the whole share."""
    path = write_llama_gguf(tmp_path / "f32.gguf", qtype="F32", embed_qtype="F32")
    out = inspect_json(path)
    assert out["served"] is True and list(out["quant_types"]) == ["F32"]
    assert out["quant_types"]["F32"]["share"] == 1.0
    assert out["tensor_bytes"] == sum(4 * int(np.prod(t.shape)) for t in gguf.GGUFReader(path).tensors)


def test_small_quant_types_are_listed_and_served(tmp_path):
    """A file holding Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 matrices (llama.cpp's quantizer) is served,
    each type named with its share."""
    mix = {"attn_q.weight": "Q3_K", "attn_k.weight": "IQ4_NL", "attn_v.weight": "IQ4_XS", "ffn_up.weight": "MXFP4"}
    path = write_llama_gguf(tmp_path / "low.gguf", blocks=1, hidden=256, ffn=512, heads=4, kv_heads=2,
                            qtype="Q2_K", embed_qtype="Q2_K", tensor_types=mix)
    out = inspect_json(path)
    assert out["served"] is True and out["why_not"] is None, out["why_not"]
    assert {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"} <= set(out["quant_types"]), out["quant_types"]
