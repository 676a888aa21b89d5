"""The host's driver: open the session, wait for the members, plan, serve weights, replan as
members come, go or are dropped.

HostParticipant drives lifecycle.HostCore: `lifecycle` opens the session (_open_model,
_open_session), waits for the members (_wait_for_members, _hash), then forms a plan (_form,
_until_formed) and serves until the core asks for a replan (_next_replan). It holds a Stage
(stage.py: its own shard, ring and API, as every member's) and a HostWeights (the weight server).
It has no terminal code: whoever shows the host (the `host` command's console) is a HostView
fed with what happens, and presses Enter through `enter()`."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace

from rich.console import Console

from backends.errors import Refused, describe_error
from backends.kept import continues_whole
from backends.memory import RESIDENT_BYTES_PER_WEIGHT, memory_kind
from kafila import __version__
from kafila.net.codefile import write_private
from kafila.session.control import driving, lifecycle
from kafila.session.control import messages as control
from kafila.session.control.config import SessionConfig, session_context
from kafila.session.control.host_weights import HostWeights
from kafila.session.control.lifecycle import BREAK_GRACE_S  # noqa: F401 (re-exported)
from kafila.session.control.messages import PlanMessage, SessionTerms
from kafila.session.control.pricing import choose_context, model_reads, probe_fields
from kafila.session.control.preview import members_table, plan_summary, plan_table, predicted_tok_s  # noqa: F401
from kafila.session.control.replans import ReplanPacer
from kafila.session.control.stage import STATUS_EVERY_S, Stage
from kafila.session.control.system import alone_on_machine, cancel_and_wait, close_quietly, edge_stats, lan_ip
from kafila.session.ring.load import MAX_REPORTED_REQUESTS
from kafila.session.ring.prefix import WHOLE
from kafila.session.ring.slots import auto_slots, parse_concurrency, parse_max_queued
from planner import Plan

HISTORY_STATUS = 30  # membership events the host's status message carries to every member

log = logging.getLogger(__name__)


def member_row(name: str, info, state: str) -> dict:
    d = info.descriptor or {}
    return {"name": name, "nat": info.nat, "rtt_ms": round(info.rtt_ms, 2),
            "bandwidth_gbps": d.get("bandwidth_gbps"), "memory_gb": d.get("memory_gb"),
            "overhead_us": d.get("overhead_us"), "backend": d.get("backend"), "state": state}  # fmt: skip


def _resident_model(index, kinds: set[str], speculate: str = "off") -> dict:
    """The plan's model entry with memory in the members' backends' forms (backends.memory): one
    Model serves every member, so a mixed ring takes each memory figure from its largest backend.
    With --speculate mtp the head also holds the model's multi-token-prediction block, and its KV
    and rows per position of every request and of the parked ones (speculation.mtp.with_drafting_head)."""
    models = [index.planner_model(kind) for kind in sorted(kinds)]
    out = dict(models[0])
    for key in ("process_bytes", "anchor_bytes", "block_resident_bytes", "head_resident_bytes"):
        out[key] = max(m[key] for m in models)
    from kafila.session.ring.speculation.mtp import with_drafting_head

    return with_drafting_head(out, index, kinds, speculate)


def _kquant_form(kquant: str, precision: str) -> str:
    """The K-quant form the session's OpenVINO stages build: "auto" resolved as this host resolves
    it (ggml where the op builds; every member of one install alike)."""
    from backends.openvino.ggml_kernels import resolve

    return resolve(kquant, precision)


class HostView:
    """What the host shows a person beyond its lines of text: the members while it waits, each
    member's weights while a plan forms. This one shows nothing (scripts, tests); the `host`
    command's console draws them in a terminal and calls HostParticipant.enter() on Enter."""

    takes_enter = False  # a person can press Enter here (the host says so when a machine joins)

    def waiting(self, rows: list[dict], title: str) -> None:
        """The members in so far (member_row), while the host waits for them."""

    def waiting_done(self) -> None:
        """The host stopped waiting: it plans now."""

    def transfers(self, totals: dict[str, int]) -> None:
        """A plan forms: each member's weights, in bytes, about to be served."""

    def transfer(self, name: str, done: int, total: int) -> None:
        """Bytes of `name`'s weights served so far."""

    def transfers_done(self) -> None:
        """The plan formed (or was given up): its transfers are no news now."""

    def close(self) -> None:
        """The host is leaving."""


