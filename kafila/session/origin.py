"""Drafting at the member where a request was typed (DiP-SD's "local drafting"), sans I/O.

Theory of operation (`--speculate origin`). Every member keeps, for each request typed at it,
the request's history: its prompt and the tokens the head has sent back (`OriginDrafts`). After
each change it drafts up to `length` tokens continuing that history (n-gram prompt lookup,
speculate.ngram_draft) and keeps the latest `(base, tokens)`, base = the history's length. When
an activation of one of its requests passes through its stage (every activation goes round the
whole ring), the member attaches that draft (frames.Activation `draft`, `dbase`); the head keeps
each request's latest one (Scheduler.offer_draft).

The draft is one step stale by construction: the tokens a member has received when a step's
activation passes it are exactly those the step continues (they travel the same streams, in
order, ahead of it), so the draft reaches the head with that step's result. The head uses it for
the next step only if it is still ALIGNED (`aligned_draft`): the tokens the head produced since
`base` are the draft's first ones; then the draft's next K tokens are the step's drafts (K from
the scheduler's choose_k, as for every drafter). A draft longer than twice the most drafts a step
carries (2·K + 1) still covers the next step when the step in flight accepts all of its drafts.
When the draft is not aligned (a rejection ended the step earlier), the head drafts with its own
n-grams: nothing waits for a draft, and a stale or missing one only costs acceptance. Greedy
output stays token-identical either way: verification decides every token.

Requests typed at the head draft the same way, handed to the scheduler without a frame.
"""

from __future__ import annotations

from collections.abc import Sequence

from kafila.session.fields import MAX_ORIGIN_DRAFT
from kafila.session.speculate import ngram_draft


def aligned_draft(history: Sequence[int], base: int, tokens: Sequence[int], k: int) -> tuple[int, ...]:
    """The next `k` drafts of an origin's draft `tokens` continuing `history[:base]`, if the
    tokens produced since `base` are its first ones; () when it is stale past its end, refers to
    a history the head has not produced, disagrees with it, or k < 1."""
    done = len(history) - base
    if k < 1 or base < 0 or not 0 <= done < len(tokens):
        return ()
    if tuple(int(t) for t in history[base:]) != tuple(int(t) for t in tokens[:done]):
        return ()
    return tuple(int(t) for t in tokens[done : done + k])


class OriginDrafts:
    """The histories of the requests typed at this member and each one's latest draft."""

    def __init__(self, length: int) -> None:
        if not 1 <= length <= MAX_ORIGIN_DRAFT:
            raise ValueError(f"an origin draft holds 1..{MAX_ORIGIN_DRAFT} tokens")
        self.length = length
        self._history: dict[str, list[int]] = {}
        self._draft: dict[str, tuple[int, tuple[int, ...]]] = {}

    def start(self, req_id: str, prompt: Sequence[int]) -> None:
        self._history[req_id] = [int(t) for t in prompt]
        self._redraft(req_id)

    def add(self, req_id: str, ids: Sequence[int]) -> None:
        """Tokens of `req_id` came back from the head (ignored for a request not drafted here)."""
        h = self._history.get(req_id)
        if h is None or not ids:
            return
        h.extend(int(t) for t in ids)
        self._redraft(req_id)

    def draft(self, req_id: str) -> tuple[int, tuple[int, ...]] | None:
        """(base, tokens): the latest draft of `req_id`, None when there is none."""
        return self._draft.get(req_id)

    def end(self, req_id: str) -> None:
        self._history.pop(req_id, None)
        self._draft.pop(req_id, None)

    def clear(self) -> None:
        self._history.clear()
        self._draft.clear()

    def __len__(self) -> int:
        return len(self._history)

    def _redraft(self, req_id: str) -> None:
        h = self._history[req_id]
        tokens = ngram_draft(h, self.length)
        if tokens:  # else the older draft stays: the head checks whether it is still aligned
            self._draft[req_id] = (len(h), tokens)
