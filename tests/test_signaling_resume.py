"""Signaling that survives (churn issue, item 2): a member gets its session back after the
rendezvous restarts, and a restarted relay carries the relayed edges again.

First the registry alone (sans-I/O, fake connections), then real sockets: a session, its
rendezvous closed and a new one started on the same port under it.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kafila.net import Member, MemberJoined, Message
from rendezvous import messages as m
from rendezvous.limits import RESUMED_RID_BASE
from rendezvous.registry import CloseConn, Registry, SendTo
from rendezvous.service import Rendezvous

KEY = bytes(range(32))
HOST, A, B = 1, 2, 3


def _sends(actions: list, conn: int) -> list:
    return [a.message for a in actions if isinstance(a, SendTo) and a.conn == conn]


def _closed(actions: list) -> set[int]:
    return {a.conn for a in actions if isinstance(a, CloseConn)}


def _registry() -> Registry:
    rng = random.Random(3)
    return Registry(stun_port2=4000, random_bytes=rng.randbytes, random_below=rng.randrange)


def _session(reg: Registry) -> tuple[int, dict[int, tuple[int, bytes]]]:
    """A host (conn HOST) and two admitted members (conns A, B): nameplate, conn -> (rid, token)."""
    reg.connected(HOST, 0.0)
    [opened] = _sends(reg.receive(HOST, m.Open(resume_key=KEY), 0.0), HOST)
    out = {HOST: (0, opened.relay_token)}
    for conn in (A, B):
        reg.connected(conn, 0.0)
        [joined] = _sends(reg.receive(conn, m.Join(opened.nameplate), 0.0), conn)
        reg.receive(conn, m.Send(0, b"pake"), 0.0)
        reg.receive(HOST, m.Admit(joined.rid), 0.0)
        out[conn] = (joined.rid, joined.relay_token)
    return opened.nameplate, out


def _resume(reg: Registry, conn: int, nameplate: int, rid: int, token: bytes, proof: bytes | None = None) -> list:
    reg.connected(conn, 1.0)
    proof = m.resume_proof(KEY, nameplate, rid) if proof is None else proof
    return reg.receive(conn, m.Resume(nameplate, rid, proof, token), 1.0)


def test_a_restarted_rendezvous_takes_the_host_then_its_members_back() -> None:
    old = _registry()
    nameplate, ids = _session(old)
    new = _registry()  # knows nothing
    # a member that comes back before the host is told to ask again (not refused for good)
    (rid_a, token_a), (rid_b, token_b) = ids[A], ids[B]
    early = _resume(new, 10 + A, nameplate, rid_a, token_a)
    assert [x.code for x in _sends(early, 10 + A)] == ["unknown-nameplate"] and 10 + A in _closed(early)
    assert isinstance(_sends(_resume(new, 10 + HOST, nameplate, 0, ids[HOST][1], KEY), 10 + HOST)[0], m.Resumed)
    for conn, (rid, token) in ((20 + A, ids[A]), (20 + B, ids[B])):
        assert isinstance(_sends(_resume(new, conn, nameplate, rid, token), conn)[0], m.Resumed)
    # admitted at once: the host reaches a member, a member reaches the host
    assert _sends(new.receive(10 + HOST, m.Send(rid_a, b"hi"), 2.0), 20 + A) == [m.Deliver(0, b"hi")]
    assert _sends(new.receive(20 + B, m.Send(0, b"yo"), 2.0), 10 + HOST) == [m.Deliver(rid_b, b"yo")]
    # a joiner of the re-created session never gets an id the old rendezvous gave out
    new.connected(99, 2.0)
    [joined] = _sends(new.receive(99, m.Join(nameplate), 2.0), 99)
    assert joined.rid >= RESUMED_RID_BASE
    assert new.members_of(nameplate) == sorted([0, rid_a, rid_b, joined.rid])


def test_a_resume_needs_the_hosts_proof() -> None:
    old = _registry()
    nameplate, ids = _session(old)
    new = _registry()
    _resume(new, 10 + HOST, nameplate, 0, ids[HOST][1], KEY)
    rid_a, token_a = ids[A]
    for proof in (bytes(32), m.resume_proof(KEY, nameplate, rid_a + 1), m.resume_proof(KEY[::-1], nameplate, rid_a)):
        actions = _resume(new, 30, nameplate, rid_a, token_a, proof)
        assert [x.code for x in _sends(actions, 30)] == ["bad-resume"] and 30 in _closed(actions)
    # a second "host" with another key cannot take the nameplate over
    actions = _resume(new, 31, nameplate, 0, bytes(16), bytes(32))
    assert [x.code for x in _sends(actions, 31)] == ["bad-resume"]
    # nor can anyone resume into a session whose host offered no key
    plain = _registry()
    plain.connected(HOST, 0.0)
    [opened] = _sends(plain.receive(HOST, m.Open(), 0.0), HOST)
    actions = _resume(plain, 32, opened.nameplate, 1, bytes(16), m.resume_proof(b"", opened.nameplate, 1))
    assert [x.code for x in _sends(actions, 32)] == ["bad-resume"]
    with pytest.raises(Exception, match="resume_key has a bad length"):
        m.encode(m.Open(resume_key=bytes(33)))


def test_a_member_the_host_was_told_left_cannot_come_back() -> None:
    reg = _registry()
    nameplate, ids = _session(reg)
    rid_a, token_a = ids[A]
    assert _sends(reg.disconnected(A, "connection lost", 1.0), HOST) == [m.PeerLeft(rid_a, "connection lost")]
    actions = _resume(reg, 40, nameplate, rid_a, token_a)
    assert [x.code for x in _sends(actions, 40)] == ["left"] and 40 in _closed(actions)


def test_a_member_whose_connection_dropped_alone_resumes_in_place() -> None:
    """Its old connection is still open at the rendezvous (half-open): the new one replaces it
    without a PeerLeft, and its relay binding stays."""
    reg = _registry()
    nameplate, ids = _session(reg)
    rid_a, token_a = ids[A]
    actions = _resume(reg, 41, nameplate, rid_a, token_a)
    assert isinstance(_sends(actions, 41)[0], m.Resumed) and A in _closed(actions)
    assert _sends(actions, HOST) == [] and reg.relay.has_token(token_a)
    assert reg.disconnected(A, "gone", 2.0) == []  # the old connection ending changes nothing now
    # someone else's relay token is not a way in
    actions = _resume(reg, 42, nameplate, ids[B][0], token_a)
    assert [x.code for x in _sends(actions, 42)] == ["bad-resume"]


def test_both_ends_claim_a_relay_edge_the_restarted_relay_lost() -> None:
    nameplate, ids = _session(_registry())
    new = _registry()
    _resume(new, 10 + HOST, nameplate, 0, ids[HOST][1], KEY)
    (rid_a, token_a), (rid_b, token_b) = ids[A], ids[B]
    _resume(new, 20 + A, nameplate, rid_a, token_a)
    _resume(new, 20 + B, nameplate, rid_b, token_b)
    edge = b"E" * m.EDGE_ID_BYTES
    assert new.receive(20 + A, m.EdgeResume(edge, rid_b), 2.0) == []
    assert not new.relay.has_edge(edge)  # one end's word is not enough
    # the host cannot splice itself into it
    assert [x.code for x in _sends(new.receive(10 + HOST, m.EdgeResume(edge, rid_a), 2.0), 10 + HOST)] == ["no-such-edge"]
    assert new.receive(20 + B, m.EdgeResume(edge, rid_a), 2.0) == []
    assert new.relay.has_edge(edge)
    # and it forwards once both ends have bound their UDP addresses again
    from rendezvous import frames

    for token, addr in ((token_a, ("10.0.0.1", 1)), (token_b, ("10.0.0.2", 2))):
        challenge = new.relay.receive(frames.encode_bind(token), addr, 3.0)
        _, nonce = frames.decode_bind_request(challenge[0])
        new.relay.receive(frames.encode_bind(token, nonce=nonce), addr, 3.0)
    data = frames.encode_data(edge, b"ciphertext")
    assert new.relay.receive(data, ("10.0.0.1", 1), 3.0) == (data, ("10.0.0.2", 2))


# --- real sockets ----------------------------------------------------------------------------------

LOOP = "127.0.0.1"


async def _next(member: Member, kind: type, timeout: float = 10.0):
    while True:
        event = await asyncio.wait_for(member.recv(), timeout)
        if isinstance(event, kind):
            return event


async def _until(check, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _roundtrip(ea, eb, payload: bytes) -> None:
    _, w = await ea.open_stream()
    w.write(payload)
    r, _ = await asyncio.wait_for(eb.accept_stream(), 10)
    assert await asyncio.wait_for(r.readexactly(len(payload)), 10) == payload


@pytest.mark.timeout(90)
def test_restarting_the_rendezvous_under_a_session_keeps_it() -> None:
    async def main() -> None:
        rv = await Rendezvous.start(LOOP, 0)
        port = rv.address[1]
        members: list[Member] = []
        try:
            host = await Member.host(rv.address, "host", {}, bind_host=LOOP)
            members.append(host)
            for name in ("a", "b"):
                members.append(await Member.join(host.code, rv.address, name, {}, bind_host=LOOP))
                await _next(host, MemberJoined)
            _, a, b = members
            a.allow_direct = b.allow_direct = False  # a ↔ b stays on the relay
            accept = asyncio.ensure_future(b.accept())
            ea = await a.connect("b")
            eb = await asyncio.wait_for(accept, 10)
            await _roundtrip(ea, eb, b"before" * 1000)
            assert ea.kind == "relay"

            await rv.close()  # the rendezvous goes away ...
            await asyncio.sleep(1.0)
            rv = await Rendezvous.start(LOOP, port)  # ... and comes back with nothing
            await _until(lambda: all(x.resumes == 1 for x in members))
            assert all(x.signaling_up for x in members)
            # signaling works both ways again, on the same sealed channels
            await a.send("host", {"t": "after"})
            got = await _next(host, Message)
            assert (got.sender, got.body) == ("a", {"t": "after"})
            await host.send("b", {"t": "to-b"})
            assert (await _next(b, Message)).body == {"t": "to-b"}
            # the relayed edge carries data through the new relay, and new members still join
            await _roundtrip(ea, eb, b"after" * 1000)
            assert not ea.closed and not eb.closed
            late = await Member.join(host.code, rv.address, "late", {}, bind_host=LOOP)
            members.append(late)
            assert (await _next(host, MemberJoined)).info.name == "late"
        finally:
            for member in members:
                await member.close()
            await rv.close()

    asyncio.run(asyncio.wait_for(main(), 80))
