"""Ring forming: this process's ring edges for one plan, both ends.

The edge to the successor is opened here (`to_successor`); the edge from the predecessor is
accepted (`accept_loop` → `on_edge`): its first frame is a Hello, and a ring Hello becomes the
predecessor stream of the plan it names only once that plan is known here and the edge's
pinned certificate proves the plan's predecessor sent it (`ring_hello_refusal`). Any other Hello
asks for weights, which only the host serves (`Stage.weight_server`). Each edge may move its
frames to a TCP lane (kafila.session.weights.ring_lane) when the peer is reachable."""

from __future__ import annotations

import asyncio
import logging

from backends.errors import Refused, describe_error
from kafila.session.control.system import CLOSE_ERRORS, close_quietly, lan_ip, punched_host
from kafila.session.weights.bulk import BulkListener
from kafila.session.weights.bulk import dial as bulk_dial
from kafila.session.weights.ring_lane import offer_lane, take_lane
from kafila.session.wire.frames import Hello, encode
from kafila.session.wire.streams import StreamClosed, read_frame
from rendezvous.errors import ProtocolError

log = logging.getLogger("kafila.session.control")
READY_TIMEOUT_S = 900.0  # lifecycle.READY_TIMEOUT_S: weights over a slow link and a shard build
RING_EDGE_TIMEOUT_S = 60.0  # to open the edge to the successor (it accepts even while building)


class StepFailed(Refused):
    """A step of forming that failed; `blame`: the members it concerns (a ring edge's peer), whom
    the host drops and plans without (lifecycle.Prepared.blame)."""

    def __init__(self, text: str, blame: tuple[str, ...] = ()) -> None:
        super().__init__(text)
        self.blame = blame


async def step(what: str, coro, timeout_s: float | None = None, blame: tuple[str, ...] = ()):
    """One step of forming (fetch, build, a ring edge): whatever stops it becomes one line that
    says which step, with whom, and why ("the ring edge from m2 to m3 (10.0.0.3) was not up
    within 60 s"); never a bare TimeoutError or an empty reason."""
    try:
        return await (coro if timeout_s is None else asyncio.wait_for(coro, timeout_s))
    except TimeoutError:
        raise StepFailed(f"{what} was not up within {timeout_s:g} s" if timeout_s is not None
                         else f"{what}: it timed out", blame) from None  # fmt: skip
    except Exception as exc:  # any failure of the step becomes its one line (the cause chained)
        raise StepFailed(f"{what}: {describe_error(exc)}", blame) from exc


def ring_hello_refusal(claimed: str, peer: str, predecessor: str) -> str | None:
    """Why a ring stream may not feed this member's stage (None: it may). `peer` is the member
    the edge's pinned certificate proved; the Hello only claims a name, and only the plan's
    predecessor may send activations here."""
    if claimed != peer:
        return f"its Hello claims the name {claimed[:64]!r}"
    if peer != predecessor:
        return f"the plan's predecessor is {predecessor}, not {peer}"
    return None


