"""The one interface every shard runtime implements (reference, openvino, mlx).

A shard holds a contiguous block range [first, last) of one model. The head shard also holds the
token embedding (it takes token ids) and the final norm + lm_head (`logits`). Every call works on
one *slot*: an independent KV state for one request (one InferRequest on OpenVINO, one cache on MLX).

Positions are logical and the mask is physical, as in the OpenVINO paper's mask-based rewind:
`mask` covers every physical cache position of the slot, past and new (length cache_len + n),
1 where the position is visible and 0 where it was rejected; `positions` are the logical
position ids of the n new tokens. Every stage of a ring receives the same mask and positions.
`forward_batch` runs several slots' feeds as one (batched decode rows), each row with its own
positions and mask, so the weights are read once for all rows.

What the head does with its last hidden states is part of the interface too: `greedy` (the top-1
after the last row), `greedy_rows` (that for several requests' rows, from one lm_head), `sample`
(a token drawn by a request's sampler) and `logits` (every row: what verifying drafts needs).
`HeadOps` derives greedy, greedy_rows and sample from `logits` for any shard that inherits it; a
backend that computes the top-1 in its own graph (OpenVINO, MLX, the reference) overrides greedy.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class ShardSpec:
    """Which part of which model a shard holds."""

    model_path: str  # the GGUF file
    first: int  # first block, inclusive
    last: int  # last block, exclusive
    embed: bool  # holds the token embedding: forward takes token ids
    head: bool  # holds final norm + lm_head: `logits` works


class Shard(Protocol):
    spec: ShardSpec

    def open_slot(self) -> int:
        """A new independent KV state; returns its id."""

    def forward(
        self, slot: int, x: np.ndarray, positions: np.ndarray, mask: np.ndarray
    ) -> np.ndarray:
        """Run the shard's blocks on n new positions of `slot`.

        x: int64 [n] token ids when spec.embed, else float32 [n, hidden].
        positions: int64 [n] logical positions. mask: int64 [cache_len + n] over physical positions.
        Returns float32 [n, hidden], the hidden states after block last-1.
        """

    def forward_batch(
        self,
        slots: Sequence[int],
        xs: Sequence[np.ndarray],
        positions: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
    ) -> list[np.ndarray]:
        """`forward` on several distinct slots as one computation (batched decode rows): row r is
        (slots[r], xs[r], positions[r], masks[r]), each with its own n ≥ 1, its own logical
        positions and its own mask over its own cache_len + n physical positions. Returns each
        row's float32 [n, hidden], what `forward` on that slot alone returns (to f32 rounding),
        while the shard's weights are read once for all rows. Slots keep working with every
        other call in between (how cheaply depends on the backend: see its module).
        """

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Final norm + lm_head on float32 [n, hidden] → float32 [n, vocab] (head shards only).
        A verifying step (speculative decoding) takes all n rows: one per drafted position."""

    def greedy(self, hidden: np.ndarray) -> int:
        """The top-1 token after the last row of float32 [n, hidden] (head shards only)."""

    def greedy_rows(self, hiddens: Sequence[np.ndarray]) -> list[int]:
        """The top-1 token after each hidden's last row, from one lm_head over all of them (the
        rows of a micro-batch; head shards only)."""

    def sample(self, hidden: np.ndarray, sampler: Sampler) -> int:
        """A token after the last row of `hidden`, drawn by one request's `sampler` from its
        logits (kafila.sampling.Sampler; head shards only)."""

    def close_slot(self, slot: int) -> None:
        """Free the slot's KV state; its id may be reused."""

    def trim(self, slot: int, length: int) -> None:
        """Keep the slot's first `length` physical positions and drop the rest (a prompt cache
        slot reused up to a shared prefix); `length` ≤ what the slot holds."""

    def capture(self, slot: int) -> Any:
        """An opaque copy of the slot's KV state (prefix caching)."""

    def restore(self, slot: int, state: Any) -> None:
        """Replace the slot's KV state with one captured from this shard."""

    # Optional: `park(slot)`: the slot's request is over and its KV is kept for a prompt that
    # starts the same way (kafila/session/ring/prefix.py); a backend whose batched rows share a home
    # (OpenVINO's row groups) lets the slot out of it here. Backends without it need nothing.
    # Optional for hybrid models: `checkpoint(slot)`: keep a copy of the slot's recurrent state
    # as it is now (one per turn, at most KEPT_STATES: backends/kept.py), so that a later `trim`
    # to exactly that length goes back to it (where a turn's messages end: prefix.py); a trim
    # before it drops it.


class Sampler(Protocol):
    """What `sample` needs of a request's sampler (kafila.sampling.Sampler)."""

    def draw(self, logits: np.ndarray) -> int: ...


class HeadOps:
    """greedy, greedy_rows and sample from the shard's own `logits` (a mixin every shard inherits;
    a backend with the top-1 in its graph overrides greedy)."""

    logits: Any  # the shard's: float32 [n, hidden] → float32 [n, vocab]

    def greedy(self, hidden: np.ndarray) -> int:
        return int(np.argmax(self.logits(hidden[-1:])[-1]))

    def greedy_rows(self, hiddens: Sequence[np.ndarray]) -> list[int]:
        if not hiddens:
            return []
        if len(hiddens) == 1:
            return [int(self.greedy(hiddens[0]))]
        logits = self.logits(np.concatenate([h[-1:] for h in hiddens]))  # [rows, vocab]
        return [int(t) for t in np.argmax(logits, axis=-1)]

    def sample(self, hidden: np.ndarray, sampler: Sampler) -> int:
        return sampler.draw(self.logits(hidden[-1:])[-1])
