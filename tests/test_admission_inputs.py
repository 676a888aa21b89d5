"""Issue 15, findings 5, 7 and 8: hostile inputs that must be dropped quietly or refused.

- a 3-byte UDP datagram made a member log a full traceback (a log flood);
- a manifest digest was joined into a cache path unchecked, and file_bytes was unbounded;
- a ring frame addressed to a name not in the ring circulated for ever;
- `--code-file` was written 0644, and the code could only be given on the command line (`ps`).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import stat

import numpy as np
import pytest

from backends.errors import BadInput
from kafila.net.codefile import read_code, write_private
from kafila.net.sock import MemberSocket
from kafila.session.weights import manifest as W
from kafila.session.wire.frames import Cancel, Limits, Request, Tokens
from kafila.session.control.participant import role_of
from kafila.session.ring.node import RingNode
from rendezvous import frames
from rendezvous.errors import ProtocolError

CODE = "7-adroitness-absurd-yucatan"


# -- finding 5: decoder errors on the member's UDP socket ---------------------------------------
def test_bad_datagrams_are_counted_without_a_traceback(caplog) -> None:
    sock = MemberSocket()

    def strict(data: bytes, src) -> None:  # what the member's handlers do with garbage
        raise ProtocolError("malformed", "bad punch frame")

    def buggy(data: bytes, src) -> None:
        raise KeyError("a bug")

    sock.handlers[frames.KIND_PUNCH] = strict
    sock.handlers[frames.KIND_RELAY] = buggy
    with caplog.at_level(logging.DEBUG, logger="kafila.net"):
        for _ in range(1000):
            sock.datagram_received(b"\x20ab", ("203.0.113.9", 1))
        for _ in range(100):
            sock.datagram_received(b"\x12abc", ("203.0.113.9", 1))
    assert sock.malformed == 1000 and sock.handler_errors == 100 and sock.dropped == 1100
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
    assert sum(r.levelno >= logging.WARNING for r in caplog.records) <= 3  # the rest: debug lines


# -- finding 7: manifests --------------------------------------------------------------------------
def _manifest(**change) -> dict:
    good = {"sha256": "a" * 64, "file_bytes": 1000, "header_len": 100, "header_sha256": "b" * 64,
            "tensors": [["t", 100, 900, "c" * 64]]}
    return {**good, **change}


def test_good_manifest_parses() -> None:
    m = W.Manifest.from_json(_manifest())
    assert W.local_copy_path("/cache", m) == os.path.join("/cache", "a" * 32 + ".gguf")


@pytest.mark.parametrize("change", [
    {"sha256": "../../../../etc/cron.d/evil" + "0" * 40},
    {"sha256": "/tmp/" + "a" * 59},
    {"sha256": "A" * 64}, {"sha256": "a" * 63}, {"header_sha256": "../x"},
    {"tensors": [["t", 100, 900, "../../" + "c" * 58]]},
    {"file_bytes": 1 << 60},  # unbounded file_bytes: a member would reserve or fetch that much
])
def test_hostile_manifest_is_refused(change: dict) -> None:
    with pytest.raises(W.WeightError):
        W.Manifest.from_json(_manifest(**change))


def test_cache_path_never_leaves_the_cache() -> None:
    forged = W.Manifest("../../" + "a" * 58, 1000, 100, "b" * 64, ())  # built without from_json
    with pytest.raises(W.WeightError):
        W.local_copy_path("/cache", forged)


# -- finding 7: a frame addressed to a name not in the ring ----------------------------------------
class _Out:
    def __init__(self) -> None:
        self.sent: list = []

    async def send(self, frame) -> None:
        self.sent.append(frame)


def test_frame_for_a_name_not_in_the_ring_is_dropped() -> None:
    async def main():
        node = RingNode("m2", "m1", ["m1", "m2", "m3"], shard=None, limits=Limits(hidden=8, context=16, slots=1, vocab=32))
        node.out = _Out()
        import numpy as np

        for frame in (Request("r1", "m2", "nobody", 4, True, np.array([1, 2], dtype=np.int32)),
                      Tokens("r1", "nobody", (1,)), Cancel("r1", "ghost")):
            await node._on_frame(frame)
        assert node.out.sent == [] and node.misaddressed == 3
        await node._on_frame(Tokens("r1", "m3", (1,)))  # a ring name: forwarded as before
        assert len(node.out.sent) == 1
        node.executor.shutdown()
    asyncio.run(main())


def test_frame_past_its_hop_limit_is_dropped_and_counted() -> None:
    """A routed frame for a ring name is passed on one hop further; one that has been passed on
    more than len(ring) + 1 times (a member re-sending it in a loop) is dropped and counted."""
    async def main():
        node = RingNode("m2", "m1", ["m1", "m2", "m3"], shard=None, limits=Limits(hidden=8, context=16, slots=1, vocab=32))
        node.out = _Out()
        await node._on_frame(Tokens("r1", "m3", (1,), hops=2))
        assert node.out.sent == [Tokens("r1", "m3", (1,), hops=3)]
        for frame in (Tokens("r1", "m3", (1,), hops=5), Cancel("r1", "m1", hops=5),
                      Request("r1", "m3", "m1", 4, True, np.array([1], dtype=np.int32), hops=200)):
            await node._on_frame(frame)
        assert len(node.out.sent) == 1 and node.overhopped == 3
        await node._on_frame(Cancel("r1", "m1", hops=4))  # len(ring) + 1: still passed on
        assert node.out.sent[-1] == Cancel("r1", "m1", hops=5)
        node.executor.shutdown()
    asyncio.run(main())


# -- finding 8: the code outside argv ---------------------------------------------------------------
def test_code_file_is_written_0600_even_over_an_existing_file(tmp_path) -> None:
    path = tmp_path / "code"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_private(str(path), CODE + "\n")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and path.read_text() == CODE + "\n"
    assert read_code(str(path)) == CODE


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_code_from_stdin_prompt_or_file() -> None:
    assert read_code("-", stdin=io.StringIO(CODE + "\n")) == CODE
    assert read_code(None, stdin=io.StringIO(" " + CODE)) == CODE
    asked = []
    assert read_code("-", stdin=_Tty(), prompt=lambda text: asked.append(text) or CODE) == CODE
    assert asked and "not echoed" in asked[0]
    with pytest.raises(BadInput):
        read_code("-", stdin=io.StringIO(""))
    with pytest.raises(BadInput):
        read_code("/nonexistent/code")


def test_host_code_file_and_join_code_file_through_the_cli(tmp_path, monkeypatch) -> None:
    """`kafila join - ` and `--code-file` reach the same parse as a CODE argument."""
    from kafila.commands import join

    seen = {}

    class _Participant:
        def __init__(self, cfg) -> None:
            pass

        def run(self) -> int:
            seen["code"] = self.code
            return 0

    monkeypatch.setattr("kafila.session.control.participant.Participant", _Participant)
    monkeypatch.setattr(join, "check_backend", lambda name: None)
    path = tmp_path / "c"
    write_private(str(path), CODE + "\n")
    from kafila.cli import main

    assert main(["join", "--code-file", str(path), "--api", "off"]) == 0 and seen["code"] == CODE
    monkeypatch.setattr("sys.stdin", io.StringIO(CODE + "\n"))
    assert main(["join", "-", "--api", "off"]) == 0 and seen["code"] == CODE


# -- issue 15, item 6: a ring Hello names the authenticated peer and the plan's predecessor ------
class _Edge:
    """An accepted edge from `peer` (the name its pinned certificate proved) whose first stream
    opens with `hello`."""

    def __init__(self, peer: str, hello) -> None:
        from kafila.session.wire.frames import encode

        self.peer, self.closed = peer, False
        self.reader = asyncio.StreamReader()
        self.reader.feed_data(encode(hello))

    async def accept_stream(self):
        return self.reader, None

    async def close(self) -> None:
        self.closed = True


def test_ring_hello_must_name_the_authenticated_peer_and_the_planned_predecessor(caplog) -> None:
    """The first ring Hello from anyone became the predecessor stream: a member (m3, not m2's
    predecessor) or one claiming another's name could feed m2's stage."""
    from kafila.session.wire.frames import Hello
    from kafila.session.control.participant import Participant, SessionConfig

    plan = {"ring": ["m1", "m2", "m3"], "head": "m1", "blocks": {"m1": 1, "m2": 1, "m3": 1}}

    async def main():
        p = Participant(SessionConfig(name="m2", rendezvous=None))
        early = asyncio.ensure_future(p.stage.ring.on_edge(_Edge("m3", Hello("m3", "ring"))))  # before the plan
        await asyncio.sleep(0.01)
        assert not early.done()
        p.stage.set_plan(1, plan, {})
        await early
        for edge in (_Edge("m3", Hello("m1", "ring")),  # m3 claiming to be m1
                     _Edge("m1", Hello("m3", "ring"))):  # the right peer with a wrong Hello
            await p.stage.ring.on_edge(edge)
            assert edge.closed
        assert 1 not in p.stage.ring._pred_streams
        good = _Edge("m1", Hello("m1", "ring"))
        await p.stage.ring.on_edge(good)
        assert not good.closed and p.stage.ring._pred_streams[1].result()[0] is good
        stale = _Edge("m1", Hello("m1", "ring", 1))  # a replan to plan 2 (m1 stays the predecessor)
        p.stage.set_plan(2, plan, {})
        await p.stage.ring.on_edge(stale)
        assert stale.closed and 2 not in p.stage.ring._pred_streams

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    dropped = [r for r in caplog.records if "ring stream from" in r.getMessage()]
    assert len(dropped) == 4 and not any(r.exc_info for r in caplog.records)
