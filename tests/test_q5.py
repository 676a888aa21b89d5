"""Q5_0 and Q5_1: read exactly, run exactly on every backend, and the real case they exist for.

llama.cpp's Q4_K_M of a model whose rows are not whole 256-weight super-blocks (SmolLM2 at 576,
Qwen2.5-0.5B at 896) falls back to Q5_0 / Q8_0 for those tensors. Dequantization equals the gguf
package's (ggml's formulas) bit for bit; OpenVINO keeps Q5_0 as an i8 FullyConnected (q − 16 with
the file's f16 d) and Q5_1 as u8 (f32 zero point −m/d), and, like MLX (5-bit affine, group 32),
matches the float64 reference at f32 within the bounds of the other numerics tests. Then the
default model requantized by llama.cpp to Q4_K_M is served by `kafila run` and gives llama.cpp's
greedy ids (on an F32 copy of the same weights) at precision f32.
"""

from __future__ import annotations

import json
from collections import Counter

import gguf
import numpy as np
import pytest
from gguf import quants

from backends import ShardSpec, load_shard, status
from backends.gguf import open_model
from backends.gguf.quant import BLOCK_BYTES, split_blocks
from tests.conftest import fc_precisions_in
from tests.mlx_chain import assert_embedding_rows_exact, assert_stages_match_reference
from tests.synthetic_gguf import write_llama_gguf

Q5_TYPES = ("Q5_0", "Q5_1")
MODELS = {
    "q5_0": {"qtype": "Q5_0", "embed_qtype": "Q5_0"},
    "q5_1": {"qtype": "Q5_1", "embed_qtype": "Q5_1"},
    # the fallback mix of a small model's Q4_K_M: Q5_0 matrices, Q8_0 attn_v / ffn_down and output
    "mixed": {"qtype": "Q5_0", "embed_qtype": "Q8_0", "tied": False,
              "tensor_types": {"attn_v.weight": "Q8_0", "ffn_down.weight": "Q8_0", "blk.1.ffn_up.weight": "Q5_1",
                               "output.weight": "Q8_0"}},
}  # fmt: skip
FC_PRECISION = {"Q5_0": "i8", "Q5_1": "u8"}
needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
needs_mlx = pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)


def random_raw(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks: random bytes but for the f16 d (and Q5_1's m), finite values of both
    signs over a wide range of magnitudes, some exactly 0."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 32, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for i in (0, 2) if qtype == "Q5_1" else (0,):
        v = rng.uniform(-1, 1, raw.shape[:2]) * 10.0 ** rng.integers(-6, 4, raw.shape[:2])
        v[rng.random(raw.shape[:2]) < 0.05] = 0.0
        raw[..., i:i + 2] = v.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", Q5_TYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    raw = random_raw(qtype, 12, 576)
    want = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype))  # f32 [12, 576]
    b = split_blocks(qtype, raw, 12, 576)
    assert b.group == 32 and b.bits == 5 and b.q.dtype == np.uint8 and b.q.max() == 31 and b.q.min() == 0
    assert np.array_equal(b.dequantize(np.float32).view(np.uint32), want.view(np.uint32))
    assert np.array_equal(b.dequantize(np.float64).astype(np.float32), want)  # f64 exact, then one rounding
    ids = np.array([7, 0, 7, 11])
    assert np.array_equal(b.rows(ids, np.float32), want[ids])


@pytest.mark.parametrize("qtype", Q5_TYPES)
def test_high_bit_order(qtype):
    """Element j's 5th bit is bit j of qh as a little-endian uint32 (ggml's dequantize_row_q5_*):
    one set bit at a time moves exactly one weight by 16·d."""
    head = 4 if qtype == "Q5_1" else 2
    base = np.zeros((1, BLOCK_BYTES[qtype]), np.uint8)
    base[0, 0:2] = np.array([1.0], np.float16).view(np.uint8)  # d = 1, m = 0, nibbles 0
    for j in range(32):
        raw = base.copy()
        raw[0, head + j // 8] = 1 << (j % 8)
        w = split_blocks(qtype, raw, 1, 32).dequantize(np.float64)[0]
        zero = -16.0 if qtype == "Q5_0" else 0.0
        assert w[j] == zero + 16 and np.all(np.delete(w, j) == zero), (j, w)
        theirs = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype))[0]
        assert np.array_equal(w.astype(np.float32), theirs)


