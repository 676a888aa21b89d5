"""Sans-I/O tests of the network protocols: state machines paired over fake links (no sockets)."""

from __future__ import annotations

import ast
import pathlib
import random
import re

import msgpack
import pytest
from aioice import stun

from backends.errors import BadInput
from kafila.net.code import make_code, parse_code
from kafila.net.handshake import Pake, SealedChannel, reject, rejection_reason
from kafila.net.natcheck import (
    FILTER_WAIT_S,
    NatProbe,
    classify,
    predict_edge_kind,
)
from kafila.net.punch import DIRECT, Puncher, encode_probe
from kafila.net.roster import MemberInfo, distinct_name, valid_name
from kafila.net.words import EVEN_WORDS, ODD_WORDS
from rendezvous import frames
from rendezvous import messages as m
from rendezvous.errors import ProtocolError
from rendezvous.limits import MEMBER_SILENT_S, UNKNOWN_JOIN_BURST, UNKNOWN_JOINS_PER_S
from rendezvous.registry import CloseConn, Log, Registry, SendTo
from rendezvous.relay import RelayTable
from rendezvous.stun import StunResponder

ROOT = pathlib.Path(__file__).resolve().parent.parent
SANS_IO = [
    "kafila/net/code.py", "kafila/net/words.py", "kafila/net/handshake.py",
    "kafila/net/natcheck.py", "kafila/net/punch.py", "kafila/net/roster.py",
    "kafila/net/certs.py", "kafila/net/admission.py", "kafila/net/joining.py", "kafila/net/pieces.py",
    "kafila/net/edge_table.py", "kafila/net/admission_messages.py", "kafila/net/descriptor.py",
    "rendezvous/messages.py", "rendezvous/frames.py",
    "rendezvous/registry.py", "rendezvous/relay.py", "rendezvous/stun.py",
    "rendezvous/errors.py", "rendezvous/limits.py", "rendezvous/sources.py",
]


