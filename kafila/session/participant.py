"""A participant's lifecycle, host or member: join, plan, weights, shard, ring, serve, leave.

The decisions (phase, plan generation, who is ready, when to replan or give up) are the sans-I/O
cores of lifecycle.py (MemberCore here, HostCore in host.py); this module is their driver: it
feeds them net events and the end of its own preparation, and carries out their actions (send,
prepare, serve, end). The messages are control.py's, typed and bounded; the plan is a
planner.Plan (`Participant.plan`; `state.plan` is its JSON, as /status shows it).

Theory of operation (signaling messages ride the net layer's authenticated host↔member channel;
members only ever talk to the host there):

    member → host : the descriptor (probe results, backend) in the join itself
    host → member : {"t": "plan", plan, session, manifest}   or {"t": "refused", reason}
    member        : weights (edge to the host, weights.py) → shard → ring edge to the successor,
                    ring stream from the predecessor
    member → host : {"t": "ready"}   or {"t": "failed", reason}
    host → all    : {"t": "serving"} once every member is ready
    serving       : member → host {"t": "edge", stats} every STATUS_EVERY_S;
                    host → all {"t": "status", edges, members} every STATUS_EVERY_S;
                    member → host {"t": "degraded", reason, epoch} when its ring breaks
    replan        : a member left (or broke the ring, or joined with --auto-replan): the host
                    sends a new {"t": "plan", epoch: n+1, reason, ...}; every member tears its
                    ring down, fetches what it lacks, keeps its shard when its blocks are the
                    same, forms the new ring (Hellos carry the epoch) and says {"t": "ready",
                    epoch}; {"t": "serving", epoch} resumes the requests waiting at their origins
                    (engine.py). Messages of an older epoch are ignored. A plan the remaining
                    members cannot hold: {"t": "refused", reason} and the session is over.
    late joiner   : host → it {"t": "wait", reason} until the next replan includes it

`Participant.run()` owns every task it starts; SIGINT/SIGTERM cancel the lifecycle and it leaves
the session cleanly (API closed, ring closed, edges and signaling closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console

from backends.errors import BadInput, KafilaError, Refused, describe_error
from kafila import __version__
from kafila.engine.ring import RESUME_WAIT_S, RingEngine
from kafila.session import control, lifecycle
from kafila.session.bulk import BulkListener
from kafila.session.bulk import dial as bulk_dial
from kafila.session.frames import Hello, Limits, encode
from kafila.session.load import MAX_REPORTED_REQUESTS, clean_head, clean_stage, ring_load
from kafila.session.ring import RingNode
from kafila.session.ring_lane import offer_lane, take_lane
from kafila.session.slots import DEFAULT_MAX_QUEUED, MAX_QUEUED_LIMIT, session_value
from kafila.session.streams import StreamClosed, read_frame
from planner import Plan, PlanInputError, ring_neighbour
from kafila.session.weights import (
    Manifest,
    TransferProgress,
    WeightError,
    check_shard,
    local_copy_path,
)

log = logging.getLogger(__name__)
STATUS_EVERY_S = 2.0
READY_TIMEOUT_S = lifecycle.READY_TIMEOUT_S  # weights over a slow link and a shard build
RING_EDGE_TIMEOUT_S = 60.0  # to open the edge to the successor (it accepts even while building)
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "kafila", "models")


@dataclass(frozen=True)
class SessionConfig:
    name: str
    rendezvous: tuple[str, int] | None  # None: the host starts an embedded one
    backend: str = "openvino"
    precision: str = "serving"
    api: tuple[str, int] | None = ("127.0.0.1", 8740)  # None: no HTTP API
    api_tries: int = 1  # >1: the next ports up are tried when api's port is taken (the default)
    bind_host: str = "0.0.0.0"
    send_delay_ms: float = 0.0
    cache_dir: str = DEFAULT_CACHE_DIR
    local_model: str | None = None  # a member's own copy of the model (used when the digest matches)
    draft_path: str | None = None  # a draft model this member runs when it is the head (--speculate draft)
    # the host's
    model_path: str | None = None
    expect: int = 0  # session size, host included (0: plan on Enter)
    context: int | None = None  # None: 2048, or the model's own context if shorter (host.session_context)
    concurrency: int | None = None  # requests served at once; None: as many as memory holds (slots.py)
    max_queued: int = DEFAULT_MAX_QUEUED  # requests that may wait for a slot (one more: 429)
    batch_rows: bool = True  # kafila host --batch-rows: ready decode steps travel as one micro-batch
    dipsd: bool = True  # kafila host --dipsd: the head's live DiP-SD optimiser (session/dipsd_live.py)
    prompt_cache: bool = True  # kafila host --prompt-cache: finished requests' KV kept (session/prefix.py)
    speculate: str = "off"  # the head's drafter (speculate.SPECULATE_MODES), sent in the session
    policy: str = "kafila"
    code_file: str | None = None
    auto_replan: bool = False  # a machine that joins a serving session is planned in at once
    code_words: int = 3  # words in the session code (4 for a long-lived session)
    embedded_listen: tuple[str, int] = ("0.0.0.0", 7473)
    json_events: bool = False  # print one JSON line per lifecycle event on stdout (scripts)
    # "auto": weights over the bulk lane (TCP, kafila.session.bulk) when the peer is reachable,
    # else the QUIC stream; "quic": never offer or take the TCP lane
    weights_lane: str = "auto"
    # the same for ring frames (kafila.session.ring_lane): "auto" over TCP where the successor is
    # reachable, "quic": this member neither offers nor takes a TCP lane on its ring edges
    ring_lane: str = "auto"


@dataclass
class Role:
    """This participant's place in the plan."""

    ring: list[str]
    head: str
    first: int
    last: int
    blocks: dict[str, int]

    def successor(self, me: str) -> str:
        return ring_neighbour(self.ring, me, 1)

    def predecessor(self, me: str) -> str:
        return ring_neighbour(self.ring, me, -1)


