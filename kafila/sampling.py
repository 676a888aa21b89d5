"""Token sampling from logits, shared by the local engine and the ring's head.

One nucleus rule in one place: softmax(logits / temperature), restricted to the smallest set of
tokens whose probability reaches top_p, renormalised. `sample_token` draws from it; `Sampler` is
one request's (its own generator, kept to its end); `token_probs` gives the whole distribution
(zeros outside the nucleus), which speculative sampling needs to accept or reject a draft token
(speculate.verify).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def _nucleus(logits: np.ndarray, temperature: float, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the nucleus, most probable first; their renormalised probabilities)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1  # the smallest set reaching top_p
        order = order[:keep]
    return order, p[order] / p[order].sum()


def sample_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """One token from softmax(logits / temperature), restricted to the top_p nucleus."""
    order, q = _nucleus(logits, temperature, top_p)
    return int(order[rng.choice(len(order), p=q)])


def token_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The distribution `sample_token` draws from, over the whole vocabulary (float64)."""
    order, q = _nucleus(logits, temperature, top_p)
    p = np.zeros(logits.shape[-1], dtype=np.float64)
    p[order] = q
    return p


class Sampler(NamedTuple):
    """One request's sampling: `sample_token` with its own temperature, nucleus and generator.

    A request that samples gets one when it starts (the local engine, the ring's head) and keeps
    it to its end, so each request's draws are its own stream: seeded, they repeat whatever else
    runs beside them. A tuple (temperature, top_p, rng), as speculate.verify takes it."""

    temperature: float
    top_p: float
    rng: np.random.Generator

    @classmethod
    def of(cls, temperature: float, top_p: float, seed: int | None) -> Sampler | None:
        """The sampler of a request (None: temperature 0, greedy); seed None draws fresh entropy."""
        if temperature <= 0:
            return None
        return cls(temperature, top_p, np.random.default_rng(seed))

    def draw(self, logits: np.ndarray) -> int:
        """One token from a row of logits [vocab]."""
        return sample_token(logits, self.temperature, self.top_p, self.rng)
