"""Real-socket tests of the network layer on 127.0.0.1 (in one process; bounded in time).

Loopback shows no NAT: these check the protocols end to end (sessions, PAKE, pinned QUIC edges,
relay and direct routes, robustness). The NAT behaviours are natlab_tests' job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from backends.errors import BadInput, Refused
from kafila.net import Member, MemberJoined, MemberLeft, Message, RosterUpdated
from rendezvous import messages as m
from rendezvous.limits import MEMBER_SILENT_S
from rendezvous.service import Rendezvous

LOOP = "127.0.0.1"
pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 45))


async def _event(member: Member, kind: type, timeout: float = 5.0):
    while True:
        event = await asyncio.wait_for(member.recv(), timeout)
        if isinstance(event, kind):
            return event


@contextlib.asynccontextmanager
async def session(n_members: int = 2, **kwargs):
    rv = await Rendezvous.start(LOOP, 0)
    members: list[Member] = []
    try:
        host = await Member.host(rv.address, "host", {"role": "host"}, bind_host=LOOP, **kwargs)
        members.append(host)
        for i in range(n_members):
            members.append(await Member.join(host.code, rv.address, f"m{i}", {"i": i}, bind_host=LOOP))
            await _event(host, MemberJoined)
        yield rv, members
    finally:
        for member in members:
            await member.close()
        await rv.close()


async def _pair(a: Member, b: Member):
    accepting = asyncio.ensure_future(b.accept())
    edge = await a.connect(b.name)
    return edge, await asyncio.wait_for(accepting, 5)


async def _exchange(ea, eb, n: int) -> float:
    """n bytes each way over one stream; returns the seconds it took."""
    start = time.perf_counter()
    ra, wa = await ea.open_stream()
    wa.write(os.urandom(n // 2) + b"\x00" * (n - n // 2))
    rb, wb = await eb.accept_stream()
    wb.write(b"\x01" * n)
    got_b, got_a = await asyncio.gather(rb.readexactly(n), ra.readexactly(n))
    assert len(got_a) == len(got_b) == n and got_a == b"\x01" * n
    return time.perf_counter() - start


def test_session_roster_messages_edges_and_leaving() -> None:
    async def main():
        async with session(2) as (rv, (host, a, b)):
            assert host.code and parse_ok(host.code)
            assert set(host.roster()) == {"host", "m0", "m1"}
            roster = (await _event(a, RosterUpdated)).roster  # b joined after a
            assert set(roster) == {"host", "m0", "m1"}
            assert roster["m1"].fingerprint == host.roster()["m1"].fingerprint
            assert roster["m1"].descriptor == {"i": 1}
            await a.send("host", {"probe": [1, 2]})
            assert await _event(host, Message) == Message("m0", {"probe": [1, 2]})
            await host.send("m1", {"plan": "x"})
            assert (await _event(b, Message)).body == {"plan": "x"}
            with pytest.raises(BadInput):
                await a.send("m1", {"no": 1})
            # member <-> member edge, and a host edge, concurrently
            (ea, eb), (eh, ea2) = await asyncio.gather(_pair(a, b), _pair(host, a))
            for edge in (ea, eb, eh, ea2):
                assert edge.time_to_data_s is not None  # how soon: bench.edges
            seconds = await _exchange(ea, eb, 10_000_000)
            print(f"\n10 MB each way over one edge: {seconds:.2f} s; stats {ea.stats()}")
            await _exchange(eh, ea2, 100_000)
            for edge in (ea, eb):
                assert edge.kind == "direct" and edge.time_to_direct_s is not None
                assert edge.predicted == "direct"
                stats = edge.stats()
                assert stats["bytes_received"] > 10_000_000 and stats["time_to_direct_s"]
            # a clean leave reaches the host as a leave, before silence could have told it
            t0 = time.perf_counter()
            await b.close()
            left = await _event(host, MemberLeft, MEMBER_SILENT_S)
            assert left.name == "m1" and time.perf_counter() - t0 < MEMBER_SILENT_S
            assert "m1" not in host.roster()
    run(main())


def test_same_name_twice_joins_as_name_2_then_name_3() -> None:
    """Issue 14 item 4: two machines called `vm` (and the host too) once got "the name 'vm' is
    taken"; now the host names the second `vm-2`, the third `vm-3`, and each learns its name."""
    async def main():
        rv = await Rendezvous.start(LOOP, 0)
        members: list[Member] = []
        try:
            host = await Member.host(rv.address, "vm", {}, bind_host=LOOP)
            members.append(host)
            for want in ("vm-2", "vm-3"):
                joiner = await Member.join(host.code, rv.address, "vm", {}, bind_host=LOOP)
                members.append(joiner)
                assert (await _event(host, MemberJoined)).info.name == want
                assert joiner.name == want and set(joiner.roster()) >= {"vm", want}
            assert set(host.roster()) == {"vm", "vm-2", "vm-3"}
            assert (await _event(members[1], RosterUpdated)).roster["vm-3"].peer_id == members[2].rid
            # the new names work for messages and edges
            await members[2].send("vm", {"hi": 3})
            assert await _event(host, Message) == Message("vm-3", {"hi": 3})
            edge, back = await _pair(members[1], members[2])
            assert (edge.peer, back.peer) == ("vm-3", "vm-2")
        finally:
            for member in members:
                await member.close()
            await rv.close()
    run(main())


