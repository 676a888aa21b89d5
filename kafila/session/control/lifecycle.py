"""The session lifecycle as two sans-I/O machines: `MemberCore` (a member: wait for the plan,
prepare, say ready, serve, follow replans) and `HostCore` (the host: plan, wait for every ring
member, serve, decide when to replan or give up).

Theory of operation. A driver (kafila.session.control.participant / host) owns the sockets, the tasks
and the clock; it feeds what happened as an event with the current time, `core.on(event, now)`,
and carries out the actions it gets back, in order (events and actions: lifecycle_events.py).
The cores never wait, sleep or send: they keep the phase, the plan generation (epoch), who is
ready and the deadlines (`HostCore.timer()`), and decide.

Phases (`Phase`; `TRANSITIONS` below is the whole table; `status_name` is what /status says):

    FORMING ─plan─▶ PLANNED ─step─▶ LOADING ─serving─▶ SERVING ─plan─▶ REPLANNING
                                                        │   ▲              │  ▲
                                             ring broke ▼   └── serving ───┘  │
                                                     DEGRADED ──── plan ──────┘
    any phase ── refused / the host left / a stage failed / no fit ──▶ ENDED

A newer plan replaces the one being prepared in any phase but ENDED; messages of an older plan
are ignored. Members are inputs: at the host, a member that cannot prepare its stage, is not
ready in time, leaves while a plan forms, or sends what only the host sends (or what is no
message) is dropped (`Drop`, named with the reason) and the rest are planned again; the host
ends the session only when its own stage fails or what is left cannot hold the model.
"""

from __future__ import annotations

from enum import Enum

from kafila.session.control import messages as c
from kafila.session.control.lifecycle_events import (  # noqa: F401 (re-exported)
    Joined,
    Step,
    Received,
    Prepared,
    Malformed,
    MemberLeft,
    MemberJoined,
    RingBroke,
    PlanMade,
    EnterPressed,
    Tick,
    Send,
    SendAll,
    Say,
    Record,
    Prepare,
    ServePlan,
    DegradeNode,
    EndEngine,
    Apply,
    Abort,
    Finish,
    Replan,
    Drop,
    Formed,
    Action,
)

BREAK_GRACE_S = 1.0  # a reported ring break waits this long for the rendezvous to say who left
READY_TIMEOUT_S = 900.0  # weights over a slow link and a shard build


class Phase(str, Enum):
    FORMING = "forming"  # joining, waiting for members or the plan (host: hashing)
    PLANNED = "planned"  # a plan is known; preparing has not started a step yet
    LOADING = "loading"  # fetching weights, building the shard, forming the ring
    SERVING = "serving"
    DEGRADED = "degraded"  # the ring broke; a replan is coming or the session is over
    REPLANNING = "replanning"  # a newer plan replaces the serving one
    ENDED = "ended"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.FORMING: frozenset({Phase.PLANNED, Phase.DEGRADED, Phase.ENDED}),
    Phase.PLANNED: frozenset({Phase.LOADING, Phase.PLANNED, Phase.SERVING, Phase.DEGRADED, Phase.ENDED}),
    Phase.LOADING: frozenset({Phase.PLANNED, Phase.SERVING, Phase.DEGRADED, Phase.ENDED}),
    Phase.SERVING: frozenset({Phase.REPLANNING, Phase.DEGRADED, Phase.ENDED}),
    Phase.DEGRADED: frozenset({Phase.PLANNED, Phase.REPLANNING, Phase.SERVING, Phase.ENDED}),
    Phase.REPLANNING: frozenset({Phase.LOADING, Phase.REPLANNING, Phase.SERVING, Phase.DEGRADED, Phase.ENDED}),
    Phase.ENDED: frozenset(),
}
FORMING_STEPS = ("joining", "waiting", "hashing")
LOADING_STEPS = ("fetching", "building", "ring")