@pytest.mark.parametrize("path", SANS_IO)
def test_protocol_modules_do_no_io(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
            if node.module.startswith("kafila.net") or node.module.startswith("rendezvous"):
                assert node.module.replace(".", "/") + ".py" in SANS_IO or node.module in (
                    "kafila.net", "rendezvous"), f"{path} imports non-sans-I/O {node.module}"
    assert not imported & {"asyncio", "socket", "time", "selectors", "threading"}, imported


# -- codes ------------------------------------------------------------------------------------
# Every eighth byte's (even, odd) pair and the last, as the PGP word list publishes them
# (Juola & Zimmermann; the table on Wikipedia's "PGP word list" page), typed from that table and
# not from kafila/net/words.py: a word out of place, or a list shifted by one, fails here.
PUBLISHED = {
    0x00: ("aardvark", "adroitness"), 0x08: ("aimless", "antenna"), 0x10: ("assume", "autopsy"),
    0x18: ("beaming", "borderline"), 0x20: ("bison", "butterfat"), 0x28: ("breadline", "cellulose"),
    0x30: ("chairlift", "commando"), 0x38: ("classic", "consulting"), 0x40: ("crackdown", "Dakota"),
    0x48: ("deadbolt", "dictator"), 0x50: ("drumbeat", "embezzle"), 0x58: ("endorse", "everyday"),
    0x60: ("facial", "fortitude"), 0x68: ("frighten", "gravity"), 0x70: ("guidance", "hesitate"),
    0x78: ("island", "indigo"), 0x80: ("merit", "intention"), 0x88: ("newborn", "maritime"),
    0x90: ("peachy", "millionaire"), 0x98: ("printer", "narrative"), 0xA0: ("ragtime", "Orlando"),
    0xA8: ("retouch", "paramount"), 0xB0: ("ruffled", "phonetic"), 0xB8: ("select", "provincial"),
    0xC0: ("slowdown", "recipe"), 0xC8: ("spaniel", "retrieval"), 0xD0: ("stagnate", "savagery"),
    0xD8: ("stormy", "stupendous"), 0xE0: ("tapeworm", "tobacco"), 0xE8: ("trauma", "typewriter"),
    0xF0: ("unearth", "upcoming"), 0xF8: ("Vulcan", "warranty"), 0xFF: ("Zulu", "Yucatan"),
}  # fmt: skip


def test_word_lists_are_the_pgp_lists() -> None:
    assert len(set(EVEN_WORDS)) == len(set(ODD_WORDS)) == 256
    assert not set(EVEN_WORDS) & set(ODD_WORDS)
    for byte, (even, odd) in PUBLISHED.items():
        assert (EVEN_WORDS[byte], ODD_WORDS[byte]) == (even.lower(), odd.lower()), hex(byte)


def test_word_lists_spell_a_published_fingerprint() -> None:
    # the worked example in thblt/pgp-words' README: a GnuPG fingerprint read out as 20 words
    fingerprint = bytes.fromhex("EA5B81C564988C73EE90DEE9BAF1E07233CDE511")
    words = [(EVEN_WORDS if i % 2 == 0 else ODD_WORDS)[b] for i, b in enumerate(fingerprint)]
    assert words == (
        "trojan exodus minnow resistor flytrap narrative offload hurricane tycoon millionaire "
        "tactics ultimate shadow vacancy tapeworm holiness chisel sandalwood topmost babylon"
    ).split()


def test_documented_session_codes_are_valid(capsys) -> None:
    """Every code the README, `kafila join --help` and code.py's messages show is one `kafila
    join` accepts."""
    from kafila.cli import main

    with pytest.raises(SystemExit):
        main(["join", "--help"])
    root = pathlib.Path(__file__).resolve().parents[1]
    texts = [capsys.readouterr().out, (root / "README.md").read_text(),
             (root / "kafila/net/code.py").read_text()]  # fmt: skip
    texts = [re.sub(r"-\n\s+", "-", text) for text in texts]  # argparse wraps at hyphens
    found = [re.findall(r"\b\d{1,6}(?:-[a-z]+){3}\b", text) for text in texts]
    assert all(found), "the README, join's help and code.py each show an example code"
    for code in {c for codes in found for c in codes}:
        parse_code(code)  # raises BadInput for a code that is not one


def test_code_round_trip_and_errors() -> None:
    code = make_code(42, lambda n: bytes([0, 1, 255]))
    assert code == "42-adroitness-absurd-yucatan"
    assert parse_code(" 42-Adroitness-absurd-YUCATAN ") == (42, code)
    for bad in ("42", "x-adroitness-absurd-yucatan", "42-absurd-adroitness-yucatan",
                "42-adroitness-absurd", "0-adroitness-absurd-yucatan"):
        with pytest.raises(BadInput):
            parse_code(bad)


# -- PAKE and the sealed channel ----------------------------------------------------------------
def _pair(host_code: str, member_code: str, rid: int = 3) -> tuple[SealedChannel, SealedChannel]:
    host, member = Pake(host_code), Pake(member_code)
    to_host, to_member = member.start(), host.start()
    k_host, k_member = host.finish(to_host), member.finish(to_member)
    return (SealedChannel(k_host, is_host=True, nameplate=7, rid=rid),
            SealedChannel(k_member, is_host=False, nameplate=7, rid=rid))


def test_sealed_channel_carries_messages_both_ways() -> None:
    host, member = _pair("7-a-b-c", "7-a-b-c")
    for i in range(3):
        assert host.open(member.seal({"t": "hello", "i": i})) == {"t": "hello", "i": i}
        assert member.open(host.seal({"t": "roster", "i": i})) == {"t": "roster", "i": i}


def test_wrong_code_fails_closed_on_the_first_sealed_message() -> None:
    host, member = _pair("7-a-b-c", "7-a-b-d")
    with pytest.raises(ProtocolError) as err:
        host.open(member.seal({"t": "hello"}))
    assert err.value.code == "auth-failed"
    assert host.dead
    with pytest.raises(ProtocolError):  # the channel stays dead
        host.open(member.seal({"t": "hello"}))
    assert rejection_reason(reject("nope")) == "nope"


def test_replayed_message_fails_closed() -> None:
    host, member = _pair("7-a-b-c", "7-a-b-c")
    first = member.seal({"t": "app", "body": 1})
    assert host.open(first)["body"] == 1
    with pytest.raises(ProtocolError) as err:
        host.open(first)
    assert err.value.code == "replay"


def test_reordered_or_dropped_message_fails_closed() -> None:
    host, member = _pair("7-a-b-c", "7-a-b-c")
    member.seal({"t": "app"})  # dropped by the rendezvous
    with pytest.raises(ProtocolError) as err:
        host.open(member.seal({"t": "app"}))
    assert err.value.code == "replay"


def test_altered_or_redirected_message_fails_closed() -> None:
    host, member = _pair("7-a-b-c", "7-a-b-c")
    body = bytearray(member.seal({"t": "app", "body": "x" * 40}))
    body[-20] ^= 1
    with pytest.raises(ProtocolError) as err:
        host.open(bytes(body))
    assert err.value.code == "auth-failed"
    # the same key but another member's rid (a message moved between members) fails too
    _, m2 = _pair("7-a-b-c", "7-a-b-c")
    other = SealedChannel(b"k" * 32, is_host=True, nameplate=7, rid=4)
    with pytest.raises(ProtocolError):
        other.open(m2.seal({"t": "app"}))


def _info(name: str, fp: str) -> dict:
    return MemberInfo(name, {"gb": 8}, "ordinary", 10.0, fp, (("10.0.0.2", 5000),), 1).to_wire()


def test_rendezvous_substituting_a_fingerprint_fails_closed() -> None:
    """A roster the host sealed cannot be edited in transit: swapping a fingerprint breaks it."""
    host, member = _pair("7-a-b-c", "7-a-b-c")
    honest = host.seal({"t": "roster", "members": [_info("bob", "a" * 64)]})
    assert honest.count(b"a" * 64) == 0  # the roster travels encrypted: nothing to find
    forged = bytearray(honest)
    forged[30] ^= 0xFF  # the rendezvous' best effort: change ciphertext bytes
    with pytest.raises(ProtocolError) as err:
        member.open(bytes(forged))
    assert err.value.code == "auth-failed"
    # and a roster sealed with another key (the rendezvous' own PAKE run) fails as well
    mitm_host, _ = _pair("7-x-y-z", "7-x-y-z")
    _, victim = _pair("7-a-b-c", "7-a-b-c")
    with pytest.raises(ProtocolError):
        victim.open(mitm_host.seal({"t": "roster", "members": [_info("bob", "b" * 64)]}))


def test_member_info_validation() -> None:
    info = MemberInfo.from_wire(_info("bob", "c" * 64))
    assert info.candidates == (("10.0.0.2", 5000),) and info.nat == "ordinary"
    for change in ({"fp": "zz"}, {"name": ""}, {"cand": [["nope", 1]]}, {"descriptor": 3},
                   {"nat": {"nat": "weird", "rtt_ms": 1, "mapped": "", "filtering": "", "mapping": ""}}):
        with pytest.raises(ProtocolError):
            MemberInfo.from_wire({**_info("bob", "c" * 64), **change})


# -- signaling codec ----------------------------------------------------------------------------
def test_messages_round_trip() -> None:
    samples = [m.Open(), m.Opened(12, 0, b"t" * 16, 4000), m.Join(12), m.Joined(1, b"t" * 16, 5),
               m.Send(0, b"body"), m.Deliver(2, b""), m.PeerLeft(1, "left"), m.EdgeRequest(2),
               m.EdgeAllocated(b"e" * 8, 1, True), m.Kick(1), m.CloseNameplate(), m.Heartbeat(),
               m.Bye(), m.Error("x", "y"), m.SessionClosed("z"), m.Admit(3)]
    reader = m.FrameReader()
    stream = b"".join(m.encode(s) for s in samples)
    out = []
    for i in range(0, len(stream), 7):  # arbitrary TCP segmentation
        out += reader.feed(stream[i : i + 7])
    assert out == samples


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgpack.packb([]), msgpack.packb([99]), msgpack.packb([3]),
    msgpack.packb([3, "7", 1]), msgpack.packb([3, 10**9, 1]), msgpack.packb([5, 0, b"x" * 300_000]),
    msgpack.packb({"t": 1}), msgpack.packb([9, b"short", 1, True]),
])
def test_bad_signaling_frames_raise_one_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        m.decode(payload)


