"""A participant's lifecycle, host or member: join, plan, weights, shard, ring, serve, leave.

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
                    host → all {"t": "gone", member, reason} when one leaves: the ring is degraded

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

from kafila.errors import BadInput, KafilaError, Refused, describe_error
from kafila.session.engine import RingEngine
from kafila.session.frames import Hello, Limits, encode
from kafila.session.ring import RingNode
from kafila.session.streams import read_frame
from kafila.session.weights import (
    Manifest,
    TransferProgress,
    WeightError,
    check_shard,
    local_copy_path,
)

log = logging.getLogger(__name__)
STATUS_EVERY_S = 2.0
READY_TIMEOUT_S = 900.0  # weights over a slow link and a shard build
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
    concurrency: int = 4
    speculate: str = "off"  # the head's drafter (speculate.SPECULATE_MODES), sent in the session
    policy: str = "kafila"
    code_file: str | None = None
    code_words: int = 3  # words in the session code (4 for a long-lived session)
    embedded_listen: tuple[str, int] = ("0.0.0.0", 7473)
    json_events: bool = False  # print one JSON line per lifecycle event on stdout (scripts)


@dataclass
class Role:
    """This participant's place in the plan."""

    ring: list[str]
    head: str
    first: int
    last: int
    blocks: dict[str, int]

    def successor(self, me: str) -> str:
        return self.ring[(self.ring.index(me) + 1) % len(self.ring)]

    def predecessor(self, me: str) -> str:
        return self.ring[(self.ring.index(me) - 1) % len(self.ring)]


def ring_hello_refusal(claimed: str, peer: str, predecessor: str) -> str | None:
    """Why a ring stream may not feed this member's stage (None: it may). `peer` is the member
    the edge's pinned certificate proved; the Hello only claims a name, and only the plan's
    predecessor may send activations here."""
    if claimed != peer:
        return f"its Hello claims the name {claimed[:64]!r}"
    if peer != predecessor:
        return f"the plan's predecessor is {predecessor}, not {peer}"
    return None


def role_of(plan: dict, me: str) -> Role:
    ring = list(plan["ring"])
    if me not in ring:
        raise Refused(f"the plan leaves this member ({me}) out")
    blocks = {k: int(v) for k, v in plan["blocks"].items()}
    first = sum(blocks[n] for n in ring[: ring.index(me)])
    return Role(ring, plan["head"], first, first + blocks[me], blocks)