class SessionCore:
    """The phase and plan generation both sides keep, and the transitions between phases."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.phase = Phase.FORMING
        self.step = "joining"  # the forming or loading step /status shows
        self.epoch = 0  # the plan generation being prepared or served (0: none yet)
        self.served = False  # a plan has served (the API is up)
        self.degraded: str | None = None

    def go(self, phase: Phase) -> None:
        if phase is not self.phase and phase not in TRANSITIONS[self.phase]:
            raise AssertionError(f"session lifecycle: {self.phase.value} → {phase.value} is not a transition")
        self.phase = phase

    @property
    def status_name(self) -> str:
        """The phase as /status shows it: joining | waiting | hashing | planned | fetching |
        building | ring | serving | degraded."""
        replanning = self.phase is Phase.REPLANNING
        if self.phase in (Phase.FORMING, Phase.LOADING) or (replanning and self.step in LOADING_STEPS):
            return self.step
        if self.phase is Phase.REPLANNING:
            return "planned"
        if self.phase is Phase.ENDED:
            return "degraded"
        return self.phase.value

    def _step(self, name: str) -> list[Action]:
        if self.phase is Phase.ENDED:
            return []
        if name in FORMING_STEPS:
            if self.phase is Phase.FORMING:
                self.step = name
            return []
        self.step = name
        if self.phase in (Phase.PLANNED, Phase.LOADING):  # (degraded or replanning: it stays)
            self.go(Phase.LOADING)
        return []

    def _degrade(self, reason: str) -> list[Action]:
        out: list[Action] = []
        if self.degraded is None:
            self.degraded = reason
            if self.phase is not Phase.ENDED:
                self.go(Phase.DEGRADED)
            out += [Say(f"[red]{self.name}: session degraded: {reason}[/red]"),
                    Record("degraded", (("reason", reason),))]  # fmt: skip
        return out + [DegradeNode(reason)]

    def _serve(self) -> None:
        """Every member is ready: the ring serves (the first plan keeps a break it already saw)."""
        if self.served or self.degraded is None:
            self.degraded = None
            self.go(Phase.SERVING)
        else:
            self.go(Phase.DEGRADED)
        self.served = True

    def _end(self) -> None:
        self.phase = Phase.ENDED  # from anywhere


class MemberCore(SessionCore):
    """A member's side: wait for the plan, prepare, say ready, serve, follow replans."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.host = "host"
        self.ready_sent = False

    def on(self, event, now: float) -> list[Action]:
        if isinstance(event, Joined):
            self.host = event.host
            self.step = "waiting"
            return []
        if isinstance(event, Step):
            return self._step(event.name)
        if isinstance(event, Prepared):
            return self._prepared(event)
        if isinstance(event, MemberLeft):
            if event.name != self.host:
                return []
            return self._dropped(event.reason) if event.dropped else self._host_left(event.reason)
        if isinstance(event, RingBroke):
            return self._ring_broke(event)
        if isinstance(event, Received):
            return self._received(event.msg)
        if isinstance(event, Malformed):
            return self._malformed(event)
        return []

    def _dropped(self, reason: str) -> list[Action]:
        """The host removed this member (it failed, froze past the watchdog, or sent what it should
        not): never a member that answers 503 forever; it ends saying why."""
        if self.phase is Phase.ENDED:
            return []
        why = f"the host {self.host} dropped this member from the session ({reason[:300]})"
        self._end()
        return [EndEngine(why), Say(f"{self.name}: {why}"), Record("ended", (("reason", why),)),
                Abort(f"{why}: run kafila join again to come back", 0.2 if self.served else 0.0)]  # fmt: skip

    def _malformed(self, ev: Malformed) -> list[Action]:
        """A body from the host that is no control message: a plan this member cannot read ends it
        (it says so to the host and to its user: waiting for a plan that never comes helps nobody);
        anything else is dropped (the driver logs it)."""
        if ev.kind != "plan" or self.phase is Phase.ENDED:
            return []
        why = f"the host's plan cannot be read: {ev.reason[:300]}"
        self._end()
        return [Send(self.host, c.Failed(c.clip(why, 300), min(self.epoch + 1, c.MAX_EPOCH))), EndEngine(why),
                Abort(f"{why}; this member leaves the session")]  # fmt: skip

    def _prepared(self, ev: Prepared) -> list[Action]:
        if ev.epoch != self.epoch or self.ready_sent or self.phase is Phase.ENDED:
            return []
        if ev.error is not None:
            self._end()
            return [Send(self.host, c.Failed(c.clip(ev.error, 300), ev.epoch)), EndEngine(ev.error), Abort(ev.error)]
        self.ready_sent = True
        return [Send(self.host, c.Ready(ev.epoch))]

    def _host_left(self, reason: str) -> list[Action]:
        host = self.host
        if self.epoch == 0:
            self._end()
            return [Abort(f"the host {host} left the session before planning ({reason})")]
        if not self.served:
            self._end()
            return [Abort(f"the host {host} left the session before it was ready ({reason})")]
        if reason.startswith("signaling lost"):
            # only our line to the rendezvous, for good: the ring does not use it and keeps
            # serving (a replan cannot reach us now; a ring break still shows)
            return [Say(f"{self.name}: {reason}; the ring keeps serving"),
                    Record("signaling-lost", (("reason", reason[:300]),))]  # fmt: skip
        why = f"the host {host} left the session ({reason})"
        out: list[Action] = [EndEngine(why), *self._degrade(why)]  # every request here ends, none waits
        self._end()
        return out + [Say(f"{self.name}: {why}: the session is over"), Record("ended", (("reason", why),)),
                      Finish(linger_s=0.2)]  # let the API stream the failure to clients first

    def _ring_broke(self, ev: RingBroke) -> list[Action]:
        if ev.epoch != self.epoch or self.phase is Phase.ENDED:
            return []  # a ring of an older plan, torn down for a replan: no news
        out: list[Action] = []
        if self.degraded is None:
            self.degraded = ev.reason
            self.go(Phase.DEGRADED)
            out += [Say(f"[red]{self.name}: the ring broke: {ev.reason}[/red]"),
                    Record("degraded", (("reason", ev.reason),))]  # fmt: skip
        return out + [Send(self.host, c.Degraded(c.clip(ev.reason, 500), self.epoch))]

    def _received(self, msg: c.ControlMessage) -> list[Action]:
        if self.phase is Phase.ENDED:
            return []
        if isinstance(msg, c.Refusal):
            reason = f"the host refused the session: {msg.reason}"
            linger = 0.2 if self.served else 0.0  # let the API stream the failure to clients first
            self._end()
            return [EndEngine(reason), Abort(reason, linger)] if self.epoch else [Abort(reason)]
        if isinstance(msg, c.Wait):  # joined a serving session: the host's next replan adds us
            say = Say(f"{self.name}: {msg.reason[:300]}")
            return [say, Record("wait", (("reason", msg.reason[:300]),))] if self.epoch == 0 else [say]
        if isinstance(msg, c.PlanMessage):
            if msg.epoch <= self.epoch:
                return []
            why = c.protocol_mismatch("the host", msg.session.protocol, msg.session.version)
            if why is not None:  # the ring would not form (an exchange one side does not know)
                self._end()
                return [Send(self.host, c.Failed(c.clip(why, 300), msg.epoch)), EndEngine(why), Abort(why)]
            out: list[Action] = []
            if self.epoch:  # a replan: this one replaces ours
                why = (msg.reason or "the host replanned")[:300]
                out += [Say(f"{self.name}: replanning (plan {msg.epoch}): {why}"),
                        Record("replan", (("epoch", msg.epoch), ("reason", why)))]  # fmt: skip
            self.epoch, self.ready_sent = msg.epoch, False
            self.step = "planned"
            self.go(Phase.REPLANNING if self.served else Phase.PLANNED)
            return out + [Prepare(msg)]
        if self.epoch == 0:
            return []  # nothing else means anything before the plan
        if isinstance(msg, c.Serving):
            if not self.ready_sent or msg.epoch != self.epoch:
                return []
            first = not self.served
            self._serve()
            return [ServePlan(first)]
        if isinstance(msg, c.Gone | c.Degraded) and not self.served:
            why = f"member {msg.member} left" if isinstance(msg, c.Gone) else (msg.reason or "the host gave no reason")
            self._end()
            return [Abort(f"the session could not form: {why}")]
        if isinstance(msg, c.Gone):
            return [*self._degrade(f"member {msg.member} left the session ({msg.reason})"),
                    Record("left", (("name", msg.member[:64]), ("reason", msg.reason[:300])))]  # fmt: skip
        if isinstance(msg, c.Degraded):
            return self._degrade(msg.reason[:500])
        if isinstance(msg, c.Status):
            return [Apply(self.host, msg)]
        return []


