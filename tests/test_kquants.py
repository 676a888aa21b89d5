"""K-quants (Q4_K, Q5_K, Q6_K) and BF16: read exactly, run exactly on every backend.

Dequantization equals the gguf package's (ggml's formulas) bit for bit; OpenVINO keeps each type
in a compressed FullyConnected (u4 / u8 / i8) and, like MLX, matches the float64 reference at f32
within the bounds of the other numerics tests; a Q4_K_M-like mix works on all three backends.
Models are tiny files written at test time (hidden 256: K-quant rows are 256-weight blocks).
"""

from __future__ import annotations

import struct
from collections import Counter

import gguf
import numpy as np
import pytest
from gguf import quants

from backends import ShardSpec, load_shard, status
from backends.errors import BadInput
from backends.gguf import open_model
from backends.gguf.quant import BLOCK_BYTES, split_blocks
from tests.conftest import fc_precisions_in
from tests.kquant_encode import encode_k
from tests.mlx_chain import assert_embedding_rows_exact, assert_stages_match_reference
from tests.synthetic_gguf import write_llama_gguf

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
SMALL = {"hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2}
# Q4_K_M-like: Q4_K matrices, attn_v and ffn_down in Q6_K, Q6_K embedding and output, one Q5_K
MIXED = {**SMALL, "qtype": "Q4_K", "embed_qtype": "Q6_K", "tied": False,
         "tensor_types": {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K",
                          "blk.1.ffn_up.weight": "Q5_K"}}  # fmt: skip
MODELS = {
    "q4_k": {**SMALL, "qtype": "Q4_K", "embed_qtype": "Q4_K"},
    "q5_k": {**SMALL, "qtype": "Q5_K", "embed_qtype": "Q5_K"},
    "q6_k": {**SMALL, "qtype": "Q6_K", "embed_qtype": "Q6_K"},
    "bf16": {**SMALL, "qtype": "BF16", "embed_qtype": "BF16"},
    "mixed": MIXED,
}
# FullyConnected precisions of one block's four projections (qkv, o, gate+up, down) per model
BLOCK_FCS = {"q4_k": {"u4": 4}, "q5_k": {"u8": 4}, "q6_k": {"i8": 4}}
needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
needs_mlx = pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)


def random_raw(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks: random bytes everywhere but the f16 d (and dmin), set to finite values
    of both signs and a wide range of magnitudes."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)
    f16 = lambda: (rng.uniform(-1, 1, raw.shape[:2]) * 10.0 ** rng.integers(-6, 2, raw.shape[:2])).astype(np.float16)  # noqa: E731
    at = (208,) if qtype == "Q6_K" else (0, 2)  # d (Q6_K at the end), dmin
    for i in at:
        raw[..., i:i + 2] = f16().view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    raw = random_raw(qtype, 12, 768)
    want = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype))  # f32 [12, 768]
    b = split_blocks(qtype, raw, 12, 768)
    assert b.group == (16 if qtype == "Q6_K" else 32)
    assert np.array_equal(b.dequantize(np.float32), want)
    assert np.array_equal(b.dequantize(np.float64).astype(np.float32), want)  # f64 exact, then one rounding
    ids = np.array([7, 0, 7, 11])
    assert np.array_equal(b.rows(ids, np.float32), want[ids])


@pytest.mark.parametrize("name", list(MODELS))
def test_files_dequantize_as_gguf_does(tmp_path, name):
    """Every tensor of the file, read through the index, equals gguf.quants.dequantize of its bytes."""
    index = open_model(write_llama_gguf(tmp_path / "m.gguf", blocks=2, **MODELS[name]))
    reader = gguf.GGUFReader(index.path)
    types = Counter()
    for t in reader.tensors:
        types[index.tensors[t.name].qtype] += 1
        want = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(index.tensors[t.name].shape)
        assert np.array_equal(index.dequantize(t.name, np.float32), want.astype(np.float32)), t.name
    assert set(types) - {"F32"}, types


def test_k_rows_must_be_whole_super_blocks(tmp_path):
    """A Q4_K tensor whose rows are 128 weights (half a super-block) is refused in one line."""
    path = write_llama_gguf(tmp_path / "m.gguf", blocks=1, **MODELS["q4_k"])
    data = bytearray(open(path, "rb").read())
    name = b"blk.0.attn_output.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims, ne0, ne1 = struct.unpack_from("<IQQ", data, at)
    assert (n_dims, ne0, ne1) == (2, 256, 256)
    struct.pack_into("<QQ", data, at + 4, 128, 512)  # same bytes, rows of 128
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(BadInput) as exc:
        open_model(str(tmp_path / "bad.gguf"))
    msg = str(exc.value)
    assert "\n" not in msg and "128" in msg and "256" in msg, msg


