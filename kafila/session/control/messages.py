"""The session's control messages, host ↔ member: typed, frozen, bounded.

They ride the net layer's sealed host↔member channel (`kafila.net.Member.send(name, body)`,
received as `Message(sender, body)`); the net layer packs the body with msgpack. On the wire a
message is a map with its kind in `"t"` and its fields beside it, as before this module:

    plan      host → member   epoch, reason, plan (planner.Plan), session (SessionTerms), manifest
    ready     member → host   epoch: its stage of that plan is built and its ring edges are up
    failed    member → host   epoch, reason: it could not prepare its stage
    serving   host → member   epoch: every member is ready, the ring serves
    refused   host → member   reason: the session cannot be (or can no longer be) served
    wait      host → member   reason: a joiner the current plan leaves out
    degraded  member ↔ host   reason, epoch: a ring broke
    gone      host → member   member, reason: a member left
    edge      member → host   stats, load, measured, head_load: its ring edge and stage, every 2 s
    status    host → member   edges, members, measured, history, loads, head_load, every 2 s

`encode(msg) -> dict` and `decode(body) -> message` are the only ways across; decode returns a
valid message or raises `ControlError` (one line). A field missing from an older peer takes the
default the receiver used before (a plan's epoch: 1). The free-form report fields (edge stats,
loads, the members table, history) are plain data bounded here in size and depth; what they mean
is checked where they are used (kafila.session.ring.load).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from backends import KQUANTS
from planner import Plan, PlanInputError

MAX_REASON_CHARS = 2000
MAX_NAME_CHARS = 64  # kafila.net.roster.MAX_NAME_CHARS
MAX_EPOCH = 1 << 31
MAX_MEMBERS = 256
MAX_MEASURED = 64  # (what, ms) pairs the head reports ("stage:NAME", "step_ms", ...)
MAX_MEASURED_KEY_CHARS = 128
MAX_HISTORY = 100
MAX_REPORT_ITEMS = 256  # entries in any one map or list of a report
MAX_REPORT_DEPTH = 4
MAX_REPORT_TEXT_CHARS = 1000
MAX_MANIFEST_TENSORS = 1 << 16
MAX_CONTEXT_TOKENS = 1 << 24
MAX_SLOTS = 4096
MAX_QUEUED = 1 << 20


class ControlError(ValueError):
    """A control message that is not one: unknown kind, a missing field, out of bounds."""


def clip(text: object, limit: int = MAX_REASON_CHARS) -> str:
    """A reason as it may be sent: text, at most `limit` characters."""
    return str(text)[:limit]


# --- field checks --------------------------------------------------------------------------------


def _text(value: Any, what: str, limit: int = MAX_REASON_CHARS, empty: bool = True) -> str:
    if not isinstance(value, str) or len(value) > limit or (not empty and not value):
        raise ControlError(f"{what} must be text of at most {limit} characters")
    return value


def _opt_text(value: Any, what: str, limit: int = MAX_REASON_CHARS) -> str | None:
    return None if value is None else _text(value, what, limit)


def _int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ControlError(f"{what} must be an integer {low}..{high}")
    return value


def _epoch(value: Any) -> int:
    return _int(value, "epoch", 1, MAX_EPOCH)


def _plain(value: Any, what: str, depth: int = 0) -> Any:
    """Report data: None, bool, numbers, text, lists and text-keyed maps, bounded."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return _text(value, what, MAX_REPORT_TEXT_CHARS)
    if depth >= MAX_REPORT_DEPTH:
        raise ControlError(f"{what} nests deeper than {MAX_REPORT_DEPTH}")
    if isinstance(value, list | tuple):
        if len(value) > MAX_REPORT_ITEMS:
            raise ControlError(f"{what} has more than {MAX_REPORT_ITEMS} entries")
        return [_plain(v, what, depth + 1) for v in value]
    if isinstance(value, Mapping):
        if len(value) > MAX_REPORT_ITEMS:
            raise ControlError(f"{what} has more than {MAX_REPORT_ITEMS} entries")
        for k in value:
            _text(k, f"a key of {what}", MAX_REPORT_TEXT_CHARS)
        return {k: _plain(v, what, depth + 1) for k, v in value.items()}
    raise ControlError(f"{what} holds a {type(value).__name__}")


