"""The compiled OpenVINO shards run as intended: in the exact form 4-bit FullyConnected layers and
an 8-bit lm_head, in the ggml form (the serving default) one ggml op per matrix; stateful SDPA fed
by the KV memory (the ReadValue → Gather(beam_idx) → Concat → Assign chain fused away), no
per-layer KV Concat left. Read from compiled.get_runtime_model()."""

from __future__ import annotations

from collections import Counter

import pytest

pytestmark = pytest.mark.model


def layer_type(node) -> str:
    return node.get_rt_info()["layerType"].astype(str)


def precision(node) -> str:
    return node.get_rt_info()["runtimePrecision"].astype(str)


@pytest.fixture(scope="module")
def chain(chain_factory):
    return chain_factory("openvino", 3, kquant="exact")


@pytest.mark.parametrize("kquant", ["exact", "auto"])
def test_stage_runtime_models_are_fused(chain_factory, kquant):
    from backends.openvino import ggml_kernels

    form = ggml_kernels.resolve(kquant, "serving")
    for shard in chain_factory("openvino", 3, kquant=kquant).shards:
        blocks = shard.spec.last - shard.spec.first
        ops = list(shard.runtime_model().get_ordered_ops())
        kinds = Counter(layer_type(o) for o in ops)
        fc4 = [o for o in ops if layer_type(o) == "FullyConnected" and precision(o) in ("i4", "u4")]
        ggml = Counter(o.get_friendly_name().split("_")[0] for o in ops if layer_type(o) == "Reference")
        # qkv, o, gate+up, down per block: weights still 4-bit; or ggml's ops on the file's blocks,
        # qkv and o as GgmlMatMul, the whole feed-forward as one GgmlFfn
        if form == "exact":
            assert (len(fc4), sum(ggml.values())) == (4 * blocks, 0), kinds
        else:
            assert (len(fc4), ggml["GgmlMatMul"], ggml["GgmlFfn"]) == (0, 2 * blocks, blocks), (kinds, ggml)
        sdpa = [o for o in ops if layer_type(o) == "ScaledDotProductAttention"]
        assert len(sdpa) == blocks
        for node in sdpa:  # stateful: past K/V come straight from memory, new K/V go back to it
            feeders = Counter(layer_type(v.get_node()) for v in node.input_values())
            consumers = Counter(layer_type(t.get_node()) for out in node.outputs() for t in out.get_target_inputs())
            assert feeders["MemoryInput"] == 2 and consumers["MemoryOutput"] == 2, (feeders, consumers)
        kv_concats = [o for o in ops if layer_type(o) == "Concatenation" and o.get_output_partial_shape(0).rank.get_length() == 4]
        assert not kv_concats, [o.get_friendly_name() for o in kv_concats]
        assert kinds["RoPE"] == 2 * blocks  # rotate_half RoPE fused for q and k


def test_attention_takes_an_additive_float_mask(chain):
    """The SDPA's mask is f32 (0 / lowest, added to the scores), never boolean: the CPU plugin's
    kernel ran a prompt far slower with a boolean mask (graph.causal_mask, bench/prefill.py)."""
    for shard in chain.shards:
        sdpa = [o for o in shard.runtime_model().get_ordered_ops() if layer_type(o) == "ScaledDotProductAttention"]
        assert sdpa
        for node in sdpa:  # inputs: q, k, v, the mask, ...
            mask = node.input_value(3).get_element_type()
            assert mask.is_real(), mask  # a boolean mask reaches the kernel as u8


def test_head_keeps_8bit_lm_head(chain):
    ops = list(chain.head.head_runtime_model().get_ordered_ops())
    fcs = [(precision(o)) for o in ops if layer_type(o) == "FullyConnected"]
    assert fcs == ["i8"], fcs


def test_single_stage_folds_the_head(chain_factory, default_tokenizer):
    """A shard holding the last block and the head computes the greedy token in its own graph
    (the 8-bit lm_head is a FullyConnected of the stage): one inference per decode step, the same
    token as the separate head graph."""
    import numpy as np

    one = chain_factory("openvino", 1, kquant="exact")
    shard = one.shards[0]
    ops = list(shard.runtime_model().get_ordered_ops())
    fcs = Counter(precision(o) for o in ops if layer_type(o) == "FullyConnected")
    assert fcs["i8"] == 1 and fcs["i4"] + fcs["u4"] == 4 * shard.spec.last, fcs
    cursor = one.open()
    try:
        hidden = one.feed(cursor, default_tokenizer.encode("The capital of France is"))
        folded = shard.greedy(hidden)
        assert folded == shard.greedy(hidden.copy())  # a copy is not the cached array: head graph
        assert folded == int(np.argmax(shard.logits(hidden[-1:])[0]))
    finally:
        one.close(cursor)


def test_released_weight_pages_change_nothing(chain_factory, default_tokenizer):
    """The constants live in a spill file whose pages are dropped from the resident set after
    the first forwards; dropping them again at any time changes no output (pages come back)."""
    import numpy as np

    one = chain_factory("openvino", 1, kquant="exact")
    shard = one.shards[0]
    assert shard._bank.spill is not None and shard._bank.spill.nbytes > 0.5 * sum(
        t.n_bytes for t in shard.index.tensors.values())
    ids = default_tokenizer.encode("The capital of France is")
    runs = []
    for release in (False, True):
        cursor = one.open()
        try:
            hidden = one.feed(cursor, ids)
            if release:
                shard.release_weight_pages()
            logits = shard.logits(hidden[-1:])
            hidden = one.feed(cursor, [int(np.argmax(logits[0]))])
            runs.append((logits, hidden))
        finally:
            one.close(cursor)
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
