"""This process's stage of a session, host or member alike: the plan and its role, the shard,
the ring node, the API's engine, what it knows of the session (`state`) and `/status`.

A driver (participant.Participant, host.HostParticipant) owns one Stage and the lifecycle core;
the stage tells the driver what it needs decided through two callables it is given: `act` (carry
out a lifecycle action, e.g. after a Step) and `on_ring_broke(reason, epoch)`. The host hands
it `weight_server` (only the host serves weights); a member leaves it None."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from rich.console import Console

from backends import DEFAULT_KQUANT
from backends.errors import BadInput, Refused
from kafila import __version__
from kafila.engine.ring import RESUME_WAIT_S, RingEngine
from kafila.session.control import lifecycle
from kafila.session.control import messages as control
from kafila.session.control.config import SessionConfig
from kafila.session.control.fetch import fetch_weights_from
from kafila.session.control.pricing import PROBE_FIELDS, predictions
from kafila.session.control.ring_forming import RingLinks, step
from kafila.session.control.status import (
    HISTORY_KINDS,
    HISTORY_MAX,
    RequestsView,
    SessionView,
    StageView,
    State,
    StatusPage,
    history_entry,
    rounded,
)
from kafila.session.control.system import (SEND_ERRORS, alone_on_machine, cancel_and_wait, close_quietly, edge_stats,
                                           machine_id)
from kafila.session.ring.load import MAX_REPORTED_REQUESTS, clean_head, clean_stage, ring_load
from kafila.session.ring.node import RingNode
from kafila.session.ring.prefix import WHOLE
from kafila.session.ring.slots import DEFAULT_MAX_QUEUED, MAX_QUEUED_LIMIT, session_value
from kafila.session.weights.manifest import Manifest
from kafila.session.wire.frames import Limits
from planner import Plan, PlanInputError, ring_neighbour

log = logging.getLogger("kafila.session.control")
STATUS_EVERY_S = 2.0


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


class Stage:
    def __init__(self, cfg: SessionConfig, console: Console, core, *, is_host: bool, act, on_ring_broke) -> None:
        self.cfg = cfg
        self.console = console
        self.core = core  # the driver's lifecycle core: /status reads its phase
        self.is_host = is_host  # planner.member_bytes: only the host (the anchor) adds anchor_bytes
        self.act = act
        self.on_ring_broke = on_ring_broke
        self.weight_server = None  # the host's: serves a member's weight stream (edge, reader, writer, hello)
        self.host_name: str | None = cfg.name if is_host else None
        self.net = None  # kafila.net.Member
        self.state = State()
        self.plan: Plan | None = None
        self.role: Role | None = None
        # plan generations: 1 for the first plan, +1 at every replan; a ring Hello names the
        # generation it was opened for, and waits until this member knows that plan's roles
        self.epoch = 0
        self.node: RingNode | None = None
        self.engine: RingEngine | None = None
        self.api = None
        self.shard = None
        self.index = None
        self.tokenizer = None
        self.model_path: str | None = None
        self._shard_key: tuple | None = None  # what self.shard was built for (reused when unchanged)
        self.ring = RingLinks(self)
        self.transfers = None  # the host's: a callable giving /status its "transfers"
        self._tasks: set[asyncio.Task] = set()

    # --- what a person and scripts see ---------------------------------------------------------------

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)  # commands and URLs stay whole to copy

    def event(self, kind: str, **fields) -> None:
        if kind in HISTORY_KINDS:
            self.state.history.append(history_entry(kind, fields))
            del self.state.history[:-HISTORY_MAX]
        if self.cfg.json_events:
            print(json.dumps({"event": kind, **fields}, default=str), flush=True)

    # --- tasks --------------------------------------------------------------------------------------

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("task %s failed: %r", task.get_name(), task.exception())

    async def recv_unless(self, *others: asyncio.Future):
        """The next session event, or None when one of `others` finishes first."""
        get = asyncio.ensure_future(self.net.recv())
        try:
            await asyncio.wait({get, *others}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(get)
        # an event that arrived while the recv was being cancelled is still returned, not lost
        return get.result() if get.done() and not get.cancelled() else None

    def now(self) -> float:
        """The lifecycle cores' clock: the event loop's (monotonic)."""
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return time.monotonic()

    # --- talking to the others -----------------------------------------------------------------------

    async def tell(self, to: str, msg) -> bool:
        """A control message to `to`; False (logged) when it cannot go: it left, or signaling is down."""
        try:
            await self.net.send(to, control.encode(msg))
        except SEND_ERRORS as exc:
            log.info("%s not told %s: %s", to, type(msg).__name__, exc)
            return False
        return True

    async def broadcast(self, msg) -> None:
        for n in list(self.net.roster()) if self.net is not None else []:
            if n != self.cfg.name:
                await self.tell(n, msg)

    def candidate_hosts(self, name: str) -> list[str]:
        """The IPs a member's roster entry names (its edge's punch candidates)."""
        info = self.net.roster().get(name) if self.net is not None else None
        return [h for h, _ in getattr(info, "candidates", None) or ()]

    def who(self, name: str) -> str:
        """A member as a person finds it: its name and the address it joined from."""
        info = self.net.roster().get(name) if self.net is not None else None
        cands = getattr(info, "candidates", None) or ()
        return f"{name} ({cands[0][0]})" if cands else name

    def descriptor(self) -> dict:
        from kafila.probe import probe_device

        # measured on what it will serve on; members of one machine probe one at a time
        p = alone_on_machine(lambda: probe_device(quick=True, backend=self.cfg.backend))
        if p.cpu_period_ms:  # the probe spent a CPU quota's budget: let it refill before the join's
            time.sleep(2 * p.cpu_period_ms / 1e3)  # RTT samples, or they wait out a stalled period
        figures = {k: getattr(p, k) for k in PROBE_FIELDS if k != "machine"}  # what the host plans with
        return {"backend": self.cfg.backend, "probed_on": p.backend, "memory_gb": round(p.memory_gb, 3), **figures,
                "machine": machine_id(), "protocol": control.PROTOCOL, "version": __version__}  # fmt: skip

    # --- plan → weights → shard → ring ----------------------------------------------------------

    def set_plan(self, epoch: int, plan: dict | Plan, session: dict) -> None:
        """This member's role in plan `epoch`; ring Hellos waiting for it go on."""
        self.role = role_of(plan, self.cfg.name)
        self.plan = plan if isinstance(plan, Plan) else Plan.from_json(plan)
        self.state.plan, self.state.session = self.plan.to_json(), session
        self.epoch = epoch
        self.ring.planned(epoch)

    def step_to(self, name: str) -> None:
        for action in self.core.on(lifecycle.Step(name), self.now()):
            self.act(action)

    async def prepare(self, msg: control.PlanMessage, fetch_from: str | None) -> None:
        """Plan → weights (from `fetch_from`; None: the host's own file) → shard → ring."""
        from backends import ShardSpec, load_shard
        from backends.gguf import open_model
        from kafila.models import load_tokenizer

        cfg = self.cfg
        await self.teardown_ring(f"the session is replanning ({msg.reason or 'a new plan'})")
        self.set_plan(msg.epoch, msg.plan, msg.session.to_json())
        role, session = self.role, self.state.session
        self.step_to("fetching")
        if fetch_from is None:
            self.model_path = cfg.model_path
            self.state.weights = {"received_bytes": 0, "tensor_bytes": 0, "source": "own file"}
        else:
            async def fetch() -> tuple[str, dict]:
                return await fetch_weights_from(self, Manifest.from_json(msg.manifest or {}), fetch_from)

            self.model_path, self.state.weights = await step(
                f"{cfg.name} could not fetch its weights from {self.who(fetch_from)}", fetch())
        self.step_to("building")
        is_head = role.head == cfg.name
        what = f"blocks [{role.first}, {role.last}){' + head' if is_head else ''} on {cfg.backend}"
        kquant = session.get("kquant", DEFAULT_KQUANT)
        key = (self.model_path, role.first, role.last, is_head, session["precision"], kquant)

        async def build() -> None:
            self.shard = self._shard_key = None  # the old shard's memory goes before the new one's
            self.index = await asyncio.to_thread(open_model, self.model_path)
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.index)
            spec = ShardSpec(self.model_path, role.first, role.last, embed=is_head, head=is_head)
            options = {"kquant": kquant} if cfg.backend == "openvino" else {}
            self.shard = await asyncio.to_thread(load_shard, cfg.backend, spec, session["precision"], **options)
            self._shard_key = key

        if key == self._shard_key:  # a replan that left this member's blocks as they were
            self.say(f"{cfg.name}: keeping {what}")
        else:
            self.say(f"{cfg.name}: building {what}")
            await step(f"{cfg.name} could not build {what}", build())
        self.step_to("ring")
        await self.form_ring()

    async def form_ring(self) -> None:
        role, me, epoch, session = self.role, self.cfg.name, self.epoch, self.state.session
        assert role is not None
        limits = Limits(hidden=self.index.hparams.carried, context=int(session["context"]),
                        slots=int(session["concurrency"]), vocab=self.index.hparams.vocab)  # fmt: skip
        speculate = _speculate_mode(session.get("speculate"))
        drafter = None
        if speculate == "draft" and me == role.head:
            drafter, speculate = await self._drafter(limits.context)
        elif speculate == "mtp":  # the model's own draft head drafts at the head; the ring runs its steps
            drafter, speculate = await self._mtp_drafter(limits.context) if me == role.head else (None, "draft")
        # --speculate origin: a member with a draft model (--draft) drafts its own requests with it
        origin_drafter = await self._origin_drafter(limits.context) if speculate == "origin" else None
        # stages on one machine share its cores: they do not run side by side, so the head keeps
        # one micro-batch per machine of the ring (pipelining), not one per stage
        roster = self.net.roster() if self.net is not None else {}
        machines = {n: str((roster[n].descriptor or {}).get("machine") or n) if n in roster else n for n in role.ring}
        # OpenVINO pads a micro-batch's rows to its longest, MLX does not: the live optimiser's cost
        backends = [self.cfg.backend if n == me else str((roster[n].descriptor or {}).get("backend", "openvino"))
                    if n in roster else "openvino" for n in role.ring]  # fmt: skip
        self.node = RingNode(me, role.head, role.ring, self.shard, limits, machines=machines,
                             edge_rtts=self._edge_rtts, eos_ids=frozenset(self.tokenizer.eos_ids),
                             on_degraded=lambda why: self.on_ring_broke(why, epoch),
                             speculate=speculate, drafter=drafter, origin_drafter=origin_drafter,
                             max_queued=session_value(session, "max_queued", DEFAULT_MAX_QUEUED, 0, MAX_QUEUED_LIMIT),
                             batch_rows=session.get("batch_rows", True) is not False,
                             dipsd=session.get("dipsd", True) is not False,
                             prompt_cache=WHOLE if session.get("prompt_cache") == WHOLE
                             else session.get("prompt_cache", True) is not False,
                             padded_rows=any(b != "mlx" for b in backends))  # fmt: skip
        if len(role.ring) == 1:
            self.node.start()
            return
        writer = await self.ring.to_successor(me, role.successor(me), epoch)
        reader = await self.ring.from_predecessor(me, role.predecessor(me), epoch)
        self.node.start(reader, writer)

    async def _drafter(self, context: int):
        """(draft.ModelDrafter, "draft") at a head that has a draft model (--draft), else
        (None, "ngram"): a head without one speculates with n-grams, and says so."""
        if not self.cfg.draft_path:
            self.say(f"{self.cfg.name}: the session drafts with a draft model but this head has none "
                     "(kafila join --draft GGUF): drafting with n-grams instead")  # fmt: skip
            return None, "ngram"
        from kafila.session.ring.speculation.draft import ModelDrafter, open_draft

        draft = open_draft(self.cfg.draft_path, self.index)  # another vocabulary: one line
        precision = self.state.session.get("precision", "serving")
        kquant = self.state.session.get("kquant", DEFAULT_KQUANT)
        drafter = await asyncio.to_thread(ModelDrafter.build, draft, self.cfg.backend, precision, context, kquant)
        self.say(f"{self.cfg.name}: drafting with {draft.name} on {self.cfg.backend}")
        return drafter, "draft"

    async def _mtp_drafter(self, context: int):
        """(speculation.mtp.MtpDrafter, "draft") from the model's multi-token-prediction layer on the
        head's backend, else (None, "ngram") with the reason said (the host checked the file)."""
        from kafila.session.ring.speculation.mtp import MtpDrafter

        precision = self.state.session.get("precision", "serving")
        kquant = self.state.session.get("kquant", DEFAULT_KQUANT)
        try:
            drafter = await asyncio.to_thread(MtpDrafter.build, self.index, precision, context, kquant,
                                              self.cfg.backend)  # fmt: skip
        except BadInput as exc:
            self.say(f"{self.cfg.name}: {exc}: drafting with n-grams instead")
            return None, "ngram"
        self.say(f"{self.cfg.name}: drafting with {self.index.name}'s own multi-token-prediction layer")
        return drafter, "draft"

    async def _origin_drafter(self, context: int):
        """A draft.ModelDrafter for the requests typed here (--speculate origin), None without
        --draft (this member's drafts are then n-grams)."""
        if not self.cfg.draft_path:
            return None
        from kafila.session.ring.speculation.draft import ModelDrafter, open_draft

        draft = open_draft(self.cfg.draft_path, self.index)
        precision = self.state.session.get("precision", "serving")
        kquant = self.state.session.get("kquant", DEFAULT_KQUANT)
        drafter = await asyncio.to_thread(ModelDrafter.build, draft, self.cfg.backend, precision, context, kquant)
        self.say(f"{self.cfg.name}: drafting the requests typed here with {draft.name} on {self.cfg.backend}")
        return drafter

    async def teardown_ring(self, reason: str) -> None:
        """Before a replan: this member's ring node and ring edges go (its shard and weights stay).
        Requests typed here wait in RingEngine and resume on the next ring."""
        node, self.node = self.node, None
        if node is not None:
            node.on_degraded = None  # a break we make is no news to the host
            node.degrade(reason)
            await close_quietly("the ring node", node.close())
        await self.ring.close()

    # --- serving ------------------------------------------------------------------------------------

    async def start_api(self) -> None:
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

    def serve(self, first: bool) -> None:
        """Every member is ready on the current plan: the first time the API starts serving;
        after a replan the new ring takes over and requests waiting in RingEngine resume."""
        engine, name = self.engine, self.cfg.name
        engine.context_length = int(self.state.session["context"])
        url = self.api.url if self.api is not None else None
        if first:
            engine.model_name = self.state.session.get("model") or self.index.name
            engine._tokenizer = self.tokenizer
            engine.set_node(self.node)
            if self.core.degraded:
                self.node.degrade(self.core.degraded)
            self.say(f"{name}: serving; API at {url}/v1 (status: {url}/status)" if url else f"{name}: serving")
            self.event("serving", api=url, name=name)
            return
        engine.set_node(self.node)
        self.say(f"{name}: serving again (plan {self.epoch}, ring {' → '.join(self.role.ring)})")
        self.event("serving", api=url, name=name, epoch=self.epoch)

    def end_engine(self, reason: str) -> None:
        """The session is over: requests waiting at this member's API for a ring fail now."""
        if self.engine is not None:
            self.engine.end(reason)

    async def report_edges(self) -> None:
        """A member's: its successor edge and stage load (the head's measured times) to the host."""
        while True:
            edge, node = self.ring.succ_edge, self.node
            if edge is not None and self.net is not None:
                head = node is not None and node.is_head  # the head times every stage
                try:
                    report = control.EdgeReport(edge_stats(edge, self.ring.succ_lane),
                                                None if node is None else node.stage_load(),
                                                node.measured.as_pairs() if head else None,
                                                node.head_load(MAX_REPORTED_REQUESTS) if head else None)  # fmt: skip
                except control.ControlError as exc:  # ours: a bug to see, not a reason to stop reporting
                    log.warning("edge report not sent: %s", exc)
                    report = None
                if report is not None:
                    await self.tell(self.host_name, report)
            await asyncio.sleep(STATUS_EVERY_S)

    def apply(self, msg) -> None:
        """The host's status message, at a member."""
        if isinstance(msg, control.Status):
            self.take_measured(msg.measured)
            self.state.edges.update(msg.edges)
            self.state.members = dict(msg.members)
            self.state.history = list(msg.history)  # the host's: who joined and left, when, why
            self._take_loads(msg.loads, msg.head_load)

    def take_measured(self, measured) -> None:
        """The head's measured stage times, at a member that is not the head."""
        if measured and self.node is not None and not self.node.is_head:
            self.node.measured.update_from((k, v) for k, v in measured if k != "tok_s")

    def take_edge_report(self, sender: str, report: control.EdgeReport) -> None:
        """A member's edge report, at the host."""
        if report.stats is not None:
            self.state.edges[sender] = report.stats
        if (stage := clean_stage(report.load)) is not None:
            self.state.loads[sender] = stage
        if report.head_load is not None and self.role is not None and sender == self.role.head:
            self.state.head_load = clean_head(report.head_load)
        self.take_measured(report.measured)

    def _take_loads(self, loads, head_load) -> None:
        """Every stage's load and the head's queue, as the host passed them on (validated)."""
        if isinstance(loads, dict):  # only the plan's stages are looked up: nothing else is kept
            for name in self.plan.ring if self.plan is not None else ():
                if (stage := clean_stage(loads.get(name))) is not None:
                    self.state.loads[name] = stage
        if head_load is not None:
            self.state.head_load = clean_head(head_load)

    def _edge_rtts(self) -> dict:
        """Ring member → its successor edge's RTT (ms): the host's last status, and our own edge."""
        out = {n: e.get("rtt_ms") for n, e in self.state.edges.items() if isinstance(e, dict)}
        if self.ring.succ_edge is not None:
            out[self.cfg.name] = edge_stats(self.ring.succ_edge).get("rtt_ms")
        return out

    # --- /status ------------------------------------------------------------------------------------

    def status(self) -> dict:
        return self.status_page().to_json()

    def status_page(self) -> StatusPage:
        s, node, plan, core = self.state, self.node, self.plan, self.core
        m = node.measured if node is not None else None
        edges = dict(s.edges)
        if self.ring.succ_edge is not None:
            edges[self.cfg.name] = edge_stats(self.ring.succ_edge, self.ring.succ_lane)
        ring = list(plan.ring) if plan is not None else []
        blocks = dict(zip(ring, plan.blocks, strict=True)) if plan is not None else {}
        stage_ms = dict(zip(ring, plan.stage_ms, strict=True)) if plan is not None and plan.stage_ms else {}
        sched = None if node is None else node.scheduler
        session = SessionView(
            self.cfg.name, self.is_host or self.host_name,
            "degraded" if (node and node.degraded) or core.degraded else core.status_name,
            (node.degraded if node else None) or core.degraded, s.session.get("model"), self.cfg.backend,
            s.session.get("context"), s.session.get("concurrency"), s.session.get("concurrency_from"),
            round(time.monotonic() - s.started, 1))  # fmt: skip
        return StatusPage(
            session=session, members=s.members, plan=s.plan,
            stages={n: StageView(blocks.get(n), rounded(stage_ms.get(n), 6),  # 6: as Plan.to_json
                                 None if m is None else rounded(m.stage_ms.get(n))) for n in ring},
            edges=[{"from": a, "to": ring_neighbour(ring, a), **e} for a, e in edges.items() if a in ring],
            network_ms=None if m is None else rounded(m.network_ms),
            step_ms=None if m is None else rounded(m.step_ms),
            tok_s=None if m is None else rounded(m.tok_s),
            prediction=predictions(s.plan, {} if m is None else m.stage_ms, None if m is None else m.tok_s),
            weights=s.weights, memory=self._memory(),
            requests=None if sched is None else RequestsView(sched.active, sched.queued, sched.free_slots,
                                                             sched.parked),
            speculation=None if sched is None else {"mode": sched.speculate, **sched.spec.as_dict(),
                                                    "trip_ms": sched.step_cost.as_dict(),
                                                    "dipsd": node.core.dipsd_status()},
            history=list(s.history), signaling=None if self.net is None else self.net.signaling(),
            load=ring_load(ring, self.cfg.name, None if node is None else node.stage_load(), s.loads,
                           (node.head_load(MAX_REPORTED_REQUESTS) if node is not None and node.is_head
                            else s.head_load)),
            transfers=None if self.transfers is None else self.transfers())  # fmt: skip

    def _memory(self) -> dict:
        """RSS, peak RSS, PSS of this process against its shard's bytes (+ KV) and the plan's."""
        from backends.memory import memory_kind
        from kafila.session.ring.memory import member_memory

        role, sess = self.role, self.state.session
        if role is None or self.index is None or not sess:
            return member_memory(None, 0, 0, False, 0, 0)
        kind = memory_kind(self.cfg.backend, getattr(self.shard, "kquant", ""))
        return member_memory(self.index, role.first, role.last, role.head == self.cfg.name,
                             int(sess["context"]), int(sess["concurrency"]), kind, self.is_host,
                             _speculate_mode(sess.get("speculate")))  # fmt: skip

    # --- leaving ------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Every task this stage started, the API, the ring node and edges, signaling, the bulk lane."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            await cancel_and_wait(task)
        if self.api is not None:
            await close_quietly("the API", self.api.close())
            self.api = None
        if self.node is not None:
            await close_quietly("the ring node", self.node.close())
            self.node = None
        await self.ring.close()
        if self.net is not None:
            await close_quietly("signaling", asyncio.wait_for(self.net.close(), 3.0))
            self.net = None
        await self.ring.close_bulk()


def _speculate_mode(value) -> str:
    """The session's drafter as the host sent it; anything unknown (an older host) is "off"."""
    from kafila.session.ring.speculation.speculate import SPECULATE_MODES

    return value if isinstance(value, str) and value in SPECULATE_MODES else "off"


__all__ = ["STATUS_EVERY_S", "Role", "Stage", "role_of"]