def _map(value: Any, what: str, default: Any = None) -> dict | None:
    if value is None:
        return default
    if not isinstance(value, Mapping):
        raise ControlError(f"{what} must be a map")
    return _plain(value, what)


def _measured(value: Any) -> tuple[tuple[str, float], ...]:
    """The head's measured times, [(what, ms), ...]: the first MAX_MEASURED pairs, those that are
    not (text, number) dropped (as before); a list longer than MAX_REPORT_ITEMS is an error."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or len(value) > MAX_REPORT_ITEMS:
        raise ControlError(f"measured must list at most {MAX_REPORT_ITEMS} (what, ms) pairs")
    out = []
    for pair in value[:MAX_MEASURED]:
        if (isinstance(pair, list | tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and len(pair[0]) <= MAX_MEASURED_KEY_CHARS and isinstance(pair[1], int | float)
                and not isinstance(pair[1], bool)):  # fmt: skip
            out.append((pair[0], float(pair[1])))
    return tuple(out)


# --- the session's terms -------------------------------------------------------------------------


# The session protocol: raised whenever members of one session must run the same code to work
# together (a frame, a message or an exchange that an older member does not understand). 1: the
# first numbered, the ring's TCP lane (ring_lane.py); 2: a Free frame may keep the slot's KV
# (prompt caching, prefix.py); 3: a step's cache_len below what a stage holds cuts the slot back to
# it (a reused prefix, prefix.py; stages of 2 would have computed wrongly). A host and its members compare it at planning
# (protocol_mismatch), so mixed versions fail with one line instead of a timeout.
PROTOCOL = 3


def protocol_mismatch(who: str, theirs: object, version: object) -> str | None:
    """Why `who` (running Kafila `version`, session protocol `theirs`; None: from before both were
    sent) cannot be in a session with this process, or None when it can."""
    from kafila import __version__

    if theirs == PROTOCOL:
        return None
    what = (f"Kafila {str(version)[:32]} (session protocol {str(theirs)[:16]})" if theirs is not None
            else "an older Kafila (from before session protocols were numbered)")  # fmt: skip
    return (f"{who} runs {what}, this machine Kafila {__version__} (session protocol {PROTOCOL}): "
            "install the same Kafila version on every machine of the session")


@dataclass(frozen=True)
class SessionTerms:
    """What the host decided for the whole session, sent with every plan."""

    context: int  # tokens
    concurrency: int  # KV slots every stage opens
    precision: str = "serving"
    kquant: str = "exact"  # the OpenVINO stages' K-quant form (backends.KQUANTS; a host from before it: exact)
    speculate: str = "off"  # the head's drafter (speculate.SPECULATE_MODES; unknown: off)
    max_queued: int = 64
    batch_rows: bool = True
    dipsd: bool = True  # the head's live DiP-SD optimiser (several speculating requests)
    # finished requests' KV kept for prompts that start the same way; "whole": only for a prompt
    # continuing a slot's whole history (hybrid models, kafila/session/ring/prefix.py's WHOLE)
    prompt_cache: bool | str = True
    concurrency_from: str = "--concurrency"  # or "memory" (auto)
    model: str | None = None
    sha256: str | None = None
    protocol: int | None = None  # the host's PROTOCOL (None: a host from before it was sent)
    version: str | None = None  # the host's Kafila version, for the message when they differ

    def __post_init__(self) -> None:
        _int(self.context, "session.context", 1, MAX_CONTEXT_TOKENS)
        _int(self.concurrency, "session.concurrency", 1, MAX_SLOTS)
        _int(self.max_queued, "session.max_queued", 0, MAX_QUEUED)
        _text(self.precision, "session.precision", 32)
        if self.kquant not in KQUANTS:
            raise ControlError(f"session.kquant must be one of {', '.join(KQUANTS)}")
        _text(self.speculate, "session.speculate", 32)
        _text(self.concurrency_from, "session.concurrency_from", 32)
        if not isinstance(self.batch_rows, bool):
            raise ControlError("session.batch_rows must be true or false")
        if not isinstance(self.dipsd, bool):
            raise ControlError("session.dipsd must be true or false")
        if not isinstance(self.prompt_cache, bool) and self.prompt_cache != "whole":
            raise ControlError('session.prompt_cache must be true, false or "whole"')
        _opt_text(self.model, "session.model", 256)
        _opt_text(self.sha256, "session.sha256", 64)
        if self.protocol is not None:
            _int(self.protocol, "session.protocol", 0, 1 << 30)
        _opt_text(self.version, "session.version", 32)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> SessionTerms:
        if not isinstance(data, Mapping):
            raise ControlError("session must be a map")
        known = {f.name for f in fields(cls)}
        missing = {"context", "concurrency"} - set(data)
        if missing:
            raise ControlError(f"session lacks {', '.join(sorted(missing))}")
        return cls(**{k: v for k, v in data.items() if k in known})


# --- the messages --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanMessage:
    """host → member: plan `epoch` (1 the first, +1 at every replan) and this member's manifest."""

    T: ClassVar[str] = "plan"
    epoch: int
    plan: Plan
    session: SessionTerms
    manifest: dict | None = None  # weights.Manifest.to_json(); None for the host's own stage
    reason: str | None = None  # why the host replanned (None: the first plan)

    def __post_init__(self) -> None:
        _epoch(self.epoch)
        _opt_text(self.reason, "reason")
        if not isinstance(self.plan, Plan) or not isinstance(self.session, SessionTerms):
            raise ControlError("a plan message carries a Plan and SessionTerms")
        if self.manifest is not None:
            tensors = self.manifest.get("tensors") if isinstance(self.manifest, Mapping) else None
            if not isinstance(tensors, list | tuple) or len(tensors) > MAX_MANIFEST_TENSORS:
                raise ControlError(f"manifest must list at most {MAX_MANIFEST_TENSORS} tensors")

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "reason": self.reason, "plan": self.plan.to_json(),
                "session": self.session.to_json(), "manifest": self.manifest}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping) -> PlanMessage:
        try:
            plan = Plan.from_json(d.get("plan"))
        except PlanInputError as exc:
            raise ControlError(str(exc)) from None
        manifest = d.get("manifest")
        if manifest is not None and not isinstance(manifest, Mapping):
            raise ControlError("manifest must be a map")
        return cls(_epoch(d.get("epoch", 1)), plan, SessionTerms.from_json(d.get("session")),
                   None if manifest is None else dict(manifest), d.get("reason"))  # fmt: skip


