"""Gemma 4 (`gemma4`) on OpenVINO and MLX computes what llama.cpp computes (issue 34).

tests/gemma4_gguf.py's small random files (llama.cpp's gemma-4 tokenizer): blocks of two geometries
(windowed: 2 KV heads of 16, window 8; full: heads of 32 with 24 rotated dims and rope_freqs
factors, one with its own values and one whose values are its keys), per-block output scales,
soft-capped logits, and in the MoE file 8 experts beside each block's dense FFN. A 40-id prompt
then 64 greedy ids (positions far past the window) from llama.cpp (f32 weights and KV) are the
yardstick for both backends' shards at f32, one stage and three cut unevenly (blocks 0–1, 2, 3),
and for the file quantized by llama.cpp's own quantizer (Q4_K_M, on its exactly dequantized
weights; OpenVINO's ggml form on the file itself).
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import ShardSpec, load_shard, status
from backends.errors import BadInput
from backends.gguf import open_model
from tests.gemma4_gguf import BLOCKS, HEAD_FULL, HEAD_SWA, KV_HEADS, SWA, WINDOW, write_gemma4_gguf
from tests.test_llamacpp_arch import LOGITS_ABS_BOUND, _Chain, check_against_llamacpp, kafila_greedy, needs_llamacpp

PROMPT_IDS = [int(i) for i in np.random.default_rng(1).integers(0, 100_000, 40)]
N_TOKENS = 64
UNEVEN = [(0, 2), (2, 3), (3, 4)]
PLE_BLOCKS = 6  # blocks 4 (windowed) and 5 (full) share blocks 2's and 3's KV
PLE_SPLITS = ([(0, 3), (3, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)], [(0, 2), (2, 6)])
needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)


def _shards(path, index, ranges, backend: str = "openvino"):
    if not status(backend).available:
        pytest.skip(status(backend).reason)
    shards = [load_shard(backend, ShardSpec(path, a, b, a == 0, a == 0), "f32", index=index) for a, b in ranges]
    return shards[0] if len(shards) == 1 else _Chain(shards)


@needs_llamacpp
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
@pytest.mark.parametrize("moe, fused", [(False, False), (True, False), (True, True)], ids=["dense", "moe", "fused"])
def test_both_backends_match_llamacpp_one_and_three_stages(tmp_path, moe, fused, backend):
    """fused: the experts' gate and up in one ffn_gate_up_exps, as real Gemma 4 files have them."""
    from tests.llamacpp_ref import greedy_run

    path = write_gemma4_gguf(tmp_path / "g.gguf", moe=moe, fused=fused)
    index = open_model(path)
    ref_ids, ref_logits = greedy_run(path, PROMPT_IDS, N_TOKENS)
    assert len(set(ref_ids)) > 8, ref_ids  # the random model is not degenerate
    for ranges in ([(0, BLOCKS)], UNEVEN):
        got = kafila_greedy(_shards(path, index, ranges, backend), PROMPT_IDS, N_TOKENS)
        check_against_llamacpp(got, ref_ids, ref_logits)


@needs_llamacpp
@needs_openvino
@pytest.mark.parametrize("moe, fused, ple, ftype", [
    (False, False, False, "Q4_K_M"), (True, False, False, "Q4_K_M"), (True, True, False, "Q4_K_M"),
    (False, False, True, "Q4_K_M"), (True, False, False, "Q8_0")], ids=["dense", "moe", "fused", "e2b-like", "moe-q8_0"])  # fmt: skip
