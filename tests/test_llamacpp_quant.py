"""K-quant files made by llama.cpp's own quantizer run in Kafila as llama.cpp runs their weights.

A small random F32 Llama (hidden 256, 3 blocks, tests/synthetic_gguf.py's byte-level vocabulary)
is quantized by llama.cpp to Q4_K_M, Q5_K_M and Q6_K (mixes of Q4_K/Q5_K/Q6_K chosen by its own
rules). llama.cpp computing on a quantized file quantizes activations too (Q8_K dot products), so
its yardstick is an F32 copy of the dequantized weights (gguf.quants.dequantize, ggml's formulas),
run with an f32 KV cache. Kafila reads the quantized file itself; the float64 reference and the
OpenVINO shard at f32 must give llama.cpp's greedy ids after a 72-id prompt (MLX: wherever
llama.cpp's choice is clear).

Hidden size and FFN are multiples of 256 so that llama.cpp keeps K-quants for every matrix (it
falls back to other types for rows that are not whole 256-weight super-blocks); the type mix of
each file is checked, and every tensor of it must dequantize bit for bit as gguf.quants does.
llama-cpp-python is a test dependency (the test extra): without it these tests fail, never skip.
"""

from __future__ import annotations

from collections import Counter

import gguf
import numpy as np
import pytest
from gguf import quants

from backends import ShardSpec, load_shard, status
from tests.synthetic_gguf import write_llama_gguf
from tests.test_llamacpp_arch import check_against_llamacpp, kafila_greedy

FTYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
# llama.cpp's mixes on this 3-block model (llama_tensor_get_type): *_K_M keeps the output matrix
# and the last block's attn_v/ffn_down at Q6_K; norms stay F32. No other type may appear.
MATRIX_TYPES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"}}
FC_PRECISION = {"Q4_K": "u4", "Q5_K": "u8", "Q6_K": "i8"}  # OpenVINO's compressed weights per type
PROMPT_IDS = [int(i) for i in np.random.default_rng(7).integers(0, 260, 72)]
N_TOKENS = 16