@dataclass(frozen=True)
class Ready:
    """member → host: its stage of plan `epoch` is built and its ring edges are up."""

    T: ClassVar[str] = "ready"
    epoch: int = 1

    def __post_init__(self) -> None:
        _epoch(self.epoch)


@dataclass(frozen=True)
class Failed:
    """member → host: it could not prepare its stage of plan `epoch`."""

    T: ClassVar[str] = "failed"
    reason: str
    epoch: int = 1

    def __post_init__(self) -> None:
        _text(self.reason, "reason")
        _epoch(self.epoch)


@dataclass(frozen=True)
class Serving:
    """host → member: every member of plan `epoch` is ready; the ring serves."""

    T: ClassVar[str] = "serving"
    epoch: int = 1

    def __post_init__(self) -> None:
        _epoch(self.epoch)


@dataclass(frozen=True)
class Refusal:
    """host → member: the session cannot be served; it is over."""

    T: ClassVar[str] = "refused"
    reason: str

    def __post_init__(self) -> None:
        _text(self.reason, "reason")


@dataclass(frozen=True)
class Wait:
    """host → member: the current plan leaves this member out; a later replan adds it."""

    T: ClassVar[str] = "wait"
    reason: str

    def __post_init__(self) -> None:
        _text(self.reason, "reason")


@dataclass(frozen=True)
class Degraded:
    """member → host (or host → member): the ring of plan `epoch` broke."""

    T: ClassVar[str] = "degraded"
    reason: str
    epoch: int = 1

    def __post_init__(self) -> None:
        _text(self.reason, "reason")
        _epoch(self.epoch)


@dataclass(frozen=True)
class Gone:
    """host → member: `member` left the session."""

    T: ClassVar[str] = "gone"
    member: str
    reason: str = ""

    def __post_init__(self) -> None:
        _text(self.member, "member", MAX_NAME_CHARS)
        _text(self.reason, "reason")


