"""K-quant files made by llama.cpp's own quantizer run in Kafila as llama.cpp runs their weights.

A small random F32 Llama (hidden 256, 3 blocks, tests/synthetic_gguf.py's byte-level vocabulary)
is quantized by llama.cpp to Q4_K_M, Q5_K_M and Q6_K (mixes of Q4_K/Q5_K/Q6_K chosen by its own
rules). llama.cpp computing on a quantized file quantizes activations too (Q8_K dot products), so
its yardstick is an F32 copy of the dequantized weights (gguf.quants.dequantize, ggml's formulas),
run with an f32 KV cache. Kafila reads the quantized file itself; the float64 reference and the
OpenVINO shard at f32 must give llama.cpp's greedy ids after a 72-id prompt.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import quants

from backends import ShardSpec, load_shard, status
from tests.synthetic_gguf import write_llama_gguf
from tests.test_llamacpp_arch import check_against_llamacpp, kafila_greedy, needs_llamacpp

FTYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
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
    from kafila.models import open_model

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
    from kafila.models import open_model
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


@needs_llamacpp
@pytest.mark.parametrize("ftype", FTYPES)
def test_llamacpp_quantized_files_hold_k_quants(quantized, ftype):
    _, index, ids, _ = quantized(ftype)
    types = {t.qtype for t in index.tensors.values()}
    assert types & {"Q4_K", "Q5_K", "Q6_K"}, types
    assert len(set(ids)) > 1, ids  # the continuation is not one token repeated


@needs_llamacpp
@pytest.mark.parametrize("ftype", FTYPES)
def test_reference_matches_llamacpp_on_quantized_files(quantized, ftype):
    from backends.reference import ReferenceShard

    path, index, ref_ids, ref_logits = quantized(ftype)
    shard = ReferenceShard(ShardSpec(path, 0, index.hparams.n_blocks, True, True), index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


@needs_llamacpp
@pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
@pytest.mark.parametrize("ftype", FTYPES)
def test_openvino_matches_llamacpp_on_quantized_files(quantized, ftype):
    path, index, ref_ids, ref_logits = quantized(ftype)
    shard = load_shard("openvino", ShardSpec(path, 0, index.hparams.n_blocks, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


@needs_llamacpp
@pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)
@pytest.mark.parametrize("ftype", FTYPES)
def test_mlx_matches_llamacpp_on_quantized_files(quantized, ftype):
    path, index, ref_ids, ref_logits = quantized(ftype)
    shard = load_shard("mlx", ShardSpec(path, 0, index.hparams.n_blocks, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits, exact_ids=False)
