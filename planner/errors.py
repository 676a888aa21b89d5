"""The one error the planner raises: its input cannot be planned at all.

A fleet that is well formed but does not fit is not an error; it is a plan with
`feasible=False` and a `refused` list. `PlanInputError` is for input that is malformed
(missing fields, non-positive bandwidth or memory, no devices, more devices than blocks).
Its message is one line that says what is wrong and where.
"""

from __future__ import annotations

__all__ = ["PlanInputError"]


class PlanInputError(ValueError):
    """A fleet description that cannot be planned; the message is one line."""