def ring_hello_refusal(claimed: str, peer: str, predecessor: str) -> str | None:
    """Why a ring stream may not feed this member's stage (None: it may). `peer` is the member
    the edge's pinned certificate proved; the Hello only claims a name, and only the plan's
    predecessor may send activations here."""
    if claimed != peer:
        return f"its Hello claims the name {claimed[:64]!r}"
    if peer != predecessor:
        return f"the plan's predecessor is {predecessor}, not {peer}"
    return None


def role_of(plan: dict | Plan, me: str) -> Role:
    """This member's place in `plan` (a Plan, or its JSON)."""
    if not isinstance(plan, Plan):
        try:
            plan = Plan.from_json(plan)
        except PlanInputError as exc:
            raise Refused(f"the host's plan cannot be read: {exc}") from None
    if me not in plan.ring:
        raise Refused(f"the plan leaves this member ({me}) out")
    first, last = plan.block_ranges()[me]
    return Role(list(plan.ring), plan.head, first, last, dict(zip(plan.ring, plan.blocks, strict=True)))


@dataclass
class State:
    plan: dict | None = None  # the plan's JSON, as /status shows it (Participant.plan: the Plan)
    session: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    edges: dict = field(default_factory=dict)  # successor name → edge stats (all, at the host)
    members: dict = field(default_factory=dict)  # name → {nat, rtt_ms, ...}
    started: float = field(default_factory=time.monotonic)
    history: list = field(default_factory=list)  # membership events, oldest first (HISTORY_MAX)
    loads: dict = field(default_factory=dict)  # stage name → its load as last reported (load.clean_stage)
    head_load: dict | None = None  # the head's queue and requests as last reported (load.clean_head)


HISTORY_KINDS = ("joined", "left", "plan", "serving", "degraded", "ended")  # what /status keeps
HISTORY_MAX = 100


def history_entry(kind: str, fields: dict) -> dict:
    """One membership event as /status shows it: when (UTC), what, who and why, in short."""
    entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": kind}
    for key in ("name", "reason"):
        if isinstance(fields.get(key), str):
            entry[key] = fields[key][:300]
    if kind == "plan" and isinstance(fields.get("plan"), dict):
        entry["ring"] = list(fields["plan"].get("ring", []))[:64]
    return entry