@pytest.mark.parametrize("name", list(MODELS))
def test_files_dequantize_as_gguf_does(tmp_path, name):
    index = open_model(write_llama_gguf(tmp_path / "m.gguf", blocks=2, **MODELS[name]))
    reader = gguf.GGUFReader(index.path)
    types = Counter()
    for t in reader.tensors:
        types[index.tensors[t.name].qtype] += 1
        want = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(index.tensors[t.name].shape)
        assert np.array_equal(index.dequantize(t.name, np.float32), want.astype(np.float32)), t.name
    assert set(types) & set(Q5_TYPES), types


# --- OpenVINO -------------------------------------------------------------------------------


# OpenVINO against the float64 reference: tests/test_kquants.py's test_openvino_matches_the_reference
# runs these models too (one test for every quantization's table).


@needs_openvino
@pytest.mark.parametrize("name", list(MODELS))
def test_openvino_keeps_q5_compressed(tmp_path, name, ov_form):
    """Every projection is a FullyConnected at its code precision (Q5_0 i8, Q5_1 u8, Q8_0 i8)."""
    from backends.openvino import OpenVINOShard
    from tests.test_kquants import _fc_precisions

    index = open_model(write_llama_gguf(tmp_path / "m.gguf", blocks=2, **MODELS[name]))
    shard = OpenVINOShard(ShardSpec(index.path, 0, 2, embed=True, head=False), "f32", index=index)
    fcs = _fc_precisions(shard.runtime_model())
    if name == "mixed":  # per block: q+k i8 (Q5_0), v i8 (Q8_0), o, gate+up, down i8 (Q8_0);
        # block 1 splits gate (i8) from up (u8)
        assert fcs == Counter(fc_precisions_in(ov_form, {"i8": 10, "u8": 1})), fcs
    else:
        assert fcs == Counter(fc_precisions_in(ov_form, {FC_PRECISION[MODELS[name]["qtype"]]: 8})), fcs


@needs_openvino
def test_q5_1_zero_scale_groups_stay_exact(ov_form):
    """A Q5_1 group with d = 0 is the constant m: stored as codes 1, zero point 0, scale m."""
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino.shard import F32_CONFIG, core
    from backends.openvino.weights import WeightBank
    from tests.test_kquants import _fc_precisions

    rng = np.random.default_rng(5)
    x_w = rng.normal(0, 0.1, (8, 128)).astype(np.float32)
    x_w[2, 32:64] = 0.375  # one constant group: d = 0, m = 0.375
    raw = quants.quantize(x_w, gguf.GGMLQuantizationType.Q5_1)
    b = split_blocks("Q5_1", raw, 8, 128)
    assert b.scale[2, 1] == 0 and b.offset[2, 1] == np.float16(0.375)
    x_in = ops.parameter([-1, 128], ov.Type.f32)
    bank = WeightBank(None)  # holds the buffers the constants point into: keep it alive
    compiled = core().compile_model(
        ov.Model([ops.result(bank.quantized_linear(x_in.output(0), b))], [x_in]), "CPU", F32_CONFIG)
    assert _fc_precisions(compiled.get_runtime_model()) == Counter(fc_precisions_in(ov_form, {"u8": 1}))
    x = rng.normal(0, 1, (3, 128)).astype(np.float32)
    ours = compiled.create_infer_request().infer({0: x})[0]
    ref = x.astype(np.float64) @ b.dequantize(np.float64).T
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < 1e-5


# --- MLX ------------------------------------------------------------------------------------


@needs_mlx
@pytest.mark.parametrize("name", list(MODELS))
def test_mlx_matches_the_reference(tmp_path, name):
    _mlx_check(open_model(write_llama_gguf(tmp_path / "m.gguf", **MODELS[name])))