def write_f32_copy(src: str, dst: str) -> str:
    """`src` with every tensor replaced by its dequantized f32 values (metadata copied)."""
    reader = gguf.GGUFReader(src, "r")
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub_type = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        w.add_tensor(t.name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_f32_copy_holds_the_dequantized_weights(tmp_path):
    """The yardstick's file: the same weights Kafila reads from the quantized file, as F32."""
    from backends.gguf import open_model

    src = write_llama_gguf(tmp_path / "q.gguf", blocks=1, hidden=256, ffn=512, qtype="Q4_K", embed_qtype="Q6_K",
                           tensor_types={"attn_v.weight": "Q6_K", "ffn_up.weight": "Q5_K"})
    copy = open_model(write_f32_copy(src, str(tmp_path / "f32.gguf")))
    index = open_model(src)
    assert {t.qtype for t in copy.tensors.values()} == {"F32"}
    assert copy.hparams == index.hparams
    for name in index.tensors:
        assert np.array_equal(copy.dequantize(name, np.float32), index.dequantize(name, np.float32)), name


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized(ftype) → (path, index, llama.cpp's ids and logits on the F32 copy), once each."""
    from backends.gguf import open_model
    from tests.llamacpp_ref import greedy_run, quantize

    root = tmp_path_factory.mktemp("lcpq")
    src = write_llama_gguf(root / "f32.gguf", blocks=3, hidden=256, heads=4, kv_heads=2, ffn=512,
                           qtype="F32", embed_qtype="F32", tied=False, seed=3)
    built: dict[str, tuple] = {}

    def get(ftype: str):
        if ftype not in built:
            path = quantize(src, str(root / f"{ftype}.gguf"), ftype)
            index = open_model(path)  # refuses a type Kafila does not serve
            copy = write_f32_copy(path, str(root / f"{ftype}-dequantized.gguf"))
            ids, logits = greedy_run(copy, PROMPT_IDS, N_TOKENS)
            built[ftype] = (path, index, ids, logits)
        return built[ftype]

    return get


def type_histogram(index) -> dict[str, int]:
    return dict(sorted(Counter(t.qtype for t in index.tensors.values()).items()))


@pytest.mark.slow
@pytest.mark.parametrize("ftype", FTYPES)
def test_llamacpp_quantized_files_hold_k_quants(quantized, ftype):
    """Every matrix is one of the K types the mix names (no fallback type), vectors stay F32."""
    _, index, ids, _ = quantized(ftype)
    hist = type_histogram(index)
    matrices = {t.qtype for t in index.tensors.values() if len(t.shape) == 2}
    vectors = {t.qtype for t in index.tensors.values() if len(t.shape) == 1}
    assert matrices == MATRIX_TYPES[ftype] and vectors == {"F32"}, (ftype, hist)
    assert len(set(ids)) > 1, ids  # the continuation is not one token repeated


@pytest.mark.slow
@pytest.mark.parametrize("ftype", FTYPES)
def test_llamacpp_quantized_files_dequantize_as_gguf_does(quantized, ftype):
    """Kafila's dequantization of every tensor of llama.cpp's file equals gguf.quants' bit for bit
    (f32 bit patterns, so −0 and +0 differ): the F32 copy holds exactly the weights Kafila uses."""
    path, index, _, _ = quantized(ftype)
    reader = gguf.GGUFReader(path, "r")
    assert sorted(t.name for t in reader.tensors) == sorted(index.tensors), type_histogram(index)
    checked: Counter = Counter()
    for t in reader.tensors:
        info = index.tensors[t.name]
        assert info.qtype == t.tensor_type.name, t.name
        theirs = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(info.shape)
        ours = index.dequantize(t.name, np.float32)
        assert ours.dtype == np.float32 and ours.shape == theirs.shape, t.name
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), (t.name, info.qtype)
        checked[info.qtype] += 1
    assert set(checked) == MATRIX_TYPES[ftype] | {"F32"}, checked


@pytest.mark.slow
@pytest.mark.parametrize("ftype", FTYPES)
def test_reference_matches_llamacpp_on_quantized_files(quantized, ftype):
    from backends.reference import ReferenceShard

    path, index, ref_ids, ref_logits = quantized(ftype)
    shard = ReferenceShard(ShardSpec(path, 0, index.hparams.n_blocks, True, True), index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


@pytest.mark.slow
@pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
@pytest.mark.parametrize("ftype", FTYPES)
def test_openvino_matches_llamacpp_on_quantized_files(quantized, ftype):
    path, index, ref_ids, ref_logits = quantized(ftype)
    shard = load_shard("openvino", ShardSpec(path, 0, index.hparams.n_blocks, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


@pytest.mark.slow
@pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
@pytest.mark.parametrize("ftype", FTYPES)
def test_openvino_keeps_llamacpp_k_quants_compressed(quantized, ftype):
    """Every projection of llama.cpp's mix (lm_head included) compiles to a FullyConnected at its
    code precision (Q4_K u4, Q5_K u8, Q6_K i8; in the split form i4, i8 and an f32 one for the
    offsets): none is expanded to f32 weights."""
    from tests.conftest import default_ov_form, fc_precisions_in
    from tests.test_kquants import _fc_precisions

    path, index, _, _ = quantized(ftype)
    shard = load_shard("openvino", ShardSpec(path, 0, index.hparams.n_blocks, True, True), "f32", index=index)
    fcs = _fc_precisions(shard.runtime_model())
    want = fc_precisions_in(default_ov_form(), {FC_PRECISION[q]: 1 for q in MATRIX_TYPES[ftype]})
    assert set(fcs) == set(want), (fcs, type_histogram(index))


@pytest.mark.slow
@pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)
@pytest.mark.parametrize("ftype", FTYPES)
def test_mlx_matches_llamacpp_on_quantized_files(quantized, ftype):
    path, index, ref_ids, ref_logits = quantized(ftype)
    shard = load_shard("mlx", ShardSpec(path, 0, index.hparams.n_blocks, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits, exact_ids=False)