def test_frame_reader_refuses_huge_announced_length() -> None:
    with pytest.raises(ProtocolError):
        m.FrameReader().feed(b"\xff\xff\xff\xff")


# -- registry -----------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


def _registry() -> tuple[Registry, _Clock]:
    rng = random.Random(1)
    return Registry(stun_port2=4000, random_bytes=rng.randbytes,
                    random_below=rng.randrange), _Clock()


def _sends(actions: list, conn: int) -> list:
    return [a.message for a in actions if isinstance(a, SendTo) and a.conn == conn]


def _open_session(reg: Registry, clock: _Clock) -> int:
    reg.connected(1, clock.now)
    [opened] = _sends(reg.receive(1, m.Open(), clock.now), 1)
    assert isinstance(opened, m.Opened) and opened.rid == 0
    return opened.nameplate


def test_registry_session_flow() -> None:
    reg, clock = _registry()
    nameplate = _open_session(reg, clock)
    reg.connected(2, clock.now)
    [joined] = _sends(reg.receive(2, m.Join(nameplate), clock.now), 2)
    assert isinstance(joined, m.Joined) and joined.rid == 1
    # member -> host is forwarded; member -> member is refused
    assert _sends(reg.receive(2, m.Send(0, b"pake"), clock.now), 1) == [m.Deliver(1, b"pake")]
    reg.connected(3, clock.now)
    reg.receive(3, m.Join(nameplate), clock.now)
    for rid in (1, 2):  # both confirmed their PAKE: the host admits them
        assert reg.receive(1, m.Admit(rid), clock.now) == []
    [err] = _sends(reg.receive(2, m.Send(2, b"x"), clock.now), 2)
    assert isinstance(err, m.Error) and err.code == "forbidden"
    # an edge is announced to both ends
    actions = reg.receive(2, m.EdgeRequest(2), clock.now)
    [a], [b] = _sends(actions, 2), _sends(actions, 3)
    assert a.edge_id == b.edge_id and a.initiator and not b.initiator and a.peer == 2 and b.peer == 1
    # leaving reaches the host
    assert _sends(reg.receive(2, m.Bye(), clock.now), 1) == [m.PeerLeft(1, "left")]
    # silence reaches the host too, once it lasted MEMBER_SILENT_S (not before)
    clock.now += MEMBER_SILENT_S - 1.0
    reg.receive(1, m.Heartbeat(), clock.now)
    assert _sends(reg.tick(clock.now), 1) == []
    clock.now += 1.5
    reg.receive(1, m.Heartbeat(), clock.now)
    actions = reg.tick(clock.now)
    assert _sends(actions, 1) == [m.PeerLeft(2, "connection lost (no heartbeat)")]
    # the host leaving ends the session
    reg.connected(4, clock.now)
    reg.receive(4, m.Join(nameplate), clock.now)
    actions = reg.disconnected(1, "lost", clock.now)
    assert _sends(actions, 4) == [m.SessionClosed("the host left the session")]
    assert reg.session_count == 0


