"""Sans-I/O bound on replans: a member that keeps coming and going (a flaky Wi-Fi link, a laptop
lid opened and shut) must not keep the whole ring replanning. Up to `burst` replans within
`window_s` go at once; past that each waits, 1 s, then 2, 4, … up to `max_wait_s`, so requests in
flight resume on a ring that had time to settle (they wait at their origin meanwhile).

    delay(now)   seconds to wait before the replan about to start
    record(now)  a replan started
"""

from __future__ import annotations

import collections

REPLAN_BURST = 5
REPLAN_WINDOW_S = 60.0
REPLAN_MAX_WAIT_S = 30.0


class ReplanPacer:
    def __init__(self, burst: int = REPLAN_BURST, window_s: float = REPLAN_WINDOW_S,
                 max_wait_s: float = REPLAN_MAX_WAIT_S) -> None:  # fmt: skip
        self.burst, self.window_s, self.max_wait_s = max(1, burst), window_s, max_wait_s
        self._started: collections.deque[float] = collections.deque()

    def delay(self, now: float) -> float:
        while self._started and now - self._started[0] > self.window_s:
            self._started.popleft()
        over = len(self._started) - self.burst + 1
        return 0.0 if over <= 0 else min(self.max_wait_s, 2.0 ** (over - 1))

    def record(self, now: float) -> None:
        self._started.append(now)

    @property
    def recent(self) -> int:
        return len(self._started)
