"""A draft model at the head: a small GGUF with the target's vocabulary proposes K tokens a trip.

Theory of operation. The drafter runs a one-stage chain of the draft model (kafila.engine.chain) on the
head's worker thread and keeps, per request, a cursor and the tokens whose KV is live in it. To
propose k tokens after a request's history: the longest common prefix of the live tokens and the
history stays; what follows it (the drafts the ring rejected) is masked out — the same
mask-based rewind the ring's stages use, so no state is rebuilt — the rest of the history is fed
as one step, and each greedy draft is fed in turn to get the next (k forwards; the last draft is
never fed: verifying it is the ring's job). When masked positions would take the cursor past
its bound, the request's cursor is rebuilt from its history (the masked positions reclaimed).

Drafting ahead. While a verifying step is out round the ring, the head's compute thread is idle
(one request in flight): the driver (head_driver.py) has the drafter go on from the drafts it
sent, one token at a time, as if the ring accepted them all: the first token guesses the target's
own token after them, the rest continue it. When the step comes back with every draft accepted
and that token, the next step's drafts are ready (`ahead_drafts`); else they are masked out as
any rejected draft is.

Slots are opened and closed on the worker thread only: `release` (called from the event loop
when a request ends) just queues the request, and the next `propose` or `close` frees it.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends import DEFAULT_KQUANT
from backends.errors import BadInput
from backends.gguf import ModelIndex, open_model
from backends.gguf.hybrid import has_mtp
from kafila.models.tokenizer import Tokenizer, load_tokenizer


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """Drafts are token ids of the target: the two vocabularies must be the same tokens."""
    if draft.tokens != target.tokens:
        n, m = len(draft.tokens), len(target.tokens)
        where = next((i for i, (a, b) in enumerate(zip(draft.tokens, target.tokens)) if a != b), min(n, m))
        raise BadInput(f"--draft {draft_name}: its vocabulary is not the model's ({n} tokens vs {m}, "
                       f"first different at id {where}): choose a draft model of the same family")  # fmt: skip


def open_draft(path: str, target: ModelIndex) -> ModelIndex:
    """The draft model's index, refused with one line when it cannot draft for `target`."""
    draft = open_model(path)  # missing, not GGUF, unsupported: one line already
    if draft.hparams.hybrid is not None:  # its chain rewinds by masking, which a recurrent state ignores
        raise BadInput(f"draft model {path}: a hybrid (recurrent) model cannot draft yet; choose a "
                       "transformer draft model of the same vocabulary")
    check_same_vocabulary(load_tokenizer(target), load_tokenizer(draft), path)
    return draft


def check_drafting(speculate: str, draft_path: str | None, target: ModelIndex) -> None:
    """What `kafila host` and `kafila demo` check before anything starts (one line, exit 2): a
    draft model for --speculate draft, of the target's vocabulary; a multi-token-prediction layer
    in the model for --speculate mtp."""
    if speculate == "draft" and not draft_path:
        raise BadInput("--speculate draft needs --draft GGUF (a small model of the same vocabulary)")
    if speculate == "mtp" and not has_mtp(target):
        raise BadInput(f"--speculate mtp: {target.name} has no multi-token-prediction (nextn) layer; use "
                       "--speculate ngram, or draft with --draft GGUF")
    if draft_path:
        open_draft(draft_path, target)


class _State:
    def __init__(self, cursor) -> None:
        self.cursor = cursor
        self.live: list[int] = []  # the tokens whose KV is live in the cursor, in order


class ModelDrafter:
    """Greedy drafts from a draft model's chain (kafila.engine.chain.LocalChain of one stage)."""

    def __init__(self, chain, max_positions: int) -> None:
        self.chain = chain
        self.max_positions = max_positions  # physical positions a cursor may hold
        self._states: dict[str, _State] = {}
        self._released: list[str] = []

    @classmethod
    def build(cls, index: ModelIndex, backend: str, precision: str, context: int,
              kquant: str = DEFAULT_KQUANT) -> ModelDrafter:
        from kafila.engine.chain import LocalChain

        chain = LocalChain.build(index.path, 1, backend, precision, index=index, kquant=kquant)
        # a request's history fills at most `context`; the rest of the bound is for rejected drafts
        return cls(chain, max_positions=min(2 * context, index.hparams.context_length + context))

    def propose(self, req_id: str, history: Sequence[int], k: int) -> tuple[int, ...]:
        self._free_released()
        if k < 1 or not history:
            return ()
        history = [int(t) for t in history]
        st = self._states.get(req_id)
        if st is None:
            st = self._states[req_id] = _State(self.chain.open())
        keep = common_prefix(st.live, history)
        if keep == len(history):
            keep -= 1  # the last token must be fed again to get its successor
        if st.cursor.cache_len + (len(history) - keep) + k > self.max_positions:
            self.chain.close(st.cursor)  # reclaim the masked positions: rebuild from the history
            st.cursor, st.live, keep = self.chain.open(), [], 0
        self.chain.rewind(st.cursor, len(st.live) - keep)
        del st.live[keep:]
        hidden = self.chain.feed(st.cursor, history[keep:])
        st.live += history[keep:]
        drafts = [self.chain.next_token(hidden)]
        while len(drafts) < k:
            hidden = self.chain.feed(st.cursor, drafts[-1:])
            st.live.append(drafts[-1])
            drafts.append(self.chain.next_token(hidden))
        return tuple(drafts)

    def release(self, req_id: str) -> None:
        """`req_id` ended (any thread): its cursor is freed on the worker at the next call."""
        self._released.append(req_id)

    def _free_released(self) -> None:
        while self._released:
            st = self._states.pop(self._released.pop(), None)
            if st is not None:
                self.chain.close(st.cursor)

    def close(self) -> None:
        self._free_released()
        for st in self._states.values():
            self.chain.close(st.cursor)
        self._states.clear()


def ahead_drafts(base: Sequence[int], ahead: Sequence[int], history: Sequence[int]) -> tuple[int, ...]:
    """The drafts made ahead that still hold. `ahead` continues `base` (a request's history with
    the drafts its verifying step sent), its first token a guess at the target's token after
    them; the rest hold when the ring accepted every draft and gave that token, i.e. `history`
    is now `base` and that token. () otherwise."""
    n = len(base)
    if len(ahead) < 2 or len(history) != n + 1 or history[n] != ahead[0] or tuple(history[:n]) != tuple(base):
        return ()
    return tuple(int(t) for t in ahead[1:])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
