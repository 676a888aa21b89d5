"""The host's weight server: each member's shard of the model over its edge (or the TCP bulk
lane), counted per member for /status and for whoever shows the host (HostView.transfer)."""

from __future__ import annotations

import asyncio
import logging

from backends.errors import describe_error
from kafila.session.control.system import CLOSE_ERRORS, close_quietly
from kafila.session.weights.manifest import TransferProgress, WeightError
from kafila.session.wire.streams import StreamClosed
from rendezvous.errors import ProtocolError

log = logging.getLogger("kafila.session.control")


class HostWeights:
    def __init__(self, stage, view) -> None:
        self.stage = stage  # stage.Stage: its cfg, and its ring's bulk listener
        self.view = view  # host.HostView
        self.digests = None  # weights.manifest.DigestCache, once hashed
        self.cache: dict = {}  # the compressed header every member asks for first, and such
        self.transfers: dict[str, TransferProgress] = {}  # member → the weights it was sent
        self.lanes: dict[str, str] = {}  # member → "tcp" | "quic": how its weights went

    def expect(self, name: str, total_bytes: int, now: float) -> None:
        self.transfers[name] = TransferProgress(total_bytes, now)

    def forget(self, name: str) -> None:
        self.transfers.pop(name, None)

    def status(self) -> dict:
        return {n: {**p.as_dict(), "lane": self.lanes.get(n, "quic")} for n, p in self.transfers.items()}

    async def serve(self, edge, reader, writer, hello=None) -> None:
        """Serve one member's weight stream (`hello`: its Hello, already read by RingLinks.on_edge)."""
        from kafila.session.weights.transfer import serve_weights

        stage = self.stage
        clock = asyncio.get_running_loop().time
        prog = self.transfers.get(edge.peer)
        if prog is not None:
            prog.started_s = clock()  # the rate counts from the member's first request

        def served(n: int) -> None:
            if prog is not None:
                prog.update(n, clock())
                self._show(edge.peer)

        def lane(kind: str) -> None:
            self.lanes[edge.peer] = kind

        self.lanes[edge.peer] = "quic"
        listener = None if stage.cfg.weights_lane == "quic" else await stage.ring.bulk_listener()
        try:
            sent = await serve_weights(reader, writer, stage.cfg.model_path, self.digests.index.file_bytes,
                                       self.cache, served, listener, lane, hello)  # fmt: skip
            log.info("served %d weight bytes to %s over %s", sent, edge.peer, self.lanes[edge.peer])
        except (StreamClosed, ProtocolError, WeightError, *CLOSE_ERRORS) as exc:  # the member's stream, not us
            log.warning("weight transfer to %s ended: %s", edge.peer, describe_error(exc))
        finally:
            self.done(edge.peer)
            await close_quietly("a weights edge", edge.close())

    def done(self, name: str) -> None:
        """The member closed its weight stream or said it is ready (a local copy needs none)."""
        prog = self.transfers.get(name)
        if prog is not None and not prog.finished:
            prog.finish(asyncio.get_running_loop().time())
            self._show(name)

    def _show(self, name: str) -> None:
        prog = self.transfers.get(name)
        if prog is not None:
            self.view.transfer(name, prog.total_bytes if prog.finished else prog.done_bytes, prog.total_bytes)


__all__ = ["HostWeights"]
