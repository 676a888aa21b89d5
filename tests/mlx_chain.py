"""Helpers for the MLX tests: availability, the default model, prompts, a greedy chain of shards.

A chain here is a list of shards in ring order; the head (spec.head) embeds the tokens and turns
the last shard's hidden states back into the next token. Hidden states cross between shards,
and between backends, as float32 numpy arrays.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from backends import ShardSpec, load_shard, status

MLX = status("mlx")
# mlx is optional (no wheels on some platforms): skip with its install hint. OpenVINO is a
# dependency: a test that needs it fails where it is missing.
needs_mlx = pytest.mark.skipif(not MLX.available, reason=MLX.reason)







def even_cuts(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    edges = [round(i * n_blocks / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(edges))


def build_chain(index, backends: list[str], precision: str) -> list:
    """One shard per backend name over even block ranges; the first holds embedding and head."""
    cuts = even_cuts(index.hparams.n_blocks, len(backends))
    return [
        load_shard(
            name, ShardSpec(index.path, a, b, embed=i == 0, head=i == 0), precision, index=index
        )
        for i, (name, (a, b)) in enumerate(zip(backends, cuts))
    ]


def greedy_tokens(
    chain: list, prompt: list[int], n_new: int, hidden: list | None = None
) -> list[int]:
    """n_new greedy tokens (EOS ignored): prefill the prompt, then one token per step.
    `hidden`, when given, collects the last stage's output of every step."""
    head = chain[0]
    slots = [s.open_slot() for s in chain]
    try:
        x = np.asarray(prompt, dtype=np.int64)
        cache_len, out = 0, []
        for _ in range(n_new):
            n = len(x)
            positions = np.arange(cache_len, cache_len + n, dtype=np.int64)
            mask = np.ones(cache_len + n, dtype=np.int64)
            h = x
            for shard, slot in zip(chain, slots):
                h = shard.forward(slot, h, positions, mask)
            if hidden is not None:
                hidden.append(h)
            token = int(head.greedy(h))
            out.append(token)
            cache_len += n
            x = np.array([token], dtype=np.int64)
        return out
    finally:
        for shard, slot in zip(chain, slots):
            shard.close_slot(slot)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def assert_stages_match_reference(index, ids, ranges, *, reference_index=None) -> None:
    """MLX at f32 against the float64 reference, range by range ((first, last, embed), …): hidden
    states within 1e-5 relative (+1e-4), logits within 1e-3 and the same argmax. Each range is fed
    the reference's own output of the previous one, so an error shows where it arises."""
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    pos, mask = np.arange(n), np.ones(n, dtype=np.int64)
    x = ids
    for first, last, embed in ranges:
        spec = ShardSpec(index.path, first, last, embed, head=True)
        ref = load_shard("reference", spec, index=reference_index)
        mine = load_shard("mlx", spec, precision="f32", index=index)
        want = ref.forward(ref.open_slot(), x, pos, mask)
        got = mine.forward(mine.open_slot(), x, pos, mask)
        err, scale = np.abs(got - want).max(), np.abs(want).max()
        assert err <= 1e-5 * scale + 1e-4, (first, last, err, scale)
        want_logits, got_logits = ref.logits(want), mine.logits(want.astype(np.float32))
        assert np.abs(got_logits - want_logits).max() <= 1e-3
        assert (got_logits.argmax(-1) == want_logits.argmax(-1)).all()
        x = want.astype(np.float32)


def assert_embedding_rows_exact(index, step: int = 7) -> None:
    """Every `step`-th embedding row as the MLX head looks it up (from its tied table, or from
    the file) equals the GGUF's exact values."""
    rows = np.arange(0, index.hparams.vocab, step)
    head = load_shard("mlx", ShardSpec(index.path, 0, 0, True, True), precision="f32", index=index)
    got = np.array(head._embed(rows, len(rows)))
    assert np.array_equal(got, index.dequantize("token_embd.weight", np.float32)[rows])