@dataclass(frozen=True)
class EdgeReport:
    """member → host, every STATUS_EVERY_S: its successor edge, its stage's load, and at the head
    the measured stage times and the head's queue."""

    T: ClassVar[str] = "edge"
    stats: dict | None = None
    load: dict | None = None
    measured: tuple[tuple[str, float], ...] | None = None  # the head's only
    head_load: dict | None = None  # the head's only

    def __post_init__(self) -> None:
        if self.stats is not None and not isinstance(self.stats, Mapping):
            raise ControlError("stats must be a map")
        _plain(self.stats, "stats")
        _plain(self.load, "load")
        _plain(self.head_load, "head_load")

    def to_json(self) -> dict:
        body: dict = {} if self.stats is None else {"stats": self.stats}
        if self.load is not None:
            body["load"] = self.load
        if self.measured is not None:
            body["measured"] = [list(p) for p in self.measured]
        if self.head_load is not None:
            body["head_load"] = self.head_load
        return body

    @classmethod
    def from_json(cls, d: Mapping) -> EdgeReport:
        measured = d.get("measured")
        return cls(_map(d.get("stats"), "stats"), _map(d.get("load"), "load"),
                   None if measured is None else _measured(measured), _map(d.get("head_load"), "head_load"))  # fmt: skip


@dataclass(frozen=True)
class Status:
    """host → member, every STATUS_EVERY_S: what /status shows of the others."""

    T: ClassVar[str] = "status"
    edges: dict = field(default_factory=dict)  # ring member → its successor edge's stats
    members: dict = field(default_factory=dict)  # name → the host's row for it
    measured: tuple[tuple[str, float], ...] = ()
    history: tuple[dict, ...] = ()  # membership events, oldest first
    loads: dict = field(default_factory=dict)  # stage → its load
    head_load: dict | None = None

    def __post_init__(self) -> None:
        for what in ("edges", "members", "loads"):
            if not isinstance(getattr(self, what), Mapping):
                raise ControlError(f"{what} must be a map")
            if len(getattr(self, what)) > MAX_MEMBERS:
                raise ControlError(f"{what} has more than {MAX_MEMBERS} entries")
        if len(self.history) > MAX_HISTORY:
            raise ControlError(f"history has more than {MAX_HISTORY} entries")
        _plain(self.head_load, "head_load")

    def to_json(self) -> dict:
        return {"edges": self.edges, "members": self.members, "measured": [list(p) for p in self.measured],
                "history": list(self.history), "loads": self.loads, "head_load": self.head_load}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping) -> Status:
        history = d.get("history") or []
        if not isinstance(history, list | tuple):
            raise ControlError("history must be a list")
        history = history[-MAX_HISTORY:]  # the newest, as before
        entries = tuple(h for h in _plain(list(history), "history") if isinstance(h, dict))
        return cls(_map(d.get("edges"), "edges", {}), _map(d.get("members"), "members", {}),
                   _measured(d.get("measured")), entries, _map(d.get("loads"), "loads", {}),
                   _map(d.get("head_load"), "head_load"))  # fmt: skip


ControlMessage = PlanMessage | Ready | Failed | Serving | Refusal | Wait | Degraded | Gone | EdgeReport | Status
KINDS: dict[str, type] = {c.T: c for c in (PlanMessage, Ready, Failed, Serving, Refusal, Wait, Degraded, Gone,
                                          EdgeReport, Status)}  # fmt: skip


def encode(msg: ControlMessage) -> dict:
    """The body to hand kafila.net.Member.send."""
    to_json = getattr(msg, "to_json", None)
    body = to_json() if to_json is not None else {f.name: getattr(msg, f.name) for f in fields(msg)}
    return {"t": msg.T, **body}


def decode(body: Any) -> ControlMessage:
    """A received body as its message, or ControlError saying why it is not one."""
    if not isinstance(body, Mapping) or not isinstance(body.get("t"), str):
        raise ControlError("a control message is a map with its kind in 't'")
    cls = KINDS.get(body["t"])
    if cls is None:
        raise ControlError(f"unknown control message {body['t'][:32]!r}")
    from_json = getattr(cls, "from_json", None)
    try:
        if from_json is not None:
            return from_json(body)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in names})
    except TypeError as exc:  # a required field missing
        raise ControlError(f"{body['t']}: {exc}") from None


__all__ = ["KINDS", "ControlError", "ControlMessage", "Degraded", "EdgeReport", "Failed", "Gone", "PlanMessage",
           "Ready", "Refusal", "Serving", "SessionTerms", "Status", "Wait", "clip", "decode", "encode", "PROTOCOL",
           "protocol_mismatch"]  # fmt: skip
