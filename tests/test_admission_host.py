"""Issue 15, finding 3 (sans-I/O): online guessing of the code is bounded at the host.

The host's admission machine is paired with joiners' `Pake`s over a fake link; the attacker is a
malicious rendezvous (it can start as many PAKEs as it likes, with any guess) or a stranger who
knows the nameplate. Before admission.py the host answered every PAKE it was sent.
"""

from __future__ import annotations

import pytest

from kafila.net import admission as adm
from kafila.net.admission import HostAdmission
from kafila.net.code import make_code
from kafila.net.handshake import Pake, SealedChannel, rejection_reason

CODE = "7-adroitness-absurd-yucatan"
NAMEPLATE = 7


class Joiner:
    def __init__(self, rid: int, code: str = CODE) -> None:
        self.rid, self.pake = rid, Pake(code)
        self.channel: SealedChannel | None = None

    def first(self) -> bytes:
        return self.pake.start()

    def hello(self, answer: bytes) -> bytes:
        key = self.pake.finish(answer)
        self.channel = SealedChannel(key, is_host=False, nameplate=NAMEPLATE, rid=self.rid)
        return self.channel.seal({"t": "hello", "member": {"name": f"m{self.rid}"}})


def _bodies(actions, rid: int) -> list[bytes]:
    return [a.body for a in actions if isinstance(a, adm.SendBody) and a.rid == rid]


def _kinds(actions) -> list[type]:
    return [type(a) for a in actions]


def _admit(host: HostAdmission, joiner: Joiner, now: float = 0.0) -> list:
    [answer] = _bodies(host.receive(joiner.rid, joiner.first(), now), joiner.rid)
    return host.receive(joiner.rid, joiner.hello(answer), now)


def test_right_code_is_confirmed() -> None:
    host = HostAdmission(CODE, NAMEPLATE)
    [confirmed] = _admit(host, Joiner(1))
    assert isinstance(confirmed, adm.Confirmed) and confirmed.hello["member"] == {"name": "m1"}
    assert host.state == adm.OPEN and host.answered == 1


def test_one_wrong_code_and_the_host_answers_no_further_pake() -> None:
    host = HostAdmission(CODE, NAMEPLATE)
    actions = _admit(host, Joiner(1, "7-adroitness-absurd-zulu"))
    assert _kinds(actions) == [adm.SendBody, adm.Drop, adm.CloseNameplate]
    assert host.state == adm.CLOSED
    # even the right code gets no PAKE answer now: only a reject (a new code is needed)
    later = host.receive(2, Joiner(2).first(), 1.0)
    [body] = _bodies(later, 2)
    assert "new one" in (rejection_reason(body) or "") and _kinds(later) == [adm.SendBody, adm.Drop]
    assert host.answered == 1
    # joining needs a new code, which works (the host would be restarted with it)
    fresh = make_code(NAMEPLATE)
    host2 = HostAdmission(fresh, NAMEPLATE)
    assert isinstance(_admit(host2, Joiner(3, fresh))[0], adm.Confirmed)


def test_malicious_rendezvous_gets_one_guess_per_code() -> None:
    """It starts 30 PAKEs at once, each with another guess: one answer, then nothing."""
    host = HostAdmission(CODE, NAMEPLATE, queue_max=64)
    guesses = [Joiner(rid, f"7-adroitness-absurd-{w}") for rid, w in
               enumerate(["zulu", "yucatan", "absurd"] + ["adviser"] * 27, start=1)]  # fmt: skip
    answers = {}
    for g in guesses:
        for a in host.receive(g.rid, g.first(), 0.0):
            if isinstance(a, adm.SendBody) and rejection_reason(a.body) is None:
                answers[a.rid] = a.body
    assert list(answers) == [1]  # only the first is answered; the rest wait their turn
    actions = host.receive(1, guesses[0].hello(answers[1]), 0.0)  # the guess fails...
    answered_after = [a for a in actions if isinstance(a, adm.SendBody) and rejection_reason(a.body) is None]
    assert answered_after == [] and host.answered == 1  # ...and no queued guess is ever answered
    assert {a.rid for a in actions if isinstance(a, adm.Drop)} == {g.rid for g in guesses}


