"""OpenVINO shards at f32 (f32 compute, f32 KV, no dynamic quantization) against the exact
float64 reference: every shard's hidden states and the head's logits, prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest

from backends import ShardSpec

# Relative error bound ‖ours − ref‖∞ / ‖ref‖∞ per shard output. Measured ≈ 2e-7 on the synthetic
# models and ≈ 4e-6 on SmolLM2 (f32 rounding only: the 4-bit decompression is exact).
REL_BOUND = 5e-5


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def compare_chain(index, ranges, prompt, decode_tokens):
    """Feed the same inputs to OpenVINO f32 shards and reference shards, stage by stage: each
    OpenVINO stage gets the reference's input, so errors are per shard, not accumulated."""
    from backends.openvino import OpenVINOShard
    from backends.reference import ReferenceShard

    pairs = []
    for i, (first, last) in enumerate(ranges):
        spec = ShardSpec(index.path, first, last, embed=i == 0, head=i == 0)
        ov_shard, ref = OpenVINOShard(spec, "f32", index=index), ReferenceShard(spec, index=index)
        pairs.append((ov_shard, ov_shard.open_slot(), ref, ref.open_slot()))
    worst = {"hidden": 0.0, "logits": 0.0}
    feeds = [np.asarray(prompt)] + [np.asarray([t]) for t in decode_tokens]
    total = 0
    for ids in feeds:
        n = len(ids)
        total += n
        mask, positions = np.ones(total, np.int64), np.arange(total - n, total)
        x = ids
        for ov_shard, ov_slot, ref, ref_slot in pairs:
            ours = ov_shard.forward(ov_slot, x, positions, mask)
            x = ref.forward_exact(ref_slot, x, positions, mask)
            worst["hidden"] = max(worst["hidden"], rel_err(ours, x))
        head_ov, head_ref = pairs[0][0], pairs[0][2]
        worst["logits"] = max(worst["logits"], rel_err(head_ov.logits(x.astype(np.float32)), head_ref.logits_exact(x)))
        assert head_ov.greedy(x.astype(np.float32)) == int(np.argmax(head_ref.logits_exact(x[-1:])))
    return worst


@pytest.mark.parametrize(
    "options",
    [{}, {"qtype": "Q4_0"}, {"qtype": "Q8_0"}, {"qtype": "F16", "embed_qtype": "F16"},
     {"qtype": "F32", "embed_qtype": "Q4_1", "tied": False}, {"arch": "qwen2", "qkv_bias": True}],
    ids=["q4_1", "q4_0", "q8_0", "f16", "f32-untied", "qwen2-bias"],
)
def test_synthetic_models_match_reference(tmp_path, options):
    from backends.gguf import open_model
    from tests.synthetic_gguf import write_llama_gguf

    index = open_model(write_llama_gguf(tmp_path / "m.gguf", **options))
    worst = compare_chain(index, [(0, 1), (1, 4)], [5, 60, 200, 7, 258, 33], [70, 71, 72])
    assert worst["hidden"] < REL_BOUND and worst["logits"] < REL_BOUND, worst


@pytest.mark.model
def test_default_model_shards_match_reference(default_index, default_tokenizer):
    prompt = default_tokenizer.encode("The capital of France is")
    worst = compare_chain(default_index, default_index.split_blocks(3), prompt, [12366, 30])
    assert worst["hidden"] < REL_BOUND and worst["logits"] < REL_BOUND, worst


@pytest.mark.parametrize("zero_scale", [False, True], ids=["zero-point", "d0-fallback"])
def test_q4_1_linear_is_exact(zero_scale, ov_form):
    """Q4_1 runs as u4 with an f32 zero point −m/d; a block with d = 0, m ≠ 0 (no zero point) is
    stored as codes 1, zero point 0, scale m; or in the split form, i4 q − 8 and offsets m + 8d.
    All match w = d·q + m in float64."""
    import openvino as ov
    import openvino.opset13 as ops

    from backends.gguf.quant import QuantBlocks
    from backends.openvino.shard import F32_CONFIG, core
    from backends.openvino.weights import WeightBank

    rng = np.random.default_rng(3)
    rows, nb = 48, 4
    q = rng.integers(0, 16, (rows, nb, 32), dtype=np.uint8)
    d = (rng.uniform(0.5, 2.0, (rows, nb)) * 1e-2).astype(np.float16)
    m = (-7.5 * d.astype(np.float32) + rng.normal(0, 2e-3, (rows, nb))).astype(np.float16)
    if zero_scale:
        d[3, 1], m[3, 1] = 0, np.float16(0.01)
    b = QuantBlocks("Q4_1", q, d, m)
    x_in = ops.parameter([-1, nb * 32], ov.Type.f32)
    bank = WeightBank(None)  # holds the buffers the constants point into
    y = bank.quantized_linear(x_in.output(0), b)
    req = core().compile_model(ov.Model([ops.result(y)], [x_in]), "CPU", F32_CONFIG).create_infer_request()
    x = rng.normal(0, 1, (3, nb * 32)).astype(np.float32)
    ours = req.infer({0: x})[0]
    del bank
    ref = x.astype(np.float64) @ b.dequantize(np.float64).T
    assert rel_err(ours, ref) < 1e-5
