"""Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 read exactly as llama.cpp dequantizes them.

The reference is llama.cpp's own C code in llama-cpp-python's libggml-base (tests/ggml_quants.py):
weights quantized by ggml_quantize_chunk (the quantizer llama_model_quantize runs per tensor; for
MXFP4 the only way to get real blocks without a gpt-oss file) and random bytes (every code, scale
and sign pattern), dequantized by ggml's dequantize_row_<type>, must equal Kafila's f32 values bit
for bit; gguf-py's numpy port agrees too. Cheap: a few hundred rows, no model.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import quants

from backends.gguf import quant
from backends.gguf.quant import BLOCK_BYTES, BLOCK_WEIGHTS, split_blocks
from tests.ggml_quants import ggml_dequantize, ggml_quantize

LOWBIT = ("MXFP4", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
GROUP = {"MXFP4": 32, "Q2_K": 16, "Q3_K": 16, "IQ4_NL": 32, "IQ4_XS": 32}


def real_weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Gaussian rows of very different magnitudes (as a model's), some outliers."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp(2 * rng.standard_normal((rows, 1)))
    w[rng.random((rows, cols)) < 0.01] *= 8
    return w.astype(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", LOWBIT)
def test_llamacpp_quantized_blocks_dequantize_as_llamacpp(qtype):
    w = real_weights(24, 1024)
    raw = ggml_quantize(qtype, w)
    theirs = ggml_dequantize(qtype, raw, 1024)
    b = split_blocks(qtype, raw, 24, 1024)
    assert b.group == GROUP[qtype] and b.q.shape == (24, 1024 // b.group, b.group)
    ours = b.dequantize(np.float32)
    assert same_bits(ours, theirs), qtype
    assert np.array_equal(b.dequantize(np.float64), theirs.astype(np.float64))  # exact: no rounding to lose
    assert same_bits(quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32).reshape(24, 1024),
                     theirs)  # gguf-py's port agrees
    assert np.abs(theirs - w).max() < 0.35 * np.abs(w).max()  # a quantization of w, not noise
    rows = np.array([5, 0, 23, 5])
    assert same_bits(b.rows(rows, np.float32), theirs[rows])  # the embedding lookup


@pytest.mark.parametrize("qtype", LOWBIT)
def test_random_blocks_dequantize_as_llamacpp(qtype):
    """Every byte random: all codes, scale bits and (Q3_K) sign masks; non-finite scales aside."""
    rng = np.random.default_rng(1)
    cols = 2 * BLOCK_WEIGHTS[qtype] * (1 if BLOCK_WEIGHTS[qtype] == 256 else 4)
    raw = rng.integers(0, 256, (16, cols // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]), dtype=np.uint8)
    theirs = ggml_dequantize(qtype, raw, cols)
    with np.errstate(over="ignore", invalid="ignore"):
        ours = split_blocks(qtype, raw, 16, cols).dequantize(np.float32)
    finite = np.isfinite(theirs)
    assert finite.mean() > 0.9
    assert np.array_equal(ours.view(np.uint32)[finite], theirs.view(np.uint32)[finite]), qtype
    assert np.array_equal(np.isfinite(ours), finite)


def test_mxfp4_scales_cover_every_exponent():
    """E8M0 → 2^(e − 128) for all 256 exponents, subnormal ones (e < 2) and e = 255 included."""
    raw = np.zeros((256, 17), np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1] = 0x71  # codes 1 (value 1) and 7 (value 12)
    theirs = ggml_dequantize("MXFP4", raw, 32)
    ours = split_blocks("MXFP4", raw, 256, 32)
    assert same_bits(ours.scale[:, 0], np.ldexp(np.float32(1), np.arange(256) - 128).astype(np.float32))
    with np.errstate(over="ignore"):
        assert same_bits(ours.dequantize(np.float32), theirs)


@pytest.mark.parametrize("qtype", LOWBIT)
def test_split_in_chunks_equals_one_pass(qtype, monkeypatch):
    raw = ggml_quantize(qtype, real_weights(40, 512, seed=2))
    whole = split_blocks(qtype, raw, 40, 512)
    monkeypatch.setattr(quant, "SPLIT_CHUNK_BYTES", raw.shape[1] * 3)  # 3 rows at a time
    parts = split_blocks(qtype, raw, 40, 512)
    for a, b in ((whole.q, parts.q), (whole.scale, parts.scale), (whole.offset, parts.offset)):
        assert (a is None and b is None) or np.array_equal(a, b)