class Participant:
    """One process in a session. The host subclass adds planning and weight serving."""

    IS_ANCHOR = False  # planner.member_bytes: only the host (the anchor) adds anchor_bytes

    is_host = False

    def __init__(self, cfg: SessionConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.net = None  # kafila.net.Member
        self.state = State()
        self.core = self._new_core()  # the lifecycle's phase and decisions (lifecycle.py)
        self.plan: Plan | None = None
        self.node: RingNode | None = None
        self.engine: RingEngine | None = None
        self.api = None
        self.shard = None
        self.index = None
        self.tokenizer = None
        self.model_path: str | None = None
        self.role: Role | None = None
        self._tasks: set[asyncio.Task] = set()
        # plan generations: 1 for the first plan, +1 at every replan; a ring Hello names the
        # generation it was opened for, and waits until this member knows that plan's roles
        self.epoch = 0
        self._epoch_changed = asyncio.Event()
        self._pred_streams: dict[int, asyncio.Future] = {}  # epoch → (edge, reader, writer) from the predecessor
        self._planned = asyncio.Event()  # set once `role` is known: a ring Hello waits for it
        self._ring_edges: list = []
        self._lanes_out: list = []  # ring_lane.Lane of this member's ring edges (both ends)
        # successors (name, certificate) whose TCP lane broke while the QUIC edge stayed up: their
        # frames stay on QUIC, so a path that drops TCP does not break every plan's ring
        self._lanes_broken: set[tuple] = set()
        self.succ_lane = None  # ring_lane.Lane to the successor: what /status says it carries frames on
        self._bulk = None  # kafila.session.bulk.BulkListener: the TCP lanes' (opened at first use)
        self._bulk_failed = False  # it could not listen: not tried again
        self._shard_key: tuple | None = None  # what self.shard was built for (reused when unchanged)
        self._serving = asyncio.Event()
        self.leaving = False  # SIGINT/SIGTERM: the lifecycle is being cancelled

    def _new_core(self):
        return lifecycle.MemberCore(self.cfg.name)

    # --- helpers ---------------------------------------------------------------------------------

    async def recv_unless(self, *others: asyncio.Future):
        """The next session event, or None when one of `others` finishes first."""
        get = asyncio.ensure_future(self.net.recv())
        try:
            await asyncio.wait({get, *others}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(get)
        # an event that arrived while the recv was being cancelled is still returned, not lost
        return get.result() if get.done() and not get.cancelled() else None

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)  # commands and URLs stay whole to copy

    def event(self, kind: str, **fields) -> None:
        if kind in HISTORY_KINDS:
            self.state.history.append(history_entry(kind, fields))
            del self.state.history[:-HISTORY_MAX]
        if self.cfg.json_events:
            import json

            print(json.dumps({"event": kind, **fields}), flush=True)

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("task %s failed: %r", task.get_name(), task.exception())

    def _edge_rtts(self) -> dict:
        """Ring member → its successor edge's RTT (ms): the host's last status, and our own edge."""
        out = {n: e.get("rtt_ms") for n, e in self.state.edges.items() if isinstance(e, dict)}
        own = getattr(self, "succ_edge", None)
        if own is not None:
            out[self.cfg.name] = edge_stats(own).get("rtt_ms")
        return out

    def descriptor(self) -> dict:
        from kafila.probe import probe_device

        p = probe_device(quick=True, backend=self.cfg.backend)  # measured on what it will serve on
        return {"backend": self.cfg.backend, "probed_on": p.backend, "memory_gb": round(p.memory_gb, 3),
                "bandwidth_gbps": p.bandwidth_gbps, "overhead_us": p.overhead_us,
                "tflops": p.tflops, "machine": machine_id(),
                "protocol": control.PROTOCOL, "version": __version__}  # fmt: skip

    # --- running ---------------------------------------------------------------------------------

    def run(self) -> int:
        return asyncio.run(self._main())

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await self._start_api()
        life = asyncio.create_task(self._lifecycle(), name="lifecycle")
        stopper = asyncio.create_task(stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait({life, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if life in done:
                return life.result() or 0
            self.say(f"{self.cfg.name}: leaving the session")
            self.leaving = True  # nothing new starts (a replan), whatever the lifecycle is in
            life.cancel()
            with contextlib.suppress(asyncio.CancelledError, KafilaError):
                await life
            return 0
        finally:
            stopper.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await self.shutdown()

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.api is not None:
            with contextlib.suppress(Exception):
                await self.api.close()
            self.api = None
        if self.node is not None:
            with contextlib.suppress(Exception):
                await self.node.close()
            self.node = None
        await self._close_ring_edges()
        if self.net is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.net.close(), 3.0)
            self.net = None
        if self._bulk is not None:
            with contextlib.suppress(Exception):
                await self._bulk.close()
            self._bulk = None
        await self.close_extra()

    async def _close_ring_edges(self) -> None:
        edges, self._ring_edges = self._ring_edges, []
        lanes, self._lanes_out = self._lanes_out, []
        for edge in edges:
            with contextlib.suppress(Exception):
                await edge.close()
        for lane in lanes:
            if lane.broke and lane.peer not in self._lanes_broken:
                self._lanes_broken.add(lane.peer)
                log.warning("ring: the TCP lane to %s broke while its QUIC edge stayed up: its frames stay "
                            "on QUIC from the next plan on", lane.peer[0])  # fmt: skip
            await lane.close()
        self.succ_edge = self.succ_lane = None

    async def bulk_listener(self):
        """This process's TCP listener for the bulk lanes (weights at the host, ring frames at
        every member), opened at first use; None when it cannot listen (QUIC carries it all)."""
        if self._bulk is None and not self._bulk_failed:
            # its LAN address first: a host's own candidates may name only the loopback it reached
            # its embedded rendezvous on
            hosts = [lan_ip(), *self._candidate_hosts(self.cfg.name)]
            try:
                self._bulk = await BulkListener.start(self.cfg.bind_host, hosts)
            except OSError as exc:
                self.say(f"{self.cfg.name}: no TCP listener ({exc}): weights and ring frames go over QUIC")
                self._bulk_failed = True
                return None
            log.info("bulk lane: listening on port %d for %s", self._bulk.port, ", ".join(self._bulk.hosts))
        return self._bulk

    async def close_extra(self) -> None:
        """The host's embedded rendezvous."""

    async def _lifecycle(self) -> int:
        from kafila.net import Member

        cfg = self.cfg
        self.say(f"{cfg.name}: measuring this device…")
        desc = await asyncio.to_thread(self.descriptor)
        assert cfg.rendezvous is not None
        self.net = await Member.join(self.code, cfg.rendezvous, cfg.name, desc,
                                     bind_host=cfg.bind_host, send_delay_ms=cfg.send_delay_ms)  # fmt: skip
        if self.net.name != cfg.name:  # another member has our name: the host gave us `name-2`
            self.say(f"{cfg.name}: the name {cfg.name!r} is taken in this session; "
                     f"this member is {self.net.name}")  # fmt: skip
            self.cfg = cfg = dataclasses.replace(cfg, name=self.net.name)
            self.core.name = cfg.name
        host = next((n for n, i in self.net.roster().items() if i.peer_id == 0), "host")
        self.say(f"{cfg.name}: joined the session of {host} (NAT {self.net.nat.nat}, "
                 f"rendezvous RTT {self.net.nat.rtt_ms:.1f} ms); waiting for the plan")  # fmt: skip
        self.event("joined", host=host, nat=self.net.nat.nat, name=cfg.name)
        self.host_name = host
        self.core.on(lifecycle.Joined(host), self._now())
        self.spawn(self._accept_loop(), "accept")
        return await self._follow_plans(host)

    async def _follow_plans(self, host: str) -> int:
        """Plan → weights → shard → ring → serving, and again at every replan the host sends.

        A thin driver of MemberCore (lifecycle.py): net events and the preparation's end go in,
        its actions come out. Forming and a replan take the same path, while listening to the
        host: a newer plan replaces the one being prepared; a failure goes to the host (which
        ends the session) and ends this member; a session that cannot form (the host gone)
        ends it at once."""
        core = self.core
        prep: asyncio.Task | None = None
        prep_epoch = 0
        failure: BaseException | None = None  # why the preparation failed (raised as it was)
        actions: list = []
        try:
            while True:
                for action in actions:
                    if isinstance(action, lifecycle.Prepare):
                        if prep is not None:
                            await cancel_and_wait(prep)
                        prep_epoch = action.msg.epoch
                        prep = asyncio.create_task(self._prepare(action.msg, fetch_from=host), name="prepare")
                    elif isinstance(action, lifecycle.ServePlan):
                        await self._serve_plan(first=action.first)
                        if action.first:
                            self.spawn(self._report_edges(), "report-edges")
                    elif isinstance(action, lifecycle.Abort):
                        if action.linger_s:
                            await asyncio.sleep(action.linger_s)
                        if isinstance(failure, KafilaError):
                            raise failure
                        raise Refused(action.reason) from failure
                    elif isinstance(action, lifecycle.Finish):
                        await asyncio.sleep(action.linger_s)
                        return 0
                    else:
                        await self._carry_out(action)
                if prep is not None and prep.done() and prep_epoch == core.epoch and not core.ready_sent:
                    failure = prep.exception()
                    error = None if failure is None else describe_error(failure)
                    actions = core.on(lifecycle.Prepared(prep_epoch, error), self._now())
                    continue
                waiting = prep is not None and not prep.done() and not core.ready_sent
                ev = await (self.recv_unless(prep) if waiting else self.recv_unless())
                actions = self._core_event(ev)
        finally:
            if prep is not None:
                await cancel_and_wait(prep)

    def _now(self) -> float:
        """The lifecycle cores' clock: the event loop's (monotonic)."""
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return time.monotonic()

    def _core_event(self, ev) -> list:
        """A net event fed to the lifecycle core: its actions (none for what it does not use)."""
        from kafila.net import MemberJoined, MemberLeft, Message

        if isinstance(ev, MemberLeft):
            event = lifecycle.MemberLeft(ev.name, str(ev.reason))
        elif isinstance(ev, MemberJoined):
            event = lifecycle.MemberJoined(ev.info.name)
        elif isinstance(ev, Message):
            try:
                event = lifecycle.Received(ev.sender, control.decode(ev.body))
            except control.ControlError as exc:
                log.info("a control message from %s dropped: %s", ev.sender, exc)
                return []
        else:
            return []
        return self.core.on(event, self._now())

    async def _carry_out(self, action) -> None:
        """One action of the core that needs no decision of the loop driving it."""
        if isinstance(action, lifecycle.Send):
            if isinstance(action.msg, control.Ready):  # as before: a Ready that cannot go is an error
                await self.net.send(action.to, control.encode(action.msg))
            else:
                with contextlib.suppress(Exception):
                    await self.net.send(action.to, control.encode(action.msg))
        elif isinstance(action, lifecycle.SendAll):
            await self.broadcast(control.encode(action.msg))
        else:
            self._act(action)

    def _act(self, action) -> None:
        """The actions that need no waiting (a send spawns a task)."""
        if isinstance(action, lifecycle.Say):
            self.say(action.text)
        elif isinstance(action, lifecycle.Record):
            self.event(action.kind, **dict(action.fields))
        elif isinstance(action, lifecycle.DegradeNode):
            if self.node is not None:
                self.node.degrade(action.reason)
        elif isinstance(action, lifecycle.EndEngine):
            self._end_engine(action.reason)
        elif isinstance(action, lifecycle.Apply):
            self._apply(action.sender, action.msg)
        elif isinstance(action, lifecycle.Send | lifecycle.SendAll):
            self.spawn(self._carry_out(action), "tell")
        else:
            raise AssertionError(f"no driver for {action!r}")

    def _apply(self, sender: str, msg) -> None:
        if isinstance(msg, control.Status):
            self._take_measured(msg.measured)
            self.state.edges.update(msg.edges)
            self.state.members = dict(msg.members)
            self.state.history = list(msg.history)  # the host's: who joined and left, when, why
            self._take_loads(msg.loads, msg.head_load)

    def _take_measured(self, measured) -> None:
        """The head's measured stage times, at a member that is not the head."""
        if measured and self.node is not None and not self.node.is_head:
            self.node.measured.update_from((k, v) for k, v in measured if k != "tok_s")

    def _take_loads(self, loads, head_load) -> None:
        """Every stage's load and the head's queue, as the host passed them on (validated)."""
        if isinstance(loads, dict):  # only the plan's stages are looked up: nothing else is kept
            for name in self.plan.ring if self.plan is not None else ():
                if (stage := clean_stage(loads.get(name))) is not None:
                    self.state.loads[name] = stage
        if head_load is not None:
            self.state.head_load = clean_head(head_load)

    def _ring_broke(self, reason: str, epoch: int | None = None) -> None:
        """This member's ring noticed a break itself (a stage failed, an edge closed, a bad
        frame): the host hears of it at once and replans (a member gone) or ends the session.
        A break of an older plan's ring (torn down for a replan) is no news."""
        if epoch is not None and epoch != self.epoch:
            return
        for action in self.core.on(lifecycle.RingBroke(self.cfg.name, reason, self.epoch), self._now()):
            self._act(action)

    def _end_engine(self, reason: str) -> None:
        """The session is over: requests waiting at this member's API for a ring fail now."""
        if self.engine is not None:
            self.engine.end(reason)

    async def broadcast(self, body: dict) -> None:
        for n in list(self.net.roster()) if self.net is not None else []:
            if n != self.cfg.name:
                with contextlib.suppress(Exception):
                    await self.net.send(n, body)

    # --- plan → weights → shard → ring ----------------------------------------------------------

    async def _prepare(self, msg: control.PlanMessage, fetch_from: str | None) -> None:
        from backends import ShardSpec, load_shard
        from backends.gguf import open_model
        from kafila.models import load_tokenizer

        cfg = self.cfg
        await self._teardown_ring(f"the session is replanning ({msg.reason or 'a new plan'})")
        self._set_plan(msg.epoch, msg.plan, msg.session.to_json())
        role, session = self.role, self.state.session
        self._step_to("fetching")
        if fetch_from is None:
            self.model_path = cfg.model_path
            self.state.weights = {"received_bytes": 0, "tensor_bytes": 0, "source": "own file"}
        else:
            async def fetch() -> tuple[str, dict]:
                return await self._fetch(Manifest.from_json(msg.manifest or {}), fetch_from)

            self.model_path, self.state.weights = await _step(
                f"{cfg.name} could not fetch its weights from {self._who(fetch_from)}", fetch())
        self._step_to("building")
        is_head = role.head == cfg.name
        what = f"blocks [{role.first}, {role.last}){' + head' if is_head else ''} on {cfg.backend}"

        key = (self.model_path, role.first, role.last, is_head, session["precision"])

        async def build() -> None:
            self.shard = self._shard_key = None  # the old shard's memory goes before the new one's
            self.index = await asyncio.to_thread(open_model, self.model_path)
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.index)
            spec = ShardSpec(self.model_path, role.first, role.last, embed=is_head, head=is_head)
            self.shard = await asyncio.to_thread(load_shard, cfg.backend, spec, session["precision"])
            self._shard_key = key

        if key == self._shard_key:  # a replan that left this member's blocks as they were
            self.say(f"{cfg.name}: keeping {what}")
        else:
            self.say(f"{cfg.name}: building {what}")
            await _step(f"{cfg.name} could not build {what}", build())
        self._step_to("ring")
        await self._form_ring()

    def _step_to(self, step: str) -> None:
        for action in self.core.on(lifecycle.Step(step), self._now()):
            self._act(action)

    async def _fetch(self, manifest: Manifest, host: str) -> tuple[str, dict]:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )  # fmt: skip

        from kafila.session.transfer import Lanes, check_local_file, fetch_weights

        cfg = self.cfg
        if cfg.local_model and await asyncio.to_thread(check_local_file, cfg.local_model, manifest):
            self.say(f"{cfg.name}: using the local copy {cfg.local_model} (same SHA-256)")
            return cfg.local_model, {"received_bytes": 0, "tensor_bytes": manifest.tensor_bytes,
                                     "source": "local file"}  # fmt: skip
        path = local_copy_path(cfg.cache_dir, manifest)
        self.state.weights = {"source": "host", "tensor_bytes": manifest.tensor_bytes, "done_bytes": 0,
                              "total_bytes": manifest.tensor_bytes, "state": "connecting"}  # fmt: skip
        edge = await self.net.connect(host)
        # the TCP lane tries where the edge already reached the host first (its punched address)
        prefer = punched_host(edge)
        lanes = None if cfg.weights_lane == "quic" else Lanes(lambda offer: bulk_dial(offer, prefer))

        def lane() -> str:
            return lanes.lane if lanes is not None else "quic"

        try:
            reader, writer = await edge.open_stream()
            with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
                          disable=not self.console.is_terminal) as bar:  # fmt: skip
                task = bar.add_task(f"{cfg.name}: weights", total=manifest.tensor_bytes)
                live = TransferProgress(manifest.tensor_bytes, time.monotonic())

                def progress(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)
                    live.update(done, time.monotonic(), total)  # /status and the page, live
                    self.state.weights = {"source": "host", "tensor_bytes": manifest.tensor_bytes,
                                          "lane": lane(), **live.as_dict()}  # fmt: skip

                stats = await fetch_weights(reader, writer, cfg.name, manifest, path, progress,
                                            self._shard_check(manifest), lanes)  # fmt: skip
        finally:
            await edge.close()
        live.finish(time.monotonic())
        mb = stats["received_bytes"] / 1e6
        secs = max(stats["seconds"], 1e-6)
        how = ("over TCP" if stats["lane"] == "tcp" else
               f"over the QUIC stream ({lanes.note})" if lanes is not None and lanes.note else "over the QUIC stream")
        self.say(f"{cfg.name}: weights ready: {stats['fetched_tensors']} of {len(manifest.tensors)} "
                 f"tensors fetched, {mb:.1f} MB in {secs:.1f} s ({mb / secs:.1f} MB/s {how}), SHA-256 verified")  # fmt: skip
        self.event("weights", **stats)
        self.state.weights = {**live.as_dict(), **stats, "source": "host"}
        if lanes is not None and lanes.note:
            self.state.weights["lane_note"] = lanes.note[:300]
        return path, self.state.weights

    def _candidate_hosts(self, name: str) -> list[str]:
        """The IPs a member's roster entry names (its edge's punch candidates)."""
        info = self.net.roster().get(name) if self.net is not None else None
        return [h for h, _ in getattr(info, "candidates", None) or ()]

    def _who(self, name: str) -> str:
        """A member as a person finds it: its name and the address it joined from."""
        info = self.net.roster().get(name) if self.net is not None else None
        cands = getattr(info, "candidates", None) or ()
        return f"{name} ({cands[0][0]})" if cands else name

    async def _drafter(self, context: int):
        """(draft.ModelDrafter, "draft") at a head that has a draft model (--draft), else
        (None, "ngram"): a head without one speculates with n-grams, and says so."""
        if not self.cfg.draft_path:
            self.say(f"{self.cfg.name}: the session drafts with a draft model but this head has none "
                     "(kafila join --draft GGUF): drafting with n-grams instead")  # fmt: skip
            return None, "ngram"
        from kafila.session.draft import ModelDrafter, open_draft

        draft = open_draft(self.cfg.draft_path, self.index)  # another vocabulary: one line
        precision = self.state.session.get("precision", "serving")
        drafter = await asyncio.to_thread(ModelDrafter.build, draft, self.cfg.backend, precision, context)
        self.say(f"{self.cfg.name}: drafting with {draft.name} on {self.cfg.backend}")
        return drafter, "draft"

    def _shard_check(self, manifest: Manifest):
        """For fetch_weights: once the copy's header is verified, the manifest must be exactly
        this member's shard of that model (weights.check_shard). Blocking. None without a plan
        (a fetch on its own, as in tests): there is no shard to check against."""
        role = self.role
        if role is None:
            return None

        def check(path: str) -> None:
            from backends.gguf import open_model

            try:
                index = open_model(path)
            except BadInput as exc:
                raise WeightError(f"the model header the host sent cannot be read: {exc}") from None
            check_shard(manifest, index, role.first, role.last, role.head == self.cfg.name)

        return check

    async def _accept_loop(self) -> None:
        while True:
            edge = await self.net.accept()
            self.spawn(self._on_edge(edge), f"edge-{edge.peer}")

    async def _on_edge(self, edge) -> None:
        try:
            reader, writer = await edge.accept_stream()
            hello = await read_frame(reader, None)
        except Exception as exc:
            log.warning("edge from %s: %s", edge.peer, exc)
            await edge.close()
            return
        if not isinstance(hello, Hello):
            await edge.close()
            return
        if hello.purpose == "ring":
            why = await self._ring_refusal(hello, edge)
            if why is not None:  # one line, no traceback: a member that lies is not our bug
                log.warning("ring stream from %s dropped: %s", edge.peer, why)
                await edge.close()
                return
            fut = self._pred_future(hello.epoch)
            if fut.done():
                await edge.close()
                return
            self._ring_edges.append(edge)
            if hello.bulk:
                try:
                    listener = await self.bulk_listener() if self.cfg.ring_lane != "quic" else None
                    reader, lane = await offer_lane(reader, writer, listener)
                except StreamClosed as exc:
                    log.warning("ring stream from %s dropped: %s", edge.peer, exc)
                    await edge.close()
                    return
                self._lanes_out.append(lane)
                if fut.done():  # a replan while the lane was offered: this stream is stale
                    await lane.close()
                    await edge.close()
                    return
            fut.set_result((edge, reader, writer))
        else:
            await self.serve_weights(edge, reader, writer, hello)

    async def _ring_refusal(self, hello: Hello, edge) -> str | None:
        """Why a ring Hello may not become the predecessor stream (None: it may), once the plan
        it was opened for says who the predecessor is (a Hello may come before that plan: at a
        replan the predecessor may learn the new plan first)."""
        deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_S
        while self.epoch < hello.epoch or not self._planned.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return f"no plan {hello.epoch} arrived"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._epoch_changed.wait(), left)
        if hello.epoch < self.epoch:
            return f"it was opened for plan {hello.epoch}; this member is on plan {self.epoch}"
        assert self.role is not None
        return ring_hello_refusal(hello.name, edge.peer, self.role.predecessor(self.cfg.name))

    def _pred_future(self, epoch: int) -> asyncio.Future:
        if epoch not in self._pred_streams:
            self._pred_streams[epoch] = asyncio.get_running_loop().create_future()
        return self._pred_streams[epoch]

    def _set_plan(self, epoch: int, plan: dict | Plan, session: dict) -> None:
        """This member's role in plan `epoch`; ring Hellos waiting for it go on."""
        self.role = role_of(plan, self.cfg.name)
        self.plan = plan if isinstance(plan, Plan) else Plan.from_json(plan)
        self.state.plan, self.state.session = self.plan.to_json(), session
        self.epoch = epoch
        for old in [e for e in self._pred_streams if e < epoch]:
            self._pred_streams.pop(old)
        self._planned.set()
        self._epoch_changed.set()
        self._epoch_changed = asyncio.Event()

    async def _teardown_ring(self, reason: str) -> None:
        """Before a replan: this member's ring node and ring edges go (its shard and weights stay).
        Requests typed here wait in RingEngine and resume on the next ring."""
        node, self.node = self.node, None
        if node is not None:
            node.on_degraded = None  # a break we make is no news to the host
            node.degrade(reason)
            with contextlib.suppress(Exception):
                await node.close()
        await self._close_ring_edges()

    async def serve_weights(self, edge, reader, writer, hello: Hello | None = None) -> None:
        await edge.close()  # only the host serves weights

    async def _form_ring(self) -> None:
        role, me, epoch = self.role, self.cfg.name, self.epoch
        assert role is not None
        limits = Limits(hidden=self.index.hparams.hidden, context=int(self.state.session["context"]),
                        slots=int(self.state.session["concurrency"]),
                        vocab=self.index.hparams.vocab)  # fmt: skip
        speculate = _speculate_mode(self.state.session.get("speculate"))
        drafter = None
        if speculate == "draft" and me == role.head:
            drafter, speculate = await self._drafter(limits.context)
        # stages on one machine share its cores: they do not run side by side, so the head keeps
        # one micro-batch per machine of the ring (pipelining), not one per stage
        roster = self.net.roster() if self.net is not None else {}
        machines = {n: str((roster[n].descriptor or {}).get("machine") or n) if n in roster else n for n in role.ring}
        # OpenVINO pads a micro-batch's rows to its longest, MLX does not: the live optimiser's cost
        backends = [self.cfg.backend if n == me else str((roster[n].descriptor or {}).get("backend", "openvino"))
                    if n in roster else "openvino" for n in role.ring]  # fmt: skip
        self.node = RingNode(me, role.head, role.ring, self.shard, limits, machines=machines,
                             edge_rtts=self._edge_rtts,
                             eos_ids=frozenset(self.tokenizer.eos_ids),
                             on_degraded=lambda why: self._ring_broke(why, epoch),
                             speculate=speculate, drafter=drafter,
                             max_queued=session_value(self.state.session, "max_queued", DEFAULT_MAX_QUEUED,
                                                      0, MAX_QUEUED_LIMIT),
                             batch_rows=self.state.session.get("batch_rows", True) is not False,
                             dipsd=self.state.session.get("dipsd", True) is not False,
                             prompt_cache=self.state.session.get("prompt_cache", True) is not False,
                             padded_rows=any(b != "mlx" for b in backends))  # fmt: skip
        if len(role.ring) == 1:
            self.node.start()
            return
        pred_stream = self._pred_future(epoch)
        succ = role.successor(me)

        async def edge_to_successor():
            edge = await self.net.connect(succ)
            self._ring_edges.append(edge)
            reader, writer = await edge.open_stream()
            dial = None
            info = self.net.roster().get(succ)
            peer = (succ, info.fingerprint if info is not None else None)
            if self.cfg.ring_lane != "quic" and peer not in self._lanes_broken:
                async def dial(offer):  # where the edge reached it (by now), then where it said it is
                    return await bulk_dial(offer, prefer=punched_host(edge) + self._candidate_hosts(succ))
            writer.write(encode(Hello(me, "ring", epoch, bulk=dial is not None)))
            await writer.drain()
            try:
                writer, lane = await take_lane(reader, writer, dial, self.cfg.send_delay_ms)
            except StreamClosed as exc:
                raise Refused(f"{self._who(succ)} closed the ring stream from {me}: {exc}") from None
            lane.peer = peer
            if peer in self._lanes_broken:
                lane.note = "its TCP lane broke in an earlier plan while the QUIC edge stayed up"
            self._lanes_out.append(lane)
            return edge, lane, writer

        self.succ_edge, self.succ_lane, writer = await _step(f"the ring edge from {me} to {self._who(succ)}",
                                                             edge_to_successor(), RING_EDGE_TIMEOUT_S)  # fmt: skip
        try:
            # the predecessor opens its edge once its own weights and shard are ready
            _, reader, _ = await asyncio.wait_for(pred_stream, READY_TIMEOUT_S)
        except TimeoutError:
            raise Refused(f"the ring edge from {self._who(role.predecessor(me))} to {me} was not up "
                          f"within {READY_TIMEOUT_S:g} s") from None  # fmt: skip
        self.node.start(reader, writer)

    async def _start_api(self) -> None:
        """The API is up from the start (503 while forming), so a busy port fails at once."""
        self.engine = RingEngine("", 0, None, self.status, resume_wait_s=RESUME_WAIT_S)
        if self.cfg.api is not None:
            from kafila.api import start_api

            host, port = self.cfg.api
            for i in range(self.cfg.api_tries):
                try:
                    self.api = await start_api(self.engine, host, port + i)
                    break
                except BadInput:
                    if i == self.cfg.api_tries - 1:
                        raise

    async def _start_serving(self) -> None:
        cfg = self.cfg
        engine = self.engine
        engine.model_name = self.state.session.get("model") or self.index.name
        engine.context_length = int(self.state.session["context"])
        engine._tokenizer = self.tokenizer
        engine.set_node(self.node)
        if self.core.degraded:
            self.node.degrade(self.core.degraded)
        if self.api is not None:
            self.say(f"{cfg.name}: serving; API at {self.api.url}/v1 (status: {self.api.url}/status)")
            self.event("serving", api=self.api.url, name=cfg.name)
        else:
            self.say(f"{cfg.name}: serving")
            self.event("serving", api=None, name=cfg.name)

    async def _serve_plan(self, first: bool) -> None:
        """Every member is ready on the current plan: the first time the API starts serving;
        after a replan the new ring takes over and requests waiting in RingEngine resume."""
        if first:
            await self._start_serving()
            return
        self.engine.context_length = int(self.state.session["context"])
        self.engine.set_node(self.node)
        self.say(f"{self.cfg.name}: serving again (plan {self.epoch}, ring {' → '.join(self.role.ring)})")
        self.event("serving", api=self.api.url if self.api is not None else None, name=self.cfg.name,
                   epoch=self.epoch)  # fmt: skip

    async def _report_edges(self) -> None:
        while True:
            edge = getattr(self, "succ_edge", None)
            if edge is not None and self.net is not None:
                node = self.node
                head = node is not None and node.is_head  # the head times every stage
                try:
                    report = control.EdgeReport(edge_stats(edge, self.succ_lane), None if node is None else node.stage_load(),
                                                node.measured.as_pairs() if head else None,
                                                node.head_load(MAX_REPORTED_REQUESTS) if head else None)  # fmt: skip
                except control.ControlError as exc:  # ours: a bug to see, not a reason to stop reporting
                    log.warning("edge report not sent: %s", exc)
                    report = None
                if report is not None:
                    with contextlib.suppress(Exception):
                        await self.net.send(self.host_name, control.encode(report))
            await asyncio.sleep(STATUS_EVERY_S)

    # --- status ----------------------------------------------------------------------------------

    def status(self) -> dict:
        s = self.state
        node = self.node
        m = node.measured if node is not None else None
        own_edge = getattr(self, "succ_edge", None)
        edges = dict(s.edges)
        if own_edge is not None:
            edges[self.cfg.name] = edge_stats(own_edge, self.succ_lane)
        plan, core = self.plan, self.core
        ring = list(plan.ring) if plan is not None else []
        blocks = dict(zip(ring, plan.blocks, strict=True)) if plan is not None else {}
        stage_ms = dict(zip(ring, plan.stage_ms, strict=True)) if plan is not None and plan.stage_ms else {}
        return {
            "session": {"name": self.cfg.name, "host": self.is_host or getattr(self, "host_name", None),
                        "state": "degraded" if (node and node.degraded) or core.degraded else core.status_name,
                        "degraded": (node.degraded if node else None) or core.degraded,
                        "model": s.session.get("model"),
                        "backend": self.cfg.backend,
                        "context": s.session.get("context"), "concurrency": s.session.get("concurrency"),
                        "concurrency_from": s.session.get("concurrency_from"),  # "memory" (auto) or "--concurrency"
                        "uptime_s": round(time.monotonic() - s.started, 1)},
            "members": s.members,
            "plan": s.plan,
            "stages": {n: {"blocks": blocks.get(n), "predicted_ms": _r6(stage_ms.get(n)),
                           "compute_ms": None if m is None else _r(m.stage_ms.get(n))}
                       for n in ring},
            "edges": [{"from": a, "to": ring_neighbour(ring, a), **e} for a, e in edges.items() if a in ring],
            "network_ms": None if m is None else _r(m.network_ms),
            "step_ms": None if m is None else _r(m.step_ms),
            "tok_s": None if m is None else _r(m.tok_s),
            "weights": s.weights,
            "memory": self._memory(),
            "requests": None if node is None or node.scheduler is None else {
                "active": node.scheduler.active, "queued": node.scheduler.queued,
                "free_slots": node.scheduler.free_slots, "parked": node.scheduler.parked},
            # the head's finished requests together: drafted, accepted, acceptance, tokens a trip
            "speculation": None if node is None or node.scheduler is None else {
                "mode": node.scheduler.speculate, **node.scheduler.spec.as_dict(),
                "trip_ms": node.scheduler.step_cost.as_dict(), "dipsd": node.core.dipsd_status()},
            "history": list(s.history),  # membership: joined, left, planned, serving, degraded
            "signaling": None if self.net is None else self.net.signaling(),  # to the rendezvous
            # per stage: requests holding a KV slot, rows in its last forward; the head's queue and
            # its requests with their tok/s (load.py: live here, relayed from the others)
            "load": ring_load(ring, self.cfg.name, None if node is None else node.stage_load(), s.loads,
                              (node.head_load(MAX_REPORTED_REQUESTS) if node is not None and node.is_head
                               else s.head_load)),
        }  # fmt: skip

    def _memory(self) -> dict:
        """RSS, peak RSS, PSS of this process against its shard's bytes (+ KV) and the plan's."""
        from kafila.session.memory import member_memory

        role, sess = self.role, self.state.session
        if role is None or self.index is None or not sess:
            return member_memory(None, 0, 0, False, 0, 0)
        return member_memory(self.index, role.first, role.last, role.head == self.cfg.name,
                             int(sess["context"]), int(sess["concurrency"]), self.cfg.backend,
                             self.IS_ANCHOR)  # fmt: skip

    @property
    def code(self) -> str:
        return self._code

    @code.setter
    def code(self, value: str) -> None:
        self._code = value


