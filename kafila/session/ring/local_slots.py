"""A stage's KV slots: the head's ring slot ids mapped onto this shard's own.

Its own module so that the head's tests (test_head_core) drive real slots without a ring node."""

from __future__ import annotations

from kafila.session.wire.frames import FrameError


class LocalSlots:
    """Ring slot ids (the head's) → this shard's slot ids, and each slot's physical length here.

    A step's `cache_len` is the physical length of the KV it builds on: 0 resets the slot, and
    a slot that holds more drops the rest first (a parked slot that a new prompt reuses up to
    the prefix they share: session/ring/prefix.py). More than the slot holds is a broken ring."""

    def __init__(self, shard) -> None:
        self.shard = shard
        self.slots: dict[int, int] = {}
        self.lengths: dict[int, int] = {}  # ring slot → physical positions in its KV here
        self.parked: set[int] = set()  # ring slots keeping a finished request's KV (prompt caching)

    @property
    def active(self) -> int:
        """Slots a request holds here now (parked ones are nobody's)."""
        return len(self.slots) - len(self.parked)

    def get(self, ring_slot: int, cache_len: int, n: int) -> int:
        """The shard's slot for a step of `n` positions after `cache_len` (opened, reset or cut
        back as the step says)."""
        self.parked.discard(ring_slot)
        if cache_len == 0:
            self.free(ring_slot)
        if ring_slot not in self.slots:
            self.slots[ring_slot] = self.shard.open_slot()
        local, held = self.slots[ring_slot], self.lengths.get(ring_slot, 0)
        if cache_len > held:
            raise FrameError(f"a step of slot {ring_slot} builds on {cache_len} positions; this stage holds {held}")
        if cache_len < held:
            self.shard.trim(local, cache_len)
        self.lengths[ring_slot] = cache_len + n
        return local

    def checkpoint(self, ring_slot: int) -> None:
        """Keep a copy of the slot's recurrent state as it is now (a hybrid's prompt end, which a
        later prompt may go back to: prefix.py); shards without recurrent state have nothing to keep."""
        keep = getattr(self.shard, "checkpoint", None)
        if keep is not None:
            keep(self.slots[ring_slot])

    def free(self, ring_slot: int) -> None:
        self.parked.discard(ring_slot)
        self.lengths.pop(ring_slot, None)
        local = self.slots.pop(ring_slot, None)
        if local is not None:
            self.shard.close_slot(local)

    def park(self, ring_slot: int) -> None:
        """The request in the slot is over but its KV stays (prompt caching): only let it out of
        any micro-batch, so the batch's other rows go on without it (backends.base.Shard.park)."""
        local = self.slots.get(ring_slot)
        if local is None:
            return
        self.parked.add(ring_slot)
        park = getattr(self.shard, "park", None)
        if park is not None:
            park(local)

    def settle(self, ring_slot: int, keep: bool) -> None:
        """A Free frame's work here: park the slot (`keep`) or free it."""
        if keep:
            self.park(ring_slot)
        else:
            self.free(ring_slot)

    def free_all(self) -> None:
        for s in list(self.slots):
            self.free(s)

