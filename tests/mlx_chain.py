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