def machine_id() -> str:
    """A short hash naming this machine (its kernel's boot id: containers and network namespaces
    of one host share it, as they share its cores), so a head can tell members that share one."""
    import hashlib

    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw:
            return hashlib.sha256(f"kafila-machine|{raw}".encode()).hexdigest()[:16]
    import socket

    return hashlib.sha256(f"kafila-machine|{socket.gethostname()}".encode()).hexdigest()[:16]


async def cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has ended. asyncio.wait, not `await task` under
    suppress(CancelledError): that also swallowed a cancellation of the caller arriving then
    (a host told to leave went on to replan, and was killed at the grace deadline)."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: an error of a task we gave up on is not news


async def _step(what: str, coro, timeout_s: float | None = None):
    """One step of forming (fetch, build, a ring edge): whatever stops it becomes one line that
    says which step, with whom, and why ("the ring edge from m2 to m3 (10.0.0.3) was not up
    within 60 s"); never a bare TimeoutError or an empty reason."""
    try:
        return await (coro if timeout_s is None else asyncio.wait_for(coro, timeout_s))
    except TimeoutError:
        raise Refused(f"{what} was not up within {timeout_s:g} s" if timeout_s is not None
                      else f"{what}: it timed out") from None  # fmt: skip
    except Exception as exc:
        raise Refused(f"{what}: {describe_error(exc)}") from exc