def test_registry_rejects_unknown_and_closed_nameplates() -> None:
    reg, clock = _registry()
    nameplate = _open_session(reg, clock)
    codes = []
    for conn in range(10, 1010):  # 1000 bogus joins to unknown nameplates, from one address
        reg.connected(conn, clock.now, "10.0.0.9")
        bogus = 1 + (nameplate + conn) % 9999
        if bogus == nameplate:
            continue
        actions = reg.receive(conn, m.Join(bogus), clock.now)
        assert any(isinstance(a, CloseConn) for a in actions)
        codes += [e.code for e in _sends(actions, conn)]
    # a scanner gets a few answers, then only "rate-limited", also for the live nameplate
    assert codes.count("unknown-nameplate") == UNKNOWN_JOIN_BURST, codes[:20]
    reg.connected(3, clock.now, "10.0.0.9")
    [err] = _sends(reg.receive(3, m.Join(nameplate), clock.now), 3)
    assert err.code == "rate-limited"
    [log] = [a for a in reg.tick(clock.now) if isinstance(a, Log)]
    assert "from 10.0.0.9" in log.text
    assert int(log.text.split()[0]) >= 990  # counted, in one line
    assert reg.tick(clock.now + 1) == []  # one line per interval, however many joins
    clock.now += 1 / UNKNOWN_JOINS_PER_S  # one more allowance after its interval
    reg.connected(4, clock.now, "10.0.0.9")
    [ok] = _sends(reg.receive(4, m.Join(nameplate), clock.now), 4)
    assert isinstance(ok, m.Joined)
    reg.receive(1, m.CloseNameplate(), clock.now)  # after a failed PAKE
    reg.connected(2, clock.now)
    [err] = _sends(reg.receive(2, m.Join(nameplate), clock.now), 2)
    assert isinstance(err, m.Error) and err.code == "unknown-nameplate"
    assert reg.session_count == 1


