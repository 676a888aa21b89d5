"""LocalChain: S shards of one model chained in one process, with per-request mask bookkeeping.

Used by `kafila run`, the local benchmark and the tests. A `Cursor` is one request: a slot on
every shard plus the mask-based rewind state of the OpenVINO paper §5 — the physical cache
length, the logical position and a `valid` vector over physical positions. Each feed sends
`mask = valid[:cache_len] ++ ones(n)` and `positions = logical .. logical + n − 1` to every stage;
`rewind(k)` masks the last k live positions out and moves the logical position back by k.
Hidden states cross from stage to stage as float32 (so stages may run on different backends).
A prompt is fed in chunks, the first of at most `chunk_tokens` positions and the rest smaller
(`prefill`), the rule the ring's head uses (kafila.session.ring.chunks.prefill_chunk_tokens and
later_chunk_tokens), so a long prompt never runs one unbounded batch through a stage; only the
last chunk's hidden states are kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

import backends
from backends.base import Shard, ShardSpec
from backends.errors import BadInput
from backends.gguf import ModelIndex, open_model
from backends.kept import kept_until

INITIAL_MASK_CAPACITY = 256


@dataclass
class Cursor:
    """One request's slots and positions."""

    slots: list[int]  # one slot per shard, in chain order
    valid: np.ndarray = field(default_factory=lambda: np.zeros(INITIAL_MASK_CAPACITY, np.int64))
    cache_len: int = 0  # physical positions fed so far (masked ones included)
    logical: int = 0  # logical position of the next token
    kept: tuple[int, ...] = ()  # hybrids: the positions whose recurrent states every shard keeps (backends/kept.py)

    def _reserve(self, n: int) -> None:
        need = self.cache_len + n
        if need > len(self.valid):
            grown = np.zeros(max(need, 2 * len(self.valid)), np.int64)
            grown[: self.cache_len] = self.valid[: self.cache_len]
            self.valid = grown


def _chunk_tokens(index: ModelIndex) -> int:
    """Prefill positions per feed: the ring head's rule (a frame's worth at this hidden size)."""
    from kafila.session.ring.chunks import prefill_chunk_tokens

    return prefill_chunk_tokens(index.hparams.carried)


