"""The member socket's demultiplexer (kafila/net/edge_table.py), without sockets: fake edges
record what reaches them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kafila.net.edge_table import EARLY_DATAGRAM_TTL_S, EARLY_DATAGRAMS_PER_EDGE_MAX, EARLY_EDGES_MAX, EdgeTable

PEER = ("192.0.2.7", 4000)
OTHER = ("192.0.2.8", 4000)


@dataclass
class _Puncher:
    direct: tuple | None = None
    candidates: list = field(default_factory=lambda: [PEER])


@dataclass
class FakeEdge:
    edge_id: bytes
    closed: bool = False
    awaiting_initial: bool = False
    puncher: _Puncher = field(default_factory=_Puncher)
    got: list = field(default_factory=list)

    def datagram(self, data: bytes) -> None:
        self.got.append(("data", data))

    def punch_frame(self, data: bytes, src) -> None:
        self.got.append(("punch", data, src))


def test_datagrams_before_the_allocation_are_replayed_when_the_edge_arrives() -> None:
    table = EdgeTable()
    table.relay(b"E1", b"early-relay", 0.0)
    table.punch(b"E1", b"early-punch", PEER, 0.1)
    table.relay(b"E1", b"", 0.2)  # an empty relay payload carries nothing: not kept
    edge = FakeEdge(b"E1")
    table.add(edge, 1.0)
    assert edge.got == [("data", b"early-relay"), ("punch", b"early-punch", PEER)]
    table.relay(b"E1", b"later", 1.1)
    assert edge.got[-1] == ("data", b"later") and table.early_edges == 0


def test_early_datagrams_are_bounded_and_expire() -> None:
    table = EdgeTable()
    for i in range(EARLY_EDGES_MAX + 5):
        table.relay(b"E%d" % i, b"x", 0.0)
    assert table.early_edges == EARLY_EDGES_MAX
    for _ in range(EARLY_DATAGRAMS_PER_EDGE_MAX + 10):
        table.relay(b"E0", b"y", 0.0)
    late = FakeEdge(b"E0")
    table.add(late, EARLY_DATAGRAM_TTL_S + 1)  # they are stale by then: nothing replayed
    assert late.got == []
    fresh = FakeEdge(b"E1")
    table.add(fresh, 1.0)
    assert fresh.got == [("data", b"x")]


def test_quic_goes_to_the_edge_of_its_connection_id_and_only_from_a_punched_address() -> None:
    table = EdgeTable()
    edge = FakeEdge(b"E1")
    table.add(edge, 0.0)
    table.register_cid(b"cid1", edge)
    assert table.quic(b"cid1", False, b"pkt", PEER) and edge.got == [("data", b"pkt")]
    assert not table.quic(b"cid1", False, b"spoofed", OTHER)
    assert not table.quic(b"unknown", False, b"pkt", PEER)
    table.register_cid(b"cid1", None)
    assert not table.quic(b"cid1", False, b"pkt", PEER)


def test_a_retransmitted_initial_finds_the_server_edge_that_punched_its_sender() -> None:
    table = EdgeTable()
    waiting = FakeEdge(b"E1", awaiting_initial=True)
    table.add(waiting, 0.0)
    assert table.quic(b"fresh-cid", True, b"initial", PEER) and waiting.got == [("data", b"initial")]
    assert not table.quic(b"fresh-cid", True, b"initial", OTHER)


def test_relay_only_ignores_punches() -> None:
    table = EdgeTable(allow_direct=False)
    edge = FakeEdge(b"E1")
    table.punch(b"E1", b"early", PEER, 0.0)
    table.add(edge, 0.1)
    table.punch(b"E1", b"probe", PEER, 0.2)
    assert edge.got == []
