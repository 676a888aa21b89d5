"""Cutting back a hybrid slot exactly: its recurrent state cannot be masked like a KV cache.

A delta-net layer's conv and matrix states (delta_net.py, variables `recurrent.*`) hold the whole
history folded in, so `trim` cannot just mask positions out. What a speculative step needs is
a cut inside its last step (a verify step that accepted j of k drafts), so before every step of
more than one position a slot keeps a copy of its recurrent variables and that step's inputs;
a cut to `length` inside the step puts the KV back to the step's start (the shard's own masking),
the recurrent variables back to the copy, and feeds the step's first `length − start` positions
again: the state is then exactly as if only those had been fed (re-feed, not per-position
snapshots: a step's states at every position would cost L × Hv·S² floats per layer, a prompt
chunk's far too many). Steps of one position keep nothing: decoding without drafts is never
cut back inside a step. A cut further back goes only to a kept state: `keep` copies a slot's
recurrent variables where a prompt's messages end (the head says which step: Activation.keep),
one per turn (backends/kept.py's rules), and a cut to exactly such a length puts them back (a
prompt-cache prefix that ends where an earlier prompt's messages ended: kafila/session/ring/prefix.py).
Any other cut is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from backends.kept import KeptStates

RECURRENT_PREFIX = "recurrent."


@dataclass
class LastStep:
    start: int  # the caller's physical positions before the step
    states: dict[str, np.ndarray]  # recurrent variables before the step
    x: np.ndarray  # the step's inputs, as forward got them
    positions: np.ndarray
    mask: np.ndarray  # caller's layout: start + n entries


class RecurrentSteps:
    """The last multi-position step of each slot of a hybrid shard (see the module docstring)."""

    def __init__(self) -> None:
        self._last: dict[int, LastStep] = {}
        self.kept: KeptStates[dict[str, np.ndarray]] = KeptStates()  # slot → its variables by length

    def before(self, slot: int, req: ov.InferRequest, start: int, x: np.ndarray, positions: np.ndarray,
               mask: np.ndarray) -> None:
        if len(x) < 2:
            self._last.pop(slot, None)
            return
        self._last[slot] = LastStep(start, _recurrent_states(req), np.array(x, copy=True), np.array(positions, copy=True),
                                    np.array(mask, copy=True))  # fmt: skip

    def forget(self, slot: int, kept: bool = False) -> None:
        """Drop the slot's last step (and with `kept` its kept states too)."""
        self._last.pop(slot, None)
        if kept:
            self.kept.forget(slot)

    def keep(self, slot: int, req: ov.InferRequest, length: int) -> None:
        """Copy the slot's recurrent variables as they are at `length` physical positions."""
        self.kept.keep(slot, length, _recurrent_states(req))

    def kept_at(self, slot: int, length: int) -> dict[str, np.ndarray] | None:
        """The variables kept at exactly `length` positions, if any; the states kept past
        `length` are dropped (the slot is being cut back before them)."""
        return self.kept.back_to(slot, length)

    def cut(self, slot: int, length: int, held: int) -> LastStep:
        """The step to go back into for a cut of a slot holding `held` positions to `length`
        (ValueError when the cut reaches before the slot's last step)."""
        step = self._last.get(slot)
        if step is None or not step.start <= length < held:
            raise ValueError(f"a hybrid model's slot {slot} (recurrent state) can be cut back only within its "
                             f"last step of several positions, not from {held} to {length} positions")
        return step

    @staticmethod
    def put_back(req: ov.InferRequest, states: dict[str, np.ndarray]) -> None:
        for s in req.query_state():
            if s.name in states:
                s.state = ov.Tensor(np.ascontiguousarray(states[s.name]))


def _recurrent_states(req: ov.InferRequest) -> dict[str, np.ndarray]:
    return {s.name: s.state.data.copy() for s in req.query_state() if s.name.startswith(RECURRENT_PREFIX)}
