"""The lifecycle cores' events (what a driver saw) and actions (what it is to do): frozen data.

See kafila.session.control.lifecycle, which re-exports them."""

from __future__ import annotations

from dataclasses import dataclass

from kafila.session.control import messages as c
from planner import Plan

# --- events: what the driver saw ------------------------------------------------------------------


@dataclass(frozen=True)
class Joined:  # This member is in the session of `host`; it waits for the plan.
    host: str


@dataclass(frozen=True)
class Step:  # A step of forming or loading began (FORMING_STEPS, LOADING_STEPS).
    name: str


@dataclass(frozen=True)
class Received:  # A control message from `sender`.
    sender: str
    msg: c.ControlMessage


@dataclass(frozen=True)
class Prepared:  # This process's stage of plan `epoch` is ready (error None) or could not be prepared.
    epoch: int
    error: str | None = None
    blame: tuple[str, ...] = ()  # the members the error concerns (a ring edge to one that never came up)


@dataclass(frozen=True)
class Malformed:  # `sender` sent a body that is no control message (`kind`: its "t", when text).
    sender: str
    reason: str
    kind: str | None = None


@dataclass(frozen=True)
class MemberLeft:
    name: str
    reason: str
    dropped: bool = False  # a member's: the host (or the rendezvous for it) removed this member


@dataclass(frozen=True)
class MemberJoined:
    name: str


@dataclass(frozen=True)
class RingBroke:  # A ring of plan `epoch` broke at `member` (this process's own ring, or as a member said).
    member: str
    reason: str
    epoch: int


@dataclass(frozen=True)
class PlanMade:  # host: plan `epoch` among the roster (`reason` None: the first plan).
    epoch: int
    plan: Plan
    reason: str | None = None


@dataclass(frozen=True)
class EnterPressed:
    """host: Enter at its terminal while serving (replan with the joiners)."""


@dataclass(frozen=True)
class Tick:
    """Time passed: deadlines (core.timer()) may have come."""


# --- actions: what the driver does ---------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    to: str
    msg: c.ControlMessage


@dataclass(frozen=True)
class SendAll:  # To every member in the roster but this one.
    msg: c.ControlMessage


@dataclass(frozen=True)
class Say:
    text: str


@dataclass(frozen=True)
class Record:  # A lifecycle event (participant.event: history, --json-events).
    kind: str
    fields: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class Prepare:  # Start preparing this stage for the plan (a running preparation is cancelled first).
    msg: c.PlanMessage


@dataclass(frozen=True)
class ServePlan:
    first: bool  # the first plan: the API starts serving; else the new ring takes over


@dataclass(frozen=True)
class DegradeNode:
    reason: str


@dataclass(frozen=True)
class EndEngine:  # Requests waiting at this member's API fail now.
    reason: str


@dataclass(frozen=True)
class Apply:  # Take a report into this process's status (status from the host, an edge report).
    sender: str
    msg: c.ControlMessage


@dataclass(frozen=True)
class Abort:  # The session is over for this process: raise Refused(reason) (after `linger_s`).
    reason: str
    linger_s: float = 0.0


@dataclass(frozen=True)
class Finish:  # The session is over; the lifecycle returns 0 (after `linger_s`).
    linger_s: float = 0.0


@dataclass(frozen=True)
class Replan:  # host: plan again among whoever is present, for `reason`.
    reason: str


@dataclass(frozen=True)
class Drop:  # host: remove `member` from the session (it hears why); the next plan goes without it.
    member: str
    reason: str


@dataclass(frozen=True)
class Formed:  # host: every member of plan `epoch` is ready (the driver says serving to them).
    epoch: int


Action = (Send | SendAll | Say | Record | Prepare | ServePlan | DegradeNode | EndEngine | Apply | Abort
          | Finish | Replan | Drop | Formed)  # fmt: skip


__all__ = [
    "Abort", "Action", "Apply", "DegradeNode", "Drop", "EndEngine", "EnterPressed", "Finish", "Formed", "Joined",
    "Malformed", "MemberJoined", "MemberLeft", "PlanMade", "Prepare", "Prepared", "Received", "Record", "Replan",
    "RingBroke", "Say", "Send", "SendAll", "ServePlan", "Step", "Tick",
]  # fmt: skip