def test_only_one_unconfirmed_pake_at_a_time() -> None:
    host = HostAdmission(CODE, NAMEPLATE)
    a, b = Joiner(1), Joiner(2)
    [answer_a] = _bodies(host.receive(1, a.first(), 0.0), 1)
    assert host.receive(2, b.first(), 0.0) == []  # queued
    actions = host.receive(1, a.hello(answer_a), 0.1)
    assert isinstance(actions[0], adm.Confirmed)
    [answer_b] = _bodies(actions, 2)  # b's turn comes when a confirmed
    assert isinstance(host.receive(2, b.hello(answer_b), 0.2)[0], adm.Confirmed)


def test_junk_pake_is_dropped_without_closing_the_nameplate() -> None:
    """Finding 2: one junk PAKE body used to close the nameplate (a host waiting for --expect N
    then waited for ever). Junk tests no password: the id is dropped, nothing else changes."""
    host = HostAdmission(CODE, NAMEPLATE)
    for junk in (b"P", b"P" + b"\x00" * 33, b"P-not-an-element", b"Sxx", b"", b"R"):
        actions = host.receive(9, junk, 0.0)
        assert _kinds(actions) == [adm.Drop], junk
    assert host.state == adm.OPEN and host.answered == 0
    assert isinstance(_admit(host, Joiner(1))[0], adm.Confirmed)


def test_stalled_pake_times_out_without_closing_and_the_next_joiner_goes_on() -> None:
    host = HostAdmission(CODE, NAMEPLATE, pake_timeout_s=5.0)
    staller, legit = Joiner(1), Joiner(2)
    assert _bodies(host.receive(1, staller.first(), 0.0), 1)
    assert host.receive(2, legit.first(), 1.0) == []
    assert host.tick(4.9) == []
    actions = host.tick(5.0)
    assert adm.Drop(1, "no PAKE confirmation within 5 s") in actions
    [answer] = _bodies(actions, 2)
    assert isinstance(host.receive(2, legit.hello(answer), 5.1)[0], adm.Confirmed)
    assert host.state == adm.OPEN and host.failed_confirmations == 0


def test_second_pake_or_gone_joiner_frees_the_turn() -> None:
    host = HostAdmission(CODE, NAMEPLATE)
    a, b = Joiner(1), Joiner(2)
    host.receive(1, a.first(), 0.0)
    host.receive(2, b.first(), 0.0)
    actions = host.receive(1, Pake(CODE).start(), 0.0)  # a second PAKE from 1: dropped
    assert actions[0] == adm.Drop(1, "a second PAKE message") and _bodies(actions, 2)
    c = Joiner(3)
    host.receive(3, c.first(), 0.0)
    assert _bodies(host.left(2, 0.0), 3)  # 2 left (PeerLeft): 3's turn
    assert host.state == adm.BUSY and host.current == 3


def test_queue_is_bounded() -> None:
    host = HostAdmission(CODE, NAMEPLATE, queue_max=2)
    host.receive(1, Joiner(1).first(), 0.0)
    assert host.receive(2, Joiner(2).first(), 0.0) == []
    assert host.receive(3, Joiner(3).first(), 0.0) == []
    assert _kinds(host.receive(4, Joiner(4).first(), 0.0)) == [adm.Drop]


@pytest.mark.parametrize("words", [3, 4])
def test_codes_of_three_and_four_words(words: int) -> None:
    from kafila.net.code import parse_code

    code = make_code(42, words=words)
    assert len(code.split("-")) == words + 1 and parse_code(code) == (42, code)
    host = HostAdmission(code, 42)
    joiner = Joiner(1, code)
    [answer] = _bodies(host.receive(1, joiner.first(), 0.0), 1)
    joiner.channel = SealedChannel(joiner.pake.finish(answer), is_host=False, nameplate=42, rid=1)
    assert isinstance(host.receive(1, joiner.channel.seal({"t": "hello"}), 0.0)[0], adm.Confirmed)
