"""backends.reference on a tiny synthetic model: the yardstick's own invariants (float64)."""

from __future__ import annotations

import numpy as np
import pytest

from backends import ShardSpec
from backends.reference import ReferenceShard, rope_angles, rope_interleaved, rope_neox
from kafila.engine.chain import LocalChain

PROMPT = [5, 60, 200, 7, 258, 33, 91]


@pytest.fixture(scope="module")
def whole(synthetic_index):
    return ReferenceShard(ShardSpec(synthetic_index.path, 0, 4, True, True), index=synthetic_index)


def run(shard, slot, feeds):
    total, out = 0, None
    for ids in feeds:
        total += len(ids)
        out = shard.forward_exact(slot, np.asarray(ids), np.arange(total - len(ids), total), np.ones(total, np.int64))
    return out


def test_incremental_equals_one_pass(whole):
    a, b = whole.open_slot(), whole.open_slot()
    one = run(whole, a, [PROMPT])
    inc = run(whole, b, [PROMPT[:3], PROMPT[3:5], PROMPT[5:6], PROMPT[6:]])
    np.testing.assert_allclose(inc[-1], one[-1], rtol=1e-12, atol=1e-12)


def test_split_equals_unsplit(synthetic_index, whole):
    parts = [ReferenceShard(ShardSpec(synthetic_index.path, f, l, f == 0, f == 0), index=synthetic_index)
             for f, l in ((0, 1), (1, 3), (3, 4))]
    slots = [p.open_slot() for p in parts]
    n = len(PROMPT)
    x = np.asarray(PROMPT)
    for p, s in zip(parts, slots):
        x = p.forward_exact(s, x, np.arange(n), np.ones(n, np.int64))
    np.testing.assert_allclose(x, run(whole, whole.open_slot(), [PROMPT]), rtol=1e-12, atol=1e-12)


def test_masked_positions_are_never_seen(whole):
    """Physical positions with mask 0 are exactly as if never fed (positions stay logical)."""
    plain, masked = whole.open_slot(), whole.open_slot()
    run(whole, plain, [PROMPT])
    run(whole, masked, [PROMPT])
    n = len(PROMPT)
    whole.forward_exact(masked, np.array([9, 10, 11]), np.arange(n, n + 3), np.ones(n + 3, np.int64))
    mask = np.r_[np.ones(n, np.int64), np.zeros(3, np.int64), 1]
    got = whole.forward_exact(masked, np.array([44]), np.array([n]), mask)
    want = whole.forward_exact(plain, np.array([44]), np.array([n]), np.ones(n + 1, np.int64))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_capture_restore(whole):
    s = whole.open_slot()
    run(whole, s, [PROMPT])
    state = whole.capture(s)
    a = whole.forward_exact(s, np.array([3]), np.array([7]), np.ones(8, np.int64))
    whole.restore(s, state)
    b = whole.forward_exact(s, np.array([3]), np.array([7]), np.ones(8, np.int64))
    np.testing.assert_array_equal(a, b)


def test_rope_interleaved_rotates_pairs():
    x = np.zeros((1, 1, 4))
    x[0, 0, 0] = 1.0  # the pair (x0, x1) = (1, 0) at position 1, θ = 1 rad
    out = rope_interleaved(x, rope_angles(np.array([1]), 4, 10000.0))
    np.testing.assert_allclose(out[0, 0], [np.cos(1), np.sin(1), 0, 0], atol=1e-15)


def test_rope_neox_rotates_halves_with_factors_and_scale():
    x = np.zeros((1, 1, 4))
    x[0, 0, 1] = 1.0  # the pair (x1, x3) = (1, 0), i = 1: θ = p·scale·base^(−1/2) / factor_1
    theta = rope_angles(np.array([8]), 4, 100.0, scale=0.5, factors=np.array([1.0, 0.2]))
    out = rope_neox(x, theta)
    np.testing.assert_allclose(out[0, 0], [0, np.cos(2), 0, np.sin(2)], atol=1e-15)


def test_local_chain_on_reference(synthetic_model, synthetic_index):
    one = LocalChain.build(synthetic_model, 1, "reference", index=synthetic_index)
    three = LocalChain.build(synthetic_model, 3, "reference", index=synthetic_index)
    assert list(one.generate(PROMPT, 10)) == list(three.generate(PROMPT, 10))
    assert [s["blocks"] for s in three.stages] == [[0, 1], [1, 3], [3, 4]]
