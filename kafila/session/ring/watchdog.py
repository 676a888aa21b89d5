"""The ring's watchdog bounds: how long a step may compute on one stage before it counts as hung.

Apart from the ring node so that the head's driver (head_driver.py) and tests share them."""

from __future__ import annotations

# The watchdog: a stage whose compute has not finished one step of up to HANG_ROWS positions in
# STAGE_HANG_S hangs; a step that has not come back round the ring in twice its bound is lost (a
# member frozen whole: its own watchdog cannot fire). A longer step (a prefill chunk: 512
# positions at hidden 4096) computes for proportionally longer, so its bound grows with the
# positions it feeds: the 8B shape's chunk takes minutes on a slow CPU (issue 10), not a hang.
STAGE_HANG_S = 120.0
HANG_ROWS = 32


def hang_bound_s(stage_hang_s: float, rows: int) -> float:
    """The watchdog's bound on one step of `rows` positions on one stage (a trip: twice it)."""
    return stage_hang_s * max(1.0, rows / HANG_ROWS)


class StageHung(Exception):
    """This member's stage did not finish a step within its bound."""
