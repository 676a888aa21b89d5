"""Issue 15 at the rendezvous (sans-I/O): a stranger who knows only the nameplate.

Each test is one attack from the issue's list, run against the Registry with fake connections;
each failed before admission (pending ids, drops everywhere) was built.
"""

from __future__ import annotations

import random

import pytest

from rendezvous import messages as m
from rendezvous.limits import (
    JOIN_WAIT_S,
    MAX_MEMBERS_PER_SESSION,
    MAX_PENDING_PER_SESSION,
    MAX_PENDING_PER_SOURCE,
    PAKE_START_S,
    MAX_RELAY_EDGES_PER_MEMBER,
    PENDING_BODIES_MAX,
    PENDING_TIMEOUT_S,
    SIGNAL_BURST_FRAMES,
)
from rendezvous.registry import CloseConn, Registry, SendTo

HOST = 1


def _sends(actions: list, conn: int) -> list:
    return [a.message for a in actions if isinstance(a, SendTo) and a.conn == conn]


def _closed(actions: list) -> set[int]:
    return {a.conn for a in actions if isinstance(a, CloseConn)}


class Rig:
    """A registry, a host on conn 1, and helpers that join and admit."""

    def __init__(self) -> None:
        rng = random.Random(7)
        self.reg = Registry(stun_port2=4000, random_bytes=rng.randbytes, random_below=rng.randrange)
        self.now = 0.0
        self.next_conn = 100
        self.reg.connected(HOST, self.now)
        [opened] = _sends(self.reg.receive(HOST, m.Open(), self.now), HOST)
        self.nameplate = opened.nameplate
        self.to_host: list = []

    def recv(self, conn: int, message: m.Message) -> list:
        actions = self.reg.receive(conn, message, self.now)
        self.to_host += _sends(actions, HOST)
        return actions

    def join(self) -> tuple[int, int | None]:
        conn = self.next_conn
        self.next_conn += 1
        self.reg.connected(conn, self.now)
        out = _sends(self.recv(conn, m.Join(self.nameplate)), conn)
        joined = out[0] if out and isinstance(out[0], m.Joined) else None
        return conn, joined.rid if joined else None

    def member(self) -> tuple[int, int]:
        conn, rid = self.join()
        assert rid is not None
        self.recv(conn, m.Send(0, b"P" + b"x" * 32))
        assert self.recv(HOST, m.Admit(rid)) == []
        return conn, rid

    def host_alive(self) -> bool:
        return self.reg.session_count == 1 and self.reg.is_host(HOST)


def test_junk_pake_and_heartbeat_flood_leave_no_ghost_and_kick_is_harmless() -> None:
    """Finding 1: one write of a junk PAKE body and ~450 heartbeats got the connection
    rate-limited but left its id in the session; the host's Kick of it then raised KeyError in
    the rendezvous and ended the session for everyone."""
    rig = Rig()
    legit_conn, legit = rig.member()
    conn, rid = rig.join()
    rig.recv(conn, m.Send(0, b"P-junk"))
    actions = []
    for _ in range(450):
        actions += rig.recv(conn, m.Heartbeat())
    assert conn in _closed(actions)
    assert rid not in rig.reg.members_of(rig.nameplate)  # dropped everywhere: no ghost
    assert m.PeerLeft(rid, "too many signaling messages") in rig.to_host  # the host hears it
    assert rig.recv(HOST, m.Kick(rid)) == []  # the host's Kick of the gone id: nothing happens
    assert rig.recv(HOST, m.Kick(9999)) == [] and rig.recv(HOST, m.Kick(0)) == []
    assert rig.host_alive()
    assert _sends(rig.recv(legit_conn, m.Send(0, b"S-still-here")), HOST) == [m.Deliver(legit, b"S-still-here")]


def test_ghosts_cannot_fill_the_session() -> None:
    """Finding 1, repeated: ghost ids used to fill the session (`full`) for ever."""
    rig = Rig()
    for _ in range(3 * MAX_MEMBERS_PER_SESSION):
        conn, rid = rig.join()
        assert rid is not None, "a ghost kept a slot"
        for _ in range(SIGNAL_BURST_FRAMES + 5):
            rig.recv(conn, m.Heartbeat())
    assert rig.reg.members_of(rig.nameplate) == [0]
    assert rig.member()[1] > 0  # a real member still gets in


