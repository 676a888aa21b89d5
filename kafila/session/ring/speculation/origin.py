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

With a draft model at the member (`kafila join --draft SMALL.gguf`, `model=True`), the drafts are
the draft model's greedy tokens, computed off the event loop while the ring works (RingNode's
drafting task asks `wanted` what to compute and hands the answer to `put`). A greedy draft stays
valid as long as the head's tokens agree with it (the model's continuation of an agreeing prefix
is the rest of the draft), so after an accepted run only the tokens the head took are drafted
anew at the end, and after a rejection the draft restarts from the head's token: at most `CHUNK`
tokens a job, so a fresh short draft is out soon and grows while the ring works. Until it is
out, the older one rides along and the head falls back to its n-grams where it is not aligned.
"""

from __future__ import annotations

from collections.abc import Sequence

from kafila.session.wire.fields import MAX_ORIGIN_DRAFT
from kafila.session.ring.speculation.speculate import ngram_draft


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


MODEL_DRAFT = 12  # a draft model's draft at most: each token costs a forward of it (n-grams: ~nothing)
CHUNK = 4  # the most tokens a draft model drafts in one job (a fresh draft is out after CHUNK forwards)


class OriginDrafts:
    """The histories of the requests typed at this member and each one's latest draft
    (n-grams, or with `model` the draft model's tokens that `put` hands in)."""

    def __init__(self, length: int, model: bool = False, ahead: bool = True) -> None:
        if not 1 <= length <= MAX_ORIGIN_DRAFT:
            raise ValueError(f"an origin draft holds 1..{MAX_ORIGIN_DRAFT} tokens")
        self.length = length
        self.model = model
        # a draft model drafts the next step's drafts too while a step is out (`add`); not where
        # other members share this machine: there every draft is the ring's compute, and one the
        # head may not take (a rejection) costs it, which the live optimiser does not price
        self.ahead = ahead
        self._history: dict[str, list[int]] = {}
        self._draft: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._budget: dict[str, int] = {}  # tokens worth drafting ahead, from the head's plan (`add`)

    def start(self, req_id: str, prompt: Sequence[int]) -> None:
        self._history[req_id] = [int(t) for t in prompt]
        self._redraft(req_id)

    def add(self, req_id: str, ids: Sequence[int], want: int = -1) -> None:
        """Tokens of `req_id` came back from the head (ignored for a request not drafted here);
        `want`: the drafts the head plans for its steps (frames.Tokens.want; -1: none planned).
        A draft model drafts at most 2·want + 1 ahead (a step's drafts, and the next step's if
        the step in flight accepts them all; without `ahead` the step's want alone), none when
        the head plans none: on a machine the ring computes on too, a draft nobody verifies
        costs the ring its cores."""
        h = self._history.get(req_id)
        if h is None or not ids:
            return
        reach = 2 * want + 1 if self.ahead else want
        self._budget[req_id] = self.length if want < 0 else min(self.length, reach if want else 0)
        h.extend(int(t) for t in ids)
        self._redraft(req_id)

    def draft(self, req_id: str) -> tuple[int, tuple[int, ...]] | None:
        """(base, tokens): the latest draft of `req_id`, None when there is none."""
        return self._draft.get(req_id)

    def end(self, req_id: str) -> None:
        self._history.pop(req_id, None)
        self._draft.pop(req_id, None)
        self._budget.pop(req_id, None)

    def clear(self) -> None:
        self._history.clear()
        self._draft.clear()
        self._budget.clear()

    def __len__(self) -> int:
        return len(self._history)

    def wanted(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
        """For a draft model: (req_id, history, kept, n) of every request whose draft is short:
        `kept` the tokens of its latest draft still continuing the history, `n` (1..CHUNK) more
        to draft after history + kept. Empty without a model."""
        out = []
        for req_id, h in self._history.items() if self.model else ():
            kept, budget = self._kept(req_id, h), self._budget.get(req_id, self.length)
            if len(kept) < budget:
                out.append((req_id, tuple(h), kept, min(CHUNK, budget - len(kept))))
        return out

    def put(self, req_id: str, history_len: int, tokens: Sequence[int]) -> bool:
        """A draft model's `tokens` continuing the first `history_len` tokens of `req_id`'s
        history; kept unless the request ended or a newer draft is kept already."""
        h = self._history.get(req_id)
        old = self._draft.get(req_id)
        if h is None or not tokens or history_len > len(h) or (old is not None and old[0] > history_len):
            return False
        self._draft[req_id] = (history_len, tuple(int(t) for t in tokens[: self.length]))
        return True

    def _kept(self, req_id: str, h: Sequence[int]) -> tuple[int, ...]:
        d = self._draft.get(req_id)
        if d is None:
            return ()
        base, tokens = d
        done = len(h) - base
        if done >= len(tokens) or tuple(h[base:]) != tokens[:done]:
            return ()
        return tokens[done:]

    def _redraft(self, req_id: str) -> None:
        if self.model:
            return  # the drafting task asks `wanted`
        h = self._history[req_id]
        tokens = ngram_draft(h, self.length)
        if tokens:  # else the older draft stays: the head checks whether it is still aligned
            self._draft[req_id] = (len(h), tokens)