def test_a_quantized_gemma4_matches_llamacpp(tmp_path, moe, fused, ple, ftype):
    """Q4_K_M (and Q8_0 on the MoE file) from llama.cpp's quantizer (rows of 256: K-quants on the
    dense and expert matrices):
    the exact form and MLX answer llama.cpp's ids on the file's dequantized weights at 1 and 3 stages.
    The ggml form on the file itself: the first logits are llama.cpp's own to rounding
    (tests/test_ggml_kernels.py's check), after an 8-id prompt for the dense file and after one id
    for the MoE files (gate and up fused too: one GgmlMoe node reads the fused tensor), as for
    qwen3moe there. (After 8 ids the MoE file's are 0.06-0.07 from
    llama.cpp's, the exact form's 0.08-0.09; after 1 or 3 ids 1e-6. The suspect, not shown:
    llama.cpp's repacked GEMM for an expert's rows of a prompt, where GgmlMoe reads the blocks as
    stored.)"""
    from backends.openvino import ggml_kernels
    from tests.llamacpp_ref import greedy_run, quantize
    from tests.test_llamacpp_quant import write_f32_copy

    shape = dict(blocks=PLE_BLOCKS, per_layer=8, shared_kv=2) if ple else {}  # e2b-like: per-layer inputs, shared KV
    src = write_gemma4_gguf(tmp_path / "f32.gguf", moe=moe, hidden=256, ffn=256, experts=(8, 2, 256), fused=fused,
                            **shape)  # fmt: skip
    path = quantize(src, str(tmp_path / "q.gguf"), ftype)
    index = open_model(path)
    assert ({"Q4_K", "Q6_K"} if ftype == "Q4_K_M" else {"Q8_0"}) <= {t.qtype for t in index.tensors.values()}
    ref_ids, ref_logits = greedy_run(write_f32_copy(path, str(tmp_path / "deq.gguf")), PROMPT_IDS, N_TOKENS)
    n = index.hparams.n_blocks
    for backend in ("openvino", "mlx") if status("mlx").available else ("openvino",):
        for ranges in ([(0, n)], PLE_SPLITS[0] if ple else UNEVEN):
            got = kafila_greedy(_shards(path, index, ranges, backend), PROMPT_IDS, N_TOKENS)
            check_against_llamacpp(got, ref_ids, ref_logits, bound=0.02 if ple else LOGITS_ABS_BOUND)
    if not ggml_kernels.available()[0] or ple:  # e2b-like: rows of 8 (proj) stay F16, which the ggml form
        return  # computes in f32, where llama.cpp rounds the activations to f16 (ggml_kernels.py)
    from tests.test_ggml_kernels import _first_positions_are_llamacpps

    _first_positions_are_llamacpps(path, [7] if moe else PROMPT_IDS[:8])


def test_each_block_keeps_its_own_kv_geometry_and_the_plan_prices_their_mean(tmp_path):
    """Windowed blocks hold 2 KV heads of 16 a position, the full ones 2 and 1 heads of 32: the
    planner's KV per position per block is the full blocks' over every block, the windowed ones'
    window priced per request (the KV holds only it: backends/window.py),
    and an OpenVINO stage's KV variables and an MLX slot's buffers have exactly those shapes;
    MLX's batched rows are each slot's own forward."""
    from backends.memory import window_held_positions

    index = open_model(write_gemma4_gguf(tmp_path / "g.gguf"))
    per_block = [2 * n * (HEAD_SWA if w else HEAD_FULL) * 2 for n, w in zip(KV_HEADS, SWA)]
    windowed = sum(b for b, w in zip(per_block, SWA) if w)
    model = index.planner_model()
    assert model["kv_bytes_per_token_per_block"] == (sum(per_block) - windowed) / BLOCKS
    assert model["state_bytes_per_request_per_block"] == windowed * window_held_positions(WINDOW) / BLOCKS
    if status("openvino").available:
        shard = load_shard("openvino", ShardSpec(index.path, 0, BLOCKS, True, True), "f32", index=index)
        slot = shard.open_slot()
        shard.forward(slot, np.arange(5), np.arange(5), np.ones(5, np.int64))
        held = {s.name: tuple(s.state.shape) for s in shard._reqs[slot].query_state()}
        for b, (n, w) in enumerate(zip(KV_HEADS, SWA)):
            d = HEAD_SWA if w else HEAD_FULL
            assert held[f"past_key_values.{b}.key"] == held[f"past_key_values.{b}.value"] == (1, n, 5, d)
    if status("mlx").available:
        shard = load_shard("mlx", ShardSpec(index.path, 0, BLOCKS, True, True), "f32", index=index)
        a, b = shard.open_slot(), shard.open_slot()
        alone = shard.forward(a, np.arange(5), np.arange(5), np.ones(5, np.int64))
        cache = shard._slots[a]
        assert [k.shape[1::2] for k in cache.keys] == [(n, HEAD_SWA if w else HEAD_FULL) for n, w in zip(KV_HEADS, SWA)]
        both = shard.forward_batch([b, a], [np.arange(5), np.array([9])], [np.arange(5), np.array([5])],
                                   [np.ones(5, np.int64), np.ones(6, np.int64)])  # fmt: skip
        np.testing.assert_allclose(both[0], alone, rtol=1e-5, atol=1e-5)


