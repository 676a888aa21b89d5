"""Issue 15 on 127.0.0.1 (one process, real sockets, bounded): a stranger who knows only the
nameplate, and a member who knows the code but sends wrong messages, against a live session."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import pytest

from backends.errors import Refused
from kafila.net import Member, MemberJoined, Message
from kafila.net.handshake import Pake, SealedChannel
from kafila.net.natcheck import NatReport
from kafila.net.roster import MemberInfo
from rendezvous import messages as m
from rendezvous.service import Rendezvous
from tests.test_net_loopback import LOOP, _event, _exchange, _pair, run, session

pytestmark = pytest.mark.timeout(90)


class Stranger:
    """A raw signaling connection: joins the nameplate and sends whatever it likes."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer, self.frames = reader, writer, m.FrameReader()
        self.rid: int | None = None

    @classmethod
    async def join(cls, rv: Rendezvous, nameplate: int) -> Stranger:
        self = cls(*await asyncio.open_connection(*rv.address))
        self.writer.write(m.encode(m.Join(nameplate)))
        joined = await self.next()
        assert isinstance(joined, m.Joined), joined
        self.rid = joined.rid
        return self

    async def next(self, timeout: float = 5.0) -> m.Message:
        while True:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                raise ConnectionError("closed")
            out = self.frames.feed(data)
            if out:
                return out[0]

    async def until_closed(self, timeout: float = 5.0) -> list[m.Message]:
        seen = []
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
            while True:
                seen.append(await self.next(timeout))
        return seen

    def close(self) -> None:
        self.writer.close()


async def _still_serving(host: Member, a: Member, b: Member) -> None:
    await a.send("host", {"still": "here"})
    while (message := await _event(host, Message)).sender != a.name:
        pass  # what the test's own attackers sent before
    assert message.body == {"still": "here"}
    await host.send("m1", {"plan": 1})
    assert (await _event(b, Message)).body == {"plan": 1}
    ea, eb = await _pair(a, b)
    await _exchange(ea, eb, 100_000)


def test_junk_pake_and_heartbeat_flood_do_not_end_the_session() -> None:
    """Finding 1 on real sockets: before, the host's Kick of the ghost id crashed the registry's
    handling of the host's connection and the session closed for everyone."""
    async def main():
        async with session(2) as (rv, (host, a, b)):
            for _ in range(3):
                s = await Stranger.join(rv, host.nameplate)
                s.writer.write(m.encode(m.Send(0, b"P-junk")) + m.encode(m.Heartbeat()) * 450)
                await s.until_closed()
                s.close()
            await asyncio.sleep(0.3)
            assert host.signaling_up and rv.registry.members_of(host.nameplate) == sorted(
                info.peer_id for info in host.roster().values())
            await _still_serving(host, a, b)
            # the nameplate stays open: junk tests no password
            c = await Member.join(host.code, rv.address, "m2", {}, bind_host=LOOP)
            try:
                assert (await _event(host, MemberJoined)).info.name == "m2"
            finally:
                await c.close()
    run(main())


def test_pending_stranger_cannot_open_edges_or_flood() -> None:
    """Finding 2: EdgeRequests and body floods from an id that never finished a PAKE."""
    async def main():
        async with session(2) as (rv, (host, a, b)):
            s = await Stranger.join(rv, host.nameplate)
            s.writer.write(m.encode(m.EdgeRequest(a.rid)))
            seen = await s.until_closed()
            assert any(isinstance(x, m.Error) and x.code == "not-admitted" for x in seen)
            assert rv.registry.relay.edges_in(host.nameplate) == 0
            s = await Stranger.join(rv, host.nameplate)
            s.writer.write(m.encode(m.Send(0, b"S" + b"x" * 60_000)) * 40)  # 2.4 MB at the host
            await s.until_closed()
            await _still_serving(host, a, b)
    run(main())


