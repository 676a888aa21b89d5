"""Token sampling from logits, shared by the local engine and the ring's head.

One nucleus rule in one place: softmax(logits / temperature), restricted to the smallest set of
tokens whose probability reaches top_p, renormalised. `sample_token` draws from it;
`token_probs` gives the whole distribution (zeros outside the nucleus), which speculative
sampling needs to accept or reject a draft token (speculate.verify).
"""

from __future__ import annotations

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
