"""The frame codec's errors, its Limits and its checks of a decoded header's fields (used by frames.py).

FrameError is the peer's (a RemoteProtocolError: close its edge, name it); EncodeError is ours
(a LocalProtocolError: a frame we cannot send). Each check returns the field or raises FrameError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rendezvous.errors import LocalProtocolError, RemoteProtocolError

MAX_NAME_CHARS = 64
MAX_TRACE_ENTRIES = 64
MAX_HOPS = 255  # the wire's bound on a routed frame's hops; the ring's own is len(ring) + 1
MAX_ORIGIN_DRAFT = 65  # an origin's draft on an activation: 2 × speculate.MAX_DRAFT_K + 1 tokens
MAX_DRAFT_US = 10_000_000  # an origin draft model's cost per token (µs) an activation may carry
MAX_FRAME_BYTES = 16 << 20  # payload: 16 MiB bounds a prefill of 4096 positions × hidden 1024


@dataclass(frozen=True)
class Limits:
    """What the session's plan and model allow on the wire."""

    hidden: int  # an activation row's width: float32 [n, hidden] (hparams.carried: the hidden size, or Gemma 4's carried row)
    context: int  # the most physical positions one slot may hold
    slots: int  # ring slot ids are 0..slots-1 (the session's concurrency)
    vocab: int  # token ids are 0..vocab-1
    # the largest activation payload one frame may carry on this ring: MAX_FRAME_BYTES in every
    # session; a test lowers it (on every node alike) to make a short prompt need several chunks
    frame_bytes: int = MAX_FRAME_BYTES

    def __post_init__(self) -> None:
        if not 0 < int(self.frame_bytes) <= MAX_FRAME_BYTES:
            raise ValueError(f"Limits.frame_bytes must be in 1..{MAX_FRAME_BYTES}")
        for name in ("hidden", "context", "slots", "vocab"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Limits.{name} must be >= 1")


class FrameError(RemoteProtocolError):
    """A malformed or out-of-bounds frame from the peer: the edge that carried it is closed with
    this reason (str() is the reason alone, as it always was)."""

    def __init__(self, reason: str, code: str = "malformed") -> None:
        super().__init__(code, reason)

    def __str__(self) -> str:
        return self.reason


class EncodeError(LocalProtocolError):
    """A frame of ours over a bound (h11's LocalProtocolError): nothing was written, the edge
    stays up, and only the request that made the frame fails. Not a FrameError: it must never be
    reported as the neighbour's malformed frame."""

    def __init__(self, reason: str, code: str = "too-large") -> None:
        super().__init__(code, reason)

    def __str__(self) -> str:
        return self.reason


KEY_RE = re.compile(r"[0-9a-f]{64}")


def check_str(h: dict, key: str, limit: int = MAX_NAME_CHARS, empty: bool = False) -> str:
    v = h.get(key)
    if not isinstance(v, str) or len(v) > limit or (not v and not empty):
        raise FrameError(f"field {key!r} must be a string of 1..{limit} characters")
    return v


def check_int(h: dict, key: str, lo: int, hi: int) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FrameError(f"field {key!r} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def check_float(h: dict, key: str, lo: float, hi: float) -> float:
    v = h.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise FrameError(f"field {key!r} must be a number in {lo}..{hi}, got {v!r}")
    return float(v)


def check_bool(h: dict, key: str) -> bool:
    v = h.get(key)
    if not isinstance(v, bool):
        raise FrameError(f"field {key!r} must be a boolean")
    return v


def check_pairs(h: dict, key: str, types) -> None:
    v = h.get(key, [])
    if not isinstance(v, list) or len(v) > MAX_TRACE_ENTRIES or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and len(p[0]) <= MAX_NAME_CHARS
        and isinstance(p[1], types) and not isinstance(p[1], bool)
        for p in v
    ):
        raise FrameError(f"field {key!r} must be a short list of [name, number] pairs")


def check_hops(h: dict) -> int:
    """A routed frame's hop count (absent: 0, as a peer from before hops sends it)."""
    return check_int(h, "hops", 0, MAX_HOPS) if "hops" in h else 0


def check_shape(h: dict, dtype: str, dims: int) -> tuple[int, ...]:
    if h.get("dtype") != dtype:
        raise FrameError(f"dtype must be {dtype}, got {h.get('dtype')!r}")
    s = h.get("shape")
    if not isinstance(s, list) or len(s) != dims or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s
    ):
        raise FrameError(f"shape must be a list of {dims} non-negative integers, got {s!r}")
    return tuple(s)


def check_draft(h: dict, vocab: int, context: int) -> None:
    """An activation's origin draft: 1..MAX_ORIGIN_DRAFT ids in the vocabulary after `dbase`,
    a history length inside the context (kafila/session/ring/speculation/origin.py); both fields or neither."""
    d = h.get("draft")
    if not isinstance(d, list) or not 1 <= len(d) <= MAX_ORIGIN_DRAFT or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in d
    ):
        raise FrameError(f"an origin draft must be 1..{MAX_ORIGIN_DRAFT} token ids inside the vocabulary")
    check_int(h, "dbase", 1, context)
    if "dus" in h:
        check_int(h, "dus", 0, MAX_DRAFT_US)
