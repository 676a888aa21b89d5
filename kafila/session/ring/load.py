"""Who is being served, where: the `load` part of GET /status, and its checks on the way.

Each member knows its own stage's load (requests holding a KV slot there, rows in its last
forward); only the head knows the queue and each request's progress. A member reports both to
the host with its edge statistics, and the host passes every stage's figures on in its status
message, so every member's /status shows the whole ring (others' figures are up to about two
STATUS_EVERY_S old; a member's own stage, and the head's queue at the head, are live).

What arrives from another member is validated here before it is kept: known keys only, bounded
integers and strings, at most MAX_REPORTED_REQUESTS requests.
"""

from __future__ import annotations

import math

from kafila.session.ring.slots import MAX_QUEUED_LIMIT, MAX_SLOTS

MAX_REPORTED_REQUESTS = 64  # requests listed in one status (the oldest first)
MAX_NAME_CHARS = 64
MAX_ID_CHARS = 96
MAX_COUNT = 1 << 40  # forwards a stage has run, tokens of a request: far beyond any session
REQUEST_STATES = ("queued", "prefill", "decode")
MAX_MS = 1e7  # a fitted batch cost: far beyond any step


def _count(value, high: int = MAX_COUNT) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        return None
    return value


def _text(value, most: int) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= most else None


def clean_stage(raw) -> dict | None:
    """A stage's {"active", "batch_rows", "steps"} as a member reported it (None: not valid)."""
    if not isinstance(raw, dict):
        return None
    out = {"active": _count(raw.get("active"), MAX_SLOTS), "batch_rows": _count(raw.get("batch_rows"), MAX_SLOTS),
           "steps": _count(raw.get("steps"))}  # fmt: skip
    return None if any(v is None for v in out.values()) else out


def clean_request(raw) -> dict | None:
    if not isinstance(raw, dict):
        return None
    tok_s = raw.get("tok_s")
    if tok_s is not None and (isinstance(tok_s, bool) or not isinstance(tok_s, (int, float))
                              or not math.isfinite(tok_s) or tok_s < 0):  # fmt: skip
        return None
    out = {"id": _text(raw.get("id"), MAX_ID_CHARS), "origin": _text(raw.get("origin"), MAX_NAME_CHARS),
           "state": raw.get("state") if raw.get("state") in REQUEST_STATES else None,
           "prompt_tokens": _count(raw.get("prompt_tokens")), "tokens": _count(raw.get("tokens")),
           "max_tokens": _count(raw.get("max_tokens"))}  # fmt: skip
    if any(v is None for v in out.values()):
        return None
    return {**out, "tok_s": None if tok_s is None else float(tok_s)}


def clean_head(raw) -> dict | None:
    """The head's {"slots", "active", "queued", "max_queued", "parked", "requests",
    "micro_batches", "batching"} (None: not valid)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("requests"), list):
        return None
    out = {"slots": _count(raw.get("slots"), MAX_SLOTS), "active": _count(raw.get("active"), MAX_SLOTS),
           "queued": _count(raw.get("queued"), MAX_QUEUED_LIMIT),
           "max_queued": _count(raw.get("max_queued"), MAX_QUEUED_LIMIT)}  # fmt: skip
    if any(v is None for v in out.values()) or not out["slots"]:
        return None
    requests = [clean_request(r) for r in raw["requests"][:MAX_REPORTED_REQUESTS]]
    batches = raw.get("micro_batches")
    batches = [b for b in batches[:MAX_SLOTS] if _count(b, MAX_SLOTS)] if isinstance(batches, list) else []
    parked = _count(raw.get("parked", 0), MAX_SLOTS)  # slots keeping a finished request's KV (prefix.py)
    return {**out, "parked": parked or 0, "requests": [r for r in requests if r is not None], "micro_batches": batches,
            "batching": clean_batching(raw.get("batching"))}  # fmt: skip


def clean_batching(raw) -> dict | None:
    """The head's {"groups", "c_ms"?, "beta_ms"?} (HeadCore._batching; None: absent or not valid)."""
    if not isinstance(raw, dict) or not _count(raw.get("groups"), MAX_SLOTS):
        return None
    out = {"groups": raw["groups"]}
    for key in ("c_ms", "beta_ms"):
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= MAX_MS:
            return None
        out[key] = float(v)
    return out


def ring_load(ring: list[str], me: str, own: dict | None, reported: dict, head: dict | None) -> dict:
    """The /status `load`: per stage (in ring order) its active requests and last batch rows,
    and the head's queue and requests in flight. `own`: this member's stage, live; `reported`:
    the other stages' last figures (name → clean_stage); `head`: the head's (clean_head)."""
    stages = {n: (own if n == me and own is not None else reported.get(n)) for n in ring}
    head = head or {}
    return {"slots": head.get("slots"), "active": head.get("active"), "queued": head.get("queued"),
            "max_queued": head.get("max_queued"), "parked": head.get("parked"), "stages": stages,
            "micro_batches": list(head.get("micro_batches") or []),  # requests in each, batched rows on
            "batching": head.get("batching"),  # how many the head keeps in flight, and its cost fit
            "requests": list(head.get("requests") or [])}  # fmt: skip
