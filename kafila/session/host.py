"""The host's part of a session: registration, the members table, the plan, serving weights.

HostParticipant drives lifecycle.HostCore: `_lifecycle` opens the session (_open_model,
_open_session), waits for the members (_wait_for_members, _hash), then forms a plan (_form,
_until_formed) and serves until the core asks for a replan (_next_replan)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import replace

from rich.live import Live
from rich.table import Table

from backends.errors import BadInput, Refused, describe_error
from backends.memory import RESIDENT_BYTES_PER_WEIGHT
from kafila import __version__
from kafila.net.codefile import write_private
from kafila.session import control, lifecycle
from kafila.session.control import PlanMessage, SessionTerms
from kafila.session.lifecycle import BREAK_GRACE_S  # noqa: F401 (re-exported)
from kafila.session.load import MAX_REPORTED_REQUESTS, clean_head, clean_stage
from kafila.session.participant import (
    STATUS_EVERY_S,
    Participant,
    cancel_and_wait,
    edge_stats,
    lan_ip,
    stdin_is_terminal,
)
from kafila.session.preview import plan_summary, plan_table, predicted_tok_s  # noqa: F401 (re-exported)
from kafila.session.replans import ReplanPacer
from kafila.session.slots import auto_slots, parse_concurrency, parse_max_queued
from kafila.session.weights import TransferProgress
from planner import Plan

HISTORY_STATUS = 30  # membership events the host's status message carries to every member

log = logging.getLogger(__name__)


DEFAULT_CONTEXT_TOKENS = 2048  # a session's context when --context is not given (capped by the model's)


def session_context(requested: int | None, model_context: int, model_name: str) -> tuple[int, str | None]:
    """The context a session serves and a one-line note when the default was capped: `requested`
    (--context) when given, else DEFAULT_CONTEXT_TOKENS or the model's own context if shorter.
    An explicit value outside 2..the model's context is BadInput."""
    if requested is None:
        if model_context < DEFAULT_CONTEXT_TOKENS:
            return model_context, (f"context {model_context}: {model_name}'s own context (shorter than the "
                                   f"default {DEFAULT_CONTEXT_TOKENS})")  # fmt: skip
        return DEFAULT_CONTEXT_TOKENS, None
    if requested < 2 or requested > model_context:
        raise BadInput(f"--context {requested}: choose 2..{model_context} for {model_name} (its own context), "
                       "or leave --context out")  # fmt: skip
    return requested, None


def member_row(name: str, info, state: str) -> dict:
    d = info.descriptor or {}
    return {"name": name, "nat": info.nat, "rtt_ms": round(info.rtt_ms, 2),
            "bandwidth_gbps": d.get("bandwidth_gbps"), "memory_gb": d.get("memory_gb"),
            "overhead_us": d.get("overhead_us"), "backend": d.get("backend"), "state": state}  # fmt: skip


def members_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in ("name", "NAT", "RTT ms", "bandwidth GB/s", "memory GB", "state"):
        t.add_column(col)
    for r in rows:
        bw = r["bandwidth_gbps"]
        mem = r["memory_gb"]
        t.add_row(r["name"], r["nat"], f"{r['rtt_ms']:.1f}", "?" if bw is None else f"{bw:.1f}",
                  "?" if mem is None else f"{mem:.1f}", r["state"])  # fmt: skip
    return t


def _resident_model(index, kinds: set[str]) -> dict:
    """The plan's model entry with memory in the members' backends' forms (backends.memory): one
    Model serves every member, so a mixed ring takes each memory figure from its largest backend."""
    models = [index.planner_model(kind) for kind in sorted(kinds)]
    out = dict(models[0])
    for key in ("process_bytes", "anchor_bytes", "block_resident_bytes", "head_resident_bytes"):
        out[key] = max(m[key] for m in models)
    return out


