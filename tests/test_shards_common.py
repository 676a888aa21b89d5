"""Properties every shard backend must have on the real model, run for each backend by name:
split equals unsplit, independent slots, mask-based rewind. A backend joins by adding its name.
An unavailable mlx is skipped with its install hint; OpenVINO is a dependency, so it must be there
(tests/conftest.py's chain_factory)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.model

BACKENDS_UNDER_TEST = ["openvino", "mlx"]

SPLIT_TOKENS = 64


@pytest.mark.slow
@pytest.mark.timeout(1500)  # MLX's CPU 4-bit matmul is scalar: ~800 steps take minutes here
@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_split_equals_unsplit(chain_factory, prompt_ids, backend):
    """Serving precision: 2- and 3-stage chains give the 1-stage chain's greedy tokens (MLX on
    every other prompt: its CPU steps are slow, and CI's whole run is bounded)."""
    chains = {s: chain_factory(backend, s) for s in (1, 2, 3)}
    for i, ids in enumerate(prompt_ids):
        if backend == "mlx" and i % 2:
            continue
        want = list(chains[1].generate(ids, SPLIT_TOKENS))
        assert len(want) == SPLIT_TOKENS
        for stages in (2, 3):
            got = list(chains[stages].generate(ids, SPLIT_TOKENS))
            assert got == want, f"{backend} {stages} stages, prompt {i}: first difference at {first_diff(got, want)}"


def first_diff(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_interleaved_slots_match_solo(chain_factory, prompt_ids, backend):
    chain = chain_factory(backend, 3)
    a_ids, b_ids = prompt_ids[0], prompt_ids[3]
    solo_a, solo_b = list(chain.generate(a_ids, 24)), list(chain.generate(b_ids, 24))
    a, b = chain.open(), chain.open()
    try:
        got_a, got_b = [], []
        ha, hb = chain.feed(a, a_ids), chain.feed(b, b_ids)
        for _ in range(24):  # alternate the two requests step by step
            got_a.append(chain.next_token(ha))
            ha = chain.feed(a, got_a[-1:])
            got_b.append(chain.next_token(hb))
            hb = chain.feed(b, got_b[-1:])
    finally:
        chain.close(a)
        chain.close(b)
    assert got_a == solo_a and got_b == solo_b


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_masked_rewind_equals_never_fed(chain_factory, prompt_ids, backend):
    """Drafts fed then rewound (attention_mask 0, logical position back) leave the next-token
    logits as if they had never been fed; decoding then continues identically. At f32: under
    bf16 serving precision the longer physical cache changes rounding enough to flip near-ties."""
    chain = chain_factory(backend, 3, "f32")
    ids = prompt_ids[1]
    drafts = [1274, 3548, 28, 905]  # arbitrary tokens, rejected below
    plain, masked = chain.open(), chain.open()
    try:
        chain.feed(plain, ids)
        chain.feed(masked, ids)
        chain.feed(masked, drafts)
        chain.rewind(masked, len(drafts))
        assert masked.logical == plain.logical and masked.cache_len == plain.cache_len + len(drafts)
        nxt = [30]
        lp = chain.logits(chain.feed(plain, nxt)[-1:])[0]
        lm = chain.logits(chain.feed(masked, nxt)[-1:])[0]
        assert np.argmax(lp) == np.argmax(lm)
        np.testing.assert_allclose(lm, lp, rtol=0, atol=1e-4 * np.max(np.abs(lp)))
        # a partial rewind while decoding: of 3 drafts the first is accepted, 2 are rejected
        hp = chain.feed(plain, drafts[:1])
        hm = chain.feed(masked, drafts[:3])[:1]  # the accepted draft's row
        chain.rewind(masked, 2)
        seq_p, seq_m = [], []
        for _ in range(8):
            seq_p.append(chain.next_token(hp))
            seq_m.append(chain.next_token(hm))
            hp, hm = chain.feed(plain, seq_p[-1:]), chain.feed(masked, seq_m[-1:])
        assert seq_m == seq_p
    finally:
        chain.close(plain)
        chain.close(masked)
