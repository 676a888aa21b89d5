"""Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 models on the backends: exact weights, compressed.

Tiny Llama-shaped files whose matrices llama.cpp's own quantizer wrote (tests/ggml_quants.py via
tests/synthetic_gguf.py). OpenVINO keeps every projection in a compressed FullyConnected at the
precision backends/openvino/lowbit.py gives its type and, like MLX, matches the float64
reference at f32 within the other numerics tests' bound; the greedy ids against llama.cpp itself
are tests/test_llamacpp_lowbit.py's.
"""

from __future__ import annotations

from collections import Counter

import pytest

from backends import ShardSpec, status
from backends.gguf import open_model
from tests.synthetic_gguf import write_llama_gguf

SMALL = {"hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2}
LOWBIT = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4")
FC_PRECISION = {"Q2_K": "u2", "Q3_K": "i4", "IQ4_NL": "i8", "IQ4_XS": "i8", "MXFP4": "f4e2m1"}  # zero point form
needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
needs_mlx = pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)
PROMPT = [5, 60, 200, 7, 258, 33]


def model(tmp_path, qtype: str, **kw) -> str:
    return write_llama_gguf(tmp_path / f"{qtype}.gguf", **SMALL, qtype=qtype, embed_qtype=qtype, **kw)


@needs_openvino
@pytest.mark.parametrize("qtype", [q for q in LOWBIT if q != "Q2_K"])
def test_openvino_matches_the_reference(tmp_path, qtype):
    from tests.test_openvino_numerics import REL_BOUND, compare_chain

    index = open_model(model(tmp_path, qtype))
    assert {t.qtype for t in index.tensors.values() if len(t.shape) == 2} == {qtype}
    worst = compare_chain(index, [(0, 1), (1, 4)], PROMPT, [70, 71, 72])
    assert worst["hidden"] < REL_BOUND and worst["logits"] < REL_BOUND, worst


@needs_openvino
def test_openvino_q2_k_matches_the_reference_in_both_forms(tmp_path, ov_form):
    """Q2_K has an offset per group: the zero point and the split form are both exact."""
    from tests.test_openvino_numerics import REL_BOUND, compare_chain

    worst = compare_chain(open_model(model(tmp_path, "Q2_K")), [(0, 1), (1, 4)], PROMPT, [70, 71, 72])
    assert worst["hidden"] < REL_BOUND and worst["logits"] < REL_BOUND, worst


@needs_openvino
@pytest.mark.parametrize("qtype", LOWBIT)
def test_openvino_keeps_them_compressed(tmp_path, qtype, ov_form):
    """Every projection of two blocks compiles to a FullyConnected at its type's code precision
    (4 per block: q+k+v, o, gate+up, down), none expanded to f32 weights."""
    from backends.openvino import OpenVINOShard
    from tests.test_kquants import _fc_precisions

    index = open_model(model(tmp_path, qtype, blocks=2))
    shard = OpenVINOShard(ShardSpec(index.path, 0, 2, embed=True, head=False), "f32", index=index)
    fcs = _fc_precisions(shard.runtime_model())
    want = {FC_PRECISION[qtype]: 8}
    if qtype == "Q2_K" and ov_form == "split":  # i4 codes q − 2 plus an f32 one for the offsets
        want = {"i4": 8, "f32": 8}
    assert fcs == Counter(want), fcs


@needs_mlx
@pytest.mark.parametrize("qtype", LOWBIT)
def test_mlx_matches_the_reference(tmp_path, qtype):
    from tests.mlx_chain import assert_embedding_rows_exact, assert_stages_match_reference

    index = open_model(model(tmp_path, qtype))
    assert_stages_match_reference(index, PROMPT, ((0, 1, True), (1, 4, False)), reference_index=index)
    assert_embedding_rows_exact(index)