def _mlx_check(index) -> None:
    """As tests/test_kquants.py: stage outputs and logits within the MLX bounds, embedding rows exact."""
    from backends.mlx.weights import affine

    assert_stages_match_reference(index, [5, 60, 200, 7, 258, 33], ((0, 1, True), (1, 4, False)), reference_index=index)
    assert_embedding_rows_exact(index)
    for name, t in index.tensors.items():  # the affine form is exact: scale·code + bias = w in f32
        if t.qtype in Q5_TYPES and len(t.shape) == 2:
            codes, s, bias, bits, padded = affine(index.blocks_of(name), f32=True)
            assert bits == 5 and not padded and s.dtype == bias.dtype == np.float32
            w = codes.reshape(*s.shape, 32) * s[..., None] + bias[..., None]
            assert np.array_equal(w.reshape(t.shape), index.dequantize(name, np.float32)), name


# --- the real file --------------------------------------------------------------------------

PROMPT = (
    "The history of the lighthouse begins in the ancient world, where fires were lit on hilltops to "
    "guide ships safely into harbour. The most famous of these early towers stood at Alexandria, on "
    "the island of Pharos, and for centuries it was counted among the wonders of the world. Later, "
    "sailors along the coasts of Europe relied on"
)
N_TOKENS = 16


@pytest.mark.slow
def test_smollm2_q4_k_m_is_served_and_matches_llamacpp(tmp_path, default_model_path):
    """llama.cpp's Q4_K_M of the default model (via an F32 copy of its Q4_1 weights): mostly Q5_0
    and Q8_0, every tensor dequantizes as gguf.quants does, OpenVINO keeps it compressed, and
    `kafila run --precision f32` gives llama.cpp's greedy ids on an F32 copy of its weights."""
    from tests.conftest import default_ov_form
    from tests.llamacpp_ref import greedy_ids, quantize
    from tests.test_kquants import _fc_precisions
    from tests.test_llamacpp_quant import write_f32_copy
    from tests.test_run_cli import kafila

    f32 = write_f32_copy(default_model_path, str(tmp_path / "smollm2-f32.gguf"))
    path = quantize(f32, str(tmp_path / "smollm2.Q4_K_M.gguf"), "Q4_K_M")
    (tmp_path / "smollm2-f32.gguf").unlink()
    index = open_model(path)  # served: no refusal
    bytes_by_type = Counter()
    for t in index.tensors.values():
        bytes_by_type[t.qtype] += t.n_bytes
    assert {"Q5_0", "Q8_0"} <= set(bytes_by_type), bytes_by_type
    assert max(bytes_by_type, key=bytes_by_type.get) == "Q5_0", bytes_by_type  # the most bytes
    reader = gguf.GGUFReader(path, "r")
    for t in reader.tensors:
        info = index.tensors[t.name]
        if info.qtype in Q5_TYPES:
            theirs = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
            ours = index.dequantize(t.name, np.float32)
            assert np.array_equal(ours.view(np.uint32), theirs.reshape(info.shape).view(np.uint32)), t.name
    del reader

    if status("openvino").available:
        shard = load_shard("openvino", ShardSpec(path, 0, 1, True, False), "f32", index=index)
        fcs = _fc_precisions(shard.runtime_model())
        allowed = {"i8", "u4", "u8"} if default_ov_form() == "zero-point" else {"i8", "i4", "f32"}
        assert set(fcs) <= allowed and "i8" in fcs, fcs  # Q5_0 / Q8_0 / Q6_K i8, Q4_K u4 (split: i4 + f32)

    proc = kafila("run", "--model", path, "--precision", "f32", "--raw", "--json",
                  "--max-tokens", str(N_TOKENS), PROMPT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    prompt_ids, ids = out["prompt_ids"], out["ids"]
    assert len(prompt_ids) >= 64, len(prompt_ids)
    copy = write_f32_copy(path, str(tmp_path / "q4_k_m-dequantized.gguf"))
    ref = greedy_ids(copy, prompt_ids, N_TOKENS)
    assert len(ids) == N_TOKENS and len(set(ids)) > 1, (ids, ref)
    assert ids == ref, (ids, ref)
