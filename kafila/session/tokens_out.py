"""Tokens on their way to the member a request was typed at, a few at a time (sans-I/O; the head's).

Why. Every token frame for another member wakes each member on its way there, and the origin's
API then writes to its client: on a machine whose cores the members share, that work runs while
a stage computes and slows it (a 3-member loopback session of the default model spent longer in
a frame's write, waiting for the cores, than the frame takes to compute). A person reading a
stream does not see tokens that arrive 40 ms apart in twos or threes rather than one by one, so
the head sends a request's tokens at most every STREAM_INTERVAL_S: its first token at once (time
to first token is unchanged), then what has gathered when the interval has passed, and the rest
with the frame that ends the request. Tokens for the head's own member are delivered at once
(nothing to wake), and so is everything when the origin drafts from them (--speculate origin:
a draft needs the latest token). vLLM's `--stream-interval` does the same for its clients.
"""

from __future__ import annotations

from kafila.session.frames import MAX_TOKENS_PER_FRAME, Tokens

STREAM_INTERVAL_S = 0.04
MAX_STREAM_INTERVAL_MS = 1000  # kafila host --stream-interval-ms: 0 (every token at once) .. this


class TokenBatches:
    """Each request's tokens held for its origin since its last frame."""

    def __init__(self, interval_s: float = STREAM_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._held: dict[str, tuple[str, list[int], float]] = {}  # req_id → (origin, ids, last frame at)

    def add(self, req_id: str, origin: str, token: int, now: float) -> Tokens | None:
        """A frame to send now with `token` (and those held before it), or None: held."""
        held = self._held.get(req_id)
        if held is None or self.interval_s <= 0:  # the first token leaves at once
            self._held[req_id] = (origin, [], now)
            return Tokens(req_id, origin, (token,))
        ids = held[1]
        ids.append(token)
        if now - held[2] >= self.interval_s or len(ids) >= MAX_TOKENS_PER_FRAME:
            self._held[req_id] = (origin, [], now)
            return Tokens(req_id, origin, tuple(ids))
        return None

    def due(self, now: float) -> list[Tokens]:
        """Frames for the tokens held past the interval (requests whose next step is late)."""
        out = []
        for req_id, (origin, ids, at) in self._held.items():
            if ids and now - at >= self.interval_s:
                out.append(Tokens(req_id, origin, tuple(ids)))
                self._held[req_id] = (origin, [], now)
        return out

    def end(self, req_id: str) -> tuple[int, ...]:
        """The request is over: the tokens still held (they go with its last frame)."""
        held = self._held.pop(req_id, None)
        return tuple(held[1]) if held is not None else ()

    def __len__(self) -> int:
        return len(self._held)