@needs_llamacpp
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
def test_per_layer_embeddings_and_shared_kv_match_llamacpp_one_stage_and_split(tmp_path, backend):
    """The E2B/E4B parts: per-layer embeddings (P = 8 a block) and the last two blocks attending over
    blocks 2's and 3's KV. Split so that both sources sit on an earlier stage than their sharers
    (their step K and V travel in the carried row), one on the sharers' stage and one before it,
    and both with them; 64 ids past the window. The logits within 0.02 of llama.cpp's, not the
    other files' 0.01: llama.cpp's GELU reads an f16 table (GGML_GELU_FP16) where the exact form
    computes it, and these blocks have a second GELU each (the per-layer gate), 64 ids deep."""
    from tests.llamacpp_ref import greedy_run

    path = write_gemma4_gguf(tmp_path / "ple.gguf", blocks=PLE_BLOCKS, per_layer=8, shared_kv=2)
    index = open_model(path)
    g = index.hparams.gemma4
    assert [b.kv_from for b in g.blocks] == [0, 1, 2, 3, 2, 3] and g.shared_sources == (2, 3)
    ref_ids, ref_logits = greedy_run(path, PROMPT_IDS, N_TOKENS)
    assert len(set(ref_ids)) > 8, ref_ids
    for ranges in ([(0, PLE_BLOCKS)], *PLE_SPLITS):
        got = kafila_greedy(_shards(path, index, ranges, backend), PROMPT_IDS, N_TOKENS)
        check_against_llamacpp(got, ref_ids, ref_logits, bound=0.02)


def test_a_carried_row_holds_the_per_layer_inputs_and_the_shared_sources_kv(tmp_path):
    """The row's layout, the KV the plan prices for a sharing block (a copy of its source's, once per
    source), and the head's tensors: the per-layer tables go with the first stage."""
    index = open_model(write_gemma4_gguf(tmp_path / "ple.gguf", blocks=PLE_BLOCKS, per_layer=8, shared_kv=2))
    h, g = index.hparams, index.hparams.gemma4
    kv2, kv3 = 2 * KV_HEADS[2] * HEAD_SWA, 2 * KV_HEADS[3] * HEAD_FULL
    assert h.carried == h.hidden + PLE_BLOCKS * 8 + kv2 + kv3
    assert g.ple_columns(h.hidden, 5) == (h.hidden + 40, h.hidden + 48)
    assert g.kv_columns(h.hidden, 3) == h.hidden + PLE_BLOCKS * 8 + kv2
    # the first (only) sharer of each source is priced one copy of it: a stage apart from it holds one
    assert [g.kv_values_per_token(b) for b in range(PLE_BLOCKS)] == [kv2, 2 * KV_HEADS[1] * HEAD_FULL, kv2, kv3, kv2, kv3]
    names = {t.name for t in index.shard_tensors(0, 1, True)}
    assert {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight"} <= names
    assert "per_layer_model_proj.weight" not in {t.name for t in index.shard_tensors(1, 6, False)}


@pytest.mark.parametrize("key, value, says", [
    ("gemma4.attention.shared_kv_layers", 3, "another kind"),  # full block 3 would read windowed block 2's
    ("gemma4.attention.shared_kv_layers", 5, "out of range"),  # llama.cpp needs 2 blocks of their own at least
])  # fmt: skip
def test_a_shared_kv_llamacpp_would_not_compute_as_written_is_refused_in_one_line(tmp_path, key, value, says):
    import gguf

    path = write_gemma4_gguf(tmp_path / "g.gguf", blocks=PLE_BLOCKS, extra_kv={key: (value, gguf.GGUFValueType.UINT32)})
    with pytest.raises(BadInput) as e:
        open_model(path)
    assert says in str(e.value) and "\n" not in str(e.value)
