"""A member's driver: join the session, follow the host's plans (weights, shard, ring), serve,
leave. The host's driver is host.py; what both hold is a Stage (stage.py).

The decisions (phase, plan generation, who is ready, when to give up) are the sans-I/O core
lifecycle.MemberCore; this driver feeds it net events and the end of its own preparation, and
carries out its actions (send, prepare, serve, end). The messages are control.py's, typed and
bounded; the plan is a planner.Plan (`stage.plan`; `state.plan` is its JSON, as /status shows).

Theory of operation (signaling messages ride the net layer's authenticated host↔member channel;
members only ever talk to the host there):

    member → host : the descriptor (probe results, backend) in the join itself (checked at the
                    door: kafila.net.descriptor)
    host → member : {"t": "plan", plan, session, manifest}   or {"t": "refused", reason}
    member        : weights (edge to the host, fetch.py) → shard → ring edge to the successor,
                    ring stream from the predecessor (ring_forming.py)
    member → host : {"t": "ready"}   or {"t": "failed", reason}
    host → all    : {"t": "serving"} once every member is ready
    serving       : member → host {"t": "edge", stats} every STATUS_EVERY_S;
                    host → all {"t": "status", edges, members} every STATUS_EVERY_S;
                    member → host {"t": "degraded", reason, epoch} when its ring breaks
    replan        : a member left, was dropped, broke the ring, or joined with --auto-replan: the
                    host sends a new {"t": "plan", epoch: n+1, reason, ...}; every member tears its
                    ring down, fetches what it lacks, keeps its shard when its blocks are the
                    same, forms the new ring (Hellos carry the epoch) and says {"t": "ready",
                    epoch}; {"t": "serving", epoch} resumes the requests waiting at their origins
                    (engine.py). Messages of an older epoch are ignored. A plan the remaining
                    members cannot hold: {"t": "refused", reason} and the session is over.
    late joiner   : host → it {"t": "wait", reason} until the next replan includes it
    dropped       : the host removed this member (or the rendezvous will not take it back after
                    a freeze): it ends with one line saying why, never serving 503 forever

`run()` owns every task it starts; SIGINT/SIGTERM cancel the lifecycle and it leaves the session
cleanly (API closed, ring closed, edges and signaling closed).
"""

from __future__ import annotations

import asyncio
import dataclasses

from rich.console import Console

from backends.errors import BadInput, KafilaError, Refused, describe_error
from kafila.session.control import driving, lifecycle
from kafila.session.control.config import DEFAULT_CACHE_DIR, SessionConfig
from kafila.session.control.ring_forming import READY_TIMEOUT_S, RING_EDGE_TIMEOUT_S, ring_hello_refusal
from kafila.session.control.stage import STATUS_EVERY_S, Role, Stage, role_of
from kafila.session.control.system import cancel_and_wait


