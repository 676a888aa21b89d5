"""OpenVINOShard: one compiled stage model, one InferRequest (one stateful KV) per slot.

The head shard compiles a second small model (final norm + lm_head + top-1) used by `logits`
and `greedy`; when it also holds the last block, the greedy top-1 is a second output of the stage
graph itself and the head model is compiled only if `logits` (or greedy on other states) is asked. Weight constants live in an unlinked spill file (WeightBank(spill=True)); once the plugin has
repacked them, their pages are dropped from the resident set (`release_weight_pages`), so a
shard's memory is about the plugin's own copy of the weights, not twice the model.
Inputs are wrapped as shared-memory tensors and outputs read in place, so a decode
step costs one `infer()` per shard plus a few microseconds of Python.

`forward_batch` runs several slots' steps as one inference with a batch dimension, on a row
group: one more InferRequest whose state holds those slots' KV as batch rows (design, costs and
exactness in backends/openvino/rows.py). A slot that is a row of a group has the group as its
home; the solo methods (`forward`, `capture`, `restore`) take its row out first, so they behave
exactly as before, and a slot never in a group costs one dict lookup more per forward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import openvino as ov

from backends import memory
from backends.cgroups import quota_threads
from backends.base import HeadOps, ShardSpec
from backends.gguf import ModelIndex, open_model
from backends.gguf.gemma4 import first_rows
from backends.openvino import ggml_kernels
from backends.openvino import rows as rowmod
from backends.openvino.graph import StageBuilder
from backends.openvino.recurrent import RecurrentSteps
from backends.openvino.rows import Row, RowGroup
from backends import DEFAULT_KQUANT
from backends.openvino.weights import WeightBank, releasing_pages
from backends.openvino.window import windowed_kv
from backends.window import check_window

# serving: f32 activations and an f16 KV cache on every CPU, so every CPU kind computes one way:
# - not the plugin's bf16 (its default where the CPU has it: AVX-512-BF16, AMX): there a question
#   asked again through the prompt cache got first-token logits 0.65 apart from the first ask's, and
#   an F16/BF16 file gave other greedy text at 1 and 3 stages (the residual stream rounded to bf16
#   inside a graph, not across a stage boundary);
# - not its int8 activations (dynamic quantization, taken only on VNNI CPUs): with them the default
#   model's answer to "What is the capital of France?" differed between VNNI and AVX2-only CPUs.
#   `--kquant fast` (integer zero points, openvino_genai's form) turns them on: it trades exactness
#   for the plugin's fused integer kernels anyway (OpenVINOShard);
# - an f16 KV cache, not the plugin's u8: a prompt's positions attend to their own chunk's K/V at
#   full precision and every later step to the cache's, and with u8 the two asks flipped near-ties.
#   f16 is llama.cpp's default KV type and what the planner prices.
# bench/serving_precision.py measures the choice on a CPU; tests/test_cpu_kinds.py runs the
# agreement tests on other CPU kinds' kernels.
SERVING_CONFIG: dict[str, str] = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f16",
                                  "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
# --kquant fast at serving precision: the plugin's int8 activations where the CPU has VNNI (group 32)
FAST_KQUANT_CONFIG = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}
# f32: for numerical comparison with the float64 reference.
F32_CONFIG = {
    "INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
}
CONFIGS = {"serving": SERVING_CONFIG, "f32": F32_CONFIG}


# The CPU plugin prepares (repacks) weights at the first inferences of each shape kind
# (prefill, decode); after this many forwards the original constants' pages are released.
RELEASE_AFTER = 3
# a slot alone that was cut back keeps its tail in the state, masked; once the tail is over this
# many positions and more than the slot keeps, the live positions are copied out (OpenVINOShard.trim)
COMPACT_DEAD = 256


@functools.lru_cache(maxsize=1)
def core() -> ov.Core:
    """The process's one OpenVINO Core (created on first use, never at import), computing on as
    many threads as a CPU quota allows (backends.cgroups.quota_threads)."""
    made = ov.Core()
    threads = quota_threads()
    if threads is not None:
        made.set_property("CPU", {"INFERENCE_NUM_THREADS": threads})
    return made


class OpenVINOShard(HeadOps):
    """A block range of a GGUF model compiled with OpenVINO (see backends.base.Shard)."""

    def __init__(self, spec: ShardSpec, precision: str = "serving", device: str = "CPU",
                 index: ModelIndex | None = None, config: dict[str, str] | None = None,
                 kquant: str = DEFAULT_KQUANT) -> None:
        self.spec = spec
        self.precision = precision
        self.index = index if index is not None else open_model(spec.model_path)
        kquant = self.kquant = ggml_kernels.resolve(kquant, precision)  # the form built (backends.memory.memory_kind)
        cfg = dict(CONFIGS[precision]) if config is None else dict(config)
        if config is None and precision == "serving" and kquant == "fast":
            cfg.update(FAST_KQUANT_CONFIG)
        bank = self._bank = WeightBank(self.index, spill=True, kquant=kquant)
        builder = StageBuilder(self.index, bank, f16_kv=cfg.get("KV_CACHE_PRECISION") == "f16")
        model, self._fold = self._stage_model(builder, spec)
        self.compiled = core().compile_model(model, device, cfg)
        self._head = None
        self._head_build = (builder, device, cfg) if spec.head else None
        if spec.head and not self._fold:
            self._head_request()
        self._last: tuple[np.ndarray, int] | None = None  # (hidden returned by forward, its greedy token)
        self._last_rows: list[tuple[np.ndarray, int]] = []  # the same for forward_batch's rows
        # Constants point into these buffers; the compiled models may too. Keep them alive. They
        # live in a spill file whose pages are dropped from the resident set once the plugin has
        # repacked the weights (after the first forwards, RELEASE_AFTER), see WeightBank.spill.
        self._forwards = 0
        self._batch_forwards = 0
        self._large = memory.LargeSteps(self.index.hparams.hidden)  # the plugin keeps a large step's buffers
        memory.trim_heap()
        self._reqs: dict[int, ov.InferRequest] = {}
        self._spare: list[ov.InferRequest] = []
        self._beam = ov.Tensor(np.zeros(1, dtype=np.int32))
        self._group_of: dict[int, RowGroup] = {}  # slots that are rows of a group → it
        self._parked: set[int] = set()  # rows whose request is over, KV kept (park): moved out lazily
        # slots alone: positions their state holds, and for one cut back (trim) the state
        # positions still live, in order (the rest stay in the state, masked, until compacted)
        self._held: dict[int, int] = {}
        self._live: dict[int, np.ndarray] = {}
        # a hybrid model's slots: the last step's recurrent state and inputs, for an exact cut
        self._steps = RecurrentSteps() if self.index.hparams.hybrid is not None else None
        # sliding-window models: windowed layers' KV holds the newest columns only (window.py); for
        # each slot alone, the columns gone and the mask of its physical positions as last given
        self._window = windowed_kv(self.index, spec.first, spec.last)
        self._wdrop: dict[int, int] = {}
        self._seen: dict[int, np.ndarray] = {}

    def _stage_model(self, builder: StageBuilder, spec: ShardSpec) -> tuple[ov.Model, bool]:
        """The graph of `spec`'s blocks, and whether it folds the head's greedy token in: a shard
        with the head and the last block computes it in its stage graph; its separate head graph
        (logits, or greedy on other hidden states) is compiled lazily. The embedding's rows are
        read from the file per step (ModelIndex.rows), not gathered in the graph: the plugin kept
        its own copy of the whole table beside the graph's (the 8B shape's head member held 1.58×
        its shard + KV with it, 1.15× without: docs/BENCHMARKS.md)."""
        self.index.check_range(spec.first, spec.last)
        fold = spec.head and spec.last == self.index.hparams.n_blocks
        return builder.stage(spec.first, spec.last, fold), fold

    # --- slots -------------------------------------------------------------------------

    def open_slot(self) -> int:
        req = self._spare.pop() if self._spare else self.compiled.create_infer_request()
        req.reset_state()
        req.set_input_tensor(3, self._beam)
        slot = next(i for i in range(len(self._reqs) + 1) if i not in self._reqs)
        self._reqs[slot] = req
        self._held[slot] = 0
        self._reset_window(slot)
        return slot

    def close_slot(self, slot: int) -> None:
        self._parked.discard(slot)
        if slot in self._group_of:
            self._leave_group(slot)
        req = self._reqs.pop(slot)
        req.reset_state()
        self._spare.append(req)
        self._held.pop(slot, None)
        self._live.pop(slot, None)
        if self._steps is not None:
            self._steps.forget(slot, kept=True)
        self._reset_window(slot)

    def _reset_window(self, slot: int, held: int = 0) -> None:
        """A sliding-window slot's bookkeeping for a state of `held` columns, all whole and visible."""
        if self._window is not None:
            self._wdrop[slot], self._seen[slot] = 0, np.ones(held, np.int64)
            self._window.kept.forget(slot)

    def _states(self, req: ov.InferRequest, total: int) -> dict[str, ov.Tensor]:
        """Every variable's state, a windowed one padded on the left to `total` columns (window.py)."""
        return rowmod.read_states(req) if self._window is None else self._window.states(req, total)

    def park(self, slot: int) -> None:
        """The slot's request is over but its KV is kept for the next prompt that starts the
        same way (prompt caching). Its row stays in its group until the group's next step,
        which moves every parked row out at once (one read of the group's state), so the
        other rows keep running on the group without rebuilding one for them."""
        if slot in self._group_of:
            self._parked.add(slot)

    def trim(self, slot: int, length: int) -> None:
        """Keep the slot's first `length` physical positions (a reused prompt cache slot: the
        positions after the prefix a new prompt shares go). Nothing is copied: a row of a group
        and a slot alone both forget their tail, which stays in the state masked out: a cut
        costs no copy of the state. A slot alone whose state is mostly such tail
        (over COMPACT_DEAD positions, and more than it keeps) has its live positions copied out
        once."""
        group = self._group_of.get(slot)
        if group is not None and self._window is not None:  # cut alone: it may go back to a kept window
            self._take_out(slot)
            group = None
        if group is not None:
            row = group.rows[group.position(slot)]
            if length > len(row.index):
                raise ValueError(f"slot {slot} holds {len(row.index)} positions, not {length}")
            row.index = row.index[:length]
            return
        held = self._held[slot]
        live = self._live.get(slot)
        if self._steps is not None and 0 < length < (held if live is None else len(live)):
            kept = self._steps.kept_at(slot, length)
            if kept is None:
                self._cut_recurrent(slot, length, held if live is None else len(live))
            else:  # back to the state kept at a prompt's end: the KV's own cut, then that state
                self._without_steps(lambda: self.trim(slot, length))
                self._steps.forget(slot)
                self._steps.put_back(self._reqs[slot], kept)
            return
        if length > (held if live is None else len(live)):
            raise ValueError(f"slot {slot} holds {held if live is None else len(live)} positions, not {length}")
        live = (np.arange(held, dtype=np.int64) if live is None else live)[:length]
        req = self._reqs[slot]
        if length and self._window is not None and self._cut_window(slot, live):
            return
        if length == 0:
            if self._steps is not None:
                self._steps.forget(slot, kept=True)
            req.reset_state()
            self._held[slot] = 0
            self._live.pop(slot, None)
            self._reset_window(slot)
        elif held - length > max(COMPACT_DEAD, length):
            states = self._states(req, held)
            rowmod.set_states(req, rowmod.row_kv(states, 0, live), {n: t.element_type for n, t in states.items()})
            self._held[slot] = length
            self._live.pop(slot, None)
            if self._window is not None:
                self._seen[slot] = self._seen[slot][live]
                self._wdrop[slot] = self._window.fit(req, self._seen[slot], length, 0)
        elif length < held:
            self._live[slot] = live

    def _cut_window(self, slot: int, live: np.ndarray) -> bool:
        """A sliding-window slot cut to its physical positions `live`: False when its windowed
        variables still hold the window there (the cut is the KV's own); else back to the window
        kept at that length (True), every variable compacted to `live` (window.py)."""
        back = self._window.cut(slot, self._reqs[slot], live, self._seen[slot], self._wdrop[slot])
        if back is None:
            return False
        self._held[slot], self._wdrop[slot], self._seen[slot] = len(live), *back
        self._live.pop(slot, None)
        return True

    def _cut_recurrent(self, slot: int, length: int, held: int) -> None:
        """A hybrid slot back to `length` positions inside its last step (backends/openvino/recurrent.py)."""
        step = self._steps.cut(slot, length, held)
        self._steps.forget(slot)
        self._without_steps(lambda: self.trim(slot, step.start))  # the KV's own cut, then the step's head again
        self._steps.put_back(self._reqs[slot], step.states)
        n = length - step.start
        if n:
            self.forward(slot, step.x[:n], step.positions[:n], step.mask[:length])

    def _without_steps(self, work) -> None:
        """Run `work` (a KV cut) as on a model without recurrent state."""
        steps, self._steps = self._steps, None
        try:
            work()
        finally:
            self._steps = steps

    def checkpoint(self, slot: int) -> None:
        """Keep the slot's recurrent state as it is now (backends.base.Shard; recurrent.py)."""
        if self._steps is not None:
            live = self._live.get(slot)
            self._steps.keep(slot, self._reqs[slot], self._held[slot] if live is None else len(live))
        if self._window is not None:  # the windowed variables' window (window.py)
            if slot in self._group_of:
                self._take_out(slot)
            held, live = self._held[slot], self._live.get(slot)
            cols = np.arange(held, dtype=np.int64) if live is None else live
            self._window.keep(slot, self._reqs[slot], held, self._seen[slot], cols)

    def capture(self, slot: int) -> Any:
        """{variable name: a copy of its state} (the plugin hands states back at their own precision)."""
        group = self._group_of.get(slot)
        if group is not None:  # its row, in the caller's physical layout
            p = group.position(slot)
            return rowmod.row_kv(self._states(group.req, group.length), p, group.rows[p].index)
        return rowmod.row_kv(self._states(self._reqs[slot], self._held[slot]), 0, self._live.get(slot))

    def restore(self, slot: int, state: Any) -> None:
        if slot in self._group_of:
            self._leave_group(slot)  # its row is replaced: nothing to copy out
        for s in self._reqs[slot].query_state():
            s.state = ov.Tensor(np.ascontiguousarray(state[s.name]))
        self._held[slot] = next((a.shape[2] for a in state.values() if len(a.shape) == 4), 0)
        self._live.pop(slot, None)
        self._reset_window(slot, self._held[slot])
        if self._steps is not None:  # the restored state has no last step or kept states to go back to
            self._steps.forget(slot, kept=True)

    # --- row groups (backends/openvino/rows.py) -----------------------------------------

    def _leave_group(self, slot: int) -> None:
        """Drop the slot's row from its group (lazily: the group's next step leaves it out)."""
        group = self._group_of.pop(slot)
        group.drop(slot)
        if not group.live():
            group.req.reset_state()
            self._spare.append(group.req)

    def _take_out(self, *slots: int) -> None:
        """Make the slots' solo requests their homes again (rows of one group): copy each row
        there, reading the group's state once, then drop the rows."""
        group = self._group_of[slots[0]]
        states = None
        for slot in slots:
            self._parked.discard(slot)
            p = group.position(slot)
            index = group.rows[p].index
            req = self._reqs[slot]
            if len(index):
                states = states or self._states(group.req, group.length)
                rowmod.set_states(req, rowmod.row_kv(states, p, index), {n: t.element_type for n, t in states.items()})
            else:
                req.reset_state()
            self._held[slot] = len(index)
            self._live.pop(slot, None)
            if self._window is not None:
                self._seen[slot] = group.seen[p, index]
                self._wdrop[slot] = self._window.fit(req, self._seen[slot], len(index), 0)
        for slot in slots:
            self._leave_group(slot)

    def _group_for(self, slots: list[int]) -> RowGroup:
        """The group whose live rows are exactly `slots`, or a new one built from the rows'
        current homes (one copy of their KV; the groups they leave keep their other rows)."""
        group = self._group_of.get(slots[0])
        parked = [s for s in group.live() if s in self._parked] if group is not None else []
        if parked and sorted(s for s in group.live() if s not in self._parked) == sorted(slots):
            self._take_out(*parked)  # the rows that left keep their KV; the group runs on
        if group is not None and sorted(group.live()) == sorted(slots):
            return group
        read: dict[int, dict[str, ov.Tensor]] = {}  # id(request) → its states, read once
        kvs, lengths, types, seens = [], [], {}, []
        for slot in slots:
            home = self._group_of.get(slot)
            req = home.req if home is not None else self._reqs[slot]
            states = read.get(id(req))
            if states is None:
                states = read[id(req)] = self._states(req, home.length if home is not None else self._held[slot])
            if home is not None:
                p = home.position(slot)
                index = home.rows[p].index
                n = len(index)
                kv = rowmod.row_kv(states, p, index) if n else None
                seen = home.seen[p, index] if self._window is not None else None
            else:
                live = self._live.pop(slot, None)  # a slot cut back: its live positions only
                n = min(t.shape[2] if len(t.shape) == 4 else 0 for t in states.values()) if live is None else len(live)
                kv = rowmod.row_kv(states, 0, live) if n else None
                seen = (self._seen[slot] if live is None else self._seen[slot][live]) if self._window is not None else None
            seens.append(seen)
            if n:
                types = {name: t.element_type for name, t in states.items()}
                template = states
            kvs.append(kv)
            lengths.append(n)
        for slot in slots:
            if slot in self._group_of:
                self._leave_group(slot)
        req = self._spare.pop() if self._spare else self.compiled.create_infer_request()
        req.reset_state()
        length = max(lengths)
        if length:
            arrays, length = rowmod.assemble(kvs, lengths, template)
            rowmod.set_states(req, arrays, types)
        rows = [Row(s, np.arange(length - n, length, dtype=np.int64)) for s, n in zip(slots, lengths)]
        group = RowGroup(req, rows, length)
        if self._window is not None:  # the rows' masks, aligned as their KV (window.py)
            group.seen = rowmod.assemble_masks(seens, lengths, length)
            group.dropped = self._window.fit(req, group.seen, length, 0)
        for slot in slots:
            self._group_of[slot] = group
        return group

    # --- compute -----------------------------------------------------------------------

    def forward(self, slot: int, x: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if slot in self._group_of:
            self._take_out(slot)
        req = self._reqs[slot]
        if self._steps is not None:
            start = self._held[slot] if self._live.get(slot) is None else len(self._live[slot])
            self._steps.before(slot, req, start, x, positions, mask)
        x = np.ascontiguousarray(self._inputs(x), dtype=np.float32)[None]  # [1, n, H]
        n, held, live = x.shape[1], self._held[slot], self._live.get(slot)
        if live is not None:  # the caller's positions → the state's: the cut-off tail stays masked
            if len(mask) != len(live) + n:
                raise ValueError(f"mask covers {len(mask)} positions; slot {slot} needs {len(live)} + {n}")
            full = np.zeros(held + n, dtype=np.int64)
            full[live] = mask[: len(live)]
            full[held:] = mask[len(live):]
            mask = full
        if self._window is not None:  # the keys the step's queries need are held (before anything changes)
            check_window(mask, held, self._wdrop[slot], self._window.window)
        if live is not None:
            self._live[slot] = np.concatenate([live, np.arange(held, held + n, dtype=np.int64)])
        self._held[slot] = held + n
        if self._large.due(1, x.shape[1]):
            self._release_scratch()
        req.set_input_tensor(0, ov.Tensor(x, shared_memory=True))
        req.set_input_tensor(1, ov.Tensor(np.ascontiguousarray(mask, dtype=np.int64)[None], shared_memory=True))
        req.set_input_tensor(2, ov.Tensor(np.ascontiguousarray(positions, dtype=np.int64)[None], shared_memory=True))
        with releasing_pages(self._bank, self._forwards < RELEASE_AFTER):
            req.infer()
        if self._forwards < RELEASE_AFTER:
            self._forwards += 1
            self.release_weight_pages()
        hidden = req.get_output_tensor(0).data[0].copy()  # [n, H]
        if self._window is not None:
            self._seen[slot] = np.asarray(mask, dtype=np.int64)
            self._wdrop[slot] = self._window.fit(req, self._seen[slot], held, self._wdrop[slot])
        if self._fold:
            self._last = (hidden, int(req.get_output_tensor(1).data[0]))
        return hidden

    def forward_batch(self, slots: Sequence[int], xs: Sequence[np.ndarray], positions: Sequence[np.ndarray],
                      masks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`forward` on several slots at once, as one inference (see backends.base.Shard)."""
        slots = list(slots)
        if not (len(slots) == len(xs) == len(positions) == len(masks)) or not slots:
            raise ValueError("forward_batch needs one x, positions and mask per slot, and at least one slot")
        if len(set(slots)) != len(slots):
            raise ValueError(f"forward_batch got a slot twice: {slots}")
        for slot in slots:
            if slot not in self._reqs:
                raise ValueError(f"slot {slot} is not open")
        if self._steps is not None:  # recurrent states are not batched into row groups yet: one by one
            return [self.forward(*step) for step in zip(slots, xs, positions, masks)]
        if len(slots) == 1 and slots[0] not in self._group_of:
            return [self.forward(slots[0], xs[0], positions[0], masks[0])]
        group = self._group_for(slots)
        xs = [self._inputs(x) for x in xs]
        step = rowmod.step_inputs(group, slots, xs, positions, masks, np.float32, self.index.hparams.carried)
        if self._window is not None:
            check_window(step.mask, group.length, group.dropped, self._window.window)
        if self._large.due(*step.x.shape[:2]):
            self._release_scratch()
        req = group.req
        req.set_input_tensor(0, ov.Tensor(step.x, shared_memory=True))
        req.set_input_tensor(1, ov.Tensor(step.mask, shared_memory=True))
        req.set_input_tensor(2, ov.Tensor(step.positions, shared_memory=True))
        req.set_input_tensor(3, ov.Tensor(step.beam, shared_memory=True))
        with releasing_pages(self._bank, self._batch_forwards < RELEASE_AFTER):
            req.infer()
        L = step.x.shape[1]
        rowmod.advance(group, slots, step.n, L)
        if self._window is not None:
            group.seen = step.mask
            group.dropped = self._window.fit(req, step.mask, group.length - L, group.dropped)
        if self._batch_forwards < RELEASE_AFTER:  # the batched shapes' first inferences repack too
            self._batch_forwards += 1
            self.release_weight_pages()
        out = req.get_output_tensor(0).data  # [B, L, H]
        hiddens = [out[b, :n].copy() for b, n in enumerate(step.n)]  # [n, H] each
        # the stage graph's folded token is the last batch row's only (graph.py); a row's greedy
        # token comes from the head graph (greedy), as on a shard that does not fold
        self._last_rows = []
        return hiddens

    def _release_scratch(self) -> None:
        """Hand the plugin's intermediate buffers back (CompiledModel.release_memory), then run
        one inference of a single position in a fresh state. In OpenVINO 2026.4 the first inference
        after release_memory fails ("Memory has not been allocated") in every node whose shapes
        equal the last inference's; that last one was large (rows of RELEASE_MIN_ROW or more: see
        backends.memory.large_step), so one position in a fresh state has other shapes in every node and allocates them anew."""
        self.compiled.release_memory()
        req = self._spare.pop() if self._spare else self.compiled.create_infer_request()
        try:
            req.reset_state()
            width = self.index.hparams.carried
            req.set_input_tensor(0, ov.Tensor(np.zeros((1, 1, width), np.float32)))
            req.set_input_tensor(1, ov.Tensor(np.ones((1, 1), np.int64)))
            req.set_input_tensor(2, ov.Tensor(np.zeros((1, 1), np.int64)))
            req.set_input_tensor(3, self._beam)
            req.infer()
        finally:
            req.reset_state()
            self._spare.append(req)
        memory.trim_heap()

    @property
    def scratch_releases(self) -> int:
        return self._large.releases

    def _inputs(self, x: np.ndarray) -> np.ndarray:
        """A forward's x as the stage graph takes it: hidden [n, H], the embedding's rows for ids
        (a carried row's first columns: backends.gguf.gemma4.first_rows)."""
        return first_rows(self.index, x) if self.spec.embed else x

    def release_weight_pages(self) -> None:
        """Drop the constants' file pages from the resident set (they come back if read)."""
        self._bank.release_pages()
        memory.trim_heap()

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        head = self._head_request()
        head.set_input_tensor(0, ov.Tensor(np.ascontiguousarray(hidden, dtype=np.float32), shared_memory=True))
        head.infer()
        return head.get_output_tensor(0).data.copy()  # [n, V]

    def greedy(self, hidden: np.ndarray) -> int:
        """The top-1 token after the last row of hidden [n, H] (computed in the graph). When
        `hidden` is the array the last `forward` returned on a folded shard, no inference runs."""
        if self._last is not None and hidden is self._last[0]:
            return self._last[1]
        for h, token in self._last_rows:
            if hidden is h:
                return token
        head = self._head_request()
        last = np.ascontiguousarray(hidden[-1:], dtype=np.float32)  # [1, H]
        head.set_input_tensor(0, ov.Tensor(last, shared_memory=True))
        head.infer()
        return int(head.get_output_tensor(1).data[0])

    def _head_request(self) -> ov.InferRequest:
        if self._head is None:
            if self._head_build is None:
                raise ValueError(f"shard [{self.spec.first}, {self.spec.last}) holds no head")
            builder, device, cfg = self._head_build
            self._head = core().compile_model(builder.head(), device, cfg).create_infer_request()
            with releasing_pages(self._bank, True):  # its first inference repacks the lm_head
                self._head.infer({0: np.zeros((1, self.index.hparams.carried), np.float32)})
            self.release_weight_pages()
        return self._head

    def runtime_model(self) -> ov.Model:
        """The compiled stage as the plugin runs it (for fusion checks)."""
        return self.compiled.get_runtime_model()

    def head_runtime_model(self) -> ov.Model:
        """The compiled head (final norm + lm_head + top-1) as the plugin runs it."""
        return self._head_request().get_compiled_model().get_runtime_model()
