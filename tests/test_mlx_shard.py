"""The MLX shard on the real default model: weights, numerics, slots, rewind, split = unsplit.

Needs `mlx` (mlx[cpu] on Linux); every test that does is skipped with the backend's own reason
(which carries the install hint) where it cannot be imported.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from backends import ShardSpec, load_shard, status
from tests.mlx_chain import assert_stages_match_reference, build_chain, greedy_tokens, needs_mlx

pytestmark = pytest.mark.model


def test_unavailable_mlx_reports_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx.core", None)  # `import mlx.core` now raises ImportError
    st = status("mlx")
    assert not st.available
    assert "pip install" in st.reason and "mlx" in st.reason


@pytest.fixture(scope="module")
def head4(default_index):
    """Blocks [0, 4) with embedding and head, f32: the small shard most tests drive."""
    return shard(default_index, 0, 4, embed=True, head=True)


def shard(default_index, first, last, embed=False, head=False, precision="f32"):
    spec = ShardSpec(default_index.path, first, last, embed, head)
    return load_shard("mlx", spec, precision=precision, index=default_index)


def feed(s, slot, x, cache_len, mask=None):
    n = len(x)
    mask = np.ones(cache_len + n, dtype=np.int64) if mask is None else mask
    return s.forward(slot, np.asarray(x), np.arange(cache_len, cache_len + n), mask)


@needs_mlx
def test_weights_stay_quantized_and_only_the_shards_blocks_load(default_index):
    s = shard(default_index, 3, 5, embed=True, head=True, precision="serving")
    w = s.weights
    assert len(w.blocks) == 2
    for lin in (w.blocks[0].q, w.blocks[0].down, w.blocks[1].gate):
        assert str(lin.weight.dtype) == "mlx.core.uint32" and lin.bits == 4
        assert lin.scales.shape[1] * 32 == lin.weight.shape[1] * 32 // 4  # one scale per 32
    assert w.embedding.bits == 8 and w.lm_head.bits == 8  # Q8_0 embedding, tied lm_head
    gguf_bytes = sum(t.n_bytes for t in default_index.shard_tensors(3, 5, head=True))
    assert s.weight_bytes < 1.1 * gguf_bytes  # quantized in memory: about the GGUF's own bytes


@needs_mlx
def test_mlx_dequantization_is_exact_for_q4_1_and_q8_0(default_index, head4):
    import mlx.core as mx

    q = head4.weights.blocks[0].q
    got = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=q.bits)
    assert np.array_equal(np.array(got).astype(np.float64), default_index.dequantize("blk.0.attn_q.weight"))
    rows = np.arange(0, 49152, 97)  # a spread of embedding rows (the whole table is 226 MB in f64)
    got = np.array(head4.weights.embedding.rows(mx.array(rows))).astype(np.float64)
    assert np.array_equal(got, default_index.dequantize("token_embd.weight")[rows])


@needs_mlx
def test_hidden_states_and_logits_match_the_float64_reference(default_index, prompt_ids):
    assert_stages_match_reference(default_index, prompt_ids[0], ((0, 3, True), (27, 30, False)))


@needs_mlx
def test_masked_out_positions_are_as_never_fed(head4, prompt_ids):
    s = head4
    prompt = np.asarray(prompt_ids[1], dtype=np.int64)
    n, nxt = len(prompt), np.array([42], dtype=np.int64)

    clean = s.open_slot()
    feed(s, clean, prompt, 0)
    want = s.logits(feed(s, clean, nxt, n))

    rewound = s.open_slot()
    feed(s, rewound, prompt, 0)
    feed(s, rewound, [7, 8, 9], n)  # three drafted tokens, then all rejected
    mask = np.r_[np.ones(n), np.zeros(3), np.ones(1)].astype(np.int64)
    got = s.logits(s.forward(rewound, nxt, np.array([n]), mask))  # logical position n again
    assert s.cache_len(rewound) == n + 4 and s.cache_len(clean) == n + 1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert got.argmax() == want.argmax()
    s.close_slot(clean)
    s.close_slot(rewound)


@needs_mlx
def test_capture_restore_and_independent_slots(head4, prompt_ids):
    s = head4
    a, b = s.open_slot(), s.open_slot()
    pa, pb = (np.asarray(p, dtype=np.int64) for p in prompt_ids[2:4])
    feed(s, a, pa, 0)
    state = s.capture(a)
    first = [feed(s, a, [t], len(pa) + i) for i, t in enumerate((5, 6, 7))]
    feed(s, b, pb, 0)  # another slot in between changes nothing in slot a
    s.restore(a, state)
    again = [feed(s, a, [t], len(pa) + i) for i, t in enumerate((5, 6, 7))]
    for x, y in zip(first, again):
        assert np.array_equal(x, y)
    s.restore(b, state)  # a state moves to another slot of the same shard
    assert np.array_equal(feed(s, b, [5], len(pa)), first[0])
    s.close_slot(a)
    assert s.open_slot() == a  # ids are reused
    s.close_slot(a)
    s.close_slot(b)


@needs_mlx
def test_cache_growth_and_arbitrary_positions(default_index):
    import mlx.core as mx

    from backends.mlx.model import Dims, rope

    s = shard(default_index, 0, 1, embed=True)
    ids = (np.arange(300, dtype=np.int64) * 37) % 49152
    whole = feed(s, s.open_slot(), ids, 0)
    slot = s.open_slot()  # the same 300 positions in chunks that cross the 256-step growth
    parts = [feed(s, slot, ids[a:b], a) for a, b in ((0, 200), (200, 255), (255, 257), (257, 300))]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-4, rtol=1e-5)
    # positions need not be consecutive: the general RoPE path agrees with the fused kernel
    d = Dims(576, 9, 3, 64, 1e5, 1e-5)
    q = mx.random.normal((1, 9, 3, 64), key=mx.random.key(0))
    fused, general = rope(q, 10, d), rope(q, mx.array([10, 11, 12]), d)
    np.testing.assert_allclose(np.array(fused), np.array(general), atol=1e-4)


@pytest.fixture(scope="module")
def chains(default_index):
    return {k: build_chain(default_index, ["mlx"] * k, "serving") for k in (1, 2, 3)}


@needs_mlx
@pytest.mark.slow  # about 1 min on 2 cores, most of it compiling three chains
def test_split_hidden_states_are_bitwise_the_unsplit(chains, prompt_ids):
    """Every stage computes its blocks exactly as the whole model does: hidden states crossing
    as float32 lose nothing, so 2- and 3-stage chains are bitwise the 1-stage chain."""
    want_h: list = []
    want = greedy_tokens(chains[1], prompt_ids[0], 6, want_h)
    for k in (2, 3):
        got_h: list = []
        assert greedy_tokens(chains[k], prompt_ids[0], 6, got_h) == want
        assert all(np.array_equal(a, b) for a, b in zip(got_h, want_h)), f"{k} stages"


# The full split check (2- and 3-stage chains give the 1-stage chain's greedy tokens, 8 prompt_ids ×
# 64 tokens) runs for MLX in tests/test_shards_common.py::test_split_equals_unsplit[mlx].