class Participant(driving.Driver):
    """A member of a session (`kafila join`)."""

    def __init__(self, cfg: SessionConfig, console: Console | None = None) -> None:
        self.core = lifecycle.MemberCore(cfg.name)
        self.stage = Stage(cfg, console or Console(stderr=True), self.core, is_host=False,
                           act=self._act, on_ring_broke=self._ring_broke)  # fmt: skip
        self.code = ""  # the session code (the command sets it)
        self.leaving = False  # SIGINT/SIGTERM: the lifecycle is being cancelled

    async def close(self) -> None:
        await self.stage.close()

    async def lifecycle(self) -> int:
        from kafila.net import Member

        stage = self.stage
        cfg = stage.cfg
        stage.say(f"{cfg.name}: measuring this device…")
        desc = await asyncio.to_thread(stage.descriptor)
        assert cfg.rendezvous is not None
        stage.net = await Member.join(self.code, cfg.rendezvous, cfg.name, desc,
                                      bind_host=cfg.bind_host, send_delay_ms=cfg.send_delay_ms)  # fmt: skip
        net = stage.net
        if net.name != cfg.name:  # another member has our name: the host gave us `name-2`
            stage.say(f"{cfg.name}: the name {cfg.name!r} is taken in this session; this member is {net.name}")
            stage.cfg = cfg = dataclasses.replace(cfg, name=net.name)
            self.core.name = cfg.name
        host = next((n for n, i in net.roster().items() if i.peer_id == 0), "host")
        stage.say(f"{cfg.name}: joined the session of {host} (NAT {net.nat.nat}, "
                  f"rendezvous RTT {net.nat.rtt_ms:.1f} ms); waiting for the plan")  # fmt: skip
        stage.event("joined", host=host, nat=net.nat.nat, name=cfg.name)
        stage.host_name = host
        self.core.on(lifecycle.Joined(host), stage.now())
        stage.spawn(stage.ring.accept_loop(), "accept")
        return await self._follow_plans(host)

    async def _follow_plans(self, host: str) -> int:
        """Plan → weights → shard → ring → serving, and again at every replan the host sends.

        A thin driver of MemberCore (lifecycle.py): net events and the preparation's end go in,
        its actions come out. Forming and a replan take the same path, while listening to the
        host: a newer plan replaces the one being prepared; a failure goes to the host (which
        drops this member) and ends it; a session that cannot form (the host gone) ends it at once."""
        core, stage = self.core, self.stage
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
                        prep = asyncio.create_task(stage.prepare(action.msg, fetch_from=host), name="prepare")
                    elif isinstance(action, lifecycle.ServePlan):
                        stage.serve(first=action.first)
                        if action.first:
                            stage.spawn(stage.report_edges(), "report-edges")
                    elif isinstance(action, lifecycle.Abort):
                        if action.linger_s:
                            await asyncio.sleep(action.linger_s)
                        if isinstance(failure, KafilaError):
                            raise failure
                        raise Refused(action.reason) from failure
                    elif isinstance(action, lifecycle.Finish):
                        await asyncio.sleep(action.linger_s)
                        return 0
                    elif not await driving.send(stage, action):
                        self._act(action)
                if prep is not None and prep.done() and prep_epoch == core.epoch and not core.ready_sent:
                    failure = prep.exception()
                    error = None if failure is None else describe_error(failure)
                    prepared = lifecycle.Prepared(prep_epoch, error, getattr(failure, "blame", ()))
                    actions = core.on(prepared, stage.now())
                    continue
                waiting = prep is not None and not prep.done() and not core.ready_sent
                ev = await (stage.recv_unless(prep) if waiting else stage.recv_unless())
                event = driving.core_event(ev)
                actions = [] if event is None else core.on(event, stage.now())
        finally:
            if prep is not None:
                await cancel_and_wait(prep)

    def _act(self, action) -> None:
        """The actions that need no waiting (a send spawns a task)."""
        if driving.act(self.stage, action):
            return
        if isinstance(action, lifecycle.Apply):
            self.stage.apply(action.msg)
        elif isinstance(action, lifecycle.Send | lifecycle.SendAll):
            self.stage.spawn(driving.send(self.stage, action), "tell")
        else:
            raise AssertionError(f"no driver for {action!r}")

    def _ring_broke(self, reason: str, epoch: int | None = None) -> None:
        """This member's ring noticed a break itself (a stage failed, an edge closed, a bad
        frame): the host hears of it at once and replans (a member gone) or ends the session.
        A break of an older plan's ring (torn down for a replan) is no news."""
        stage = self.stage
        if epoch is not None and epoch != stage.epoch:
            return
        for action in self.core.on(lifecycle.RingBroke(stage.cfg.name, reason, stage.epoch), stage.now()):
            self._act(action)


__all__ = ["BadInput", "DEFAULT_CACHE_DIR", "Participant", "READY_TIMEOUT_S", "RING_EDGE_TIMEOUT_S", "Role",
           "STATUS_EVERY_S", "SessionConfig", "ring_hello_refusal", "role_of"]  # fmt: skip
