"""Prompt caching for one process (`kafila serve`): a finished request's cursor keeps its KV, and
a prompt that starts the same way feeds only the rest.

The same rules as a session's head (kafila/session/ring/prefix.py, whose ParkedSlots decides): a
prompt takes a parked cursor at once when it continues that cursor's request (the next turn of
a conversation, or the same question asked again), else a new cursor while fewer than `most` are
open, else the least recently parked one, keeping a long shared prefix or nothing. Taking a
cursor cuts every shard's KV back to the prefix it shares (Shard.trim). At most `most` cursors
are open, parked or in use, so the KV held is what `most` requests hold anyway. Everything here
runs on the engine's worker thread, as the chain does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backends.kept import kept_after
from kafila.engine.chain import Cursor, LocalChain
from kafila.session.ring.prefix import ParkedSlots


class ParkedCursors:
    def __init__(self, chain: LocalChain, most: int, whole: bool = False) -> None:
        self.chain = chain
        self.most = most
        self._parked = ParkedSlots(whole)  # whole: hybrid models (prefix.WHOLE)
        self._cursors: dict[int, Cursor] = {}  # parked key → its cursor
        self._next_key = 0
        self.in_use = 0

    def __len__(self) -> int:
        """Cursors parked now."""
        return len(self._parked)

    def take(self, prompt: Sequence[int], room: int) -> tuple[Cursor, int]:
        """A cursor for `prompt` and how many of its tokens it holds already; `room`: the
        positions the context leaves after the prompt."""
        reuse = self._parked.best(prompt, room)
        if reuse is None and len(self._parked) and len(self._parked) + self.in_use >= self.most:
            key, reuse = self._parked.evict(prompt, room)
            if reuse is None:  # it shares nothing worth keeping
                self.chain.close(self._cursors.pop(key))
        self.in_use += 1
        if reuse is None:
            return self.chain.open(), 0
        cursor = self._cursors.pop(reuse.slot)
        self.chain.cut(cursor, reuse.cache_len, reuse.shared)
        return cursor, reuse.shared

    @property
    def keeps(self) -> bool:
        """Whether the shards keep a state for a later prompt (hybrid models)."""
        return self._parked.whole

    def keep(self, cursor: Cursor) -> None:
        """Hybrid models: every shard keeps the cursor's recurrent state as it is now (where its
        prompt's messages end, which a later prompt may go back to: prefix.py)."""
        if not self.keeps:
            return
        for shard, slot in zip(self.chain.shards, cursor.slots):
            checkpoint = getattr(shard, "checkpoint", None)
            if checkpoint is not None:
                checkpoint(slot)
        cursor.kept = kept_after(cursor.kept, cursor.cache_len)

    def park(self, cursor: Cursor, history: Sequence[int], prompt: int) -> None:
        """The request is over and its cursor's state is whole: keep it. `history`: the tokens
        fed, in order (the cursor's visible positions); `prompt`: its prompt's length."""
        self.in_use -= 1
        key, self._next_key = self._next_key, self._next_key + 1
        zeros = np.flatnonzero(cursor.valid[: cursor.cache_len] == 0).tolist()
        self._cursors[key] = cursor
        self._parked.park(key, history, zeros, prompt, cursor.kept)

    def drop(self, cursor: Cursor) -> None:
        """The request failed part-way (its KV may differ between shards): close its cursor."""
        self.in_use -= 1
        self.chain.close(cursor)
