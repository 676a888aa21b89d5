"""`kafila netcheck` behind each lab NAT reports the right class (CLI, as a user runs it)."""

from __future__ import annotations

import sys

import pytest

from natlab_tests import nat

pytestmark = [pytest.mark.natlab, pytest.mark.timeout(180)]

PORT = 3478


def _rendezvous(lab, port, alternate):
    argv = [sys.executable, "-m", "kafila", "rendezvous", "--listen", f"{lab.rendezvous_ip}:{port}"]
    if alternate:
        argv += ["--alternate-ip", lab.rendezvous_alt_ip]
    proc = lab.spawn(lab.inet_ns, argv)
    assert "rendezvous listening on" in proc.read_line(60)
    return proc


def _netcheck(lab, node, port):
    argv = [
        sys.executable,
        "-m",
        "kafila",
        "netcheck",
        "--rendezvous",
        f"{lab.rendezvous_ip}:{port}",
        "--json",
    ]
    return lab.spawn(node, argv)


@pytest.mark.parametrize("alternate", [True, False], ids=["two-ips", "one-ip"])
def test_netcheck_class_behind_each_nat(lab, alternate):
    port = PORT + (10 if alternate else 0)
    rendezvous = _rendezvous(lab, port, alternate)
    nodes = {kind: lab.add_member(kind) for kind in nat.ALL_KINDS}
    checks = {kind: _netcheck(lab, node, port) for kind, node in nodes.items()}
    got = {kind: proc.read_json(60) for kind, proc in checks.items()}
    assert rendezvous.popen.poll() is None, rendezvous.stderr()
    for kind, report in got.items():
        assert set(report) >= {"nat", "mapped", "rtt_ms", "filtering", "mapping"}, report
        assert report["mapped"].startswith(nodes[kind].public_ip + ":"), (kind, report)
        want = (
            {"ordinary"} if (alternate and kind == nat.ORDINARY_ADF) else nat.EXPECTED_CLASS[kind]
        )
        assert report["nat"] in want, (kind, report)
    assert got[nat.RESTRICTIVE]["mapping"] == "endpoint-dependent"
    assert got[nat.ORDINARY_APDF]["filtering"] == "port-dependent"
    if alternate:
        assert got[nat.ORDINARY_ADF]["filtering"] == "address-dependent"
        assert got[nat.PERMISSIVE]["filtering"] == "endpoint-independent"
