"""How the token after a row that came back round the ring is chosen (the head's, on its compute
thread: `HeadCore.picks` says how, `pick_tokens` does it).

A returning row's token (`Pick`): none for a prefill chunk before the prompt's last; for a
micro-batch's plain greedy rows one lm_head over all of them (Shard.greedy_rows); for a verifying
step one row per position (speculate.verify: greedy or speculative sampling); else the shard's
greedy (OpenVINO: the token its graph computed) or the request's sampler (Shard.sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kafila.sampling import Sampler
from kafila.session.ring.speculation.speculate import verify


@dataclass(frozen=True)
class Pick:
    """How the token after a returning row is chosen (see the module's docstring)."""

    hidden: np.ndarray  # float32 [n, hidden] after every block
    wanted: bool = True  # False: a prefill chunk before the prompt's last (no lm_head)
    batched: bool = False  # a greedy row of a micro-batch: one lm_head over all of them
    draft: tuple[int, ...] = ()  # a verifying step's drafts (a row per position)
    sampler: Sampler | None = None  # None: greedy


def pick_tokens(shard, picks: Sequence[Pick]) -> list:
    """The tokens of `picks` (None, an int, or a verifying step's tuple), on the compute thread."""
    batched = [p.hidden for p in picks if p.batched]
    rows = iter(shard.greedy_rows(batched) if batched else ())
    out: list = []
    for p in picks:
        if p.batched:
            out.append(next(rows))
        elif not p.wanted:
            out.append(None)
        elif p.draft:
            out.append(verify(p.draft, shard.logits(p.hidden), p.sampler))
        elif p.sampler is None:
            out.append(int(shard.greedy(p.hidden)))
        else:
            out.append(shard.sample(p.hidden, p.sampler))
    return out