class HostParticipant(Participant):
    IS_ANCHOR = True  # planner.member_bytes: the anchor also serves weights and digests
    is_host = True

    def __init__(self, cfg, console=None) -> None:
        super().__init__(cfg, console)
        self.rendezvous_service = None
        self.digests = None
        self._weight_cache: dict = {}
        self._left_out: set[str] = set()  # members of another session protocol (_leave_out)
        self.host_name = cfg.name
        self._hash_cancel = threading.Event()  # stops a hashing worker when the host leaves
        self._transfers: dict[str, TransferProgress] = {}  # member → the weights it was sent
        self._lanes: dict[str, str] = {}  # member → "tcp" | "quic": how its weights went
        self._bars = None  # rich Progress: one bar per member while the session forms (a terminal)
        self._bar_ids: dict[str, int] = {}
        self._plans_made = 0  # epochs handed out
        self._break_event = asyncio.Event()
        self._enter_pressed = False  # Enter at the host's terminal while serving: replan with joiners
        self._pacer = ReplanPacer()

    def _wake(self) -> None:
        """Wake the serving loop (_next_replan) to look again."""
        self._break_event.set()
        self._break_event = asyncio.Event()

    def _on_enter(self) -> None:
        import sys

        if not sys.stdin.readline():  # the terminal went away: nobody presses Enter now
            asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
            return
        self._enter_pressed = True
        self._wake()

    async def close_extra(self) -> None:
        if stdin_is_terminal():
            import sys

            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
        self._hash_cancel.set()
        if self.rendezvous_service is not None:
            with contextlib.suppress(Exception):
                await self.rendezvous_service.close()
            self.rendezvous_service = None

    def _new_core(self):
        return lifecycle.HostCore(self.cfg.name, self.cfg.auto_replan)

    async def _lifecycle(self) -> int:
        """Open the session, wait for the members, plan, serve; replan as members come and go."""
        index, digests_task = await self._open_model()
        await self._open_session()
        await self._wait_for_members()
        await self._hash(index, digests_task)
        self._index = index
        cfg = self.cfg
        # "concurrency" is each plan's (auto: what its memory holds, set in _form)
        self.session = {"context": cfg.context, "concurrency": cfg.concurrency or 1, "precision": cfg.precision,
                        "speculate": cfg.speculate, "max_queued": cfg.max_queued, "batch_rows": cfg.batch_rows,
                        "dipsd": cfg.dipsd, "prompt_cache": cfg.prompt_cache,
                        "concurrency_from": "memory" if cfg.concurrency is None else "--concurrency",
                        "model": index.name, "sha256": self.digests.sha256,
                        "protocol": control.PROTOCOL, "version": __version__}  # fmt: skip
        await self._form(None)
        await self._start_serving()
        self.spawn(self._broadcast_status(), "status")
        if stdin_is_terminal():  # Enter confirms a late joiner (see _member_joined)
            import sys

            asyncio.get_running_loop().add_reader(sys.stdin.fileno(), self._on_enter)
        while not self.leaving:
            reason = await self._next_replan()
            while reason is not None and not self.leaving:  # a member left while we replanned: again
                reason = await self._form(reason)
            self._serving_again()

    # --- opening the session -------------------------------------------------------------------

    async def _open_model(self):
        """The model's index, the session's context, this device's descriptor under way, and the
        digests hashing in a worker (returned as a task)."""
        from backends.gguf import open_model
        from kafila.session.weights import DigestCache, warm_header_cache

        cfg = self.cfg
        index = await asyncio.to_thread(open_model, cfg.model_path)
        if self.engine is not None:
            self.engine.model_name = index.name  # /v1/models answers while the session forms
        context, capped = session_context(cfg.context, index.hparams.context_length, index.name)
        if capped:
            self.say(f"{cfg.name}: {capped}")
        self.cfg = cfg = replace(cfg, context=context)
        parse_concurrency(cfg.concurrency)  # (the CLI checked already; a SessionConfig built in code too)
        parse_max_queued(cfg.max_queued)
        self.say(f"{cfg.name}: measuring this device and indexing {index.name}…")
        self._desc_task = asyncio.create_task(asyncio.to_thread(self.descriptor))

        # hashing a big file takes tens of seconds: in a worker, while members join (never on
        # this loop: heartbeats, the API and the signaling channel keep running)
        def digests() -> DigestCache:  # then the compressed header every member asks for first
            d = DigestCache.load(index, cfg.cache_dir, None, self._hash_cancel)
            warm_header_cache(cfg.model_path, index.file_bytes, d.header_len, self._weight_cache)
            return d

        return index, self.spawn(asyncio.to_thread(digests), "digests")

    async def _open_session(self) -> None:
        """Register with the rendezvous (an embedded one without --rendezvous) and print the code."""
        from kafila.net import Member

        cfg = self.cfg
        desc = await self._desc_task
        rv = cfg.rendezvous
        if rv is None:
            from kafila.net import Rendezvous

            # it serves this session only: a stranger cannot open sessions on the host's machine
            self.rendezvous_service = await Rendezvous.start(*cfg.embedded_listen, max_sessions=1)
            rv = self.rendezvous_service.address
            shown = rv if rv[0] not in ("0.0.0.0", "::") else (lan_ip(), rv[1])
            self.say(f"{cfg.name}: embedded rendezvous on {rv[0]}:{rv[1]} (TCP+UDP; STUN also on UDP "
                     f"{self.rendezvous_service.stun_port2})")
        else:
            shown = rv
        self.net = await Member.host(rv, cfg.name, desc, bind_host=cfg.bind_host,
                                     send_delay_ms=cfg.send_delay_ms, code_words=cfg.code_words,
                                     embedded_rendezvous=self.rendezvous_service is not None)  # fmt: skip
        code = self.net.code
        if cfg.code_file:  # before the code is printed: whoever reads stdout may open the file next
            write_private(cfg.code_file, code + "\n")
        print(code, flush=True)
        self.say(f"session code: [bold]{code}[/bold]\non the other machines run:\n"
                 f"  kafila join {code} --rendezvous {shown[0]}:{shown[1]}")  # fmt: skip
        self.event("code", code=code, rendezvous=f"{rv[0]}:{rv[1]}")
        self.spawn(self._accept_loop(), "accept")

    async def _wait_for_members(self) -> None:
        """Until --expect members are in, or Enter at the host's terminal; a table while waiting."""
        from kafila.net import MemberJoined, MemberLeft

        cfg = self.cfg
        self._step_to("waiting")
        interactive = stdin_is_terminal() and self.console.is_terminal
        enter = asyncio.Event()
        loop = asyncio.get_running_loop()
        if stdin_is_terminal():
            import sys

            loop.add_reader(sys.stdin.fileno(), lambda: (sys.stdin.readline(), enter.set()))
        rows = lambda: [member_row(n, i, "joined") for n, i in self.net.roster().items()]
        expect = cfg.expect
        title = (f"waiting for {expect} members (press Enter to plan now)" if expect and stdin_is_terminal()
                 else f"waiting for {expect} members" if expect else "press Enter to plan")  # fmt: skip
        live = Live(members_table(rows(), title), console=self.console, auto_refresh=False) if interactive else None
        try:
            if live:
                live.start()
            while not (expect and len(self.net.roster()) >= expect) and not enter.is_set():
                waiter = asyncio.ensure_future(enter.wait())
                ev = await self.recv_unless(waiter)
                waiter.cancel()
                if ev is None:
                    continue
                if isinstance(ev, MemberJoined):
                    r = member_row(ev.info.name, ev.info, "joined")
                    if not live:
                        self.say(f"member {r['name']} joined: NAT {r['nat']}, RTT {r['rtt_ms']} ms, "
                                 f"{r['bandwidth_gbps']} GB/s, {r['memory_gb']} GB")  # fmt: skip
                    self.event("joined", **r)
                elif isinstance(ev, MemberLeft):
                    self.say(f"member {ev.name} left ({ev.reason})")
                    self.event("left", name=ev.name, reason=ev.reason)
                if live:
                    live.update(members_table(rows(), title), refresh=True)
        finally:
            if live:
                live.stop()
            if stdin_is_terminal():
                import sys

                loop.remove_reader(sys.stdin.fileno())
        self.state.members = {r["name"]: r for r in rows()}

    async def _hash(self, index, digests_task) -> None:
        cfg = self.cfg
        if not digests_task.done():
            self._step_to("hashing")
            self.say(f"{cfg.name}: hashing {index.name} ({index.file_bytes / 1e9:.2f} GB) before planning…")
        self.digests = await digests_task
        d = self.digests
        self.say(f"{cfg.name}: model digests {'computed' if d.hashed else 'read from the cache'} in "
                 f"{d.seconds:.1f} s ({d.cache_path or 'not cached'})")  # fmt: skip
        self.event("digests", hashed=d.hashed, seconds=round(d.seconds, 3), cache=d.cache_path)

    # --- forming and replanning ----------------------------------------------------------------

    async def _form(self, reason: str | None) -> str | None:
        """Plan among the members in the roster (epoch + 1), send each its plan and manifest,
        prepare the host's own stage, wait until every ring member is ready and say serving.
        `reason` None: the session's first plan, where a member that leaves or fails ends the
        session; otherwise a replan, where a member that leaves makes another (its reason is
        returned). Refused (after telling every member) when the plan cannot be served."""
        cfg, loop = self.cfg, asyncio.get_running_loop()
        if reason is not None:  # a member coming and going must not keep the ring replanning (replans.py)
            wait = self._pacer.delay(loop.time())
            if wait > 0:
                self.say(f"{cfg.name}: {self._pacer.recent} replans within a minute: waiting {wait:.0f} s "
                         "before the next, for the session to settle")  # fmt: skip
                self.event("replan-wait", seconds=wait)
                await asyncio.sleep(wait)
            self._pacer.record(loop.time())
        self._plans_made += 1  # (not self.epoch + 1: a replan cut short never set self.epoch)
        epoch = self._plans_made
        plan, slots = self._plan(self._index)
        self.session["concurrency"] = slots  # every member's slots and the head's scheduler follow it
        ranges, plan_json = plan.block_ranges(), plan.to_json()
        if reason is not None:
            self.say(f"{cfg.name}: replanning (plan {epoch}): {reason}")
        self.console.print(plan_table(plan_json, ranges))
        self.say(f"{cfg.name}: plan preview: {plan_summary(plan_json)}")  # before anything is sent
        if plan.feasible:
            how = "as many as memory holds" if cfg.concurrency is None else "--concurrency"
            self.say(f"{cfg.name}: {slots} requests at once ({how}), {cfg.max_queued} more may wait")
        self.event("plan", plan=plan_json, epoch=epoch, reason=reason)
        made = lifecycle.PlanMade(epoch, plan, reason)
        outcome = await self._host_actions(self.core.on(made, loop.time()), None)
        if outcome is not None:  # never: an infeasible plan aborts
            return outcome
        terms = SessionTerms.from_json(self.session)
        for n in plan.ring:
            if n == cfg.name:
                continue
            a, b = ranges[n]
            manifest = self.digests.manifest(a, b, n == plan.head)
            self._transfers[n] = TransferProgress(manifest.header_len + manifest.tensor_bytes, loop.time())
            await self.net.send(n, control.encode(PlanMessage(epoch, plan, terms, manifest.to_json(), reason)))
        for n in self.net.roster():  # a member the plan leaves out (the planner found it no help)
            if n != cfg.name and n not in plan.ring:
                with contextlib.suppress(Exception):
                    await self.net.send(n, control.encode(control.Wait(f"plan {epoch} leaves {n} out; "
                                                                       "it waits for the next replan")))  # fmt: skip
        # the host's own stage: a task this loop owns (awaits, or cancels when it leaves)
        own = asyncio.create_task(self._prepare(PlanMessage(epoch, plan, terms, None, reason), None), name="prepare")
        self._show_transfers()
        try:
            outcome = await self._until_formed(own, epoch)
        finally:
            self._hide_transfers()
            await cancel_and_wait(own)
        if outcome is not None:
            return outcome
        own.result()
        self.state.members = {r["name"]: r for r in self._rows("serving")}
        for n in plan.ring:
            if n != cfg.name:
                await self.net.send(n, control.encode(control.Serving(epoch)))
        return None

    async def _until_formed(self, own: asyncio.Task, epoch: int) -> str | None:
        """Feed HostCore until every ring member and the host's own stage are ready (None), a
        replan is due (its reason), or the session cannot form (Refused)."""
        loop = asyncio.get_running_loop()
        own_fed = False
        while True:
            if own.done() and not own_fed:
                own_fed = True
                exc = own.exception()
                error = None if exc is None else describe_error(exc)
                actions = self.core.on(lifecycle.Prepared(epoch, error), loop.time())
                outcome = await self._host_actions(actions, exc)
                if outcome is not None or not self.core.forming:
                    return outcome
                continue
            timer = self.core.timer()
            due = None if timer is None else asyncio.ensure_future(asyncio.sleep(max(0.0, timer - loop.time())))
            try:
                ev = await self.recv_unless(*(() if own_fed else (own,)), *(() if due is None else (due,)))
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
        return self._core_event(ev)

    async def _host_actions(self, actions: list, failure: BaseException | None) -> str | None:
        """Carry out HostCore's actions; a replan's reason when one is due; Refused on Abort."""
        for action in actions:
            if isinstance(action, lifecycle.Abort):
                raise Refused(action.reason) from failure
            if isinstance(action, lifecycle.Replan):
                return action.reason
            if isinstance(action, lifecycle.Apply) and isinstance(action.msg, control.Ready):
                self._transfer_done(action.sender)
            elif isinstance(action, lifecycle.Apply) and isinstance(action.msg, control.EdgeReport):
                self._edge_report(action.sender, action.msg)
            elif not isinstance(action, lifecycle.Formed):
                await self._carry_out(action)
        return None

    def _rows(self, state: str) -> list[dict]:
        return [member_row(n, i, state) for n, i in self.net.roster().items()]

    def _serving_again(self) -> None:
        """The replanned ring serves: requests waiting at the host resume (the members' own
        resume on the host's {"t": "serving"})."""
        self.engine.set_node(self.node)
        self.say(f"{self.cfg.name}: serving again (plan {self.epoch}, ring {' → '.join(self.role.ring)})")
        self.event("serving", api=self.api.url if self.api is not None else None, name=self.cfg.name,
                   epoch=self.epoch)  # fmt: skip

    async def _next_replan(self) -> str:
        """Serve until the session needs a new plan; returns why. A member that leaves the ring
        replans at once; a ring break a member reports (its edge closed) waits BREAK_GRACE_S for
        the rendezvous to say who left, then replans with whoever is still here."""
        loop = asyncio.get_running_loop()
        while True:
            actions = self.core.on(lifecycle.Tick(), loop.time())  # a joiner with --auto-replan, a break due
            entered, self._enter_pressed = self._enter_pressed, False
            if entered:
                actions += self.core.on(lifecycle.EnterPressed(), loop.time())
            if (reason := await self._host_actions(actions, None)) is not None:
                return reason
            timer = self.core.timer()
            timeout = None if timer is None else max(0.0, timer - loop.time())
            wake = asyncio.ensure_future(self._break_event.wait() if timeout is None else asyncio.sleep(timeout))
            ev = await self.recv_unless(wake)
            wake.cancel()
            if ev is not None and (reason := await self._host_actions(self._host_event(ev), None)) is not None:
                return reason

    def _ring_broke(self, reason: str, epoch: int | None = None) -> None:
        """The host's own ring broke: HostCore replans after BREAK_GRACE_S; the serving loop looks."""
        super()._ring_broke(reason, epoch)
        self._wake()

    def _member_left(self, ev) -> None:
        self.state.members.pop(ev.name, None)
        self.say(f"member {ev.name} left ({ev.reason})")
        self.event("left", name=ev.name, reason=ev.reason)

    def _member_joined(self, ev) -> None:
        """A machine that joins a serving session is added at the next replan: at once with
        --auto-replan, else when a member leaves; it is told so, and so is the host's terminal."""
        r = member_row(ev.info.name, ev.info, "waiting")
        self.state.members[r["name"]] = r
        self.event("joined", **r)
        when = "now (--auto-replan)" if self.cfg.auto_replan else "at the next replan"
        how = ("" if self.cfg.auto_replan else ": press Enter here to replan with it now" if stdin_is_terminal()
               else " (kafila host --auto-replan adds joiners at once)")  # fmt: skip
        self.say(f"member {ev.info.name} joined the serving session: it is added {when}{how}")
        wait = control.Wait(f"the session of {self.cfg.name} is serving: this member is added {when}")
        self.spawn(self._tell(ev.info.name, control.encode(wait)), "tell-wait")

    async def _tell(self, name: str, body: dict) -> None:
        with contextlib.suppress(Exception):
            await self.net.send(name, body)

    def _edge_report(self, sender: str, report: control.EdgeReport) -> None:
        if report.stats is not None:
            self.state.edges[sender] = report.stats
        if (stage := clean_stage(report.load)) is not None:
            self.state.loads[sender] = stage
        if report.head_load is not None and self.role is not None and sender == self.role.head:
            self.state.head_load = clean_head(report.head_load)
        self._take_measured(report.measured)

    async def _refuse_all(self, reason: str) -> None:
        await self.broadcast(control.encode(control.Refusal(control.clip(reason))))

    def _plan(self, index) -> tuple[Plan, int]:
        """The plan among the roster and the slots it serves: --concurrency, or with auto the
        plan made for one request and as many slots as its memory then holds (slots.py)."""
        from planner import PlanInputError, plan_fleet

        devices, kinds = [], {self.cfg.backend}
        for name, info in self.net.roster().items():
            d = info.descriptor or {}
            if why := control.protocol_mismatch(f"member {name}", d.get("protocol"), d.get("version")):
                self._leave_out(name, why)  # it could not form a ring edge with this version's members
                continue
            dev = {"name": name, "memory_gb": d.get("memory_gb") or 1.0, "nat": info.nat,
                   "rtt_ms": float(info.rtt_ms)}  # fmt: skip
            for k in ("bandwidth_gbps", "overhead_us", "tflops"):
                if d.get(k) is not None:
                    dev[k] = d[k]
            devices.append(dev)
            if d.get("backend") in RESIDENT_BYTES_PER_WEIGHT:
                kinds.add(d["backend"])
        fleet = {"context": self.cfg.context, "concurrency": self.cfg.concurrency or 1,
                 "anchor": self.cfg.name, "model": _resident_model(index, kinds), "devices": devices}  # fmt: skip
        try:
            plan = plan_fleet(fleet, None, self.cfg.policy)
            if self.cfg.concurrency is not None:
                return plan, self.cfg.concurrency
            return plan, (auto_slots(fleet, plan.to_json()) if plan.feasible else 1)
        except PlanInputError as exc:
            raise Refused(f"cannot plan this session: {exc}") from None

    def _leave_out(self, name: str, why: str) -> None:
        """A member of another Kafila version is left out of every plan: told once, in one line
        (it ends with it), and so is the host's terminal."""
        if name in self._left_out:
            return
        self._left_out.add(name)
        self.say(f"{self.cfg.name}: {why}; it is left out of the session")
        self.event("left-out", name=name, reason=why)
        self.spawn(self._tell(name, control.encode(control.Refusal(control.clip(why)))), "tell-left-out")

    async def serve_weights(self, edge, reader, writer, hello=None) -> None:
        """Serve one member's weight stream (`hello`: its Hello, already read by _on_edge)."""
        from kafila.session.transfer import serve_weights

        clock = asyncio.get_running_loop().time
        prog = self._transfers.get(edge.peer)
        if prog is not None:
            prog.started_s = clock()  # the rate counts from the member's first request

        def served(n: int) -> None:
            if prog is not None:
                prog.update(n, clock())
                self._show_transfer(edge.peer)

        def lane(kind: str) -> None:
            self._lanes[edge.peer] = kind

        self._lanes[edge.peer] = "quic"
        try:
            sent = await serve_weights(reader, writer, self.cfg.model_path, self.digests.index.file_bytes,
                                       self._weight_cache, served, await self._bulk_listener(), lane, hello)  # fmt: skip
            log.info("served %d weight bytes to %s over %s", sent, edge.peer, self._lanes[edge.peer])
        except Exception as exc:
            log.warning("weight transfer to %s ended: %s", edge.peer, describe_error(exc))
        finally:
            self._transfer_done(edge.peer)
            with contextlib.suppress(Exception):
                await edge.close()

    async def _bulk_listener(self):
        """The bulk lane's TCP listener for weights; None with --weights-lane quic, or when it
        cannot listen (the QUIC stream serves then)."""
        return None if self.cfg.weights_lane == "quic" else await self.bulk_listener()

    # --- each member's weights, as the host serves them -------------------------------------------

    def status(self) -> dict:
        return {**super().status(), "transfers": {n: {**p.as_dict(), "lane": self._lanes.get(n, "quic")}
                                                  for n, p in self._transfers.items()}}  # fmt: skip

    def _transfer_done(self, name: str) -> None:
        """The member closed its weight stream or said it is ready (a local copy needs none)."""
        prog = self._transfers.get(name)
        if prog is not None and not prog.finished:
            prog.finish(asyncio.get_running_loop().time())
            self._show_transfer(name)

    def _show_transfers(self) -> None:
        """A bar per member (MB/s, ETA) in a terminal, for as long as the session forms."""
        if not self._transfers or not self.console.is_terminal:
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )  # fmt: skip

        self._bars = Progress(TextColumn("weights to {task.description}"), BarColumn(), DownloadColumn(),
                              TransferSpeedColumn(), TimeRemainingColumn(), console=self.console)  # fmt: skip
        for name, prog in self._transfers.items():
            self._bar_ids[name] = self._bars.add_task(name, total=prog.total_bytes)
        self._bars.start()

    def _show_transfer(self, name: str) -> None:
        prog = self._transfers.get(name)
        if self._bars is None or prog is None or name not in self._bar_ids:
            return
        done = prog.total_bytes if prog.finished else prog.done_bytes
        self._bars.update(self._bar_ids[name], completed=done, total=prog.total_bytes)

    def _hide_transfers(self) -> None:
        if self._bars is not None:
            self._bars.stop()
            self._bars = None

    async def _broadcast_status(self) -> None:
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            edges = dict(self.state.edges)
            own = getattr(self, "succ_edge", None)
            if own is not None:
                edges[self.cfg.name] = edge_stats(own, self.succ_lane)
                self.state.edges[self.cfg.name] = edges[self.cfg.name]
            measured = self.node.measured.as_pairs() if self.node is not None else ()
            loads = dict(self.state.loads)
            head_load = self.state.head_load
            if self.node is not None:
                loads[self.cfg.name] = self.node.stage_load()
                if self.node.is_head:
                    head_load = self.node.head_load(MAX_REPORTED_REQUESTS)
            try:
                status = control.Status(edges, self.state.members, tuple(measured),
                                        tuple(self.state.history[-HISTORY_STATUS:]), loads, head_load)  # fmt: skip
            except control.ControlError as exc:  # ours: a bug to see, not a reason to stop reporting
                log.warning("status not sent: %s", exc)
                continue
            await self.broadcast(control.encode(status))


