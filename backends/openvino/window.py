"""A windowed layer's KV holds its window, not the whole history (sliding-window models on OpenVINO;
MLX holds its buffers the same way: backends/mlx/model.py's SlotCache).

A windowed layer's query at logical position p sees keys at p − window < k ≤ p only
(attention.window_mask), so once a slot is past its window, whatever lies before its last
window − 1 visible positions is never read again: Gemma 3 has 5 windowed layers in 6, gpt-oss
one in 2, and at a long context their KV is most of a request's memory. So every request's
windowed variables hold only the newest columns of the slot's physical layout:

- the graph: a windowed layer's variable is the same ReadValue → Gather → Concat → Assign chain
  as a full layer's, only shorter; its mask is the last columns of the window mask, as many as the
  variable holds (`last_columns`): the mask still spans every physical position, so a key's
  logical position (the cumsum of the visible ones) is what it was;
- the shard: after each step of a slot (or of a row group) the columns before the first one a later
  query may need are dropped (`WindowedKV.fit`). That first column is the (window − 1 +
  window_rewind)-th last visible one *before the step*, so a cut anywhere inside the step (a verify
  step's rejected drafts) still finds its window, and so does a later step that masks up to
  window_rewind positions fed one step each (a draft model's chain rewinding its drafts); a step
  that masks more is refused in one line (backends.window.check_window), never computed on missing
  keys. Columns go drop_at(window) at a time (backends.memory), a copy of the windowed variables
  that often rather than every step;
- states read out (a row group joining, a row leaving it, capture) are padded on the left with
  zeros back to the slot's physical length (`WindowedKV.states`), so the code that moves rows works
  on every variable alike; the zeros lie outside every later query's window;
- a cut further back than the window held is not possible, as a hybrid's recurrent state cannot be
  cut back: the head's prompt cache continues whole histories or goes back to a kept state
  (backends/kept.py; kafila/session/ring/prefix.py, WHOLE), and at each kept length the shard keeps
  a copy of the windowed variables' window (llama-server's context checkpoints do the same for
  sliding-window models). Any other cut is refused in one line.

Memory (what the plan prices, backends.memory.window_held_positions): window + window_rewind +
drop_at columns a request at most (plus a step's own positions while it runs and masked ones,
rejected drafts, among them), and window − 1 for each kept state.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from backends.kept import KeptStates
from backends.window import KeptWindow, drop_to, needs_kept, window_start
from backends.openvino.rows import row_kv, set_states

I64 = ov.Type.i64


def last_columns(mask: ov.Output, kv: ov.Output) -> ov.Output:
    """mask f32 [B, 1, L, S] → its last columns, as many as kv [B, nkv, S', D] holds positions."""
    total = ops.gather(ops.shape_of(mask, I64), ops.constant(np.array([3], np.int64)), ops.constant(np.int64(0)))
    held = ops.gather(ops.shape_of(kv, I64), ops.constant(np.array([2], np.int64)), ops.constant(np.int64(0)))
    start = ops.subtract(total, held)
    return ops.slice(mask, start, total, ops.constant(np.array([1], np.int64)),
                     ops.constant(np.array([3], np.int64))).output(0)  # fmt: skip


class WindowedKV:
    """A shard's windowed variables (their names) and what the module docstring says is done with them."""

    def __init__(self, names: frozenset[str], window: int) -> None:
        self.names = names
        self.window = window
        self.kept: KeptStates[KeptWindow] = KeptStates()

    def states(self, req: ov.InferRequest, total: int, windowed_only: bool = False) -> dict[str, ov.Tensor]:
        """{name: state} of every variable (`windowed_only`: of the windowed ones), the windowed
        ones padded on the left to `total` columns."""
        out = {}
        for s in req.query_state():
            if windowed_only and s.name not in self.names:
                continue
            t = s.state
            if s.name in self.names and t.shape[2] < total:
                b, nkv, held, d = t.shape
                padded = ov.Tensor(t.element_type, ov.Shape([b, nkv, total, d]))
                padded.data[:, :, : total - held] = 0
                padded.data[:, :, total - held :] = t.data
                t = padded
            out[s.name] = t
        return out

    def fit(self, req: ov.InferRequest, seen: np.ndarray, before: int, dropped: int) -> int:
        """Drop the windowed columns no later query needs, when enough are due
        (backends.window.drop_to's arguments); the columns gone now."""
        start = drop_to(seen, before, dropped, self.window)
        if start is None:
            return dropped
        for s in req.query_state():
            if s.name in self.names:
                t = s.state
                a = t.data[:, :, start - dropped :]
                kept = ov.Tensor(t.element_type, ov.Shape(list(a.shape)))
                kept.data[...] = a
                s.state = kept
        return start

    def cut(self, slot: int, req: ov.InferRequest, live: np.ndarray, seen: np.ndarray,
            dropped: int) -> tuple[int, np.ndarray] | None:
        """A slot alone cut to its physical columns `live`: None when its windowed variables still
        hold the window there (the KV's own cut does); else every variable compacted to `live`, the
        windowed ones back to the window kept at that length, and (columns dropped, mask) after.
        ValueError when no window was kept there."""
        kept = self.kept.back_to(slot, len(live))
        if not needs_kept(slot, seen, live, dropped, self.window, kept):
            return None
        states = {s.name: s.state for s in req.query_state()}
        arrays = {**row_kv({n: t for n, t in states.items() if n not in self.names}, 0, live), **kept.arrays}
        set_states(req, arrays, {n: t.element_type for n, t in states.items()})
        return len(live) - len(kept.seen), kept.mask(len(live))

    def keep(self, slot: int, req: ov.InferRequest, total: int, seen: np.ndarray, cols: np.ndarray) -> None:
        """Keep the window of a slot of `total` physical columns whose live ones are `cols`."""
        start = window_start(seen[cols], len(cols), self.window)
        tail = cols[start:]
        arrays = {n: np.ascontiguousarray(t.data[:, :, tail]) for n, t in self.states(req, total, True).items()}
        self.kept.keep(slot, len(cols), KeptWindow(arrays, np.asarray(seen)[tail].copy()))


def windowed_kv(index, first: int, last: int) -> WindowedKV | None:
    """The windowed variables of blocks [first, last) of `index`'s model (None: none there; a
    hybrid model's KV is left whole)."""
    h = index.hparams
    fam = h.family
    if h.hybrid is not None or not fam.sliding_window:
        return None
    g = h.gemma4  # a block that shares an earlier one's KV attends over that one's variable
    names = frozenset(f"past_key_values.{b if g is None else g.blocks[b].kv_from}.{kv}" for b in range(first, last)
                      if fam.windowed(b) for kv in ("key", "value"))  # fmt: skip
    return WindowedKV(names, fam.sliding_window) if names else None
