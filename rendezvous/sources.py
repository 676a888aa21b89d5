"""Per-address bookkeeping for the registry: joins to nameplates that do not exist (a scanner is
slowed to UNKNOWN_JOINS_PER_S and named in the log), and refusals counted to tell the host.

Sans-I/O: the registry passes `now`; reports are text for a log line or a Notice, at most one per
NOTICE_INTERVAL_S, each with counts, so no flood of joins becomes a flood of lines.
"""

from __future__ import annotations

import collections

from rendezvous.limits import MAX_TRACKED_SOURCES, NOTICE_INTERVAL_S, UNKNOWN_JOIN_BURST, UNKNOWN_JOINS_PER_S
from rendezvous.relay import TokenBucket

REPORTED_SOURCES_MAX = 3  # addresses named in one report (the most frequent); the rest are counted


class SourceCounts:
    """Events per address since the last report; `report` at most once per NOTICE_INTERVAL_S."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._next_report = 0.0

    def add(self, source: str) -> None:
        if source in self.counts or len(self.counts) < MAX_TRACKED_SOURCES:
            self.counts[source or "?"] += 1

    def report(self, now: float, template: str) -> str | None:
        """One line ("12 joins refused from 10.0.0.9 ..."), or None (nothing, or too soon)."""
        if not self.counts or now < self._next_report:
            return None
        self._next_report = now + NOTICE_INTERVAL_S
        top = self.counts.most_common(REPORTED_SOURCES_MAX)
        parts = [f"{n} {template.format(source=source)}" for source, n in top]
        rest = sum(self.counts.values()) - sum(n for _, n in top)
        self.counts.clear()
        return "; ".join(parts) + (f"; {rest} more from other addresses" if rest else "")


class UnknownJoins:
    """Joins to nameplates that do not exist, per address: a burst, then a slow rate."""

    def __init__(self) -> None:
        self._buckets: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()
        self._seen = SourceCounts()
        self.refused = 0  # joins refused because their address had no allowance left

    def allowed(self, source: str, now: float) -> bool:
        """Whether a join from `source` may be looked at (False: it scanned too much)."""
        bucket = self._buckets.get(source)
        if bucket is None or bucket.peek(now) >= 1.0:
            return True
        self.refused += 1
        self._seen.add(source)
        return False

    def miss(self, source: str, now: float) -> None:
        """A join from `source` named a nameplate that does not exist (or is closed)."""
        bucket = self._buckets.pop(source, None)
        if bucket is None:
            if len(self._buckets) >= MAX_TRACKED_SOURCES:
                self._buckets.popitem(last=False)
            bucket = TokenBucket(UNKNOWN_JOINS_PER_S, UNKNOWN_JOIN_BURST)
        self._buckets[source] = bucket
        bucket.take(1, now)
        self._seen.add(source)

    def report(self, now: float) -> str | None:
        return self._seen.report(now, "joins to nameplates that do not exist (or refused for scanning) "
                                      f"from {{source}}; each address is slowed to one per "
                                      f"{1 / UNKNOWN_JOINS_PER_S:g} s")  # fmt: skip
