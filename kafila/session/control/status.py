"""What a participant knows of its session (`State`), its membership history, and `/status` as
typed records with one `to_json`.

The JSON's shape is a contract: the page (kafila/api/static), `kafila status` and scripts read
it, so `StatusPage.to_json()` gives exactly the keys it always had (a host's page adds
`transfers`). The records are built by the stage (stage.py), which knows the live figures."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

HISTORY_KINDS = ("joined", "left", "plan", "serving", "degraded", "ended", "dropped")  # what /status keeps
HISTORY_MAX = 100


@dataclass
class State:
    plan: dict | None = None  # the plan's JSON, as /status shows it (Stage.plan: the Plan)
    session: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    edges: dict = field(default_factory=dict)  # successor name → edge stats (all, at the host)
    members: dict = field(default_factory=dict)  # name → {nat, rtt_ms, ...}
    started: float = field(default_factory=time.monotonic)
    history: list = field(default_factory=list)  # membership events, oldest first (HISTORY_MAX)
    loads: dict = field(default_factory=dict)  # stage name → its load as last reported (load.clean_stage)
    head_load: dict | None = None  # the head's queue and requests as last reported (load.clean_head)


def history_entry(kind: str, fields: dict) -> dict:
    """One membership event as /status shows it: when (UTC), what, who and why, in short."""
    entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": kind}
    for key in ("name", "reason"):
        if isinstance(fields.get(key), str):
            entry[key] = fields[key][:300]
    if kind == "plan" and isinstance(fields.get("plan"), dict):
        entry["ring"] = list(fields["plan"].get("ring", []))[:64]
    return entry


def rounded(v, digits: int = 3):
    return None if v is None else round(v, digits)


@dataclass(frozen=True)
class SessionView:
    name: str
    host: bool | str | None  # True at the host; a member: the host's name
    state: str  # the lifecycle's status_name, or "degraded"
    degraded: str | None
    model: str | None
    backend: str
    context: int | None
    concurrency: int | None
    concurrency_from: str | None  # "memory" (auto) or "--concurrency"
    uptime_s: float

    def to_json(self) -> dict:
        return {"name": self.name, "host": self.host, "state": self.state, "degraded": self.degraded,
                "model": self.model, "backend": self.backend, "context": self.context,
                "concurrency": self.concurrency, "concurrency_from": self.concurrency_from,
                "uptime_s": self.uptime_s}  # fmt: skip


@dataclass(frozen=True)
class StageView:
    blocks: int | None
    predicted_ms: float | None
    compute_ms: float | None  # measured at the head

    def to_json(self) -> dict:
        return {"blocks": self.blocks, "predicted_ms": self.predicted_ms, "compute_ms": self.compute_ms}


@dataclass(frozen=True)
class RequestsView:
    active: int
    queued: int
    free_slots: int
    parked: int

    def to_json(self) -> dict:
        return {"active": self.active, "queued": self.queued, "free_slots": self.free_slots, "parked": self.parked}


@dataclass(frozen=True)
class StatusPage:
    """GET /status. Report-shaped parts (edges, load, memory, weights, speculation, signaling)
    stay the plain maps their own modules build and bound."""

    session: SessionView
    members: dict
    plan: dict | None
    stages: dict[str, StageView]
    edges: list[dict]  # {"from", "to", **edge stats}
    network_ms: float | None
    step_ms: float | None
    tok_s: float | None
    prediction: dict | None  # the plan's per-stage ms and tok/s beside the measured (pricing.predictions)
    weights: dict
    memory: dict
    requests: RequestsView | None
    speculation: dict | None  # the head's: drafted, accepted, acceptance, tokens a trip
    history: list[dict]  # membership: joined, left, dropped, planned, serving, degraded
    signaling: dict | None  # to the rendezvous
    load: dict  # per stage: requests holding a KV slot, rows in its last forward; the head's queue
    transfers: dict | None = None  # the host's: each member's weights as it serves them

    def to_json(self) -> dict:
        out = {"session": self.session.to_json(), "members": self.members, "plan": self.plan,
               "stages": {n: s.to_json() for n, s in self.stages.items()}, "edges": self.edges,
               "network_ms": self.network_ms, "step_ms": self.step_ms, "tok_s": self.tok_s,
               "prediction": self.prediction, "weights": self.weights, "memory": self.memory,
               "requests": None if self.requests is None else self.requests.to_json(),
               "speculation": self.speculation, "history": self.history, "signaling": self.signaling,
               "load": self.load}  # fmt: skip
        if self.transfers is not None:
            out["transfers"] = self.transfers
        return out


__all__ = ["HISTORY_KINDS", "HISTORY_MAX", "RequestsView", "SessionView", "StageView", "State", "StatusPage",
           "history_entry", "rounded"]  # fmt: skip
