"""A hybrid slot's kept recurrent states: the checkpoints a later prompt may go back to.

A delta-net layer's state folds in the whole history, so a slot cannot be cut back to any
position as a KV cache can (backends/openvino/recurrent.py). Instead every stage keeps a copy of
a slot's recurrent state where a chat's messages end (the head says which step: Step.keep), one
per turn, so a conversation's next turn goes back to its last one, and an edited or regenerated
earlier message goes back to the last turn before it (kafila/session/ring/prefix.py).

The rules, which the head mirrors without asking the stages (`kept_after`):
- keeping at length L replaces any state kept at L or later, and a slot keeps at most
  KEPT_STATES, the earliest going first (the plan prices each: backends.memory);
- a cut to length L drops every state kept after L; a cut to exactly a kept length goes back to it;
- a slot reset, restored or closed keeps nothing.
"""

from __future__ import annotations

from typing import Generic, TypeVar

# One per turn of a conversation: its last KEPT_STATES turns can be gone back to. Each costs a
# request's recurrent state (Qwen3.5-35B-A3B's 30 delta-net layers: about 63 MB); llama-server
# keeps up to 32 such checkpoints a slot (--ctx-checkpoints) but does not price them up front.
KEPT_STATES = 4

State = TypeVar("State")


def kept_after(kept: tuple[int, ...], length: int) -> tuple[int, ...]:
    """The lengths a slot keeps states at after keeping one at `length` (the module's rules)."""
    return (*(k for k in kept if k < length), length)[-KEPT_STATES:]


def kept_until(kept: tuple[int, ...], length: int) -> tuple[int, ...]:
    """The lengths a slot keeps states at after a cut to `length`."""
    return tuple(k for k in kept if k <= length)


class KeptStates(Generic[State]):
    """Each slot's kept states, by length (the module's rules)."""

    def __init__(self) -> None:
        self._slots: dict[int, dict[int, State]] = {}

    def keep(self, slot: int, length: int, state: State) -> None:
        old = self._slots.get(slot, {})
        lengths = kept_after(tuple(old), length)
        self._slots[slot] = {k: old[k] if k != length else state for k in lengths}

    def back_to(self, slot: int, length: int) -> State | None:
        """The state kept at exactly `length`, if any, after dropping those kept past it (the
        slot is being cut back to `length`)."""
        old = self._slots.get(slot)
        if not old:
            return None
        self._slots[slot] = {k: old[k] for k in kept_until(tuple(old), length)}
        return old.get(length)

    def lengths(self, slot: int) -> tuple[int, ...]:
        return tuple(self._slots.get(slot, ()))

    def states(self, slot: int) -> list[State]:
        return list(self._slots.get(slot, {}).values())

    def forget(self, slot: int) -> None:
        self._slots.pop(slot, None)


def continues_whole(hparams) -> bool:
    """Whether a slot of this model goes back only to a whole history or a kept state: a hybrid's
    recurrent state cannot be cut back, nor can a sliding-window model's windowed KV past the window
    it holds (backends/window.py). Its prompt cache is prefix.WHOLE's."""
    return hparams.hybrid is not None or bool(hparams.family.sliding_window)
