"""The lab itself, proven with plain UDP sockets (no Kafila): each NAT kind maps and filters as
specified, and the punch matrix comes out as RFC 4787 predicts."""

from __future__ import annotations

import itertools
import subprocess

import pytest

from natlab_tests import nat, plain
from natlab_tests.lab import Lab, lab_namespaces

pytestmark = [pytest.mark.natlab, pytest.mark.timeout(120)]

# Which ordered pairs two plain sockets can punch (probes to every candidate, every probe answered
# to its observed source, the observed source adopted).
PLAIN_DIRECT = {
    (a, b): not ({a, b} == {nat.RESTRICTIVE} or {a, b} == {nat.ORDINARY_APDF, nat.RESTRICTIVE})
    for a, b in itertools.product(nat.ALL_KINDS, nat.ALL_KINDS)
}


@pytest.fixture(scope="module")
def echo(lab):
    return plain.start_echo(lab)


@pytest.mark.parametrize("kind", nat.ALL_KINDS)
def test_mapping_and_filtering(lab, echo, kind):
    node = lab.add_member(kind)
    got = plain.classify(lab, node)
    local_port = got["local"].rsplit(":", 1)[1]
    assert got["mapped"].startswith(node.public_ip + ":")
    if kind == nat.RESTRICTIVE:
        assert got["mapping"] == "endpoint-dependent", got
    else:
        assert got["mapping"] == "endpoint-independent", got
        assert got["mapped"].endswith(":" + local_port), (
            "the lab relies on masquerade keeping the port"
        )
    expect_answer = kind in (nat.PERMISSIVE, nat.ORDINARY_ADF, nat.PUBLIC)
    assert (got["filtering"] != "port-dependent") == expect_answer, got
    assert got["nat"] in nat.EXPECTED_CLASS[kind], got


def _unsolicited(lab, target_kind):
    """Who gets through to a socket behind `target_kind`: a stranger, and the rendezvous address
    from a port the member never sent to."""
    node = lab.add_member(target_kind)
    stranger = lab.add_member(nat.PUBLIC)
    listener = plain.listen(lab, node, seconds=2.0)
    mapped = listener.read_json(15)["mapped"]
    ip, port = mapped.rsplit(":", 1)
    plain.spray(lab, stranger, ip, port, rounds=20)
    plain.spray(lab, lab.inet_ns, ip, port, rounds=20, source_port=3490)
    return node, listener.read_json(15)


@pytest.mark.parametrize("kind", nat.ALL_KINDS)
def test_unsolicited_inbound(lab, echo, kind):
    _, got = _unsolicited(lab, kind)
    sources = {addr.rsplit(":", 1)[0] for addr in got["sources"]}
    from_stranger = any(ip.startswith("100.64.2.") for ip in sources)
    from_rendezvous_ip = lab.rendezvous_ip in sources
    assert from_stranger == (kind in (nat.PERMISSIVE, nat.PUBLIC)), got
    assert from_rendezvous_ip == (kind in (nat.PERMISSIVE, nat.ORDINARY_ADF, nat.PUBLIC)), got


def test_restrictive_never_accepts_unsolicited(lab, echo):
    """A sweep of every port of a restrictive router's address, twice, plus the mapped port from
    the rendezvous address: nothing reaches the member, and the router counted the drops."""
    node = lab.add_member(nat.RESTRICTIVE)
    stranger = lab.add_member(nat.PUBLIC)
    listener = plain.listen(lab, node, seconds=4.0)
    mapped = listener.read_json(15)["mapped"]
    ip, port = mapped.rsplit(":", 1)
    sent = plain.spray(lab, stranger, ip, "1-65535", rounds=2)["sent"]
    plain.spray(lab, lab.inet_ns, ip, port, rounds=50, source_port=3490)
    got = listener.read_json(20)
    assert got["unsolicited"] == 0, got
    assert node.router.counter("unsolicited_in") >= sent * 0.9


def test_punch_matrix(lab, echo):
    """Every ordered pair of kinds (Table III with both ordinary variants, plus public)."""
    pairs = list(itertools.product(nat.ALL_KINDS, nat.ALL_KINDS))
    nodes = [(lab.add_member(a), lab.add_member(b)) for a, b in pairs]
    results = plain.punch_many(lab, nodes)
    wrong = []
    for (a, b), (ra, rb) in zip(pairs, results):
        direct = ra["direct"] and rb["direct"]
        if direct != PLAIN_DIRECT[(a, b)]:
            wrong.append((a, b, ra, rb))
        if direct:
            assert ra["data_received"] > 0 and rb["data_received"] > 0
    assert not wrong, wrong


def test_shared_lan_punches_over_local_addresses(lab, echo):
    router = lab.add_router(nat.ORDINARY_APDF)
    x = lab.add_member(nat.ORDINARY_APDF, router)
    y = lab.add_member(nat.ORDINARY_APDF, router)
    [(rx, ry)] = plain.punch_many(lab, [(x, y)])
    assert rx["direct"] and ry["direct"]
    assert rx["via"].startswith(y.ip + ":") and ry["via"].startswith(x.ip + ":")


def test_lab_stays_inside(lab):
    """No lab namespace is linked to the host: nothing routes out of the internet namespace."""
    routes = lab.run(lab.inet_ns, ["ip", "route", "show"])
    assert "default" not in routes
    unreachable = subprocess.run(
        ["ip", "netns", "exec", lab.inet_ns, "ip", "route", "get", "1.1.1.1"],
        check=False,
        capture_output=True,
    )
    assert unreachable.returncode != 0


def test_teardown_on_failure():
    from natlab_tests.conftest import _reason

    if (reason := _reason()) is not None:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="boom"), Lab() as lab:
        node = lab.add_member(nat.RESTRICTIVE)
        proc = lab.spawn(node, ["sleep", "600"])
        raise RuntimeError("boom")
    assert proc.popen.poll() is not None
    assert not any(ns.startswith(lab.id) for ns in lab_namespaces())