def test_wrong_code_closes_that_code_a_fresh_one_admits_and_members_keep_working() -> None:
    """Finding 3, and issue 38 item 2: after one failed confirmation the host answers no PAKE for
    that code (one guess per code), then opens a fresh code at a fresh nameplate by itself; the
    fresh code admits a joiner, the old one admits nobody, members already in are unaffected."""
    async def main():
        async with session(2) as (rv, (host, a, b)):
            old, fresh = host.code, asyncio.get_running_loop().create_future()
            host.codes.on_new_code = fresh.set_result
            words = old.split("-")
            wrong = "-".join([words[0], "adroitness" if words[1] != "adroitness" else "adviser", *words[2:]])
            with pytest.raises(Refused, match="wrong code"):
                await Member.join(wrong, rv.address, "eve", {}, bind_host=LOOP)
            assert host.code_void and host._admission.state == "closed"
            # until the fresh code, a malicious rendezvous reopening the nameplate gets no PAKE answer
            rv.registry._sessions[host.nameplate].open_for_joins = True
            s = await Stranger.join(rv, int(words[0]))
            s.writer.write(m.encode(m.Send(0, Pake(old).start())))
            answer = await s.next()
            assert isinstance(answer, m.Deliver) and answer.body[:1] == b"R"  # a refusal, no PAKE
            assert host._admission.answered == 3  # m0, m1 and eve: nothing since
            code = await asyncio.wait_for(fresh, 15)
            assert code == host.code != old and not host.code_void and code.split("-")[0] != words[0]
            with pytest.raises(Refused, match="check the code"):  # the old nameplate is closed
                await Member.join(old, rv.address, "old", {}, bind_host=LOOP)
            c = await Member.join(code, rv.address, "carol", {}, bind_host=LOOP)
            assert c.nameplate == host.nameplate  # resumes name the session, not the code's nameplate
            await c.close()
            await _still_serving(host, a, b)
    run(main())


def _hello(rid: int, member: object) -> dict:
    return {"t": "hello", "member": member}


async def _confirmed_joiner(rv: Rendezvous, host: Member) -> tuple[Stranger, SealedChannel]:
    """A raw joiner that knows the code: its PAKE confirms, then it sends what the test wants."""
    s = await Stranger.join(rv, host.nameplate)
    pake = Pake(host.code)
    s.writer.write(m.encode(m.Send(0, pake.start())))
    reply = await s.next()
    assert isinstance(reply, m.Deliver)
    channel = SealedChannel(pake.finish(reply.body), is_host=False, nameplate=host.nameplate, rid=s.rid)
    return s, channel


def test_bad_hello_types_do_not_kill_the_hosts_signaling_task(caplog) -> None:
    """Finding 5: a hello with a list where a map belongs raised TypeError in the host's
    signaling task, and after that nobody could join."""
    info = MemberInfo("x", {}, "ordinary", 1.0, "a" * 64, (("127.0.0.1", 5),), 0,
                      NatReport("ordinary", 1.0, "127.0.0.1:5", "", "")).to_wire()
    bad_hellos = [_hello(0, [1, 2]), _hello(0, "text"), _hello(0, None), _hello(0, {**info, "name": ["x"]}),
                  _hello(0, {**info, "cand": "no"}), _hello(0, {**info, "nat": [1]}),
                  {"t": ["hello"]}, {"t": "hello", "member": {**info, "descriptor": 5}}]  # fmt: skip

    async def main():
        async with session(2) as (rv, (host, a, b)):
            with caplog.at_level(logging.DEBUG):
                for hello in bad_hellos:
                    s, channel = await _confirmed_joiner(rv, host)
                    s.writer.write(m.encode(m.Send(0, channel.seal(hello))))
                    await s.until_closed()
                    s.close()
            assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
            assert host.signaling_up and host._admission.state == "open"
            await _still_serving(host, a, b)
            c = await Member.join(host.code, rv.address, "m2", {}, bind_host=LOOP)
            await c.close()
    run(main())


def test_wrong_but_well_formed_messages_from_a_member_kill_no_task(caplog) -> None:
    """Signaling handlers with random well-formed-but-wrong messages (types, sizes): the host
    keeps serving, nothing logs a traceback."""
    rng = random.Random(15)
    values = [None, 1, -1, 2**40, "x", "", b"\x00" * 10, [1, [2]], {"a": 1}, True, 1.5, "y" * 5000]

    async def main():
        async with session(2) as (rv, (host, a, b)):
            with caplog.at_level(logging.DEBUG):
                for round_ in range(6):
                    s, channel = await _confirmed_joiner(rv, host)
                    s.writer.write(m.encode(m.Send(0, channel.seal(
                        {"t": "hello", "member": {**host.roster()["m0"].to_wire(), "name": f"z{round_}"}}))))
                    assert isinstance(await s.next(), m.Deliver)  # welcome: admitted
                    for _ in range(30):
                        kind = rng.choice(["app", "part", "roster", "hello", "welcome", "refuse", "??"])
                        msg = {"t": kind, **{k: rng.choice(values) for k in
                                             rng.sample(["body", "i", "n", "data", "members", "key"], 3)}}
                        s.writer.write(m.encode(m.Send(0, channel.seal(msg))))
                    s.writer.write(m.encode(m.Send(0, channel.seal({"t": "app", "body": "end"}))))
                    await asyncio.sleep(0.2)
                    s.close()
            assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
            assert host.signaling_up
            assert all(not t.done() for t in host._tasks if "signal" in t.get_name())
            await _still_serving(host, a, b)
    run(main())