def test_registry_requires_hello_first_and_times_out_idle_connections() -> None:
    reg, clock = _registry()
    reg.connected(5, clock.now)
    actions = reg.receive(5, m.Send(0, b"x"), clock.now)
    assert any(isinstance(a, CloseConn) for a in actions)
    reg.connected(6, clock.now)
    clock.now += 11
    assert CloseConn(6, "no hello") in reg.tick(clock.now)


# -- relay ------------------------------------------------------------------------------------
def test_relay_forwards_only_between_bound_ends_within_rate() -> None:
    relay = RelayTable(edge_bytes_per_s=10_000, edge_burst_bytes=3_000)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    for i, tok in enumerate((a, b, c)):
        relay.add_member(tok, 7, i)
        challenge, to = relay.receive(frames.encode_bind(tok), (f"10.0.0.{i}", 1000), 0.0)
        assert to == (f"10.0.0.{i}", 1000) and challenge[0] == frames.BIND_CHALLENGE
        _, nonce = frames.decode_bind_request(challenge)
        out = relay.receive(frames.encode_bind(tok, nonce=nonce), (f"10.0.0.{i}", 1000), 0.0)
        assert out == (frames.encode_bind(tok, ack=True), (f"10.0.0.{i}", 1000))
    relay.allocate(b"E" * 8, 7, a, b, 0.0)
    frame = frames.encode_data(b"E" * 8, b"x" * 1000)
    assert relay.receive(frame, ("10.0.0.0", 1000), 0.0) == (frame, ("10.0.0.1", 1000))
    assert relay.receive(frame, ("10.0.0.1", 1000), 0.0) == (frame, ("10.0.0.0", 1000))
    assert relay.receive(frame, ("10.0.0.2", 1000), 0.0) is None  # c is not an end
    assert relay.receive(frame, ("10.9.9.9", 1), 0.0) is None  # unbound source
    assert relay.receive(frame, ("10.0.0.0", 1000), 0.0) is None  # over the burst
    assert relay.stats.dropped["rate-limited"] == 1
    assert relay.receive(frame, ("10.0.0.0", 1000), 1.0) is not None  # refilled
    relay.expire(1.0 + 10_000)
    assert relay.receive(frame, ("10.0.0.0", 1000), 10_002.0) is None


