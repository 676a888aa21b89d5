"""How many requests a session serves at once (its KV slots) and how many may wait for one.

`kafila host --concurrency auto` (the default) gives the session as many slots as the plan's
memory leaves room for: the planner divides the blocks as it would for one request (the fastest
division; more slots never change which member is the bottleneck), then every member's memory
beyond its blocks' weights is counted in KV slots at the session's context
(planner.slots_that_fit), the fewest of any member taken, at most AUTO_MAX_SLOTS. A small model
on a big machine gets many slots; a member that is nearly full limits everyone (every active
request holds one slot on every stage). An explicit number is planned as before: admission checks
the memory for that many.
"""

from __future__ import annotations

from backends.errors import BadInput

AUTO = "auto"
AUTO_MAX_SLOTS = 32  # auto's bound: past this, a ring of home machines is compute-bound anyway
MAX_SLOTS = 64  # the most an explicit --concurrency may ask for (frames.Limits bounds slot ids)
DEFAULT_MAX_QUEUED = 64  # requests that may wait for a slot; one more is answered 429
MAX_QUEUED_LIMIT = 4096


def parse_concurrency(text: str | int | None) -> int | None:
    """`--concurrency` → a slot count, or None for auto (BadInput, one line, otherwise)."""
    if text is None or (isinstance(text, str) and text.strip().lower() == AUTO):
        return None
    value = _integer(text)
    if value is None or not 1 <= value <= MAX_SLOTS:
        raise BadInput(f"--concurrency {text}: give the requests served at once, 1..{MAX_SLOTS}, or "
                       f"{AUTO} (as many as the members' memory holds, at most {AUTO_MAX_SLOTS})")  # fmt: skip
    return value


def parse_max_queued(text: str | int) -> int:
    """`--max-queued` → the requests that may wait for a slot (BadInput, one line, otherwise)."""
    value = _integer(text)
    if value is None or not 0 <= value <= MAX_QUEUED_LIMIT:
        raise BadInput(f"--max-queued {text}: give the requests that may wait for a slot, "
                       f"0..{MAX_QUEUED_LIMIT} (beyond them a request is answered 429)")  # fmt: skip
    return value


def _integer(text: str | int) -> int | None:
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return text
    text = str(text).strip()
    if not text.lstrip("+-").isdigit() or len(text) > 12:
        return None
    return int(text)


def auto_slots(fleet: dict, plan: dict) -> int:
    """The slots `plan` (planned for `fleet` at concurrency 1) leaves memory for, 1..AUTO_MAX_SLOTS."""
    from planner import parse_fleet, slots_that_fit

    parsed = parse_fleet(fleet)
    return max(1, slots_that_fit(parsed, plan["blocks"], plan["head"], AUTO_MAX_SLOTS))


def session_value(session: dict, key: str, default: int, low: int, high: int) -> int:
    """An integer the host sent in the session (from a host of before `key`: `default`)."""
    value = session.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return default
    return value