def test_pending_id_cannot_request_edges_or_send_to_members() -> None:
    """Finding 2: an unauthenticated id could spend the session's relay-edge budget."""
    rig = Rig()
    _, a = rig.member()
    _, b = rig.member()
    conn, rid = rig.join()
    actions = rig.recv(conn, m.EdgeRequest(a))
    [err] = _sends(actions, conn)
    assert err.code == "not-admitted" and conn in _closed(actions)
    assert rig.reg.relay.edges_in(rig.nameplate) == 0
    conn, rid = rig.join()
    assert conn in _closed(rig.recv(conn, m.Send(b, b"x")))  # to a member: refused, dropped
    assert rig.reg.members_of(rig.nameplate) == [0, a, b]


def test_pending_id_may_send_only_a_few_small_bodies() -> None:
    """Finding 2: a pending id flooding the host with bodies (the host was then dropped for
    reading too slowly); now the pending quota drops the sender."""
    rig = Rig()
    conn, rid = rig.join()
    for i in range(PENDING_BODIES_MAX):
        assert _sends(rig.recv(conn, m.Send(0, b"P" + bytes([i]))), HOST) == [m.Deliver(rid, b"P" + bytes([i]))]
    actions = rig.recv(conn, m.Send(0, b"one more"))
    assert conn in _closed(actions) and _sends(actions, HOST) == [m.PeerLeft(rid, "too much before the host admitted you")]
    conn, rid = rig.join()
    actions = rig.recv(conn, m.Send(0, b"x" * 150_000))  # one large body before admission
    assert conn in _closed(actions)
    assert rig.host_alive()


def test_pending_ids_cannot_hold_every_slot() -> None:
    """Finding 2: ids that never did a PAKE used to hold all member slots."""
    rig = Rig()
    pending = [rig.join() for _ in range(MAX_PENDING_PER_SESSION)]
    assert all(rid is not None for _, rid in pending)
    conn, rid = rig.join()
    assert rid is None  # a fifth pending id is refused ("busy": the joiner retries)...
    rig.now += PENDING_TIMEOUT_S + 1  # ...and the squatters expire
    for c in [HOST, *(c for c, _ in pending)]:  # everyone heartbeats: only admission expires
        rig.recv(c, m.Heartbeat())
    actions = rig.reg.tick(rig.now)
    assert {c for c, _ in pending} <= _closed(actions) and HOST not in _closed(actions)
    assert rig.reg.pending_of(rig.nameplate) == []
    assert rig.member()[1] > 0


def test_admitted_members_keep_their_powers_and_host_controls_admission() -> None:
    rig = Rig()
    conn_a, a = rig.member()
    conn_b, b = rig.member()
    actions = rig.recv(conn_a, m.EdgeRequest(b))
    assert isinstance(_sends(actions, conn_a)[0], m.EdgeAllocated)
    assert isinstance(_sends(actions, conn_b)[0], m.EdgeAllocated)
    # no edge to a pending id, and only the host admits
    conn_c, c = rig.join()
    [err] = _sends(rig.recv(conn_a, m.EdgeRequest(c)), conn_a)
    assert err.code == "no-such-member"
    [err] = _sends(rig.recv(conn_a, m.Admit(c)), conn_a)
    assert err.code == "unexpected" and c in rig.reg.pending_of(rig.nameplate)
    assert rig.recv(HOST, m.Admit(12345)) == []  # an unknown id: harmless


def test_relay_edges_per_member_are_bounded() -> None:
    rig = Rig()
    conn_a, a = rig.member()
    _, b = rig.member()
    for _ in range(MAX_RELAY_EDGES_PER_MEMBER):
        rig.now += 0.01
        assert isinstance(_sends(rig.recv(conn_a, m.EdgeRequest(b)), conn_a)[0], m.EdgeAllocated)
    [err] = _sends(rig.recv(conn_a, m.EdgeRequest(b)), conn_a)
    assert err.code == "full"
    assert rig.reg.relay.edges_in(rig.nameplate) == MAX_RELAY_EDGES_PER_MEMBER


def test_byte_budget_drops_a_member_that_sends_too_much() -> None:
    rig = Rig()
    conn, rid = rig.member()
    dropped = False
    for _ in range(40):  # 40 x 190 KB in one instant: over the member's 2 MiB burst
        if conn in _closed(rig.recv(conn, m.Send(0, b"S" + b"x" * 190_000))):
            dropped = True
            break
    assert dropped and rig.host_alive()


def test_host_may_send_plans_to_many_members() -> None:
    """The host's budgets allow a 1 MiB plan in 16 KiB pieces to each of 31 members at once."""
    rig = Rig()
    members = [rig.member() for _ in range(MAX_MEMBERS_PER_SESSION - 1)]
    for _, rid in members:
        for _ in range(64):
            assert not _closed(rig.recv(HOST, m.Send(rid, b"S" + b"p" * 16_400)))
    assert rig.host_alive()