class HostParticipant(driving.Driver):
    """The host of a session (`kafila host`)."""

    def __init__(self, cfg: SessionConfig, console: Console | None = None, view: HostView | None = None) -> None:
        self.core = lifecycle.HostCore(cfg.name, cfg.auto_replan)
        self.stage = Stage(cfg, console or Console(stderr=True), self.core, is_host=True,
                           act=self._act, on_ring_broke=self._ring_broke)  # fmt: skip
        self.view = view or HostView()
        self.weights = HostWeights(self.stage, self.view)
        self.stage.weight_server = self.weights.serve
        self.stage.transfers = self.weights.status
        self.rendezvous_service = None
        self.leaving = False  # SIGINT/SIGTERM: the lifecycle is being cancelled
        self._left_out: set[str] = set()  # members of another session protocol (_leave_out)
        self._hash_cancel = threading.Event()  # stops a hashing worker when the host leaves
        self._plans_made = 0  # epochs handed out
        self._wake_event = asyncio.Event()
        self._enter_pressed = False  # Enter while serving: replan with joiners
        self._planning_now = asyncio.Event()  # Enter while waiting for the members: plan now
        self._pacer = ReplanPacer()
        self._index = None
        self._calibration: dict = {}  # the model's own blocks timed here (calibrate.py)
        self.session: dict = {}
        self._context_asked: int | None = cfg.context  # None: the model's own, capped by memory at each plan
        self._context_why: str | None = None  # the last context note said, said again only when it changes

    def enter(self) -> None:
        """A person pressed Enter at the host: plan now while waiting for the members, replan
        with the machines that joined while serving."""
        self._planning_now.set()
        self._enter_pressed = True
        self._wake()

    def _wake(self) -> None:
        """Wake the serving loop (_next_replan) to look again."""
        self._wake_event.set()
        self._wake_event = asyncio.Event()

    async def close(self) -> None:
        self._hash_cancel.set()  # a hashing worker stops at its next chunk
        self.view.close()
        await self.stage.close()
        if self.rendezvous_service is not None:
            service, self.rendezvous_service = self.rendezvous_service, None
            await close_quietly("the embedded rendezvous", service.close())

    async def lifecycle(self) -> int:
        """Open the session, wait for the members, plan, serve; replan as members come and go."""
        index, digests_task = await self._open_model()
        await self._open_session()
        await self._wait_for_members()
        await self._hash(index, digests_task)
        self._index = index
        self._calibration = await self._calibrate(index)  # with the members in: their probes are done
        cfg = self.cfg
        # "concurrency" is each plan's (auto: what its memory holds, set in _form)
        self.session = {"context": cfg.context, "concurrency": cfg.concurrency or 1, "precision": cfg.precision,
                        "kquant": cfg.kquant,
                        "speculate": cfg.speculate, "max_queued": cfg.max_queued, "batch_rows": cfg.batch_rows,
                        "dipsd": cfg.dipsd,
                        # hybrid and sliding-window models continue whole histories (backends/kept.py)
                        "prompt_cache": (WHOLE if continues_whole(index.hparams) else True) if cfg.prompt_cache else False,
                        "concurrency_from": "memory" if cfg.concurrency is None else "--concurrency",
                        "model": index.name, "sha256": self.weights.digests.sha256,
                        "protocol": control.PROTOCOL, "version": __version__}  # fmt: skip
        reason = await self._form(None)
        while reason is not None and not self.leaving:  # a member dropped or gone: the rest plan again
            reason = await self._form(reason)
        self.stage.serve(first=True)
        self.stage.spawn(self._broadcast_status(), "status")
        self._enter_pressed = False  # an Enter before serving was for the plan just made
        while not self.leaving:
            reason = await self._next_replan()
            while reason is not None and not self.leaving:  # a member left while we replanned: again
                reason = await self._form(reason)
            self.stage.serve(first=False)

    # --- opening the session -------------------------------------------------------------------

    async def _open_model(self):
        """The model's index, the session's context, this device's descriptor under way, and the
        digests hashing in a worker (returned as a task)."""
        from backends.gguf import open_model
        from kafila.session.weights.manifest import DigestCache, warm_header_cache

        stage, cfg = self.stage, self.cfg
        index = await asyncio.to_thread(open_model, cfg.model_path)
        if stage.engine is not None:
            stage.engine.model_name = index.name  # /v1/models answers while the session forms
        context, _ = session_context(cfg.context, index.hparams.context_length, index.name)
        stage.cfg = cfg = replace(cfg, context=context)
        parse_concurrency(cfg.concurrency)  # (the CLI checked already; a SessionConfig built in code too)
        parse_max_queued(cfg.max_queued)
        stage.say(f"{cfg.name}: measuring this device and indexing {index.name}…")
        self._desc_task = asyncio.create_task(asyncio.to_thread(stage.descriptor))

        # hashing a big file takes tens of seconds: in a worker, while members join (never on
        # this loop: heartbeats, the API and the signaling channel keep running)
        def digests() -> DigestCache:  # then the compressed header every member asks for first
            d = DigestCache.load(index, cfg.cache_dir, None, self._hash_cancel)
            warm_header_cache(cfg.model_path, index.file_bytes, d.header_len, self.weights.cache)
            return d

        return index, stage.spawn(asyncio.to_thread(digests), "digests")

    async def _calibrate(self, index) -> dict:
        """The model's own blocks timed on this machine against its probe (calibrate.py): the
        plan's model fields; {} where they cannot be measured (the plan then uses the probe alone)."""
        from kafila.session.control.calibrate import calibrate, too_big

        cfg, desc = self.cfg, await self._desc_task
        if cfg.backend != "openvino" or too_big(index):
            return {}
        form = _kquant_form(cfg.kquant, cfg.precision)
        try:  # as the probes: members of one machine measure one at a time
            out = await asyncio.to_thread(alone_on_machine, lambda: calibrate(index, desc, form, cfg.precision))
        except Exception as exc:  # noqa: BLE001 - a failed measurement prices with the probe alone
            self.stage.say(f"{cfg.name}: could not time {index.name}'s blocks ({type(exc).__name__}: {exc}); "
                           "the plan prices them from the probe alone")  # fmt: skip
            return {}
        if out:
            self.stage.say(f"{cfg.name}: {index.name}'s blocks timed here: {out['block_scale']:.2f}× what the probe "
                           f"predicts, {out['shared_scale']:.2f}× that again beside other members on one machine")
        return out

    async def _open_session(self) -> None:
        """Register with the rendezvous (an embedded one without --rendezvous) and print the code."""
        from kafila.net import Member

        stage, cfg = self.stage, self.cfg
        desc = await self._desc_task
        rv = cfg.rendezvous
        if rv is None:
            from kafila.net import Rendezvous

            # it serves this session only: a stranger cannot open sessions on the host's machine
            self.rendezvous_service = await Rendezvous.start(*cfg.embedded_listen, max_sessions=1)
            rv = self.rendezvous_service.address
            shown = rv if rv[0] not in ("0.0.0.0", "::") else (lan_ip(), rv[1])
            stage.say(f"{cfg.name}: embedded rendezvous on {rv[0]}:{rv[1]} (TCP+UDP; STUN also on UDP "
                      f"{self.rendezvous_service.stun_port2})")
        else:
            shown = rv
        stage.net = await Member.host(rv, cfg.name, desc, bind_host=cfg.bind_host,
                                      send_delay_ms=cfg.send_delay_ms, code_words=cfg.code_words,
                                      embedded_rendezvous=self.rendezvous_service is not None)  # fmt: skip
        self._show_code(stage.net.code, shown, rv)
        # a fresh code (after a wrong guess, or POST /admin/new-code): shown and written the same way
        stage.net.codes.on_new_code = lambda code: self._show_code(code, shown, rv, fresh=True)
        if stage.api is not None:
            stage.api.codes = stage.net.codes
        stage.spawn(stage.ring.accept_loop(), "accept")

    def _show_code(self, code: str, shown: tuple, rv: tuple, fresh: bool = False) -> None:
        if self.cfg.code_file:  # before the code is printed: whoever reads stdout may open the file next
            write_private(self.cfg.code_file, code + "\n")
        print(code, flush=True)
        self.stage.say(f"{'new ' if fresh else ''}session code: [bold]{code}[/bold]\non the other machines run:\n"
                       f"  kafila join {code} --rendezvous {shown[0]}:{shown[1]}")  # fmt: skip
        self.stage.event("code", code=code, rendezvous=f"{rv[0]}:{rv[1]}")

    async def _wait_for_members(self) -> None:
        """Until --expect members are in, or Enter at the host (HostView); the view shows them."""
        from kafila.net import MemberJoined, MemberLeft

        stage, cfg = self.stage, self.cfg
        stage.step_to("waiting")
        rows = lambda: [member_row(n, i, "joined") for n, i in stage.net.roster().items()]
        expect, enter = cfg.expect, self.view.takes_enter
        title = (f"waiting for {expect} members (press Enter to plan now)" if expect and enter
                 else f"waiting for {expect} members" if expect else "press Enter to plan")  # fmt: skip
        self._planning_now.clear()
        self.view.waiting(rows(), title)
        try:
            while not (expect and len(stage.net.roster()) >= expect) and not self._planning_now.is_set():
                waiter = asyncio.ensure_future(self._planning_now.wait())
                ev = await stage.recv_unless(waiter)
                waiter.cancel()
                if ev is None:
                    continue
                if isinstance(ev, MemberJoined):
                    r = member_row(ev.info.name, ev.info, "joined")
                    stage.say(f"member {r['name']} joined: NAT {r['nat']}, RTT {r['rtt_ms']} ms, "
                              f"{r['bandwidth_gbps']} GB/s, {r['memory_gb']} GB")  # fmt: skip
                    stage.event("joined", **r)
                elif isinstance(ev, MemberLeft):
                    stage.say(f"member {ev.name} left ({ev.reason})")
                    stage.event("left", name=ev.name, reason=ev.reason)
                self.view.waiting(rows(), title)
        finally:
            self.view.waiting_done()
        stage.state.members = {r["name"]: r for r in rows()}

    async def _hash(self, index, digests_task) -> None:
        stage, cfg = self.stage, self.cfg
        if not digests_task.done():
            stage.step_to("hashing")
            stage.say(f"{cfg.name}: hashing {index.name} ({index.file_bytes / 1e9:.2f} GB) before planning…")
        d = self.weights.digests = await digests_task
        stage.say(f"{cfg.name}: model digests {'computed' if d.hashed else 'read from the cache'} in "
                  f"{d.seconds:.1f} s ({d.cache_path or 'not cached'})")  # fmt: skip
        stage.event("digests", hashed=d.hashed, seconds=round(d.seconds, 3), cache=d.cache_path)

    # --- forming and replanning ----------------------------------------------------------------

    async def _form(self, reason: str | None) -> str | None:
        """Plan among the members in the roster (epoch + 1), send each its plan and manifest,
        prepare the host's own stage, wait until every ring member is ready and say serving.
        `reason` None: the session's first plan. A member that fails, leaves or is not ready in
        time is dropped and the rest plan again (the reason is returned). Refused (after telling
        every member) when the host cannot prepare its own stage or the plan cannot be served."""
        stage, cfg, loop = self.stage, self.cfg, asyncio.get_running_loop()
        if reason is not None:  # a member coming and going must not keep the ring replanning (replans.py)
            wait = self._pacer.delay(loop.time())
            if wait > 0:
                stage.say(f"{cfg.name}: {self._pacer.recent} replans within a minute: waiting {wait:.0f} s "
                          "before the next, for the session to settle")  # fmt: skip
                stage.event("replan-wait", seconds=wait)
                await asyncio.sleep(wait)
            self._pacer.record(loop.time())
        self._plans_made += 1  # (not stage.epoch + 1: a replan cut short never set stage.epoch)
        epoch = self._plans_made
        plan, slots = self._plan(self._index)
        self.session["concurrency"] = slots  # every member's slots and the head's scheduler follow it
        ranges, plan_json = plan.block_ranges(), plan.to_json()
        if reason is not None:
            stage.say(f"{cfg.name}: replanning (plan {epoch}): {reason}")
        stage.console.print(plan_table(plan_json, ranges))
        stage.say(f"{cfg.name}: plan preview: {plan_summary(plan_json)}")  # before anything is sent
        if plan.feasible:
            how = "as many as memory holds" if cfg.concurrency is None else "--concurrency"
            stage.say(f"{cfg.name}: {slots} requests at once ({how}), {cfg.max_queued} more may wait")
        stage.event("plan", plan=plan_json, epoch=epoch, reason=reason)
        outcome = await self._host_actions(self.core.on(lifecycle.PlanMade(epoch, plan, reason), loop.time()), None)
        if outcome is not None:  # never: an infeasible plan aborts
            return outcome
        terms = SessionTerms.from_json(self.session)
        for n in plan.ring:
            if n == cfg.name:
                continue
            a, b = ranges[n]
            manifest = self.weights.digests.manifest(a, b, n == plan.head)
            self.weights.expect(n, manifest.header_len + manifest.tensor_bytes, loop.time())
            # one that cannot be told is not ready in time (or its leaving replans first)
            await stage.tell(n, PlanMessage(epoch, plan, terms, manifest.to_json(), reason))
        for n in stage.net.roster():  # a member the plan leaves out (the planner found it no help)
            if n != cfg.name and n not in plan.ring:
                await stage.tell(n, control.Wait(f"plan {epoch} leaves {n} out; it waits for the next replan"))
        # the host's own stage: a task this loop owns (awaits, or cancels when it leaves)
        own = asyncio.create_task(stage.prepare(PlanMessage(epoch, plan, terms, None, reason), None), name="prepare")
        self.view.transfers({n: p.total_bytes for n, p in self.weights.transfers.items()})
        try:
            outcome = await self._until_formed(own, epoch)
        finally:
            self.view.transfers_done()
            await cancel_and_wait(own)
        if outcome is not None:
            return outcome
        own.result()
        stage.state.members = {r["name"]: r for r in self._rows("serving")}
        for n in plan.ring:
            if n != cfg.name:
                await stage.tell(n, control.Serving(epoch))
        return None

    async def _until_formed(self, own: asyncio.Task, epoch: int) -> str | None:
        """Feed HostCore until every ring member and the host's own stage are ready (None), a
        replan is due (its reason), or the session cannot form (Refused)."""
        stage, loop = self.stage, asyncio.get_running_loop()
        own_fed = False
        while True:
            if own.done() and not own_fed:
                own_fed = True
                exc = own.exception()
                error = None if exc is None else describe_error(exc)
                actions = self.core.on(lifecycle.Prepared(epoch, error, getattr(exc, "blame", ())), loop.time())
                outcome = await self._host_actions(actions, exc)
                if outcome is not None or not self.core.forming:
                    return outcome
                continue
            timer = self.core.timer()
            due = None if timer is None else asyncio.ensure_future(asyncio.sleep(max(0.0, timer - loop.time())))
            try:
                ev = await stage.recv_unless(*(() if own_fed else (own,)), *(() if due is None else (due,)))
            finally:
                if due is not None:
                    due.cancel()
            actions = self.core.on(lifecycle.Tick(), loop.time()) if ev is None else self._host_event(ev)
            outcome = await self._host_actions(actions, None)
            if outcome is not None:
                return outcome
            if not self.core.forming:
                return None

    def _host_event(self, ev) -> list:
        """A net event: the host's own bookkeeping first (tables, what a person sees), then the core."""
        from kafila.net import MemberJoined, MemberLeft

        if isinstance(ev, MemberLeft):
            self._member_left(ev)
        elif isinstance(ev, MemberJoined):
            self._member_joined(ev)  # added at the next replan (right after this one: --auto-replan)
        event = driving.core_event(ev)
        return [] if event is None else self.core.on(event, self.stage.now())

    async def _host_actions(self, actions: list, failure: BaseException | None) -> str | None:
        """Carry out HostCore's actions; a replan's reason when one is due; Refused on Abort."""
        for action in actions:
            if isinstance(action, lifecycle.Abort):
                raise Refused(action.reason) from failure
            if isinstance(action, lifecycle.Replan):
                return action.reason
            if isinstance(action, lifecycle.Drop):
                self._drop(action.member, action.reason)
            elif isinstance(action, lifecycle.Apply) and isinstance(action.msg, control.Ready):
                self.weights.done(action.sender)
            elif isinstance(action, lifecycle.Apply) and isinstance(action.msg, control.EdgeReport):
                self.stage.take_edge_report(action.sender, action.msg)
            elif not isinstance(action, lifecycle.Formed) and not await driving.send(self.stage, action):
                self._act(action)
        return None

    def _act(self, action) -> None:
        if driving.act(self.stage, action):
            return
        if isinstance(action, lifecycle.Send | lifecycle.SendAll):
            self.stage.spawn(driving.send(self.stage, action), "tell")
        else:
            raise AssertionError(f"no driver for {action!r}")

    def _rows(self, state: str) -> list[dict]:
        return [member_row(n, i, state) for n, i in self.stage.net.roster().items()]

    async def _next_replan(self) -> str:
        """Serve until the session needs a new plan; returns why. A member that leaves the ring
        replans at once; a ring break a member reports (its edge closed) waits BREAK_GRACE_S for
        the rendezvous to say who left, then replans with whoever is still here."""
        stage, loop = self.stage, asyncio.get_running_loop()
        while True:
            actions = self.core.on(lifecycle.Tick(), loop.time())  # a joiner with --auto-replan, a break due
            entered, self._enter_pressed = self._enter_pressed, False
            if entered:
                actions += self.core.on(lifecycle.EnterPressed(), loop.time())
            if (reason := await self._host_actions(actions, None)) is not None:
                return reason
            timer = self.core.timer()
            timeout = None if timer is None else max(0.0, timer - loop.time())
            wake = asyncio.ensure_future(self._wake_event.wait() if timeout is None else asyncio.sleep(timeout))
            ev = await stage.recv_unless(wake)
            wake.cancel()
            if ev is not None and (reason := await self._host_actions(self._host_event(ev), None)) is not None:
                return reason

    def _ring_broke(self, reason: str, epoch: int | None = None) -> None:
        """The host's own ring broke: HostCore replans after BREAK_GRACE_S; the serving loop looks."""
        stage = self.stage
        if epoch is not None and epoch != stage.epoch:
            return
        for action in self.core.on(lifecycle.RingBroke(stage.cfg.name, reason, stage.epoch), stage.now()):
            self._act(action)
        self._wake()

    def _member_left(self, ev) -> None:
        self.stage.state.members.pop(ev.name, None)
        if ev.name in self.core.dropped:  # said when it was dropped
            return
        self.stage.say(f"member {ev.name} left ({ev.reason})")
        self.stage.event("left", name=ev.name, reason=ev.reason)

    def _drop(self, name: str, reason: str) -> None:
        """HostCore dropped `name`: out of the roster now (the next plan goes without it); it
        hears why, and ends (or runs kafila join again)."""
        self.stage.state.members.pop(name, None)
        self.weights.forget(name)
        if self.stage.net is not None:
            self.stage.net.kick(name, reason)

    def _member_joined(self, ev) -> None:
        """A machine that joins a serving session is added at the next replan: at once with
        --auto-replan, else when a member leaves; it is told so, and so is the host."""
        stage, cfg = self.stage, self.cfg
        r = member_row(ev.info.name, ev.info, "waiting")
        stage.state.members[r["name"]] = r
        stage.event("joined", **r)
        when = "now (--auto-replan)" if cfg.auto_replan else "at the next replan"
        how = ("" if cfg.auto_replan else ": press Enter here to replan with it now" if self.view.takes_enter
               else " (kafila host --auto-replan adds joiners at once)")  # fmt: skip
        stage.say(f"member {ev.info.name} joined the serving session: it is added {when}{how}")
        wait = control.Wait(f"the session of {cfg.name} is serving: this member is added {when}")
        stage.spawn(stage.tell(ev.info.name, wait), "tell-wait")

    def _plan(self, index) -> tuple[Plan, int]:
        """The plan among the roster and the slots it serves: --concurrency, or with auto the
        plan made for one request and as many slots as its memory then holds (slots.py)."""
        from planner import PlanInputError, plan_fleet

        cfg = self.cfg
        form = _kquant_form(cfg.kquant, cfg.precision)
        devices, kinds = [], {memory_kind(cfg.backend, form)}
        host = self._desc_task.result() if self._desc_task.done() else None  # its calibration's probe
        for name, info in self.stage.net.roster().items():
            d = info.descriptor or {}
            if why := control.protocol_mismatch(f"member {name}", d.get("protocol"), d.get("version")):
                self._leave_out(name, why)  # it could not form a ring edge with this version's members
                continue
            dev = {"name": name, "memory_gb": d.get("memory_gb") or 1.0, "nat": info.nat,
                   "rtt_ms": float(info.rtt_ms), **probe_fields(d, host)}  # fmt: skip
            devices.append(dev)
            if d.get("backend") in RESIDENT_BYTES_PER_WEIGHT:
                kinds.add(memory_kind(d["backend"], form))
        fleet = {"context": cfg.context, "concurrency": cfg.concurrency or 1, "anchor": cfg.name,
                 "model": {**_resident_model(index, kinds, cfg.speculate), **model_reads(index), **self._calibration},
                 "devices": devices}  # fmt: skip
        try:
            # the context: the asked one, or the model's own capped by what the members' memory holds
            fleet["context"], why = choose_context(fleet, self._context_asked, index.hparams.context_length,
                                                   index.name, cfg.policy, cfg.concurrency)  # fmt: skip
        except PlanInputError as exc:
            raise Refused(f"cannot plan this session: {exc}") from None
        if fleet["context"] != self.session.get("context") or why != self._context_why:
            self.stage.say(f"{cfg.name}: {why}")
        self._context_why = why
        self.stage.cfg = replace(cfg, context=fleet["context"])
        self.session["context"] = fleet["context"]
        try:
            plan = plan_fleet(fleet, None, cfg.policy)
            if cfg.concurrency is not None:
                return plan, cfg.concurrency
            return plan, (auto_slots(fleet, plan.to_json()) if plan.feasible else 1)
        except PlanInputError as exc:
            raise Refused(f"cannot plan this session: {exc}") from None

    def _leave_out(self, name: str, why: str) -> None:
        """A member of another Kafila version is left out of every plan: told once, in one line
        (it ends with it), and so is the host's terminal."""
        if name in self._left_out:
            return
        self._left_out.add(name)
        self.stage.say(f"{self.cfg.name}: {why}; it is left out of the session")
        self.stage.event("left-out", name=name, reason=why)
        self.stage.spawn(self.stage.tell(name, control.Refusal(control.clip(why))), "tell-left-out")

    async def _broadcast_status(self) -> None:
        stage = self.stage
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            state, node, name = stage.state, stage.node, self.cfg.name
            edges = dict(state.edges)
            if stage.ring.succ_edge is not None:
                edges[name] = state.edges[name] = edge_stats(stage.ring.succ_edge, stage.ring.succ_lane)
            measured = node.measured.as_pairs() if node is not None else ()
            loads, head_load = dict(state.loads), state.head_load
            if node is not None:
                loads[name] = node.stage_load()
                if node.is_head:
                    head_load = node.head_load(MAX_REPORTED_REQUESTS)
            try:
                status = control.Status(edges, state.members, tuple(measured),
                                        tuple(state.history[-HISTORY_STATUS:]), loads, head_load)  # fmt: skip
            except control.ControlError as exc:  # ours: a bug to see, not a reason to stop reporting
                log.warning("status not sent: %s", exc)
                continue
            await stage.broadcast(status)


__all__ = ["HostParticipant", "HostView", "member_row", "session_context"]
