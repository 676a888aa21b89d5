"""Stop sequences on streamed text: emit what cannot be the start of a stop, hold back the rest."""

from __future__ import annotations


class StopScanner:
    """Feed text pieces in order; get back the text safe to show and whether a stop was reached.

    Text that might be the beginning of a stop sequence is held back until the next piece shows
    whether it is one; `flush()` releases it when generation ends without a stop.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        buffer = self.held + piece
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.held = True, ""
            return buffer[:cut]
        keep = partial_suffix(buffer, self.stops)
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `markers`
    (held back: the marker may follow). Stop sequences here; tool-call and thinking tags too."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