def _r(v):
    return None if v is None else round(v, 3)


def _r6(v):
    return None if v is None else round(v, 6)  # as Plan.to_json


def lan_ip() -> str:
    """This machine's address on the route out (its LAN address behind a home router)."""
    import socket

    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
        return s.getsockname()[0]
    return "127.0.0.1"


def punched_host(edge) -> list[str]:
    """[the IP the edge reached its peer at directly], or [] (relayed): a TCP lane tries it first."""
    direct = (getattr(edge, "stats", dict)() or {}).get("direct_address")
    return [direct.rpartition(":")[0]] if direct else []


def edge_stats(edge, lane=None) -> dict:
    """An edge's row for /status; with its ring_lane.Lane, what carries the ring's frames."""
    s = edge.stats()
    row = {k: s.get(k) for k in ("peer", "kind", "predicted", "rtt_ms", "bytes_sent", "bytes_received",
                                 "time_to_data_s", "time_to_direct_s")}  # fmt: skip
    return row | (lane.as_dict() if lane is not None else {})


def stdin_is_terminal() -> bool:
    try:
        return sys.stdin.isatty()
    except (ValueError, OSError):
        return False


__all__ = ["BadInput", "Participant", "SessionConfig", "role_of"]


def _speculate_mode(value) -> str:
    """The session's drafter as the host sent it; anything unknown (an older host) is "off"."""
    from kafila.session.speculate import SPECULATE_MODES

    return value if isinstance(value, str) and value in SPECULATE_MODES else "off"
