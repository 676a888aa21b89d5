"""Speculative decoding on the ring, sans I/O: n-gram drafts and greedy acceptance.

Theory of operation. A trip round the ring costs about the same for K+1 positions as for one
(the network, not the compute, dominates), so the head guesses K tokens and verifies them in
the trip it would make anyway:

1. Draft (`ngram_draft`): prompt lookup. Take the last n tokens of the request's own prompt +
   output (n = NGRAM_MAX_N down to NGRAM_MIN_N), find their most recent earlier occurrence and
   propose the tokens that followed it. Deterministic, no model, no memory beyond the history.
2. Verify: the head feeds [last token, d1 .. dK] as one K+1-position step; every stage runs
   them against its KV; back at the head, row i's greedy top-1 g_i is the token after position i.
3. Accept (`accept`): the longest prefix with d_{i+1} == g_i, then the bonus token g_a. Every
   emitted token is exactly the greedy token plain decoding would produce, so greedy output is
   token-identical to decoding without speculation.
4. Rewind: the rejected draft positions stay in every stage's KV but are masked out (the mask
   is physical, positions are logical: see scheduler.py and notes-backends.md), so no state
   ever round-trips.

With temperature > 0 the head does not speculate (speculative sampling is left for later).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SPECULATE_MODES = ("off", "ngram")
DRAFT_K = 6  # draft tokens per trip (positions per verifying step: DRAFT_K + 1)
MAX_DRAFT_K = 32  # the most a session may ask for
NGRAM_MAX_N = 4  # longest suffix matched (tokens)
NGRAM_MIN_N = 2  # shortest suffix matched: one-token matches are mostly noise


def ngram_draft(history: Sequence[int] | np.ndarray, k: int, max_n: int = NGRAM_MAX_N,
                min_n: int = NGRAM_MIN_N) -> tuple[int, ...]:  # fmt: skip
    """Up to `k` tokens that followed the most recent earlier occurrence of the history's
    longest matching suffix (max_n down to min_n tokens); () when nothing matches or k < 1."""
    if k < 1:
        return ()
    h = np.asarray(history, dtype=np.int64)
    size = len(h)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = h[size - n :]
        # candidate starts i (i + n < size: the occurrence is earlier than the suffix itself)
        starts = np.flatnonzero(h[: size - n] == suffix[0])
        for i in starts[::-1]:  # the most recent first
            if np.array_equal(h[i : i + n], suffix):
                follow = h[i + n : i + n + k]
                if len(follow):
                    return tuple(int(t) for t in follow)
    return ()


def accept(draft: Sequence[int], predicted: Sequence[int]) -> tuple[int, ...]:
    """The tokens a verifying step yields: the drafts that match the greedy predictions, in
    order, then the first prediction that differs (or the bonus after a full match).
    `predicted[i]` is the greedy token after the step's position i (len(draft) + 1 of them)."""
    if len(predicted) != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafts need {len(draft) + 1} predictions, got {len(predicted)}")
    out = []
    for d, g in zip(draft, predicted):
        if int(d) != int(g):
            break
        out.append(int(d))
    out.append(int(predicted[len(out)]))
    return tuple(out)


@dataclass
class SpecStats:
    """Counts of one request (or of a session): drafted and accepted tokens, verifying trips
    (decode steps that carried drafts) and the tokens they yielded."""

    drafted: int = 0
    accepted: int = 0
    trips: int = 0  # every decode step (with or without drafts)
    tokens: int = 0  # tokens those steps yielded

    def add(self, drafted: int, yielded: int) -> None:
        self.drafted += drafted
        self.accepted += yielded - 1
        self.trips += 1
        self.tokens += yielded

    def merge(self, other: SpecStats) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.trips += other.trips
        self.tokens += other.tokens

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_trip(self) -> float | None:
        return self.tokens / self.trips if self.trips else None

    def as_dict(self) -> dict:
        acc, tpt = self.acceptance, self.tokens_per_trip
        return {"drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": None if acc is None else round(acc, 4),
                "tokens_per_trip": None if tpt is None else round(tpt, 4)}  # fmt: skip

    def as_pairs(self) -> tuple[tuple[str, float], ...]:
        return (("spec:drafted", self.drafted), ("spec:accepted", self.accepted),
                ("spec:trips", self.trips), ("spec:tokens", self.tokens))  # fmt: skip

    @classmethod
    def from_pairs(cls, pairs) -> SpecStats | None:
        d = {k[5:]: int(v) for k, v in pairs if isinstance(k, str) and k.startswith("spec:")}
        if not d:
            return None
        return cls(d.get("drafted", 0), d.get("accepted", 0), d.get("trips", 0), d.get("tokens", 0))