# -- STUN + NAT classification with emulated NATs ----------------------------------------------------
class _FakeNat:
    """Maps the member's one socket; filtering and mapping as the named kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.contacted: set[tuple[str, int]] = set()
        self.ports: dict[tuple[str, int], int] = {}

    def outbound(self, dest: tuple[str, int]) -> tuple[str, int]:
        self.contacted.add(dest)
        if self.kind == "restrictive":
            port = self.ports.setdefault(dest, 40000 + len(self.ports))
        else:
            port = 40000
        return ("198.51.100.1", port)

    def inbound_ok(self, src: tuple[str, int]) -> bool:
        if self.kind == "permissive":
            return True
        if self.kind == "ordinary-adf":
            return any(ip == src[0] for ip, _ in self.contacted)
        return src in self.contacted


def _classify(kind: str, *, alternate: bool, drop_p2: bool = False) -> object:
    rv_ip, p1, p2, alt_ip = "203.0.113.1", 7000, 7001, "203.0.113.2"
    responder = StunResponder(port2=p2, alternate_ip=alt_ip if alternate else None)
    sockets = {0: (rv_ip, p1), 1: (rv_ip, p2), 2: (alt_ip, 7002)}
    nat, now = _FakeNat(kind), 0.0
    probe = NatProbe((rv_ip, p1), now)
    for _ in range(100):
        for data, dest in probe.datagrams_to_send(now):
            mapped = nat.outbound(dest)
            index = {(rv_ip, p1): 0, (rv_ip, p2): 1}[dest]
            if drop_p2 and index == 1:
                continue
            answer = responder.respond(data, mapped, index)
            if answer and nat.inbound_ok(sockets[answer[1]]):
                probe.receive(answer[0], sockets[answer[1]], now + 0.01)
        if probe.done:
            break
        now += 0.05
        probe.handle_timer(now)
    assert probe.done
    return probe.report()


@pytest.mark.parametrize("kind,alternate,nat,filtering,mapping", [
    ("permissive", True, "permissive", "endpoint-independent", "endpoint-independent"),
    ("permissive", False, "permissive", "not-port-dependent", "endpoint-independent"),
    ("ordinary-adf", True, "ordinary", "address-dependent", "endpoint-independent"),
    ("ordinary", True, "ordinary", "port-dependent", "endpoint-independent"),
    ("ordinary", False, "ordinary", "port-dependent", "endpoint-independent"),
    ("restrictive", False, "restrictive", "port-dependent", "endpoint-dependent"),
])
def test_nat_probe_classifies(kind: str, alternate: bool, nat: str, filtering: str, mapping: str) -> None:
    report = _classify(kind, alternate=alternate)
    assert (report.nat, report.filtering, report.mapping) == (nat, filtering, mapping)
    assert report.mapped.startswith("198.51.100.1:")


def test_nat_probe_waits_for_filtering_before_contacting_p2() -> None:
    probe = NatProbe(("203.0.113.1", 7000), 0.0)
    first = probe.datagrams_to_send(0.0)
    assert {dest for _, dest in first} == {("203.0.113.1", 7000)}
    assert FILTER_WAIT_S > 0.1


def test_nat_probe_rtt_is_the_shortest_of_samples_sent_apart() -> None:
    """The RTT samples leave RTT_SPACING_S apart, and the report keeps the shortest: a stall of
    the member's machine (a CPU quota's period) delayed samples sent together alike, and edges
    priced from it made a throttled ring look 2x slower than it ran."""
    from kafila.net.natcheck import RTT_SAMPLES, RTT_SPACING_S

    rv = ("203.0.113.1", 7000)
    responder = StunResponder(port2=7001)
    probe, now, sent = NatProbe(rv, 0.0), 0.0, []
    while not probe.done and now < 10.0:
        for data, dest in probe.datagrams_to_send(now):
            if dest == rv and stun.parse_message(data).attributes.get("CHANGE-REQUEST") is None:
                sent.append(now)
                late = 0.030 if len(sent) == 1 else 0.005  # the first answer meets a stalled period
                probe.receive(responder.respond(data, ("198.51.100.1", 40000), 0)[0], rv, now + late)
        timer = probe.get_timer()
        now = max(now + 0.001, timer if timer is not None else now + 0.05)
        probe.handle_timer(now)
    assert len(sent) == RTT_SAMPLES
    assert [round(b - a, 3) for a, b in zip(sent, sent[1:])] == [RTT_SPACING_S] * (RTT_SAMPLES - 1)
    assert probe.report().rtt_ms == pytest.approx(5.0)


def test_nat_probe_without_rendezvous_fails_with_a_clear_reason() -> None:
    probe = NatProbe(("203.0.113.1", 7000), 0.0)
    now = 0.0
    while not probe.done:
        probe.datagrams_to_send(now)
        now += 0.1
        probe.handle_timer(now)
    with pytest.raises(ProtocolError, match="no STUN answer"):
        probe.report()


def test_classes_and_predictions() -> None:
    assert classify("endpoint-dependent", "endpoint-independent") == "restrictive"
    assert predict_edge_kind("permissive", "restrictive") == "direct"
    assert predict_edge_kind("ordinary", "ordinary") == "direct"
    assert predict_edge_kind("ordinary", "restrictive") == "relay"
    assert predict_edge_kind("restrictive", "restrictive") == "relay"


def test_stun_responder_answers_from_the_requested_socket() -> None:
    responder = StunResponder(port2=7001)
    request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
    data, index = responder.respond(bytes(request), ("1.2.3.4", 5), 0)
    assert index == 0 and stun.parse_message(data).attributes["XOR-MAPPED-ADDRESS"] == ("1.2.3.4", 5)
    request.attributes["CHANGE-REQUEST"] = 0x02
    assert responder.respond(bytes(request), ("1.2.3.4", 5), 0)[1] == 1
    request.attributes["CHANGE-REQUEST"] = 0x04
    assert responder.respond(bytes(request), ("1.2.3.4", 5), 0) is None  # no alternate IP
    assert responder.respond(b"\x00\x01" + b"\x00" * 30, ("1.2.3.4", 5), 0) is None


# -- punching, paired over an emulated pair of NATs ---------------------------------------------
def _punch(kind_a: str, kind_b: str, seconds: float = 6.0) -> tuple[Puncher, Puncher]:
    """Two punchers behind fake NATs; returns them after `seconds` of emulated time."""
    nat = {"a": _FakeNat(kind_a), "b": _FakeNat(kind_b)}
    # public addresses differ per side
    public = {"a": "198.51.100.1", "b": "198.51.100.2"}
    for side in "ab":
        original = nat[side].outbound
        nat[side].outbound = (lambda o, s: lambda dest: (public[s], o(dest)[1]))(original, side)
    key, edge = b"k" * 32, b"E" * 8
    # candidates: what each learned from STUN towards the rendezvous
    cand_a = nat["a"].outbound(("203.0.113.1", 7000))
    cand_b = nat["b"].outbound(("203.0.113.1", 7000))
    now = 0.0
    pa = Puncher(edge, key, [cand_b], now, random.Random(1))
    pb = Puncher(edge, key, [cand_a], now, random.Random(2))
    peers = {"a": pa, "b": pb}
    rounds = 0
    inflight: list[tuple[str, bytes, tuple[str, int], tuple[str, int]]] = []
    while now < seconds:
        rounds += 1
        assert rounds < 10_000
        for side, puncher in peers.items():
            for data, dest in puncher.datagrams_to_send(now):
                inflight.append((side, data, nat[side].outbound(dest), dest))
        delivered, inflight = inflight, []
        for side, data, src, dest in delivered:
            other = "b" if side == "a" else "a"
            if dest[0] != public[other] or not nat[other].inbound_ok(src):
                continue
            if dest[1] not in (nat[other].ports.values() if nat[other].ports else [40000]):
                continue
            for reply, to in peers[other].receive(data, src, now):
                inflight.append((other, reply, nat[other].outbound(to), to))
        now += 0.01
    return pa, pb


@pytest.mark.parametrize("a,b,direct", [
    ("permissive", "permissive", True),
    ("permissive", "restrictive", True),
    ("ordinary", "ordinary", True),
    ("ordinary-adf", "restrictive", True),
    ("ordinary", "restrictive", False),
    ("restrictive", "restrictive", False),
])
def test_punch_outcomes_follow_nat_kinds(a: str, b: str, direct: bool) -> None:
    pa, pb = _punch(a, b)
    assert (pa.state == DIRECT and pb.state == DIRECT) is direct, (pa.state, pb.state)
    if direct:
        assert pa.direct is not None and pa.direct[0] == "198.51.100.2"


def test_punch_rejects_forged_and_foreign_frames() -> None:
    p = Puncher(b"E" * 8, b"k" * 32, [("1.1.1.1", 1)], 0.0, random.Random(0))
    with pytest.raises(ProtocolError):
        p.receive(encode_probe(b"x" * 32, b"E" * 8, b"t" * 8), ("2.2.2.2", 2), 0.0)
    assert ("2.2.2.2", 2) not in p.candidates  # an unauthenticated probe teaches nothing
    replies = p.receive(encode_probe(b"k" * 32, b"E" * 8, b"t" * 8), ("2.2.2.2", 2), 0.0)
    assert replies[0][1] == ("2.2.2.2", 2) and ("2.2.2.2", 2) in p.candidates


def test_punch_falls_back_to_relay_when_pongs_stop() -> None:
    pa, _ = _punch("permissive", "permissive", seconds=1.0)
    assert pa.state == DIRECT
    later = (pa.last_pong or 0) + 30.0
    pa.next_probe_at = later
    pa.datagrams_to_send(later)
    assert pa.state != DIRECT and pa.direct is None


def test_punch_disabled_sends_nothing() -> None:
    p = Puncher(b"E" * 8, b"k" * 32, [("1.1.1.1", 1)], 0.0, random.Random(0), rounds=0)
    assert p.datagrams_to_send(0.0) == [] and p.datagrams_to_send(1000.0) == []


# -- the first-byte demux -----------------------------------------------------------------------
def test_first_byte_demux() -> None:
    request = bytes(stun.Message(stun.Method.BINDING, stun.Class.REQUEST))
    assert frames.kind_of(request) == frames.KIND_STUN
    assert frames.kind_of(frames.encode_data(b"E" * 8, b"q")) == frames.KIND_RELAY
    assert frames.kind_of(encode_probe(b"k" * 32, b"E" * 8, b"t" * 8)) == frames.KIND_PUNCH
    assert frames.kind_of(b"\xc3" + b"\x00" * 30) == frames.KIND_QUIC
    assert frames.kind_of(b"\x7f" * 2000) is None  # oversized
    assert frames.kind_of(b"\x05hello") is None
    # only QUIC may be longer, where the caller allows it (a member's peer on its own machine)
    assert frames.kind_of(b"\x7f" * 2000, max_bytes=16000) == frames.KIND_QUIC
    assert frames.kind_of(b"\x7f" * 16001, max_bytes=16000) is None
    assert frames.kind_of(bytes([frames.DATA]) + b"q" * 2000, max_bytes=16000) is None


def test_member_socket_takes_large_quic_datagrams_from_loopback_only() -> None:
    from kafila.net.sock import LOOPBACK_MAX_DATAGRAM_BYTES, MemberSocket

    sock = MemberSocket()
    got: list = []
    sock.handlers[frames.KIND_QUIC] = lambda data, src: got.append((len(data), src[0]))
    big = b"\x7f" * LOOPBACK_MAX_DATAGRAM_BYTES
    for src in (("127.0.0.1", 1), ("::1", 1), ("203.0.113.9", 1), ("not an address", 1)):
        sock.datagram_received(big, src)
    sock.datagram_received(big + b"x", ("127.0.0.1", 1))
    assert got == [(len(big), "127.0.0.1"), (len(big), "::1")] and sock.dropped == 3


def test_distinct_name_numbers_a_taken_name_and_stays_valid() -> None:
    assert distinct_name("vm", {"host"}) == "vm"
    assert distinct_name("vm", {"vm"}) == "vm-2"
    assert distinct_name("vm", {"vm", "vm-2"}) == "vm-3"
    long = "a" * 64
    got = distinct_name(long, {long})
    assert got == "a" * 62 + "-2" and valid_name(got)