class LocalChain:
    """Shards in ring order; the first holds the embedding, the head (`logits`/`greedy`) is the
    shard whose spec has head=True (the first, as in a Kafila ring)."""

    def __init__(self, shards: Sequence[Shard], chunk_tokens: int | None = None) -> None:
        if not shards:
            raise BadInput("a chain needs at least one shard")
        if not shards[0].spec.embed:
            raise BadInput("the first shard of a chain must hold the token embedding")
        heads = [s for s in shards if s.spec.head]
        if len(heads) != 1:
            raise BadInput("exactly one shard of a chain must hold the head (final norm + lm_head)")
        self.shards = list(shards)
        self.head = heads[0]
        if chunk_tokens is None:
            chunk_tokens = _chunk_tokens(getattr(shards[0], "index", None) or open_model(shards[0].spec.model_path))
        if chunk_tokens < 1:
            raise BadInput(f"chunk_tokens must be at least 1 (got {chunk_tokens})")
        self.chunk_tokens = chunk_tokens

    @classmethod
    def build(cls, model_path: str, stages: int, backend_names: str | Sequence[str] = "openvino",
              precision: str = "serving", index: ModelIndex | None = None,
              chunk_tokens: int | None = None, kquant: str = backends.DEFAULT_KQUANT) -> LocalChain:
        """Cut the model into `stages` near-equal block ranges, stage i on backend_names[i];
        `kquant`: the OpenVINO stages' K-quant form (backends.KQUANTS)."""
        index = index if index is not None else open_model(model_path)
        names = parse_backends(backend_names, stages)
        shards = []
        for i, ((first, last), name) in enumerate(zip(index.split_blocks(stages), names)):
            spec = ShardSpec(index.path, first, last, embed=i == 0, head=i == 0)
            extra = {"index": index} if name in ("openvino", "reference") else {}
            if name == "openvino":
                extra["kquant"] = kquant
            shards.append(backends.load_shard(name, spec, precision, **extra))
        return cls(shards, chunk_tokens if chunk_tokens is not None else _chunk_tokens(index))

    @property
    def stages(self) -> list[dict]:
        return [
            {"backend": type(s).__module__.split(".")[1] if "." in type(s).__module__ else type(s).__name__,
             "blocks": [s.spec.first, s.spec.last], "embed": s.spec.embed, "head": s.spec.head}
            for s in self.shards
        ]

    # --- requests ------------------------------------------------------------------------

    def open(self) -> Cursor:
        return Cursor([s.open_slot() for s in self.shards])

    def close(self, cursor: Cursor) -> None:
        for shard, slot in zip(self.shards, cursor.slots):
            shard.close_slot(slot)

    def feed(self, cursor: Cursor, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Run n new tokens through every stage; float32 [n, H] after the last block."""
        ids = np.asarray(tokens, dtype=np.int64)
        n = len(ids)
        if n == 0:
            raise BadInput("nothing to feed: the token list is empty")
        cursor._reserve(n)
        cursor.valid[cursor.cache_len: cursor.cache_len + n] = 1
        mask = cursor.valid[: cursor.cache_len + n]
        positions = np.arange(cursor.logical, cursor.logical + n, dtype=np.int64)
        x: np.ndarray = ids
        for shard, slot in zip(self.shards, cursor.slots):
            x = shard.forward(slot, x, positions, mask)
        cursor.cache_len += n
        cursor.logical += n
        return x

    def prefill(self, cursor: Cursor, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """`feed` in chunks, as the ring's head does: the first of at most `chunk_tokens` positions,
        the rest of chunks.later_chunk_tokens; the last chunk's hidden states."""
        from kafila.session.ring.chunks import next_chunk

        ids = np.asarray(tokens, dtype=np.int64)
        if len(ids) == 0:
            raise BadInput("nothing to feed: the token list is empty")
        start = 0
        while start < len(ids):
            n = next_chunk(start, self.chunk_tokens)
            hidden = self.feed(cursor, ids[start: start + n])
            start += n
        return hidden

    def cut(self, cursor: Cursor, cache_len: int, logical: int) -> None:
        """Keep the cursor's first `cache_len` physical positions, holding `logical` live tokens
        (a parked cursor reused up to a shared prefix: kafila/engine/prompt_cache.py)."""
        if not 0 <= logical <= cache_len <= cursor.cache_len:
            raise ValueError(f"cannot cut a cursor of {cursor.cache_len} positions to {cache_len} ({logical} live)")
        for shard, slot in zip(self.shards, cursor.slots):
            shard.trim(slot, cache_len)
        cursor.cache_len, cursor.logical, cursor.kept = cache_len, logical, kept_until(cursor.kept, cache_len)

    def rewind(self, cursor: Cursor, k: int) -> None:
        """Forget the last k live tokens by masking them out (no cache surgery)."""
        if not 0 <= k <= cursor.logical:
            raise ValueError(f"cannot rewind {k} of {cursor.logical} tokens")
        live = np.flatnonzero(cursor.valid[: cursor.cache_len])
        cursor.valid[live[len(live) - k:]] = 0
        cursor.logical -= k

    def next_token(self, hidden: np.ndarray) -> int:
        """Greedy top-1 after the last row of hidden [n, H]."""
        return self.head.greedy(hidden)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.head.logits(hidden)

    def generate(self, prompt: Sequence[int], max_tokens: int, stop: Iterable[int] = (),
                 cursor: Cursor | None = None) -> Iterator[int]:
        """Greedy decode: yields up to max_tokens new token ids, ending after a stop id."""
        stop = frozenset(stop)
        own = cursor is None
        cursor = self.open() if own else cursor
        try:
            hidden = self.prefill(cursor, prompt)
            for i in range(max_tokens):
                token = self.next_token(hidden)
                yield token
                if token in stop or i + 1 == max_tokens:
                    return
                hidden = self.feed(cursor, (token,))
        finally:
            if own:
                self.close(cursor)


def parse_backends(names: str | Sequence[str], stages: int) -> list[str]:
    """'openvino' (every stage) or 'B1,B2,…' (one per stage) → one backend name per stage."""
    parts = [p.strip() for p in names.split(",")] if isinstance(names, str) else list(names)
    if len(parts) == 1:
        parts = parts * stages
    if len(parts) != stages:
        raise BadInput(f"--backend lists {len(parts)} backends for {stages} stages (give one, or one per stage)")
    for p in parts:
        if p not in backends.NAMES:
            raise BadInput(f"unknown backend {p!r} (choose from {', '.join(backends.NAMES)})")
    return parts
