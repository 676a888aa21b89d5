"""The model's own draft head at the head: a file's multi-token-prediction block (`--speculate mtp`).

Theory of operation. The MTP block (backends/openvino/mtp.py, backends/mlx/mtp.py) at position q
reads token q and the model's final hidden h_{q−1} (after output_norm) and predicts token q + 1,
with a KV cache of its own over the positions it was fed. As llama.cpp's draft-mtp driver
(common/speculative.cpp):

- catch-up: every step that comes back at the head brings the model's final hidden of each of
  its positions (`observe`, called from the head's driver with the step's first position); the
  MTP block is fed each history position q with the model's h_{q−1} (zeros before position 0,
  and where a row never came back) before it drafts, so its KV holds what the model computed;
- drafting: fed the request's last token (position n − 1) with h_{n−2}, the block gives the
  first draft d1 and its own h'; each next draft feeds the last one with the h' before it.
  Draft positions hold the MTP's own h', not the model's: the next `propose` masks them out
  (the mask-based rewind of the ring's stages) and catches up with the model's rows instead.

A request's rows are kept from the first position the next catch-up needs (the last token's
predecessor); when masked positions would take its slot past its bound, the slot is rebuilt
from the history, with zeros for the rows already dropped (drafts may be worse, never wrong:
the ring verifies every one). Drafting ahead (head_driver.py) is off: a draft made ahead would
need the model's hidden of drafts not yet verified.

The next turn of a conversation. With prompt caching the ring feeds a new request only what
its parked slot lacks, so the model's rows of the shared prefix never come back. A finished
request's MTP slot and rows are parked (the PARKED most recent), and a request without a slot of
its own takes the parked one that shares the longest prefix with its history, as the ring's
prompt cache does, and catches up from where that one stopped.

Slots are opened and closed on the worker thread only (as draft.ModelDrafter's); `observe` runs
on the event loop, so the rows are guarded by a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from backends import DEFAULT_KQUANT
from backends.gguf import ModelIndex
from backends.gguf.hybrid import final_norm, mtp_inputs
from kafila.session.ring.speculation.draft import common_prefix

PARKED = 4  # finished requests' MTP slots kept for the next turn of their conversation
MAX_ROWS = 4096  # the model's rows a request keeps (positions) until its next proposal


def row_bytes(hidden: int) -> int:
    """Bytes of one kept row (the model's f32 hidden of one position), as the plan prices it."""
    return hidden * np.dtype(np.float32).itemsize


def with_drafting_head(model: dict, index: ModelIndex, kinds: set[str], speculate: str) -> dict:
    """A planner model entry (with head_resident_bytes) as the head holds it drafting with the
    file's MTP block (--speculate mtp; else `model` as it is): the block's weights in the members'
    largest backend form, and per position of every request and of the PARKED ones its KV and
    the model's row it keeps. One formula for the plan and /status's planned bytes."""
    from backends.gguf.hybrid import has_mtp
    from backends.memory import resident_bytes

    if speculate != "mtp" or not has_mtp(index):
        return model
    block = index.block_tensors(index.hparams.n_blocks)
    return {**model, "head_resident_bytes": model["head_resident_bytes"] + max(resident_bytes(k, block) for k in kinds),
            "head_bytes_per_token": index.mtp_kv_bytes_per_token() + row_bytes(index.hparams.hidden),
            "head_parked": PARKED}  # fmt: skip


class _State:
    def __init__(self, slot: int, bound: int) -> None:
        self.slot = slot
        self.valid = np.zeros(bound, dtype=np.int64)  # physical positions live in the slot
        self.cache_len = 0  # physical positions fed
        self.live: list[int] = []  # the token at each live MTP position (its logical position)
        self.phys: list[int] = []  # each live position's physical one
        self.exact = 0  # live positions [0, exact) were fed with the model's own rows


class MtpDrafter:
    """Greedy drafts from the model's MTP block (the ModelDrafter interface, plus `observe`)."""

    ahead = False  # no drafting ahead (module docstring)

    def __init__(self, index: ModelIndex, shard, max_positions: int) -> None:
        self.index, self.shard = index, shard
        self.max_positions = max_positions  # physical positions a slot may hold
        self._states: dict[str, _State] = {}
        self._parked: OrderedDict[int, tuple[_State, dict[int, np.ndarray]]] = OrderedDict()  # oldest first
        self._released: list[str] = []
        self._rows: dict[str, dict[int, np.ndarray]] = {}  # req → position → the model's normed hidden
        self._lock = threading.Lock()

    @classmethod
    def build(cls, index: ModelIndex, precision: str, context: int, kquant: str = DEFAULT_KQUANT,
              backend: str = "openvino") -> MtpDrafter:
        """On the head's backend: backends/openvino/mtp.py or backends/mlx/mtp.py."""
        if backend == "mlx":
            from backends.mlx.mtp import MLXMtpShard

            shard = MLXMtpShard(index, precision)
        else:
            from backends.openvino.mtp import MtpShard

            shard = MtpShard(index, precision, kquant)
        # a request's history fills at most `context`; the rest of the bound is for masked drafts
        return cls(index, shard, max_positions=2 * context)

    def observe(self, req_id: str, pos0: int, hidden: np.ndarray) -> None:
        """The model's final hidden [n, H] (before output_norm) of positions pos0 … pos0 + n − 1,
        back at the head (any thread: the event loop's). Kept as they came (normalised on the
        worker when fed); past MAX_ROWS a request's oldest go: a request that stops drafting
        (choose_k found it does not pay) proposes nothing and would keep every row of its answer."""
        with self._lock:
            rows = self._rows.setdefault(req_id, {})
            for i, row in enumerate(hidden):
                rows[pos0 + i] = row
            if len(rows) > MAX_ROWS:
                for p in sorted(rows)[: len(rows) - MAX_ROWS]:
                    del rows[p]

    def propose(self, req_id: str, history: Sequence[int], k: int) -> tuple[int, ...]:
        self._free_released()
        n = len(history)
        if k < 1 or n < 1:
            return ()
        history = [int(t) for t in history]
        st = self._states.get(req_id)
        if st is None:
            st = self._states[req_id] = self._take_parked(req_id, history)
        keep = min(st.exact, common_prefix(st.live, history), n - 1)  # the last token is fed again
        if st.cache_len + (n - keep) + k > self.max_positions:  # reclaim the masked positions
            self.shard.close_slot(st.slot)
            st = self._states[req_id] = _State(self.shard.open_slot(), self.max_positions)
            keep = 0
        self._rewind(st, keep)
        prev = self._prev_rows(req_id, keep, n)
        out = self._feed(st, history[keep:], prev)
        st.exact = n
        drafts = [self.shard.greedy(out)]
        while len(drafts) < k:
            out = self._feed(st, drafts[-1:], out[-1:])
            drafts.append(self.shard.greedy(out))
        return tuple(int(d) for d in drafts)

    def _take_parked(self, req_id: str, history: list[int]) -> _State:
        """The parked slot sharing the longest prefix with `history` (its rows under the ones
        `req_id` brought), else a new slot."""
        shared = {k: common_prefix(st.live, history) for k, (st, _) in self._parked.items()}
        best = max(shared, key=shared.get, default=None)
        if best is None or shared[best] < 1:
            return _State(self.shard.open_slot(), self.max_positions)
        st, rows = self._parked.pop(best)
        with self._lock:
            self._rows[req_id] = {**rows, **self._rows.get(req_id, {})}
        return st

    def _prev_rows(self, req_id: str, start: int, end: int) -> np.ndarray:
        """The model's rows h_{q−1} for q in [start, end) (zeros where none came back), and the
        rows no later catch-up needs (before end − 2) dropped."""
        H = self.index.hparams.hidden
        out = np.zeros((end - start, H), np.float32)
        have = np.zeros(end - start, bool)
        with self._lock:
            rows = self._rows.get(req_id, {})
            for q in range(start, end):
                row = rows.get(q - 1)
                if row is not None:
                    out[q - start], have[q - start] = row, True
            for p in [p for p in rows if p < end - 2]:
                del rows[p]
        out[have] = final_norm(self.index, out[have])
        return out

    def _feed(self, st: _State, tokens: Sequence[int], prev: np.ndarray) -> np.ndarray:
        """Feed `tokens` at the next logical positions with the h rows before them; h' rows."""
        m, start = len(tokens), st.cache_len
        st.valid[start: start + m] = 1
        positions = np.arange(len(st.live), len(st.live) + m, dtype=np.int64)
        out = self.shard.forward(st.slot, mtp_inputs(self.index, tokens, prev), positions,
                                 st.valid[: start + m])  # fmt: skip
        st.live += list(tokens)
        st.phys += range(start, start + m)
        st.cache_len += m
        return out

    @staticmethod
    def _rewind(st: _State, keep: int) -> None:
        """Mask out every live position from `keep` on (no state surgery)."""
        st.valid[st.phys[keep:]] = 0
        del st.live[keep:], st.phys[keep:]
        st.exact = min(st.exact, keep)

    def release(self, req_id: str) -> None:
        """`req_id` ended (any thread): its slot is freed on the worker at the next call."""
        self._released.append(req_id)

    def _free_released(self) -> None:
        """Ended requests' slots parked with their rows (the oldest parked one closed past PARKED)."""
        while self._released:
            req_id = self._released.pop()
            st = self._states.pop(req_id, None)
            with self._lock:
                rows = self._rows.pop(req_id, {})
            if st is None:
                continue
            self._parked[st.slot] = (st, rows)
            while len(self._parked) > PARKED:
                old, _ = self._parked.popitem(last=False)[1]
                self.shard.close_slot(old.slot)

    def close(self) -> None:
        self._free_released()
        for st in [*self._states.values(), *(p for p, _ in self._parked.values())]:
            self.shard.close_slot(st.slot)
        self._states.clear()
        self._parked.clear()
        with self._lock:
            self._rows.clear()


__all__ = ["MtpDrafter"]