@dataclass
class State:
    phase: str = "joining"  # joining | waiting | planned | fetching | building | ring | serving | degraded
    plan: dict | None = None
    session: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    edges: dict = field(default_factory=dict)  # successor name → edge stats (all, at the host)
    members: dict = field(default_factory=dict)  # name → {nat, rtt_ms, ...}
    degraded: str | None = None
    started: float = field(default_factory=time.monotonic)
    history: list = field(default_factory=list)  # membership events, oldest first (HISTORY_MAX)


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

    is_host = False

    def __init__(self, cfg: SessionConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.net = None  # kafila.net.Member
        self.state = State()
        self.node: RingNode | None = None
        self.engine: RingEngine | None = None
        self.api = None
        self.shard = None
        self.index = None
        self.tokenizer = None
        self.model_path: str | None = None
        self.role: Role | None = None
        self._tasks: set[asyncio.Task] = set()
        self._pred_stream: asyncio.Future | None = None
        self._planned = asyncio.Event()  # set once `role` is known: a ring Hello waits for it
        self._ring_edges: list = []
        self._serving = asyncio.Event()

    # --- helpers ---------------------------------------------------------------------------------

    async def recv_unless(self, *others: asyncio.Future):
        """The next session event, or None when one of `others` finishes first."""
        get = asyncio.ensure_future(self.net.recv())
        await asyncio.wait({get, *others}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await get
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

    def descriptor(self) -> dict:
        from kafila.probe import probe_device

        p = probe_device(quick=True, backend=self.cfg.backend)  # measured on what it will serve on
        return {"backend": self.cfg.backend, "probed_on": p.backend, "memory_gb": round(p.memory_gb, 3),
                "bandwidth_gbps": p.bandwidth_gbps, "overhead_us": p.overhead_us,
                "tflops": p.tflops}  # fmt: skip

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
        for edge in self._ring_edges:
            with contextlib.suppress(Exception):
                await edge.close()
        if self.net is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.net.close(), 3.0)
            self.net = None
        await self.close_extra()

    async def close_extra(self) -> None:
        """The host's embedded rendezvous."""

    async def _lifecycle(self) -> int:
        from kafila.net import Member, MemberLeft, Message

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
        host = next((n for n, i in self.net.roster().items() if i.peer_id == 0), "host")
        self.say(f"{cfg.name}: joined the session of {host} (NAT {self.net.nat.nat}, "
                 f"rendezvous RTT {self.net.nat.rtt_ms:.1f} ms); waiting for the plan")  # fmt: skip
        self.event("joined", host=host, nat=self.net.nat.nat, name=cfg.name)
        self.state.phase = "waiting"
        self.spawn(self._accept_loop(), "accept")
        while True:
            ev = await self.net.recv()
            if isinstance(ev, MemberLeft) and ev.name == host:
                raise Refused(f"the host {host} left the session before planning ({ev.reason})")
            if isinstance(ev, Message) and isinstance(ev.body, dict):
                if ev.body.get("t") == "refused":
                    raise Refused(f"the host refused the session: {ev.body.get('reason')}")
                if ev.body.get("t") == "plan":
                    break
        msg = ev.body
        self.host_name = host
        # weights, shard and ring edges, while listening to the host: a session that cannot
        # form (a member gone, the host gone) ends this member at once, not after a timeout
        prep = asyncio.create_task(self._prepare(msg, fetch_from=host), name="prepare")
        ready_sent = False
        try:
            while True:
                if prep.done() and not ready_sent:
                    exc = prep.exception()
                    if exc is not None:
                        reason = describe_error(exc)
                        with contextlib.suppress(Exception):
                            await self.net.send(host, {"t": "failed", "reason": reason[:300]})
                        if isinstance(exc, KafilaError):
                            raise exc
                        raise Refused(reason) from exc
                    await self.net.send(host, {"t": "ready"})
                    ready_sent = True
                ev = await (self.recv_unless() if ready_sent else self.recv_unless(prep))
                if ev is None:
                    continue
                if isinstance(ev, MemberLeft):
                    raise Refused(f"the host {host} left the session before it was ready ({ev.reason})")
                if isinstance(ev, Message) and isinstance(ev.body, dict):
                    t = ev.body.get("t")
                    if t == "serving" and ready_sent:
                        break
                    if t in ("refused", "gone", "degraded"):
                        why = (f"member {ev.body.get('member')} left" if t == "gone"
                               else str(ev.body.get("reason") or "the host gave no reason"))  # fmt: skip
                        raise Refused(f"the session could not form: {why}")
        finally:
            if not prep.done():
                prep.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await prep
        await self._start_serving()
        self.spawn(self._report_edges(), "report-edges")
        while True:
            ev = await self.net.recv()
            if isinstance(ev, MemberLeft):
                reason = f"the host {host} left the session ({ev.reason})"
                self._degrade(reason)  # every request waiting here ends with the reason
                if not str(ev.reason).startswith("signaling lost"):
                    # the host is gone, not only our line to the rendezvous: nothing can come back
                    self.say(f"{cfg.name}: {reason}: the session is over")
                    self.event("ended", reason=reason)
                    await asyncio.sleep(0.2)  # let the API stream the failure to clients first
                    return 0
            elif isinstance(ev, Message) and isinstance(ev.body, dict):
                self._on_host_message(ev.body)

    def _on_host_message(self, body: dict) -> None:
        t = body.get("t")
        if t == "gone":
            self._degrade(f"member {body.get('member')} left the session ({body.get('reason')})")
            self.event("left", name=str(body.get("member"))[:64], reason=str(body.get("reason"))[:300])
        elif t == "degraded":
            self._degrade(str(body.get("reason"))[:500])
        elif t == "status":
            measured = body.get("measured")
            if isinstance(measured, list) and self.node is not None and not self.node.is_head:
                with contextlib.suppress(TypeError, ValueError):
                    self.node.measured.update_from(
                        (str(k), float(v)) for k, v in measured[:64] if k != "tok_s")
            if isinstance(body.get("edges"), dict):
                self.state.edges.update(body["edges"])
            if isinstance(body.get("members"), dict):
                self.state.members = body["members"]
            if isinstance(body.get("history"), list):  # the host's: who joined and left, when, why
                self.state.history = [h for h in body["history"][-HISTORY_MAX:] if isinstance(h, dict)]

    def _ring_broke(self, reason: str) -> None:
        """This member's ring noticed a break itself (a stage failed, an edge closed, a bad
        frame): the host tells everyone, so requests waiting anywhere fail now."""
        if self.state.degraded is None:
            self.state.degraded = reason
            self.state.phase = "degraded"
            self.say(f"[red]{self.cfg.name}: session degraded: {reason}[/red]")
            self.event("degraded", reason=reason)
        self.spawn(self._tell_host_degraded(reason), "tell-degraded")

    async def _tell_host_degraded(self, reason: str) -> None:
        if self.net is not None and not self.is_host:
            with contextlib.suppress(Exception):
                await self.net.send(self.host_name, {"t": "degraded", "reason": reason[:500]})
        elif self.is_host:
            await self.broadcast({"t": "degraded", "reason": reason[:500]})

    async def broadcast(self, body: dict) -> None:
        for n in list(self.net.roster()) if self.net is not None else []:
            if n != self.cfg.name:
                with contextlib.suppress(Exception):
                    await self.net.send(n, body)

    def _degrade(self, reason: str) -> None:
        if self.state.degraded is None:
            self.state.degraded = reason
            self.state.phase = "degraded"
            self.say(f"[red]{self.cfg.name}: session degraded: {reason}[/red]")
            self.event("degraded", reason=reason)
        if self.node is not None:
            self.node.degrade(reason)

    # --- plan → weights → shard → ring ----------------------------------------------------------

    async def _prepare(self, msg: dict, fetch_from: str | None) -> None:
        from backends import ShardSpec, load_shard
        from kafila.models import load_tokenizer, open_model

        cfg = self.cfg
        plan, session = msg["plan"], msg["session"]
        self.state.plan, self.state.session = plan, session
        self.role = role = role_of(plan, cfg.name)
        self._planned.set()
        self.state.phase = "fetching"
        if fetch_from is None:
            self.model_path = cfg.model_path
            self.state.weights = {"received_bytes": 0, "tensor_bytes": 0, "source": "own file"}
        else:
            async def fetch() -> tuple[str, dict]:
                return await self._fetch(Manifest.from_json(msg["manifest"]), fetch_from)

            self.model_path, self.state.weights = await _step(
                f"{cfg.name} could not fetch its weights from {self._who(fetch_from)}", fetch())
        self.state.phase = "building"
        is_head = role.head == cfg.name
        what = f"blocks [{role.first}, {role.last}){' + head' if is_head else ''} on {cfg.backend}"
        self.say(f"{cfg.name}: building {what}")

        async def build() -> None:
            self.index = await asyncio.to_thread(open_model, self.model_path)
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.index)
            spec = ShardSpec(self.model_path, role.first, role.last, embed=is_head, head=is_head)
            self.shard = await asyncio.to_thread(load_shard, cfg.backend, spec, session["precision"])

        await _step(f"{cfg.name} could not build {what}", build())
        self.state.phase = "ring"
        await self._form_ring()

    async def _fetch(self, manifest: Manifest, host: str) -> tuple[str, dict]:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )  # fmt: skip

        from kafila.session.transfer import check_local_file, fetch_weights

        cfg = self.cfg
        if cfg.local_model and await asyncio.to_thread(check_local_file, cfg.local_model, manifest):
            self.say(f"{cfg.name}: using the local copy {cfg.local_model} (same SHA-256)")
            return cfg.local_model, {"received_bytes": 0, "tensor_bytes": manifest.tensor_bytes,
                                     "source": "local file"}  # fmt: skip
        path = local_copy_path(cfg.cache_dir, manifest)
        self.state.weights = {"source": "host", "tensor_bytes": manifest.tensor_bytes, "done_bytes": 0,
                              "total_bytes": manifest.tensor_bytes, "state": "connecting"}  # fmt: skip
        edge = await self.net.connect(host)
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
                                          **live.as_dict()}  # fmt: skip

                stats = await fetch_weights(reader, writer, cfg.name, manifest, path, progress,
                                            self._shard_check(manifest))  # fmt: skip
        finally:
            await edge.close()
        live.finish(time.monotonic())
        mb = stats["received_bytes"] / 1e6
        secs = max(stats["seconds"], 1e-6)
        self.say(f"{cfg.name}: weights ready: {stats['fetched_tensors']} of {len(manifest.tensors)} "
                 f"tensors fetched, {mb:.1f} MB in {secs:.1f} s ({mb / secs:.1f} MB/s), SHA-256 verified")  # fmt: skip
        self.event("weights", **stats)
        self.state.weights = {**live.as_dict(), **stats, "source": "host"}
        return path, self.state.weights

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
            from kafila.models import open_model

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
            if self._pred_stream is None:
                self._pred_stream = asyncio.get_running_loop().create_future()
            if not self._pred_stream.done():
                self._ring_edges.append(edge)
                self._pred_stream.set_result((edge, reader, writer))
                return
            await edge.close()
        else:
            await self.serve_weights(edge, reader, writer)

    async def _ring_refusal(self, hello: Hello, edge) -> str | None:
        """Why a ring Hello may not become the predecessor stream (None: it may), once the plan
        says who the predecessor is (a Hello may come first)."""
        try:
            await asyncio.wait_for(self._planned.wait(), READY_TIMEOUT_S)
        except TimeoutError:
            return "no plan arrived"
        assert self.role is not None
        return ring_hello_refusal(hello.name, edge.peer, self.role.predecessor(self.cfg.name))

    async def serve_weights(self, edge, reader, writer) -> None:
        await edge.close()  # only the host serves weights

    async def _form_ring(self) -> None:
        role, me = self.role, self.cfg.name
        assert role is not None
        limits = Limits(hidden=self.index.hparams.hidden, context=int(self.state.session["context"]),
                        slots=int(self.state.session["concurrency"]),
                        vocab=self.index.hparams.vocab)  # fmt: skip
        speculate = _speculate_mode(self.state.session.get("speculate"))
        drafter = None
        if speculate == "draft" and me == role.head:
            drafter, speculate = await self._drafter(limits.context)
        self.node = RingNode(me, role.head, role.ring, self.shard, limits,
                             eos_ids=frozenset(self.tokenizer.eos_ids),
                             on_degraded=self._ring_broke, speculate=speculate, drafter=drafter)  # fmt: skip
        if len(role.ring) == 1:
            self.node.start()
            return
        if self._pred_stream is None:
            self._pred_stream = asyncio.get_running_loop().create_future()
        succ = role.successor(me)

        async def edge_to_successor():
            edge = await self.net.connect(succ)
            self._ring_edges.append(edge)
            _, writer = await edge.open_stream()
            writer.write(encode(Hello(me, "ring")))
            await writer.drain()
            return edge, writer

        self.succ_edge, writer = await _step(f"the ring edge from {me} to {self._who(succ)}",
                                             edge_to_successor(), RING_EDGE_TIMEOUT_S)  # fmt: skip
        try:
            # the predecessor opens its edge once its own weights and shard are ready
            _, reader, _ = await asyncio.wait_for(self._pred_stream, READY_TIMEOUT_S)
        except TimeoutError:
            raise Refused(f"the ring edge from {self._who(role.predecessor(me))} to {me} was not up "
                          f"within {READY_TIMEOUT_S:g} s") from None  # fmt: skip
        self.node.start(reader, writer)

    async def _start_api(self) -> None:
        """The API is up from the start (503 while forming), so a busy port fails at once."""
        self.engine = RingEngine("", 0, None, self.status)
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
        engine.node = self.node
        if self.state.degraded:
            self.node.degrade(self.state.degraded)
        self.state.phase = "serving" if not self.state.degraded else "degraded"
        if self.api is not None:
            self.say(f"{cfg.name}: serving; API at {self.api.url}/v1 (status: {self.api.url}/status)")
            self.event("serving", api=self.api.url, name=cfg.name)
        else:
            self.say(f"{cfg.name}: serving")
            self.event("serving", api=None, name=cfg.name)

    async def _report_edges(self) -> None:
        while True:
            edge = getattr(self, "succ_edge", None)
            if edge is not None and self.net is not None:
                body = {"t": "edge", "stats": edge_stats(edge)}
                if self.node is not None and self.node.is_head:  # the head times every stage
                    body["measured"] = [list(p) for p in self.node.measured.as_pairs()]
                with contextlib.suppress(Exception):
                    await self.net.send(self.host_name, body)
            await asyncio.sleep(STATUS_EVERY_S)

    # --- status ----------------------------------------------------------------------------------

    def status(self) -> dict:
        s = self.state
        node = self.node
        m = node.measured if node is not None else None
        own_edge = getattr(self, "succ_edge", None)
        edges = dict(s.edges)
        if own_edge is not None:
            edges[self.cfg.name] = edge_stats(own_edge)
        ring = list(s.plan["ring"]) if s.plan else []
        return {
            "session": {"name": self.cfg.name, "host": self.is_host or getattr(self, "host_name", None),
                        "state": "degraded" if (node and node.degraded) or s.degraded else s.phase,
                        "degraded": (node.degraded if node else None) or s.degraded,
                        "model": s.session.get("model"),
                        "backend": self.cfg.backend,
                        "context": s.session.get("context"), "concurrency": s.session.get("concurrency"),
                        "uptime_s": round(time.monotonic() - s.started, 1)},
            "members": s.members,
            "plan": s.plan,
            "stages": {n: {"blocks": (s.plan or {}).get("blocks", {}).get(n),
                           "predicted_ms": ((s.plan or {}).get("stage_ms") or {}).get(n),
                           "compute_ms": None if m is None else _r(m.stage_ms.get(n))}
                       for n in ring},
            "edges": [{"from": a, "to": _succ(ring, a), **e} for a, e in edges.items() if a in ring],
            "network_ms": None if m is None else _r(m.network_ms),
            "step_ms": None if m is None else _r(m.step_ms),
            "tok_s": None if m is None else _r(m.tok_s),
            "weights": s.weights,
            "memory": self._memory(),
            "requests": None if node is None or node.scheduler is None else {
                "active": node.scheduler.active, "queued": node.scheduler.queued,
                "free_slots": node.scheduler.free_slots},
            # the head's finished requests together: drafted, accepted, acceptance, tokens a trip
            "speculation": None if node is None or node.scheduler is None else {
                "mode": node.scheduler.speculate, **node.scheduler.spec.as_dict(),
                "trip_ms": node.scheduler.step_cost.as_dict()},
            "history": list(s.history),  # membership: joined, left, planned, serving, degraded
        }  # fmt: skip

    def _memory(self) -> dict:
        """RSS, peak RSS, PSS of this process against its shard's bytes (+ KV) and the plan's."""
        from kafila.session.memory import member_memory

        role, sess = self.role, self.state.session
        if role is None or self.index is None or not sess:
            return member_memory(None, 0, 0, False, 0, 0)
        return member_memory(self.index, role.first, role.last, role.head == self.cfg.name,
                             int(sess["context"]), int(sess["concurrency"]))  # fmt: skip

    @property
    def code(self) -> str:
        return self._code

    @code.setter
    def code(self, value: str) -> None:
        self._code = value


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


def _succ(ring: list[str], name: str) -> str | None:
    return ring[(ring.index(name) + 1) % len(ring)] if name in ring else None


def edge_stats(edge) -> dict:
    s = edge.stats()
    return {k: s.get(k) for k in ("peer", "kind", "predicted", "rtt_ms", "bytes_sent", "bytes_received",
                                  "time_to_data_s", "time_to_direct_s")}  # fmt: skip


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