def test_unsupported_type_is_refused_with_the_supported_list(tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", blocks=1, **SMALL, odd_tensor=("blk.0.ffn_up.weight", "Q8_1"))
    with pytest.raises(BadInput) as exc:
        open_model(path)
    msg = str(exc.value)
    assert "\n" not in msg and "Q8_1" in msg
    assert all(t in msg for t in ("Q4_K", "Q5_K", "Q6_K", "BF16", "Q5_0", "Q5_1"))


# --- OpenVINO -------------------------------------------------------------------------------


def _fc_precisions(model) -> Counter:
    def rt(node, key):
        return node.get_rt_info()[key].astype(str)

    return Counter(rt(o, "runtimePrecision") for o in model.get_ordered_ops() if rt(o, "layerType") == "FullyConnected")


def _all_models() -> dict:
    """This file's K-quant models and tests/test_q5.py's Q5 ones: one reference test for both."""
    from tests.test_q5 import MODELS as Q5_MODELS

    return {**MODELS, **{f"q5-{name}": kw for name, kw in Q5_MODELS.items()}}


@needs_openvino
@pytest.mark.parametrize("name", list(_all_models()))
def test_openvino_matches_the_reference(tmp_path, name, ov_form):
    from tests.test_openvino_numerics import REL_BOUND, compare_chain

    index = open_model(write_llama_gguf(tmp_path / "m.gguf", **_all_models()[name]))
    worst = compare_chain(index, [(0, 1), (1, 4)], [5, 60, 200, 7, 258, 33], [70, 71, 72])
    assert worst["hidden"] < REL_BOUND and worst["logits"] < REL_BOUND, worst


@needs_openvino
@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k", "mixed"])
def test_openvino_keeps_k_quants_compressed(tmp_path, name, ov_form):
    """The compiled stage runs every K-quant projection as a FullyConnected at its code precision
    (Q4_K u4, Q5_K u8, Q6_K i8 with groups of 16; split: i4, i8 and an f32 one for the offsets);
    a mix gives one per run of equal types."""
    from backends.openvino import OpenVINOShard

    index = open_model(write_llama_gguf(tmp_path / "m.gguf", blocks=2, **MODELS[name]))
    shard = OpenVINOShard(ShardSpec(index.path, 0, 2, embed=True, head=False), "f32", index=index)
    fcs = _fc_precisions(shard.runtime_model())
    if name == "mixed":  # per block: q+k u4, v i8, o u4, gate+up u4, down i8; block 1: gate u4, up u8
        assert fcs == Counter(fc_precisions_in(ov_form, {"u4": 6, "i8": 4, "u8": 1})), fcs
    else:
        assert fcs == Counter(fc_precisions_in(ov_form, {p: 2 * n for p, n in BLOCK_FCS[name].items()})), fcs


@needs_openvino
def test_zero_scale_groups_stay_exact(ov_form):
    """A K group with d·sc = 0 but dmin·m ≠ 0 is the constant −dmin·m; it is stored as codes 1,
    zero point 0, scale −dmin·m (split: codes × 0 + offset), and the projection stays exact and
    compressed."""
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino.shard import F32_CONFIG, core
    from backends.openvino.weights import WeightBank

    rng = np.random.default_rng(5)
    rows, nsb = 8, 2
    sc = rng.integers(1, 64, (rows, nsb, 8)).astype(np.uint8)
    sc[2, 1, 3] = 0  # one group without scale ...
    m = rng.integers(0, 64, (rows, nsb, 8)).astype(np.uint8)
    m[2, 1, 3] = 17  # ... but with a min
    d, dmin = rng.uniform(1e-3, 2e-3, (rows, nsb)), rng.uniform(1e-3, 2e-3, (rows, nsb))
    raw = encode_k("Q4_K", d, dmin, sc, m, rng.integers(0, 16, (rows, nsb, 8, 32)))
    b = split_blocks("Q4_K", raw, rows, nsb * 256)
    assert b.scale[2, 8 + 3] == 0 and b.offset[2, 8 + 3] != 0
    x_in = ops.parameter([-1, nsb * 256], ov.Type.f32)
    bank = WeightBank(None)
    compiled = core().compile_model(ov.Model([ops.result(bank.quantized_linear(x_in.output(0), b))], [x_in]),
                                    "CPU", F32_CONFIG)
    assert _fc_precisions(compiled.get_runtime_model()) == Counter(fc_precisions_in(ov_form, {"u4": 1}))
    x = rng.normal(0, 1, (3, nsb * 256)).astype(np.float32)
    ours = compiled.create_infer_request().infer({0: x})[0]
    ref = x.astype(np.float64) @ b.dequantize(np.float64).T
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < 1e-5


# --- MLX ------------------------------------------------------------------------------------


@needs_mlx
@pytest.mark.parametrize("name", list(MODELS))
def test_mlx_matches_the_reference(tmp_path, name):
    """Same bound as tests/test_mlx_shard.py; the weights are exact (dequantized rows bit-equal)."""
    index = open_model(write_llama_gguf(tmp_path / "m.gguf", **MODELS[name]))
    assert_stages_match_reference(index, [5, 60, 200, 7, 258, 33], ((0, 1, True), (1, 4, False)), reference_index=index)
    assert_embedding_rows_exact(index)