def test_embedded_rendezvous_serves_only_its_session() -> None:
    reg = Registry(max_sessions=1)
    reg.connected(1, 0.0)
    assert isinstance(_sends(reg.receive(1, m.Open(), 0.0), 1)[0], m.Opened)
    reg.connected(2, 0.0)
    actions = reg.receive(2, m.Open(), 0.0)
    assert _sends(actions, 2)[0].code == "full" and 2 in _closed(actions)


@pytest.mark.parametrize("message", [m.Kick(1), m.CloseNameplate(), m.Admit(1), m.EdgeRequest(0),
                                     m.Send(1, b"x"), m.Open(), m.Join(5)])
def test_pending_id_sending_anything_else_is_dropped(message: m.Message) -> None:
    rig = Rig()
    conn, rid = rig.join()
    actions = rig.recv(conn, message)
    assert conn in _closed(actions) and rid not in rig.reg.members_of(rig.nameplate)
    assert rig.host_alive()


def _join_from(rig: Rig, source: str, nameplate: int | None = None) -> tuple[int, list]:
    conn = rig.next_conn
    rig.next_conn += 1
    rig.reg.connected(conn, rig.now, source)
    return conn, _sends(rig.recv(conn, m.Join(nameplate or rig.nameplate)), conn)


def test_pending_slots_go_in_arrival_order_with_a_pake_deadline_and_a_cap_per_address() -> None:
    """Issue 38 item 3: a stranger re-taking the pending slots (no PAKE) used to block every join."""
    rig = Rig()
    squat = [_join_from(rig, f"10.0.0.{2 + i // 2}") for i in range(MAX_PENDING_PER_SESSION)]
    assert all(isinstance(out[0], m.Joined) for _, out in squat)
    conn, out = _join_from(rig, "10.0.0.2")  # a third from one address: refused at once
    assert [e.code for e in out] == ["busy"] and MAX_PENDING_PER_SOURCE == 2
    legit, out = _join_from(rig, "10.0.0.9")  # the slots are full: it waits in line, in order
    assert out == []
    late, _ = _join_from(rig, "10.0.0.3")  # the squatter's next try comes after it (and is capped)
    rig.now += PAKE_START_S + 0.1  # the squatters never began a PAKE
    for c in [HOST, legit]:
        rig.recv(c, m.Heartbeat())
    actions = rig.reg.tick(rig.now)
    assert {c for c, _ in squat} <= _closed(actions)
    assert {e.code for c, _ in squat for e in _sends(actions, c)} == {"no-pake"}  # the joiner may try again
    [joined] = _sends(actions, legit)
    assert isinstance(joined, m.Joined)  # its turn came with the first freed slot
    [notice] = [n for n in _sends(actions, HOST) if isinstance(n, m.Notice)]
    assert notice.reason.startswith("1 joins refused from 10.0.0.2")
    assert _sends(rig.reg.tick(rig.now + 1), HOST) == []  # the next notice waits a minute
    # the line is bounded in time too: after JOIN_WAIT_S a join gets "busy" (the joiner asks again)
    for i in range(MAX_PENDING_PER_SESSION - len(rig.reg.pending_of(rig.nameplate))):
        c, _ = _join_from(rig, f"10.0.1.{i}")
        rig.recv(c, m.Send(0, b"P-began"))  # these began their PAKE: they keep their slots
    waiting, out = _join_from(rig, "10.0.0.8")
    assert out == []
    rig.now += JOIN_WAIT_S + 1
    assert [e.code for e in _sends(rig.reg.tick(rig.now), waiting)] == ["busy"]


def test_reopen_moves_joins_to_a_fresh_nameplate() -> None:
    """Issue 38 item 2: after a wrong guess the host's fresh code has a nameplate of its own."""
    rig = Rig()
    rig.recv(HOST, m.CloseNameplate())
    [reopened] = _sends(rig.recv(HOST, m.Reopen()), HOST)
    assert isinstance(reopened, m.Reopened) and reopened.nameplate != rig.nameplate
    conn, out = _join_from(rig, "10.0.0.5")
    assert [e.code for e in out] == ["unknown-nameplate"]  # the old code's nameplate is closed
    conn, out = _join_from(rig, "10.0.0.6", reopened.nameplate)
    assert isinstance(out[0], m.Joined)
    assert rig.reg.members_of(rig.nameplate) == [0, out[0].rid]  # one session, under its first nameplate
    # after a resume the host re-claims the fresh nameplate: the same one, still open
    assert _sends(rig.recv(HOST, m.Reopen(reopened.nameplate)), HOST) == [m.Reopened(reopened.nameplate)]
