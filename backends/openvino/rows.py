"""Batched decode rows on OpenVINO: several slots' steps as ONE inference with a batch dimension.

Why this design. The stage graph is already batch-dynamic: every KV variable is
ReadValue → Gather(beam_idx, 0) → Concat → Assign, the chain the CPU plugin fuses into its
stateful SDPA with an in-place KV cache (the OpenVINO paper's beam_idx, ../shared/seeds/000_…).
A *row group* is one more InferRequest of the same compiled model whose state holds B slots'
KV as the B rows of every variable [B, Hkv, S, D]. Then:

- weights are read once per step for all rows (one FullyConnected with M = B·L rows per matmul);
  each row's attention reads only its own KV, in place (no per-step KV copy, no second graph);
- rows of different lengths share one physical length S: a shorter row is left-padded with zero
  positions that its mask hides forever (masked positions get exactly zero weight, so the
  result is the unpadded one up to f32 summation order: bit-identical on the CPU plugin here);
- rows leave, and rows are reordered, through beam_idx alone: a step whose beam_idx lists
  only the rows it runs drops the others from every variable (the Gather feeds the Assign), with
  no copy and no recompilation — the batch dimension is dynamic;
- rows join by a copy: a new group state is assembled once from the members' current KV (their
  solo InferRequest's state, or their row of the group they were in) and set on the request.

Rejected alternatives. (a) A second, stateless graph with KV as inputs/outputs: every step would
copy every row's whole KV in (and the new positions out) — O(context) traffic per step on top of
the weights, the cost the stateful fused SDPA exists to avoid; and the single-slot path would
keep its stateful KV, so a slot would still have two homes. (c) PagedAttention (what
openvino_genai's continuous batching uses) takes no attention mask, so Kafila's mask-based rewind
(rejected drafts stay in the cache, masked) would need compaction on every rejection, and it
would replace the single-user hot path, which must not change.

Where a slot's KV lives. Every slot keeps its solo InferRequest (the single-user hot path is
untouched). While a slot is a row of a group, the group is its home and its solo state is stale;
`forward`, `capture` and `restore` on such a slot first take its row out (one copy of that row,
compacted to the caller's physical layout), `close_slot` just drops it (nothing copied). A
`forward_batch` whose set of slots is exactly a group's live rows runs on that group (any order:
beam_idx reorders); any other set builds a new group from the rows' current homes (the old groups
keep their remaining rows, dropped lazily at their next step). So the cost model the scheduler
should follow: keep a micro-batch's membership stable from step to step; a join costs one copy
of the members' KV, a leave costs nothing.

Caller's view vs the group's. The caller keeps its own physical layout per slot (`mask` covers
cache_len + n positions, as in backends.base). A row maps it onto the group's S positions with
`index` (the group position of each of the caller's positions); left padding and the padding of
a row's new tokens (rows with n < L, the longest row's n) are group positions outside `index`,
always masked. A padded row's real tokens come first in the L window and its pad tokens after,
so a pad query still sees the row's own real tokens (no fully masked attention row, no NaN) and
no real token sees a pad (causal order, then the mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov


@dataclass
class Row:
    """One slot's KV inside a group: `index[k]` is the group position of the slot's physical
    position k (len(index) is the caller's cache_len)."""

    slot: int
    index: np.ndarray  # int64 [cache_len]


@dataclass
class RowGroup:
    """One InferRequest whose state holds `rows` in batch order (None: a dropped row, still in
    the state until the next step's beam_idx leaves it out). Every row is `length` long."""

    req: ov.InferRequest
    rows: list[Row | None]
    length: int
    seen: np.ndarray | None = None  # sliding-window models: the mask of every row's columns, [B, length]
    dropped: int = 0  # sliding-window models: columns the windowed variables no longer hold (window.py)

    def live(self) -> list[int]:
        return [r.slot for r in self.rows if r is not None]

    def position(self, slot: int) -> int:
        return next(i for i, r in enumerate(self.rows) if r is not None and r.slot == slot)

    def drop(self, slot: int) -> None:
        self.rows[self.position(slot)] = None


def read_states(req: ov.InferRequest) -> dict[str, ov.Tensor]:
    """{variable name: its state tensor} (a copy the plugin hands back; `.data` views it)."""
    return {s.name: s.state for s in req.query_state()}


def row_kv(states: dict[str, ov.Tensor], batch_pos: int, index: np.ndarray | None) -> dict[str, np.ndarray]:
    """One row of every variable, [1, Hkv, len(index), D], in the caller's physical layout
    (`index` None: the whole row as stored)."""
    out = {}
    for name, t in states.items():
        a = t.data[batch_pos : batch_pos + 1]  # [1, Hkv, S, D]
        # a recurrent variable (delta_net.py: 2 or 3 dims) has no positions: the row as it is
        out[name] = np.ascontiguousarray(a if index is None or a.ndim != 4 else a[:, :, index])
    return out


def set_states(req: ov.InferRequest, arrays: dict[str, np.ndarray], types: dict[str, ov.Type]) -> None:
    for s in req.query_state():
        a = arrays[s.name]
        t = ov.Tensor(types[s.name], ov.Shape(list(a.shape)))
        t.data[...] = a
        s.state = t


def assemble(rows: Sequence[dict[str, np.ndarray] | None], lengths: Sequence[int],
             template: dict[str, ov.Tensor]) -> tuple[dict[str, np.ndarray], int]:
    """The group state of `rows` (each {name: [1, Hkv, len, D]}, None when empty), left-padded to
    the longest: {name: [B, Hkv, S, D]}, and S."""
    S = max(lengths)
    out = {}
    for name, t in template.items():
        _, hkv, _, d = t.shape
        a = np.zeros((len(rows), hkv, S, d), dtype=t.data.dtype)  # [B, Hkv, S, D]
        for b, (row, n) in enumerate(zip(rows, lengths)):
            if n:
                a[b, :, S - n :] = row[name][0]
        out[name] = a
    return out, S


def assemble_masks(masks: Sequence[np.ndarray | None], lengths: Sequence[int], S: int) -> np.ndarray:
    """The rows' last masks (each over at least its `lengths` positions, the last of them taken),
    left-padded as `assemble` pads their KV: [B, S] int64."""
    out = np.zeros((len(masks), S), np.int64)
    for b, (mask, n) in enumerate(zip(masks, lengths)):
        if n:
            out[b, S - n :] = mask[len(mask) - n :]
    return out


@dataclass(frozen=True)
class StepInputs:
    """The inputs of one group step and where each row's outputs are."""

    x: np.ndarray  # [B, L] int64 ids or [B, L, H] f32
    mask: np.ndarray  # [B, S + L] int64 over group positions
    positions: np.ndarray  # [B, L] int64
    beam: np.ndarray  # [B] int32: each row's batch position in the state before the step
    n: tuple[int, ...]  # each row's real new tokens (the first n of its L)


def step_inputs(group: RowGroup, slots: Sequence[int], xs: Sequence[np.ndarray],
                positions: Sequence[np.ndarray], masks: Sequence[np.ndarray], x_dtype,
                hidden: int) -> StepInputs:
    """Lay the rows' inputs out on the group (see the module docstring: real tokens first, pads
    after; left padding and pads masked). Checks every mask against the row's cache_len."""
    B, S = len(slots), group.length
    ns = tuple(len(x) for x in xs)
    L = max(ns)
    if x_dtype is np.int64:
        x = np.zeros((B, L), np.int64)  # [B, L]
    else:
        x = np.zeros((B, L, hidden), np.float32)  # [B, L, H]
    mask = np.zeros((B, S + L), np.int64)  # [B, S + L]
    pos = np.zeros((B, L), np.int64)  # [B, L]
    beam = np.empty(B, np.int32)
    for b, (slot, xi, pi, mi, n) in enumerate(zip(slots, xs, positions, masks, ns)):
        p = group.position(slot)
        row = group.rows[p]
        c = len(row.index)
        mi = np.asarray(mi).reshape(-1)
        pi = np.asarray(pi, dtype=np.int64).reshape(-1)
        if n == 0 or pi.shape != (n,):
            raise ValueError(f"slot {slot}: forward_batch needs n ≥ 1 inputs and n positions "
                             f"(got {n} and {pi.shape[0]})")
        if mi.shape != (c + n,):
            raise ValueError(f"slot {slot}: mask covers {mi.shape[0]} positions; it needs cache_len + n = {c + n}")
        x[b, :n] = np.asarray(xi, dtype=x_dtype).reshape(x[b, :n].shape)
        mask[b, row.index] = mi[:c]
        mask[b, S : S + n] = mi[c:]
        pos[b, :n] = pi
        pos[b, n:] = pi[-1]  # pads: any finite position (they are never visible)
        beam[b] = p
    return StepInputs(x, mask, pos, beam, ns)


def advance(group: RowGroup, slots: Sequence[int], ns: Sequence[int], L: int) -> None:
    """After a step: the state holds exactly `slots`, in that order, each L positions longer."""
    S = group.length
    old = {r.slot: r for r in group.rows if r is not None}
    group.rows = [Row(s, np.concatenate([old[s].index, np.arange(S, S + n, dtype=np.int64)]))
                  for s, n in zip(slots, ns)]
    group.length = S + L
