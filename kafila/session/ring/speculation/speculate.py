"""Speculative decoding on the ring, sans I/O: n-gram drafts, their verification (greedy or
speculative sampling) and how many to draft.

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

5. Sampling (`verify` with temperature > 0): speculative sampling with the drafts as
   deterministic proposals (q one-hot on d_i): accept d_i with probability min(1, p_i/q_i) =
   p_i(d_i); at the first rejection draw from the residual max(0, p_i − q_i) ∝ p_i with d_i
   removed; after a full match draw the bonus from p_K. Every emitted token is then distributed
   exactly as plain sampling's (Leviathan et al. 2023, Theorem 1, for a one-hot q).
6. How many (`choose_k`): a trip of n positions costs t(n) = c + β·n, fitted online from the
   head's measured decode steps (`StepCost`; DiP-SD's affine latency model), and a request
   accepts each draft with probability α (`Acceptance`, a decayed running estimate with a prior,
   so a low-acceptance stretch turns drafting off and drafting is tried again a few trips later).
   With geometric acceptance a trip of K drafts yields E(K) = (1 − α^(K+1)) / (1 − α) tokens;
   K maximises E(K) / t(K+1), and K = 0 (no drafts) wins whenever speculating does not pay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kafila.sampling import sample_token, token_probs

# draft: a draft model at the head (draft.py); origin: n-gram drafts made at the member where each
# request was typed, carried to the head on its activations, the head's own n-grams when stale (origin.py);
# mtp: the model's own multi-token-prediction layer at the head (mtp.py; the ring runs it as "draft")
SPECULATE_MODES = ("off", "ngram", "draft", "origin", "mtp")
DRAFT_K = 8  # the most draft tokens per trip choose_k may pick (positions per step: DRAFT_K + 1)
MAX_DRAFT_K = 32  # the most a session may ask for
NGRAM_MAX_N = 4  # longest suffix matched (tokens)
NGRAM_MIN_N = 2  # shortest suffix matched: one-token matches are mostly noise (measured: bench.spec)
PRIOR_SLOPE = 0.05  # before two position counts are measured: one more position costs 5% of a trip
ACCEPT_PRIOR = (1.0, 1.0)  # pseudo-counts (accepted, rejected): α starts at 0.5
MIN_GAIN = 1.03  # drafting must promise 3% more tokens per unit time than plain decoding
ACCEPT_DECAY = 0.85  # weight of the past per trip: α follows the last ~7 trips


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


def verify(draft: Sequence[int], logits: np.ndarray, sampling=None) -> tuple[int, ...]:
    """The tokens a verifying step yields, from its logits rows [len(draft) + 1, vocab]:
    greedy (`sampling` None) or speculative sampling (`sampling` = (temperature, top_p, rng))."""
    if len(logits) != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafts need {len(draft) + 1} rows of logits, got {len(logits)}")
    if sampling is None:
        return accept(draft, np.argmax(logits, axis=-1))
    temperature, top_p, rng = sampling
    out = []
    for d, row in zip(draft, logits):
        p = token_probs(row, temperature, top_p)
        if rng.random() < p[int(d)]:
            out.append(int(d))
            continue
        p[int(d)] = 0.0  # the residual max(0, p − q) for q one-hot on d
        out.append(int(rng.choice(len(p), p=p / p.sum())))
        return tuple(out)
    out.append(sample_token(logits[-1], temperature, top_p, rng))
    return tuple(out)


class StepCost:
    """The measured time of a decode trip by its position count n, as t(n) = c + β·n."""

    def __init__(self, decay: float = 0.8, prior_slope: float = PRIOR_SLOPE, min_share: float = 0.0) -> None:
        self.decay = decay
        self.prior_slope = prior_slope  # β as a share of a trip while one position count is measured
        self.min_share = min_share  # β at least this share of a one-position trip, whatever the fit
        self._ms: dict[int, tuple[float, int]] = {}  # n → (moving average ms, samples)

    def observe(self, n: int, ms: float) -> None:
        old = self._ms.get(n)
        self._ms[n] = (ms, 1) if old is None else (old[0] * self.decay + ms * (1 - self.decay), old[1] + 1)

    def fit(self) -> tuple[float, float]:
        """(c, β) in ms: weighted least squares over the position counts seen, β at least
        `min_share` of a one-position trip (c + β); with one count only, β is `prior_slope` of
        that trip; with none, (1, prior_slope) (only ratios matter)."""
        pts = [(n, ms, min(k, 16)) for n, (ms, k) in self._ms.items()]
        if len(pts) >= 2:
            w = sum(k for _, _, k in pts)
            mn = sum(n * k for n, _, k in pts) / w
            mt = sum(t * k for _, t, k in pts) / w
            var = sum(k * (n - mn) ** 2 for n, _, k in pts)
            beta = max(0.0, sum(k * (n - mn) * (t - mt) for n, t, k in pts) / var)
            # β ≥ s·(c + β) with c = mt − β·mn
            beta = max(beta, self.min_share * mt / (1 + self.min_share * (mn - 1)))
            return max(mt - beta * mn, 1e-6), beta
        if pts:
            n, t, _ = pts[0]
            beta = self.prior_slope * t
            return max(t - beta * n, 1e-6), beta
        return 1.0, self.prior_slope

    def sizes(self) -> int:
        """How many different position counts have been measured."""
        return len(self._ms)

    def predict(self, n: int) -> float:
        c, beta = self.fit()
        return c + beta * n

    def as_dict(self) -> dict:
        """What choosing K sees (for /status): the fit and the measured trips by positions."""
        c, beta = self.fit()
        return {"c": round(c, 3), "beta": round(beta, 3),
                "by_positions": {n: round(ms, 3) for n, (ms, _) in sorted(self._ms.items())}}  # fmt: skip


@dataclass
class Acceptance:
    """A request's running per-draft acceptance α: decayed counts of accepted drafts and of
    rejections (a trip ends at most one run of accepted drafts with one rejection)."""

    accepted: float = 0.0
    rejected: float = 0.0
    prior: tuple[float, float] = ACCEPT_PRIOR  # pseudo-counts (accepted, rejected)

    def add(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * ACCEPT_DECAY + accepted
        self.rejected = self.rejected * ACCEPT_DECAY + (1 if accepted < drafted else 0)

    def idle(self) -> None:
        """A trip without drafts: the evidence ages, so α drifts back to the prior and drafting
        is tried again (a stretch of low acceptance does not turn it off for good)."""
        self.accepted *= ACCEPT_DECAY
        self.rejected *= ACCEPT_DECAY

    @property
    def rate(self) -> float:
        a, r = self.prior
        return (self.accepted + a) / (self.accepted + self.rejected + a + r)

    def as_prior(self) -> tuple[float, float]:
        """A new request's prior from this (the session's) estimate, with the default's weight."""
        w = sum(ACCEPT_PRIOR)
        return (w * self.rate, w * (1 - self.rate))


