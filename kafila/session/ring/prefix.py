"""Prompt caching at the head: a finished request's slot keeps its KV for the next prompt that
starts the same way (sans-I/O; the scheduler's part).

Why. A chat client sends the whole conversation every turn (`kafila chat`, the page, OpenAI and
Ollama clients alike), and every request of one app starts with the same system prompt. Fed
afresh, turn k prefills all k turns again: on a big model, where a prompt position costs a
whole pass over the weights, that is most of a turn's wait. llama.cpp's server (`cache_prompt`)
and Ollama keep a slot's KV for this; so does Kafila.

How. When a request ends, its ring slot is *parked* instead of freed: every stage keeps the
slot's KV as it is, and the head remembers the request's history as fed (its visible
positions' tokens, in order: logical position i holds history token i) and which physical
positions are masked out (rejected drafts). A new request takes the parked slot whose
visible tokens share the longest prefix with its prompt, and feeds only the rest. Its first
step's `cache_len` is the physical position after the shared prefix, and every stage cuts the
slot's KV back to it (local_slots.LocalSlots, backends' `trim`): what the old request fed after the
prefix goes, so it costs neither attention nor room. (Masking it instead, the OpenVINO paper's
rewind for rejected drafts, was the first version: each reuse left its tail in the attention,
and a question asked again six times decoded at 0.92× the cache-off speed on the default
model: docs/BENCHMARKS.md, "A question asked again".)
Rejected drafts inside the prefix stay masked; a reuse carries at most MAX_WASTE of them (every
activation's header lists them) and at most half the room its prompt leaves in the context;
should a request fill its slot while it still has room by its logical positions, the scheduler
feeds its history again into the reset slot (Scheduler._compact), so no answer ends earlier
than in a fresh slot.

Which slot. Taking a parked slot destroys what it holds past the shared prefix, so a prompt
takes one at once only when it continues that slot's request: it holds all of that request's
prompt (the next turn of its conversation, or the same question asked again). Otherwise it
takes a slot nobody has used,
and only when none is left the least recently parked one, keeping a long prefix that one shares
(a long system prompt) or resetting it (its step's cache_len is 0). So the conversations of a
household keep their own slots while slots last.

At f32 a reused prefix gives the tokens a fresh prefill gives (tests/test_prompt_cache.py); at
bf16 a near-tie can part, as with any change of chunking or batching.

Hybrid models (WHOLE). A delta-net layer's recurrent state folds in the whole history and cannot
be cut back like a KV cache (backends/openvino/recurrent.py), so a hybrid model's parked slot is
taken by a prompt that continues every visible position it holds (the next turn of its
conversation, whose prompt repeats the last one and its answer), or by one that reaches a
state every stage kept: one at a point of each prompt of the slot's conversation (Step.keep;
its last KEPT_STATES turns, backends/kept.py), the slot going back to the latest such point the
prompt reaches. The point is the end of a chat's messages, before the template's answer prefix
(GenerationRequest.keep_at; the prompt's end when not given): the next turn repeats the messages
but not always that prefix or the answer as it was generated (Qwen3.5's template renders
`<|im_start|>assistant\n<think>\n` for the answer to come and an earlier answer without its
reasoning), and a turn that edits or regenerates an earlier message goes back to the turn
before it (llama-server's context checkpoints do the same). Any other prompt starts afresh.
Sliding-window models take the same rules: a windowed layer's KV holds only its window
(backends/window.py), so a cut further back than that needs the window every
stage kept at that point (backends.kept.continues_whole).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from backends.kept import kept_until

# masked-out positions (rejected drafts) a reused prefix may carry: each is listed in every
# activation's header of the request (frames.MAX_HEADER_BYTES) and still takes its place in the attention
MAX_WASTE = 1024
MIN_SHARED = 1  # a shared prefix shorter than this is not worth a slot someone else could reuse
# The slot that goes anyway (the least recently parked) keeps a prefix of at least EVICT_SHARED
# positions (a long system prompt); a shorter one is reset. Measured (docs/BENCHMARKS.md, "Prompt caching"): keeping the default chat template's
# 26-position system prompt with about 50 positions masked cost 8 and 16 users at 0 ms a hop
# 20-28% of their aggregate (their rows join micro-batches by copying longer KV, and the
# plugin's attention over a prompt after cached positions is its slower path), more than
# feeding 26 positions saves; where the balance turns was not measured.
EVICT_SHARED = 128
WHOLE = "whole"  # the prompt-cache mode of hybrid models: only whole histories are continued
CACHED_STAT = "cached"  # in a request's last Tokens frame: prompt tokens its slot held already


def cached_of(stats) -> int | None:
    """The prompt tokens a request found cached, from its last Tokens frame's stats (None: the
    head did not say)."""
    for key, value in stats:
        if key == CACHED_STAT:
            return max(0, int(value))
    return None


@dataclass(frozen=True)
class Parked:
    """A parked slot's KV, as the head knows it: the tokens of its visible positions in order,
    and the physical positions masked out (every other physical position is visible)."""

    tokens: tuple[int, ...]
    zeros: frozenset[int]
    prompt: int = 0  # the length of the prompt of the request that left it
    kept: tuple[int, ...] = ()  # hybrids: the physical positions every stage holds the recurrent state of

    @property
    def length(self) -> int:
        """The slot's physical positions."""
        return len(self.tokens) + len(self.zeros)