MEMBER_SENDS = (c.Ready, c.Failed, c.Degraded, c.EdgeReport)  # what a member may send the host


class HostCore(SessionCore):
    """The host's side: plan, wait until every ring member is ready, serve, and decide when to
    replan (a ring member left, a ring broke, a joiner with --auto-replan or Enter)."""

    def __init__(self, name: str, auto_replan: bool = False) -> None:
        super().__init__(name)
        self.auto_replan = auto_replan
        self.replan: str | None = None  # the reason of the plan being formed (None: the first)
        self.others: frozenset[str] = frozenset()  # the forming plan's ring, the host aside
        self.ready: set[str] = set()
        self.own_ready = False
        self.deadline: float | None = None  # forming: READY_TIMEOUT_S after the plan
        self.ring_members: frozenset[str] = frozenset()  # the serving plan's ring
        self.joined_waiting: set[str] = set()  # joined while serving: in the next plan
        self.pending_break: tuple[str, float] | None = None  # a reported ring break: (why, replan at)
        self.dropped: set[str] = set()  # members this host removed (their MemberLeft is no news)

    @property
    def forming(self) -> bool:
        return self.deadline is not None

    def timer(self) -> float | None:
        """When the driver should feed Tick next (None: no deadline)."""
        if self.forming:
            return self.deadline  # a break seen meanwhile waits for serving (it replans then)
        return None if self.pending_break is None else self.pending_break[1]

    def on(self, event, now: float) -> list[Action]:
        if self.phase is Phase.ENDED:
            return []
        if isinstance(event, Step):
            return self._step(event.name)
        if isinstance(event, PlanMade):
            return self._plan_made(event, now)
        if isinstance(event, Prepared):
            if event.epoch != self.epoch or not self.forming:
                return []
            if event.error is not None:
                if culprits := set(event.blame) & self.others:  # a ring edge to a member that never came
                    return self._drop(culprits, f"the host could not form the ring with it: {event.error}")
                return self._abort(f"the host {self.name} could not prepare its stage: {event.error}")
            self.own_ready = True
            return self._formed_yet()
        if isinstance(event, Malformed):
            return self._drop({event.sender}, f"it sent a body that is no control message ({event.reason})")
        if isinstance(event, MemberLeft):
            return self._member_left(event)
        if isinstance(event, MemberJoined):
            self.joined_waiting.add(event.name)
            return self._joiners("--auto-replan") if self.auto_replan and not self.forming else []
        if isinstance(event, EnterPressed):
            return [] if self.forming else self._joiners("Enter at the host")
        if isinstance(event, RingBroke):
            return self._ring_broke(event, now)
        if isinstance(event, Tick):
            return self._tick(now)
        if isinstance(event, Received):
            return self._received(event.sender, event.msg, now)
        return []

    def _abort(self, why: str) -> list[Action]:
        self._end()
        self.deadline = None
        return [SendAll(c.Refusal(c.clip(why))), Abort(why)]

    def _plan_made(self, ev: PlanMade, now: float) -> list[Action]:
        self.joined_waiting.clear()  # the plan takes everyone in the roster
        self.replan = ev.reason
        self.epoch = ev.epoch
        if not ev.plan.feasible:
            short = ", ".join(f"{r.device} (short by {r.short_bytes / 1e6:.1f} MB)" for r in ev.plan.refused)
            why = f"the model does not fit: {short} cannot hold its share"
            if ev.reason is not None:
                why = f"{ev.reason}, and the members left cannot hold the model ({short} short): the session is over"
            self._end()
            return [SendAll(c.Refusal(c.clip(why))), EndEngine(why), Abort(why)]
        self.others = frozenset(n for n in ev.plan.ring if n != self.name)
        self.ready, self.own_ready = set(), False
        self.deadline = now + READY_TIMEOUT_S
        self.step = "planned"
        self.go(Phase.REPLANNING if self.served else Phase.PLANNED)
        return []

    def _formed_yet(self) -> list[Action]:
        if not (self.own_ready and self.others <= self.ready):
            return []
        self.deadline = None
        self.ring_members = self.others | {self.name}
        self._serve()
        return [Formed(self.epoch)]

    def _joiners(self, how: str) -> list[Action]:
        if not self.joined_waiting:
            return []
        names = ", ".join(sorted(self.joined_waiting))
        self.joined_waiting.clear()
        return self._replan(f"{names} joined ({how})")

    def _replan(self, reason: str) -> list[Action]:
        self.pending_break = None
        return [Replan(reason)]

    def _drop(self, names: set[str], why: str) -> list[Action]:
        """Members out of the session, each told why and named here; the rest planned again when a
        dropped one was in the forming plan or the serving ring. Never the session's end."""
        names = names - {self.name}
        out: list[Action] = []
        for n in sorted(names):
            self.dropped.add(n)
            self.joined_waiting.discard(n)
            out += [Drop(n, c.clip(why, 500)), Say(f"{self.name}: member {n} is dropped: {why}"),
                    Record("dropped", (("name", n), ("reason", why[:300])))]  # fmt: skip
        planned = names & (self.others if self.forming else self.ring_members)
        if not planned:
            return out
        self.deadline = None
        return out + self._replan(f"{', '.join(sorted(planned))} dropped ({why[:300]})")

    def _member_left(self, ev: MemberLeft) -> list[Action]:
        self.joined_waiting.discard(ev.name)
        if ev.name in self.dropped:  # the end of a drop this host made: no news
            self.dropped.discard(ev.name)
            return []
        if self.forming and ev.name in self.others:
            self.deadline = None  # the rest form a new plan: a member leaving never ends the session
            if self.replan is None:
                return self._replan(f"member {ev.name} left while the session was forming ({ev.reason})")
            return self._replan(f"member {ev.name} left the session while it replanned ({ev.reason})")
        if not self.forming and ev.name in self.ring_members:
            return self._replan(f"member {ev.name} left the session ({ev.reason})")
        return []

    def _ring_broke(self, ev: RingBroke, now: float) -> list[Action]:
        if ev.epoch != self.epoch:
            return []
        out: list[Action] = []
        if ev.member == self.name and self.degraded is None:  # the host's own ring noticed it
            self.degraded = ev.reason
            if self.phase is Phase.SERVING:
                self.go(Phase.DEGRADED)
            out += [Say(f"[red]{self.name}: the ring broke: {ev.reason}[/red]"),
                    Record("degraded", (("reason", ev.reason),))]  # fmt: skip
        if self.pending_break is not None:
            return out
        self.pending_break = (f"the ring broke at {ev.member} ({ev.reason})", now + BREAK_GRACE_S)
        return out + [Say(f"{self.name}: the ring broke at {ev.member}: {ev.reason}"),
                Record("degraded", (("reason", f"at {ev.member}: {ev.reason}"),))]  # fmt: skip

    def _tick(self, now: float) -> list[Action]:
        if self.forming and self.deadline is not None and now >= self.deadline:
            if late := self.others - self.ready:
                return self._drop(late, f"not ready within {READY_TIMEOUT_S:g} s of the plan")
            return self._abort(f"the session did not form within {READY_TIMEOUT_S:g} s: {self.name} not ready")
        if self.forming:
            return []
        if self.auto_replan and self.joined_waiting:  # joined while the last plan formed
            return self._joiners("--auto-replan")
        if self.pending_break is not None and now >= self.pending_break[1]:
            return self._replan(self.pending_break[0])
        return []

    def _received(self, sender: str, msg: c.ControlMessage, now: float) -> list[Action]:
        if not isinstance(msg, MEMBER_SENDS):
            return self._drop({sender}, f"it sent {msg.T!r}, which only the host sends")
        if self.forming:
            if isinstance(msg, c.Ready) and msg.epoch == self.epoch:
                self.ready.add(sender)
                return [Apply(sender, msg), Say(f"member {sender} is ready"), *self._formed_yet()]
            if isinstance(msg, c.Failed) and msg.epoch == self.epoch and sender in self.others:
                return self._drop({sender}, f"it could not prepare its stage: {msg.reason or 'it gave no reason'}")
            return []
        if isinstance(msg, c.EdgeReport):
            return [Apply(sender, msg)]
        if isinstance(msg, c.Degraded):
            if msg.epoch == self.epoch and sender not in self.ring_members:
                return self._drop({sender}, "it reported a break of a ring it is not in")
            return self._ring_broke(RingBroke(sender, msg.reason[:500], msg.epoch), now)
        return []


__all__ = [  # the cores, and the events and actions they take and give (lifecycle_events.py)
    "TRANSITIONS", "Action", "Abort", "Apply", "DegradeNode", "Drop", "EndEngine", "EnterPressed", "Finish",
    "Formed", "HostCore", "Joined", "Malformed", "MemberCore", "MemberJoined", "MemberLeft", "Phase", "PlanMade",
    "Prepare", "Prepared", "Received", "Record", "Replan", "RingBroke", "Say", "Send", "SendAll",
    "ServePlan", "SessionCore", "Step", "Tick",
]  # fmt: skip