def expected_tokens(k: int, alpha: float) -> float:
    """Tokens a trip with k drafts yields when each is accepted with probability α (in turn)."""
    return float(sum(alpha**i for i in range(k + 1)))


def choose_k(alpha: float, cost: StepCost, k_max: int) -> int:
    """The draft count 0..k_max that maximises expected tokens per unit of trip time; 0 unless
    drafting is expected to gain MIN_GAIN (what the model leaves out: drafting, frames)."""
    best, best_rate = 0, 0.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(k, alpha) / cost.predict(k + 1)
        if rate > best_rate:
            best, best_rate = k, rate
    return best if best_rate >= MIN_GAIN / cost.predict(1) else 0


@dataclass
class SpecStats:
    """Counts of one request (or of a session): drafted and accepted tokens, verifying trips
    (decode steps that carried drafts) and the tokens they yielded."""

    drafted: int = 0
    accepted: int = 0
    trips: int = 0  # every decode step (with or without drafts)
    tokens: int = 0  # tokens those steps yielded
    origin: int = 0  # --speculate origin: steps whose drafts came from the request's origin member
    fallback: int = 0  # steps that wanted drafts and had no aligned origin draft (the head's n-grams)

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
        self.origin += other.origin
        self.fallback += other.fallback

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
                "tokens_per_trip": None if tpt is None else round(tpt, 4),
                "drafts_per_trip": round(self.drafted / self.trips, 4) if self.trips else None,
                **({"origin_steps": self.origin, "fallback_steps": self.fallback}
                   if self.origin or self.fallback else {})}  # fmt: skip

    def as_pairs(self) -> tuple[tuple[str, float], ...]:
        return (("spec:drafted", self.drafted), ("spec:accepted", self.accepted),
                ("spec:trips", self.trips), ("spec:tokens", self.tokens),
                *((("spec:origin", self.origin), ("spec:fallback", self.fallback))
                  if self.origin or self.fallback else ()))  # fmt: skip

    @classmethod
    def from_pairs(cls, pairs) -> SpecStats | None:
        d = {k[5:]: int(v) for k, v in pairs if isinstance(k, str) and k.startswith("spec:")}
        if not d:
            return None
        return cls(d.get("drafted", 0), d.get("accepted", 0), d.get("trips", 0), d.get("tokens", 0),
                   d.get("origin", 0), d.get("fallback", 0))