@dataclass(frozen=True)
class Reuse:
    """A new request's start in a parked slot: `shared` prompt tokens are in its KV already;
    the step after them continues at physical `cache_len` (the stages drop what the slot holds
    after it) with `zeros` masked."""

    slot: int
    shared: int
    cache_len: int
    zeros: tuple[int, ...]
    kept: tuple[int, ...] = ()  # hybrids: the slot's kept states the request starts with (backends/kept.py)

    @property
    def waste(self) -> int:
        """Positions of the slot the request masks."""
        return self.cache_len - self.shared


def shared_prefix(parked: Parked, prompt: Sequence[int]) -> tuple[int, int]:
    """(n, cut): the prompt's first n tokens are the slot's first n visible positions, the last
    of which is physical position cut - 1. n stops one short of the prompt: its last token is
    always fed, since its step samples the first token of the answer."""
    n, most = 0, min(len(prompt) - 1, len(parked.tokens))
    while n < most and parked.tokens[n] == prompt[n]:
        n += 1
    cut = seen = 0
    while seen < n:  # the physical position after the n-th visible one
        seen += cut not in parked.zeros
        cut += 1
    return n, cut


def reuse_in(slot: int, parked: Parked, prompt: Sequence[int], room: int, whole: bool = False) -> Reuse | None:
    """How a prompt starts in `parked` (None: nothing shared, or too much masked). `room`: the
    positions the context leaves after the prompt; a reuse masks at most half of them. `whole`:
    only a prompt that continues all of the slot's visible positions, or its positions up to
    a kept state, the latest it reaches (hybrid models)."""
    shared, cut = shared_prefix(parked, prompt)
    if whole and shared < len(parked.tokens):  # back to a kept state, the latest the prompt reaches
        reached = [(k - sum(1 for z in parked.zeros if z < k), k) for k in parked.kept]  # (visible, physical)
        reached = [(v, k) for v, k in reached if 0 < v <= shared]
        if not reached:
            return None
        shared, cut = max(reached)
    zeros = tuple(sorted(z for z in parked.zeros if z < cut))
    if shared < MIN_SHARED or len(zeros) > min(MAX_WASTE, room // 2):
        return None
    return Reuse(slot, shared, cut, zeros, kept_until(parked.kept, cut))


class ParkedSlots:
    """The parked slots, least recently parked first; `whole`: a slot is reused only by a prompt
    continuing its whole history (hybrid models, WHOLE)."""

    def __init__(self, whole: bool = False) -> None:
        self._slots: OrderedDict[int, Parked] = OrderedDict()
        self.whole = whole

    def __len__(self) -> int:
        return len(self._slots)

    def park(self, slot: int, tokens: Sequence[int], zeros: Sequence[int], prompt: int = 0,
             kept: Sequence[int] = ()) -> None:
        """`slot` keeps its KV: the tokens of its visible positions (the history as fed), the
        masked physical positions, the length of the prompt of the request that leaves it, and
        (hybrids) the physical positions whose recurrent states every stage kept."""
        self._slots[slot] = Parked(tuple(tokens), frozenset(zeros), prompt, tuple(kept))
        self._slots.move_to_end(slot)

    def best(self, prompt: Sequence[int], room: int) -> Reuse | None:
        """The parked slot whose request `prompt` continues (it holds all of that request's
        prompt but the last token, which is always fed again, or reaches a kept state) with the
        longest shared prefix (ties: the least waste), taken out of the parked set; None if there
        is none."""
        found: Reuse | None = None
        for slot, parked in self._slots.items():
            r = reuse_in(slot, parked, prompt, room, self.whole)
            if r is None or (r.shared < parked.prompt - 1 and r.cache_len not in parked.kept):
                continue
            if found is None or (r.shared, -r.cache_len) > (found.shared, -found.cache_len):
                found = r
        if found is not None:
            del self._slots[found.slot]
        return found

    def evict(self, prompt: Sequence[int], room: int) -> tuple[int, Reuse | None]:
        """The least recently parked slot, taken out, and how `prompt` starts in it (None: it
        shares nothing worth keeping; the request's first step resets it)."""
        slot, parked = self._slots.popitem(last=False)
        r = reuse_in(slot, parked, prompt, room, self.whole)
        return slot, (r if r is not None and r.shared >= EVICT_SHARED else None)

    def clear(self) -> list[int]:
        """Every parked slot, taken out."""
        slots = list(self._slots)
        self._slots.clear()
        return slots

    def slots(self) -> list[int]:
        return list(self._slots)
