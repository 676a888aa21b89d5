"""Admission without sockets: the host's HostSession paired with joiners' Joiner machines.

A `Link` plays the rendezvous between them in memory, as aioquic's tests move datagrams between
two connections: every SendBody is delivered to the other side, a Kick or Drop ends that id's
connection (the host then hears PeerLeft, as from the real registry), and loops are bounded.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import msgpack
import pytest

from kafila.net import admission as adm
from kafila.net import joining
from kafila.net.admission import HostSession
from kafila.net.handshake import rejection_reason
from kafila.net.joining import Joiner
from kafila.net.natcheck import NatReport
from kafila.net.admission_messages import encode
from kafila.net.pieces import PIECE_BYTES, split
from kafila.net.roster import MemberInfo, MemberJoined, MemberLeft, Message, RosterUpdated
from rendezvous import messages as m

CODE = "7-adroitness-absurd-yucatan"
WRONG = "7-adroitness-absurd-zulu"
NAMEPLATE = 7
RESUME_KEY = b"k" * m.RESUME_KEY_BYTES
GROUP_KEY = b"g" * 32
ROOT = pathlib.Path(__file__).resolve().parent.parent


def info(name: str, rid: int) -> MemberInfo:
    report = NatReport("ordinary", f"198.51.100.{rid + 1}:4000", 10.0 + rid, "", "")
    return MemberInfo(name, {"gb": 8 + rid}, "ordinary", report.rtt_ms, f"{rid:02x}" * 32,
                      ((f"198.51.100.{rid + 1}", 4000),), rid, report)


class Link:
    """A host and its joiners, with the rendezvous in between (bodies in order, per direction)."""

    def __init__(self, **host_kwargs) -> None:
        self.host = HostSession(CODE, NAMEPLATE, info("host", 0), group_key=GROUP_KEY,
                                resume_key=RESUME_KEY, **host_kwargs)
        self.joiners: dict[int, Joiner] = {}
        self.wire: collections.deque[tuple[int, int, bytes]] = collections.deque()  # (from, to, body)
        self.host_actions: list = []
        self.joiner_actions: dict[int, list] = collections.defaultdict(list)
        self.gone: set[int] = set()  # ids whose connection the rendezvous ended
        self.now = 0.0

    def join(self, rid: int, name: str, code: str = CODE, *, own: MemberInfo | None = None) -> Joiner:
        joiner = self.joiners[rid] = Joiner(code, NAMEPLATE, rid, own or info(name, rid))
        self._from_joiner(rid, joiner.start(self.now))
        return joiner

    def _from_joiner(self, rid: int, actions: list) -> None:
        self.joiner_actions[rid] += actions
        for a in actions:
            if isinstance(a, adm.SendBody):
                assert a.rid == 0, "a joiner sends only to the host"
                self.wire.append((rid, 0, a.body))

    def _from_host(self, actions: list) -> None:
        self.host_actions += actions
        for a in actions:
            if isinstance(a, adm.SendBody):
                self.wire.append((0, a.rid, a.body))
            elif isinstance(a, adm.Drop | adm.Kick):  # the registry drops it everywhere: PeerLeft
                self.wire.append((a.rid, -1, b"kicked"))

    def step(self) -> bool:
        """Move one body; False when none was waiting."""
        if not self.wire:
            return False
        sender, to, body = self.wire.popleft()
        if to == -1:
            if sender not in self.gone:
                self.gone.add(sender)
                self._from_host(self.host.left(sender, "kicked", self.now))
        elif sender in self.gone or to in self.gone:
            pass  # its connection ended: the rendezvous forwards nothing more
        elif to == 0:
            self._from_host(self.host.receive(sender, body, self.now))
        else:
            self._from_joiner(to, self.joiners[to].receive(0, body, self.now))
        return True

    def run(self) -> None:
        rounds = 0
        while self.step():
            rounds += 1
            assert rounds < 200, "the machines keep talking"

    def of(self, rid: int, kind: type) -> list:
        return [a for a in self.joiner_actions[rid] if isinstance(a, kind)]

    def host_of(self, kind: type) -> list:
        return [a for a in self.host_actions if isinstance(a, kind)]


def test_right_code_joins_and_both_sides_agree_on_the_roster() -> None:
    link = Link()
    a = link.join(1, "alice")
    link.run()
    assert a.state == joining.JOINED and link.host.state_of(1) == adm.MEMBER
    [welcomed] = link.of(1, joining.Welcomed)
    assert welcomed == joining.Welcomed("alice", GROUP_KEY, m.resume_proof(RESUME_KEY, NAMEPLATE, 1), False, NAMEPLATE)
    assert link.host_of(adm.Admit) == [adm.Admit(1)]
    [joined] = link.host_of(MemberJoined)
    assert joined.info == info("alice", 1)
    assert a.roster == link.host.roster and set(a.roster) == {"host", "alice"}
    assert a.names == {0: "host", 1: "alice"}
    # PAKE answer; then Admit before the welcome (the member may open edges once welcomed)
    assert [type(x) for x in link.host_actions] == [adm.SendBody, adm.Admit, adm.SendBody, MemberJoined]


def test_three_members_all_hold_the_hosts_roster() -> None:
    link = Link()
    joiners = [link.join(rid, f"m{rid}") for rid in (1, 2, 3)]
    link.run()
    assert all(j.state == joining.JOINED for j in joiners)
    for j in joiners:
        assert j.roster == link.host.roster and len(j.roster) == 4
    # the earlier members heard of the later ones through roster broadcasts
    assert len(link.of(1, RosterUpdated)) == 2 and len(link.of(3, RosterUpdated)) == 0
    assert link.of(1, RosterUpdated)[-1].roster == link.host.roster


def test_wrong_code_fails_with_the_clear_error_and_the_host_answers_no_more_pakes() -> None:
    link = Link()
    eve = link.join(1, "eve", WRONG)
    link.run()
    assert eve.state == joining.FAILED
    assert link.of(1, joining.Failed) == [joining.Failed(
        "wrong code: the host could not verify your code; the nameplate is now closed")]
    assert [type(x) for x in link.host_actions] == [adm.SendBody, adm.SendBody, adm.Drop, adm.CloseNameplate]
    assert link.host.admission.state == adm.CLOSED and link.host.roster.keys() == {"host"}
    # even the right code is refused now, without a PAKE answer: joining needs a new code
    bob = link.join(2, "bob")
    link.run()
    [failed] = link.of(2, joining.Failed)
    assert failed.reason.startswith("the host refused: ") and "new one" in failed.reason
    assert bob.state == joining.FAILED and link.host.admission.answered == 1
    assert link.host_of(MemberJoined) == []


def test_a_second_pake_while_one_is_pending_is_queued_and_served_after() -> None:
    link = Link()
    a = link.join(1, "a")
    b = link.join(2, "b")
    link.step()  # a's PAKE: answered
    assert link.host.admission.current == 1 and link.wire[-1][:2] == (0, 1)
    link.step()  # b's PAKE: queued, no answer yet
    assert link.host.state_of(2) == adm.JOINING and [w[:2] for w in link.wire] == [(0, 1)]
    link.step()  # a gets the answer, sends its hello
    link.step()  # the host confirms a: welcome to a, and only now answers b
    assert link.host.state_of(1) == adm.MEMBER and link.host.admission.current == 2
    link.run()
    assert a.state == b.state == joining.JOINED and link.host.admission.answered == 2
    assert a.roster == b.roster == link.host.roster


def test_a_taken_name_gets_a_suffix_both_sides_use() -> None:
    link = Link()
    first, second, third = link.join(1, "vm"), link.join(2, "vm"), link.join(3, "host")
    link.run()
    assert [j.name for j in (first, second, third)] == ["vm", "vm-2", "host-2"]
    assert [w.name for w in link.of(2, joining.Welcomed)] == ["vm-2"]
    assert set(link.host.roster) == {"host", "vm", "vm-2", "host-2"}
    assert link.host.roster["vm-2"].peer_id == 2 and second.roster == link.host.roster


def test_kick_tells_the_member_why_and_the_rest_get_the_roster_without_it() -> None:
    link = Link()
    a, b = link.join(1, "a"), link.join(2, "b")
    link.run()
    link._from_host(link.host.kick(2, "asked to leave"))
    link.run()
    assert link.of(2, MemberLeft) == [MemberLeft("host", "removed: asked to leave")]
    assert b.state == joining.LEFT
    assert link.host_of(adm.Kick) == [adm.Kick(2, "asked to leave")]
    assert MemberLeft("b", "asked to leave") in link.host_actions
    assert set(link.host.roster) == {"host", "a"} and a.roster == link.host.roster
    assert link.host.state_of(2) == adm.DEPARTED


def test_a_tampered_body_from_a_member_kicks_it() -> None:
    link = Link()
    a = link.join(1, "a")
    link.run()
    body = bytearray(a.channel.seal({"t": "app", "body": 1}))
    body[-1] ^= 1
    link.wire.append((1, 0, bytes(body)))
    link.run()
    [kick] = link.host_of(adm.Kick)
    assert kick.rid == 1 and kick.reason.startswith("authentication failure: ")
    assert link.host_of(MemberLeft)[0].name == "a" and link.host.roster.keys() == {"host"}


def test_left_member_is_gone_from_every_roster_and_not_taken_back() -> None:
    link = Link()
    a, b = link.join(1, "a"), link.join(2, "b")
    link.run()
    link._from_host(link.host.left(1, "bye", link.now))
    link.run()
    assert link.host_of(MemberLeft) == [MemberLeft("a", "bye")]
    assert set(b.roster) == {"host", "b"} == set(link.host.roster)
    # it resumed into a restarted rendezvous and speaks again: dropped, not re-admitted
    [drop] = link.host.receive(1, a.channel.seal({"t": "app", "body": 1}), 1.0)
    assert isinstance(drop, adm.Drop) and link.host.state_of(1) == adm.DEPARTED
    assert link.host.left(5, "lost", 1.0) == []  # an id that never joined: nobody to tell


def test_messages_whole_and_in_pieces_both_ways() -> None:
    link = Link()
    a = link.join(1, "a")
    link.run()
    assert link.host.receive(1, a.channel.seal({"t": "app", "body": {"ready": 1}}), 0.0) == [
        Message("a", {"ready": 1})]
    plan = {"blocks": list(range(3 * PIECE_BYTES // 4))}
    packed = msgpack.packb(plan, use_bin_type=True)
    parts = split(packed)
    assert len(parts) > 1
    channel = link.host.channels[1]
    out = [x for part in parts for x in a.receive(0, channel.seal(encode(part)), 0.0)]
    assert out == [Message("host", plan)]


def test_junk_bodies_are_dropped_and_the_session_stays_open() -> None:
    link = Link()
    for junk in (b"", b"P", b"P-not-an-element", b"Sxx", b"R", b"\xff" * 40):
        assert [type(x) for x in link.host.receive(9, junk, 0.0)] == [adm.Drop], junk
    assert link.host.admission.state == adm.OPEN and link.host.admission.answered == 0
    a = link.join(1, "a")
    link.run()
    assert a.state == joining.JOINED
    # a joiner that gets junk for the PAKE answer fails with the reason, nothing crashes
    j = Joiner(CODE, NAMEPLATE, 4, info("j", 4))
    j.start(0.0)
    [failed] = j.receive(0, b"P-junk", 0.0)
    assert failed.reason.startswith("session handshake failed: bad PAKE message") and j.state == joining.FAILED
    assert j.receive(0, b"anything", 0.0) == []  # failed: nothing more
    # a joined member ignores bodies from anyone but the host; junk from the host ends it
    assert a.receive(3, b"Sjunk", 0.0) == []
    left, close = a.receive(0, b"Sjunk", 0.0)
    assert isinstance(left, MemberLeft) and left.reason.startswith("authentication failure")
    assert isinstance(close, joining.Close) and a.state == joining.LEFT


def test_a_body_not_from_the_host_while_joining_fails_it() -> None:
    j = Joiner(CODE, NAMEPLATE, 4, info("j", 4))
    j.start(0.0)
    assert j.receive(2, b"P" + b"x" * 32, 0.0) == [
        joining.Failed("the rendezvous delivered a message that is not from the host")]


def test_a_bad_hello_is_refused_with_its_reason() -> None:
    link = Link()
    bad = info("x", 1)
    bad = MemberInfo("no spaces allowed", bad.descriptor, bad.nat, bad.rtt_ms, bad.fingerprint,
                     bad.candidates, 1, bad.report)
    link.join(1, "", own=bad)
    link.run()
    assert link.of(1, joining.Failed) == [joining.Failed("the host refused: bad hello: bad member entry (bad name)")]
    assert link.host_of(adm.Kick) == [adm.Kick(1, "a bad hello (bad member entry (bad name))")]
    assert link.host.admission.state == adm.OPEN and link.host.roster.keys() == {"host"}


def test_a_stalled_pake_times_out_and_the_next_joiner_goes_on() -> None:
    link = Link(admission=adm.HostAdmission(CODE, NAMEPLATE, pake_timeout_s=5.0))
    link.join(1, "staller")
    b = link.join(2, "b")
    link.step()
    link.step()
    link.wire.clear()  # the staller never answers
    link.gone.add(1)
    assert link.host.tick(4.9) == []
    link.now = 5.0
    link._from_host(link.host.tick(5.0))
    assert adm.Drop(1, "no PAKE confirmation within 5 s") in link.host_actions
    link.run()
    assert b.state == joining.JOINED and link.host.admission.failed_confirmations == 0


@pytest.mark.parametrize("path", ["kafila/net/admission.py", "kafila/net/joining.py", "kafila/net/edge_table.py"])
def test_admission_cores_import_no_io(path: str) -> None:
    forbidden = {"asyncio", "socket", "time", "threading", "os", "subprocess", "random", "selectors"}
    imported = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & forbidden, imported & forbidden


def test_actions_are_frozen() -> None:
    with pytest.raises(AttributeError):
        adm.Kick(1, "x").rid = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        joining.Welcomed("a", b"", b"", False, 1).name = "b"  # type: ignore[misc]
    assert rejection_reason(adm.SendBody(1, b"Rno").body) == "no"
