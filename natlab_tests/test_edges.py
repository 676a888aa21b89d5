"""Kafila edges across the lab's NATs: every ordered pair of kinds (Kafila Table III with both
ordinary variants, plus a public member) carries data, and goes direct where the issue says."""

from __future__ import annotations

import itertools

import pytest

from natlab_tests import nat, session

pytestmark = [pytest.mark.natlab, pytest.mark.session, pytest.mark.timeout(240)]

DIRECT_WAIT_S = 8.0  # longer than one punch round (5 s) on a loaded 2-core machine
PROBE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def rendezvous(lab):
    return session.start_rendezvous(lab)


def test_every_ordered_pair(lab, rendezvous):
    kinds = nat.ALL_KINDS
    initiators = {k: lab.add_member(k) for k in kinds}
    responders = {k: lab.add_member(k) for k in kinds}
    names = [f"i-{k}" for k in kinds] + [f"r-{k}" for k in kinds]
    members = session.start_session(
        lab, rendezvous.address, [*initiators.values(), *responders.values()], names
    )
    by_name = {m.name: m for m in members}
    pairs = list(itertools.product(kinds, kinds))
    edges = [(by_name[f"i-{a}"], by_name[f"r-{b}"]) for a, b in pairs]
    try:
        opened = session.open_edges(edges)
        final = session.wait_direct(edges, DIRECT_WAIT_S)
        moved = session.exchange(edges, PROBE_BYTES)
    finally:
        session.quit_all(members)
    report = []
    for (a, b), (ea, _), (fa, fb) in zip(pairs, opened, final):
        report.append(
            (a, b, ea.get("predicted"), session.expected_kind(a, b), fa["kind"], fb["kind"])
        )
    print("\n".join(" ".join(map(str, row)) for row in report))
    lost = [t for t in moved if not t["intact"]]
    assert not lost, lost
    wrong = [r for r in report if not (r[3] == r[4] == r[5])]
    assert not wrong, (
        f"(initiator, responder, predicted, expected, achieved, at responder): {wrong}"
    )


def test_shared_lan_goes_direct_over_local_addresses(lab, rendezvous):
    router = lab.add_router(nat.ORDINARY_APDF)
    x = lab.add_member(nat.ORDINARY_APDF, router)
    y = lab.add_member(nat.ORDINARY_APDF, router)
    members = session.start_session(lab, rendezvous.address, [x, y], ["lan-x", "lan-y"])
    pair = [(members[0], members[1])]
    try:
        session.open_edges(pair)
        [(fa, fb)] = session.wait_direct(pair, DIRECT_WAIT_S)
        [there, back] = session.exchange(pair, PROBE_BYTES)
        stats = members[0].proc.request("stats", peer="lan-y")
    finally:
        session.quit_all(members)
    assert fa["kind"] == fb["kind"] == "direct"
    assert there["intact"] and back["intact"]
    assert y.ip in str(stats), f"the direct path should use the LAN address {y.ip}: {stats}"