class RingLinks:
    """The ring edges of the stage `stage` (stage.Stage): its cfg, net, epoch and role are read
    from it, so a name the host changed at joining or a new plan is seen at once."""

    def __init__(self, stage) -> None:
        self.stage = stage
        self._pred_streams: dict[int, asyncio.Future] = {}  # epoch → (edge, reader, writer) from the predecessor
        self._planned = asyncio.Event()  # set once a role is known: a ring Hello waits for it
        self._epoch_changed = asyncio.Event()
        self.edges: list = []
        self.lanes: list = []  # ring_lane.Lane of this member's ring edges (both ends)
        # successors (name, certificate) whose TCP lane broke while the QUIC edge stayed up: their
        # frames stay on QUIC, so a path that drops TCP does not break every plan's ring
        self.lanes_broken: set[tuple] = set()
        self.succ_edge = None
        self.succ_lane = None  # ring_lane.Lane to the successor: what /status says it carries frames on
        self._bulk: BulkListener | None = None  # the TCP lanes' listener (opened at first use)
        self._bulk_failed = False  # it could not listen: not tried again

    def planned(self, epoch: int) -> None:
        """Plan `epoch`'s roles are known: ring Hellos waiting for it go on."""
        for old in [e for e in self._pred_streams if e < epoch]:
            self._pred_streams.pop(old)
        self._planned.set()
        self._epoch_changed.set()
        self._epoch_changed = asyncio.Event()

    def pred_future(self, epoch: int) -> asyncio.Future:
        if epoch not in self._pred_streams:
            self._pred_streams[epoch] = asyncio.get_running_loop().create_future()
        return self._pred_streams[epoch]

    async def to_successor(self, me: str, succ: str, epoch: int):
        """The ring edge to `succ` for plan `epoch`: (edge, lane, writer); StepFailed naming it."""
        stage = self.stage

        async def connect():
            edge = await stage.net.connect(succ)
            self.edges.append(edge)
            reader, writer = await edge.open_stream()
            dial = None
            info = stage.net.roster().get(succ)
            peer = (succ, info.fingerprint if info is not None else None)
            if stage.cfg.ring_lane != "quic" and peer not in self.lanes_broken:
                async def dial(offer):  # where the edge reached it (by now), then where it said it is
                    return await bulk_dial(offer, prefer=punched_host(edge) + stage.candidate_hosts(succ))
            writer.write(encode(Hello(me, "ring", epoch, bulk=dial is not None)))
            await writer.drain()
            try:
                writer, lane = await take_lane(reader, writer, dial, stage.cfg.send_delay_ms)
            except StreamClosed as exc:
                raise Refused(f"{stage.who(succ)} closed the ring stream from {me}: {exc}") from None
            lane.peer = peer
            if peer in self.lanes_broken:
                lane.note = "its TCP lane broke in an earlier plan while the QUIC edge stayed up"
            self.lanes.append(lane)
            return edge, lane, writer

        self.succ_edge, self.succ_lane, writer = await step(f"the ring edge from {me} to {stage.who(succ)}",
                                                            connect(), RING_EDGE_TIMEOUT_S, (succ,))  # fmt: skip
        return writer

    async def from_predecessor(self, me: str, pred: str, epoch: int):
        """The reader of the predecessor's ring stream for plan `epoch` (it opens its edge once
        its own weights and shard are ready)."""
        try:
            _, reader, _ = await asyncio.wait_for(self.pred_future(epoch), READY_TIMEOUT_S)
        except TimeoutError:
            raise StepFailed(f"the ring edge from {self.stage.who(pred)} to {me} was not up "
                             f"within {READY_TIMEOUT_S:g} s", (pred,)) from None  # fmt: skip
        return reader

    async def close(self) -> None:
        edges, self.edges = self.edges, []
        lanes, self.lanes = self.lanes, []
        for edge in edges:
            await close_quietly("a ring edge", edge.close())
        for lane in lanes:
            if lane.broke and lane.peer not in self.lanes_broken:
                self.lanes_broken.add(lane.peer)
                log.warning("ring: the TCP lane to %s broke while its QUIC edge stayed up: its frames stay "
                            "on QUIC from the next plan on", lane.peer[0])  # fmt: skip
            await lane.close()
        self.succ_edge = self.succ_lane = None

    async def bulk_listener(self) -> BulkListener | None:
        """This process's TCP listener for the bulk lanes (weights at the host, ring frames at
        every member), opened at first use; None when it cannot listen (QUIC carries it all)."""
        stage = self.stage
        if self._bulk is None and not self._bulk_failed:
            # its LAN address first: a host's own candidates may name only the loopback it reached
            # its embedded rendezvous on
            hosts = [lan_ip(), *stage.candidate_hosts(stage.cfg.name)]
            try:
                self._bulk = await BulkListener.start(stage.cfg.bind_host, hosts)
            except OSError as exc:
                stage.say(f"{stage.cfg.name}: no TCP listener ({exc}): weights and ring frames go over QUIC")
                self._bulk_failed = True
                return None
            log.info("bulk lane: listening on port %d for %s", self._bulk.port, ", ".join(self._bulk.hosts))
        return self._bulk

    async def close_bulk(self) -> None:
        if self._bulk is not None:
            await close_quietly("the bulk listener", self._bulk.close())
            self._bulk = None

    # --- the accepting end -----------------------------------------------------------------------

    async def accept_loop(self) -> None:
        while True:
            edge = await self.stage.net.accept()
            self.stage.spawn(self.on_edge(edge), f"edge-{edge.peer}")

    async def on_edge(self, edge) -> None:
        stage = self.stage
        try:
            reader, writer = await edge.accept_stream()
            hello = await read_frame(reader, None)
        except (StreamClosed, ProtocolError, *CLOSE_ERRORS) as exc:  # a peer that went or sent junk
            log.warning("edge from %s: %s", edge.peer, describe_error(exc))
            await close_quietly("an edge", edge.close())
            return
        if not isinstance(hello, Hello):
            await close_quietly("an edge", edge.close())
            return
        if hello.purpose != "ring":
            if stage.weight_server is None:  # only the host serves weights
                await close_quietly("an edge", edge.close())
            else:
                await stage.weight_server(edge, reader, writer, hello)
            return
        why = await self._ring_refusal(hello, edge)
        if why is not None:  # one line, no traceback: a member that lies is not our bug
            log.warning("ring stream from %s dropped: %s", edge.peer, why)
            await close_quietly("an edge", edge.close())
            return
        fut = self.pred_future(hello.epoch)
        if fut.done():
            await close_quietly("an edge", edge.close())
            return
        self.edges.append(edge)
        if hello.bulk:
            try:
                listener = await self.bulk_listener() if stage.cfg.ring_lane != "quic" else None
                reader, lane = await offer_lane(reader, writer, listener)
            except StreamClosed as exc:
                log.warning("ring stream from %s dropped: %s", edge.peer, exc)
                await close_quietly("an edge", edge.close())
                return
            self.lanes.append(lane)
            if fut.done():  # a replan while the lane was offered: this stream is stale
                await lane.close()
                await close_quietly("an edge", edge.close())
                return
        fut.set_result((edge, reader, writer))

    async def _ring_refusal(self, hello: Hello, edge) -> str | None:
        """Why a ring Hello may not become the predecessor stream (None: it may), once the plan
        it was opened for says who the predecessor is (a Hello may come before that plan: at a
        replan the predecessor may learn the new plan first)."""
        stage = self.stage
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        while stage.epoch < hello.epoch or not self._planned.is_set():
            left = deadline - loop.time()
            if left <= 0:
                return f"no plan {hello.epoch} arrived"
            try:
                await asyncio.wait_for(self._epoch_changed.wait(), left)
            except TimeoutError:
                continue  # the loop's test says which
        if hello.epoch < stage.epoch:
            return f"it was opened for plan {hello.epoch}; this member is on plan {stage.epoch}"
        assert stage.role is not None
        return ring_hello_refusal(hello.name, edge.peer, stage.role.predecessor(stage.cfg.name))


__all__ = ["READY_TIMEOUT_S", "RING_EDGE_TIMEOUT_S", "RingLinks", "StepFailed", "ring_hello_refusal", "step"]
