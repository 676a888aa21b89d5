"""Which positions a sliding-window layer still needs: the rules both backends' windowed KV keep
(backends/openvino/window.py has the design; backends/mlx/shard.py holds its buffers the same way).

A query at logical position p of a windowed layer sees keys at p − window < k ≤ p, where a key's
logical position is its count among the visible (unmasked) physical columns before it. So a
slot's columns before its (window − 1)-th last visible one are never read again, and a cut of
the slot keeps its window only if those columns of the cut are still held.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.memory import window_drop_at, window_rewind


def window_start(seen: np.ndarray, before: int, window: int, margin: int = 0) -> int:
    """The first column any later query of these rows may need: each row's (window − 1)-th last
    visible column among its first `before` (seen [B, S] or [S], 0 = masked), the least over rows;
    with `margin`, that many visible columns earlier (later steps may mask as many)."""
    need = window - 1 + margin
    start = before
    for row in np.atleast_2d(seen):
        cols = np.flatnonzero(row[:before])
        if need > 0 and cols.size:
            start = min(start, int(cols[-need] if cols.size >= need else cols[0]))
    return start


def holds_window(seen: np.ndarray, cols: np.ndarray, dropped: int, window: int) -> bool:
    """Whether a slot cut to its physical columns `cols` (in order) still holds the window of its
    next query: its last window − 1 visible columns are at `dropped` or after."""
    visible = cols[np.asarray(seen)[cols] != 0]
    return window <= 1 or visible.size == 0 or int(visible[-(window - 1):][0]) >= dropped


def drop_to(seen: np.ndarray, before: int, dropped: int, window: int) -> int | None:
    """After a step: the first column the windowed KV keeps from now on, when window_drop_at or
    more columns are due to go (None: not yet). `seen` [B, S] or [S]: the mask of every column
    held, `before`: the columns before the step, `dropped`: the columns gone already."""
    start = window_start(seen, before, window, window_rewind(window))
    return start if before and start - dropped >= window_drop_at(window) else None


def needs_kept(slot: int, seen: np.ndarray, cols: np.ndarray, dropped: int, window: int,
               kept: KeptWindow | None) -> bool:
    """Whether a slot cut to its physical columns `cols` must go back to the window `kept` at that
    length (False: the window is still held); ValueError (one line) when it must and none was kept."""
    if holds_window(seen, cols, dropped, window):
        return False
    if kept is None:
        raise ValueError(f"a sliding-window model's slot {slot} holds the window of its last "
                         f"positions only; it cannot be cut back to {len(cols)} positions")  # fmt: skip
    return True


def check_window(seen: np.ndarray, before: int, dropped: int, window: int) -> None:
    """ValueError (one line) when a step whose mask is `seen` needs columns before `dropped`: a
    step masking more earlier positions than the windowed KV keeps for that (window_rewind)."""
    if window_start(seen, before, window) < dropped:
        raise ValueError(f"a step masks more earlier positions than a sliding-window layer keeps "
                         f"({window_rewind(window)} beyond its window): feed the history again")  # fmt: skip


@dataclass
class KeptWindow:
    """The windowed layers' last columns at a kept length (by variable name or layer), and those
    columns' mask."""

    arrays: dict
    seen: np.ndarray  # [k]

    def mask(self, length: int) -> np.ndarray:
        """The mask of a slot of `length` columns gone back to this window (the columns before it,
        gone, count as visible: no later query reaches them)."""
        return np.concatenate([np.ones(length - len(self.seen), np.int64), self.seen])
