"""Admission's sealed messages through one codec (issue 33 item 3): each kind round-trips, each
malformed field is one ProtocolError, and the machines' states move only along their tables."""

from __future__ import annotations

import pytest

from kafila.net import admission_messages as am
from kafila.net.admission import HostAdmission
from rendezvous.errors import ProtocolError

KEY, PROOF = b"k" * 32, b"p" * 32
MESSAGES = [
    am.Hello({"name": "a"}),
    am.Welcome(KEY, "a-2", [{"name": "h"}], PROOF, True, 4711),
    am.Refuse("bad hello: no name"),
    am.Roster([{"name": "h"}, {"name": "a"}]),
    am.App({"t": "ready", "epoch": 1}),
    am.Part(0, 2, 20_000, b"x" * 16_384),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda msg: msg.T)
def test_each_kind_round_trips(msg) -> None:
    assert am.decode(am.encode(msg)) == msg


def test_an_older_hosts_welcome_takes_the_old_defaults() -> None:
    welcome = am.decode({"t": "welcome", "key": KEY, "name": "a", "members": []})
    assert (welcome.resume, welcome.embedded, welcome.session) == (b"", False, 0)


@pytest.mark.parametrize("body", [
    None, [], {"t": 5}, {"t": "nope"}, {"t": "hello"}, {"t": "hello", "member": [1]},
    {"t": "welcome", "key": b"short", "name": "a", "members": []},
    {"t": "welcome", "key": KEY, "name": "a" * 65, "members": []},
    {"t": "welcome", "key": KEY, "name": "a", "members": "all"},
    {"t": "welcome", "key": KEY, "name": "a", "members": [], "resume": b"x"},
    {"t": "welcome", "key": KEY, "name": "a", "members": [], "session": 10_000},
    {"t": "welcome", "key": KEY, "name": "a", "members": [], "session": "4711"},
    {"t": "refuse", "reason": 5}, {"t": "refuse", "reason": "r" * 501},
    {"t": "roster", "members": [{}] * 65},
    {"t": "part", "i": "0", "n": 1, "size": 1, "data": b"x"}, {"t": "part", "i": 0, "n": 0, "size": 1, "data": b"x"},
    {"t": "part", "i": 0, "n": 1, "size": -1, "data": b"x"}, {"t": "part", "i": 0, "n": 1, "size": 1, "data": "x"},
])  # fmt: skip
def test_each_malformed_message_is_one_protocol_error(body) -> None:
    with pytest.raises(ProtocolError) as err:
        am.decode(body)
    assert err.value.code == "malformed" and "\n" not in err.value.reason


def test_states_move_only_along_their_tables() -> None:
    gate = HostAdmission("1-a-b-c", 1)
    assert gate.state is am.Admission.OPEN and gate.state == "open"  # the strings /status and logs used
    with pytest.raises(AssertionError, match="open → closed"):
        am.step(am.Admission.OPEN, am.Admission.CLOSED)  # only a PAKE that was answered can fail
    with pytest.raises(AssertionError, match="closed → open"):
        am.step(am.Admission.CLOSED, am.Admission.OPEN)  # a closed code stays closed: a fresh one is new
    with pytest.raises(AssertionError, match="failed → joined"):
        am.step(am.Joining.FAILED, am.Joining.JOINED)
    assert am.step(am.Joining.PAKE, am.Joining.HELLO) is am.Joining.HELLO
    assert all(state in am.TRANSITIONS for enum in (am.Admission, am.Joining) for state in enum)