def parse_ok(code: str) -> bool:
    from kafila.net.code import parse_code

    return parse_code(code)[1] == code


def test_silent_member_reaches_host_as_left_within_member_silent_s() -> None:
    """Seconds of silence are tolerated (a slow link); MEMBER_SILENT_S of it is a member gone."""
    async def main():
        async with session(1) as (_rv, (host, a)):
            # stop a's heartbeats and signaling reads without closing its TCP connection
            for task in list(a._tasks):
                task.cancel()
            t0 = time.perf_counter()
            with pytest.raises(asyncio.TimeoutError):
                await _event(host, MemberLeft, MEMBER_SILENT_S - 2.0)
            left = await _event(host, MemberLeft, 3.0)
            assert left.name == "m0" and time.perf_counter() - t0 < MEMBER_SILENT_S + 0.7
    run(main())


def test_wrong_code_fails_closed_and_kills_the_nameplate() -> None:
    async def main():
        rv = await Rendezvous.start(LOOP, 0)
        host = await Member.host(rv.address, "host", {}, bind_host=LOOP)
        try:
            nameplate = host.code.split("-")[0]
            words = host.code.split("-")[1:]
            wrong = "-".join([nameplate, "adroitness" if words[0] != "adroitness" else "adviser",
                              *words[1:]])
            with pytest.raises(Refused, match="wrong code"):
                await Member.join(wrong, rv.address, "eve", {}, bind_host=LOOP)
            with pytest.raises(Refused, match="nameplate"):  # dead after one failure
                await Member.join(host.code, rv.address, "bob", {}, bind_host=LOOP)
            with pytest.raises(Refused, match="no open session"):
                other = (int(nameplate) % 9999) + 1
                await Member.join(f"{other}-{'-'.join(words)}", rv.address, "bob", {}, bind_host=LOOP)
            with pytest.raises(BadInput):
                await Member.join("not a code", rv.address, "bob", {}, bind_host=LOOP)
            assert "eve" not in host.roster()
        finally:
            await host.close()
            await rv.close()
    run(main())


def test_replayed_signaling_message_fails_closed() -> None:
    """A rendezvous that delivers a member's sealed message twice gets that member removed."""
    async def main():
        async with session(1) as (rv, (host, a)):
            original = rv.registry.receive

            def replaying(conn, message, now):
                actions = original(conn, message, now)
                if isinstance(message, m.Send) and message.body[:1] == b"S":
                    actions = actions + actions  # deliver it again
                return actions

            rv.registry.receive = replaying
            await a.send("host", {"x": 1})
            assert (await _event(host, Message)).body == {"x": 1}
            left = await _event(host, MemberLeft)
            assert left.name == "m0" and "replayed" in left.reason
    run(main())


def test_substituted_fingerprint_fails_closed() -> None:
    async def main():
        async with session(2) as (rv, (host, a, b)):
            await _event(a, RosterUpdated)
            # as if a fingerprint had been swapped: a pins the wrong key for b
            a._roster["m1"] = dataclasses.replace(a._roster["m1"], fingerprint="ab" * 32)
            b.accept_task = asyncio.ensure_future(b.accept())
            with pytest.raises(Refused, match="fingerprint mismatch"):
                await a.connect("m1")
            # and b pins the wrong key for a: a's proof on the first stream is refused
            b._roster["m0"] = dataclasses.replace(b._roster["m0"], fingerprint="cd" * 32)
            a._roster["m1"] = host.roster()["m1"]
            with pytest.raises(Refused, match="(?i)refused|prove|closed|match"):
                await a.connect("m1")
            assert not b.accept_task.done()
            b.accept_task.cancel()
    run(main())


def test_relay_carries_only_ciphertext() -> None:
    secret = b"KAFILA-PLAINTEXT-CANARY-" * 40

    async def main():
        async with session(2) as (rv, (host, a, b)):
            a.allow_direct = b.allow_direct = False
            seen: list[bytes] = []
            original = rv.registry.relay.receive

            def spying(datagram, src, now):
                out = original(datagram, src, now)
                if out is not None:
                    seen.append(out[0])
                return out

            rv.registry.relay.receive = spying
            ea, eb = await _pair(a, b)
            _, wa = await ea.open_stream()
            wa.write(secret * 50)
            rb, _ = await eb.accept_stream()
            assert await rb.readexactly(len(secret) * 50) == secret * 50
            assert ea.kind == eb.kind == "relay" and ea.time_to_direct_s is None
            assert ea.time_to_data_s is not None
            relayed = b"".join(seen)
            assert len(relayed) > len(secret) * 50
            assert b"KAFILA-PLAINTEXT-CANARY" not in relayed
            await _exchange(ea, eb, 1_000_000)
    run(main())


def test_rendezvous_survives_abuse_while_a_session_runs() -> None:
    async def main():
        async with session(2) as (rv, (host, a, b)):
            ea, eb = await _pair(a, b)
            loop = asyncio.get_running_loop()
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.setblocking(False)
            for port in (rv.address[1], rv.stun_port2):
                for data in (b"\x00\x01\x00\x08\x21\x12\xa4\x42" + b"\xff" * 20,  # bad STUN
                             b"\x00" * 1590, os.urandom(1599), b"\x12" + b"\x00" * 3,
                             b"\x10" + b"\x00" * 16, b"\xc0" * 1600):
                    udp.sendto(data, (LOOP, port))
            with contextlib.suppress(OSError):
                udp.sendto(b"\x01" * 60000, (LOOP, rv.address[1]))  # oversized
            udp.close()

            async def bogus(i: int) -> None:
                reader, writer = await asyncio.open_connection(*rv.address)
                if i % 3 == 0:
                    writer.write(b"\xff\xff\xff\xff garbage")
                elif i % 3 == 1:
                    writer.write(m.encode(m.Send(0, b"x")))  # before joining
                else:
                    writer.write(m.encode(m.Join(1 + (i * 7) % 9999)) + m.encode(m.Send(0, b"P")))
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(reader.read(1000), 2)
                writer.close()

            t0 = loop.time()
            for start in range(0, 1000, 100):
                await asyncio.gather(*(bogus(i) for i in range(start, start + 100)))
            print(f"\n1000 bogus joins in {loop.time() - t0:.1f} s; rejected={rv.registry.rejected}")
            assert rv.registry.session_count == 1 or rv.registry.rejected >= 900
            # the real session is unaffected
            await a.send("host", {"still": "here"})
            assert (await _event(host, Message)).body == {"still": "here"}
            await _exchange(ea, eb, 200_000)
            assert set(host.roster()) == {"host", "m0", "m1"}
    run(main())


def test_direct_edge_survives_a_rendezvous_restart() -> None:
    """A direct edge carries data while the rendezvous is down and after a new one starts on the
    same port, and never through the relay: the restarted rendezvous relays nothing."""
    async def main():
        rv = await Rendezvous.start(LOOP, 0)
        port = rv.address[1]
        host = await Member.host(rv.address, "host", {}, bind_host=LOOP)
        a = await Member.join(host.code, rv.address, "a", {}, bind_host=LOOP)
        restarted = None
        try:
            eh, ea = await _pair(host, a)
            for _ in range(100):
                if eh.kind == ea.kind == "direct":
                    break
                await asyncio.sleep(0.02)
            assert eh.kind == ea.kind == "direct", (eh.kind, ea.kind)
            await rv.close()
            await asyncio.sleep(0.3)
            await _exchange(eh, ea, 300_000)  # while no rendezvous runs
            restarted = await Rendezvous.start(LOOP, port)
            relayed: list[bytes] = []
            original = restarted.registry.relay.receive

            def spying(datagram, src, now):
                out = original(datagram, src, now)
                if out is not None:
                    relayed.append(out[0])
                return out

            restarted.registry.relay.receive = spying
            await asyncio.sleep(0.3)
            await _exchange(eh, ea, 300_000)  # after the restart
            assert eh.kind == ea.kind == "direct" and relayed == []
        finally:
            await a.close()
            await host.close()
            if restarted is not None:
                await restarted.close()
    run(main())


def test_send_delay_emulates_latency() -> None:
    async def main():
        rv = await Rendezvous.start(LOOP, 0)
        host = await Member.host(rv.address, "host", {}, bind_host=LOOP, send_delay_ms=40)
        a = await Member.join(host.code, rv.address, "a", {}, bind_host=LOOP, send_delay_ms=40)
        try:
            assert host.nat.rtt_ms >= 40
            eh, ea = await _pair(host, a)
            await _exchange(eh, ea, 50_000)
            assert eh.stats()["rtt_ms"] >= 80
        finally:
            await a.close()
            await host.close()
            await rv.close()
    run(main())


def test_cli_rendezvous_and_netcheck() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kafila", "rendezvous", "--listen", f"{LOOP}:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = proc.stdout.readline()
        port = int(line.split(f"{LOOP}:")[1].split()[0])
        out = subprocess.run(
            [sys.executable, "-m", "kafila", "netcheck", "--rendezvous", f"{LOOP}:{port}", "--json"],
            capture_output=True, text=True, timeout=30, env=env, check=False,
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert set(report) == {"nat", "mapped", "rtt_ms", "filtering", "mapping"}
        assert report["nat"] == "permissive" and report["mapped"].startswith(LOOP)
        bad = subprocess.run(
            [sys.executable, "-m", "kafila", "netcheck", "--rendezvous", "nohost:port"],
            capture_output=True, text=True, timeout=30, env=env, check=False,
        )
        assert bad.returncode == 2 and "port" in bad.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
