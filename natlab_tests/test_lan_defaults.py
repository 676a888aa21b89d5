"""The README's LAN flow on a real (veth) LAN: three machines on one home network, `kafila host`
with every default on one (embedded rendezvous on 0.0.0.0:7473), the other two running exactly the
join command it printed (its LAN address), the session answering a question typed at a member.
Before the rendezvous answered from the address it was asked on, the host's own member dropped
every relay acknowledgement and the host died with "TimeoutError" while forming the ring."""

from __future__ import annotations

import json
import sys
import time

import pytest

from natlab_tests import nat
from natlab_tests.lab import Lab, Node
from tests.readme_flow import API_LINE, JOIN_COMMAND, QUESTION, SERVING_TIMEOUT_S, Output

pytestmark = [pytest.mark.natlab, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

PY = sys.executable
# openvino's telemetry child cannot reach the internet from the lab (see test_end_to_end.py)
OFFLINE_ENV = {"CI": "true"}


def _ask(lab: Lab, node: Node) -> dict:
    """The README's curl, from inside the member's own namespace, to its default API address."""
    script = (
        "import json, urllib.request\n"
        "api = 'http://127.0.0.1:8740'\n"
        "model = json.load(urllib.request.urlopen(api + '/v1/models', timeout=30))['data'][0]['id']\n"
        f"body = {{'model': model, 'max_tokens': 8, 'temperature': 0, 'messages': [{{'role': 'user', 'content': {QUESTION!r}}}]}}\n"
        "req = urllib.request.Request(api + '/v1/chat/completions', data=json.dumps(body).encode(),"
        " headers={'Content-Type': 'application/json'})\n"
        "print(urllib.request.urlopen(req, timeout=300).read().decode())\n"
    )
    return json.loads(lab.run(node, [PY, "-c", script]))


def test_default_host_and_printed_join_command_on_a_lan(lab, tmp_path):
    desk = lab.add_member(nat.PERMISSIVE, name="desk")  # the LAN 10.n.0.0/24 behind a home router
    laptop = lab.add_member(nat.PERMISSIVE, router=desk.router, name="laptop")
    pi = lab.add_member(nat.PERMISSIVE, router=desk.router, name="pi")
    # The namespaces share one file system and host name: separate HOMEs (weight caches), --name.
    env = lambda who: {**OFFLINE_ENV, "HOME": str(tmp_path / who)}  # noqa: E731
    host = lab.spawn(desk, [PY, "-m", "kafila", "host", "--expect", "3", "--name", "desk"], env=env("desk"))
    host_err = Output(snapshot=host.stderr)  # the code is on stdout, the rest on stderr
    printed = host_err.wait_for(JOIN_COMMAND, 180, "the join command the host prints")
    assert printed.group(2) == f"{desk.ip}:7473", printed.group(0)  # its LAN address, default port
    assert "STUN also on UDP 7474" in host_err.text, host_err.text  # the README's firewall note
    outs = {"desk": host_err}
    for node in (laptop, pi):
        argv = [PY, "-m", "kafila", *printed.group(0).split()[1:], "--name", node.name]
        proc = lab.spawn(node, argv, env=env(node.name))
        outs[node.name] = Output(snapshot=proc.stderr)
    for name, out in outs.items():
        out.wait_for(API_LINE, SERVING_TIMEOUT_S, f"{name} serving", list(outs.values()))
    answer = _ask(lab, pi)
    text = answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0 and text.strip(), answer
    # one LAN: every ring edge's frames take the TCP lane (the members reach each other directly)
    deadline = time.monotonic() + 15  # the host hears each member's edge every 2 s
    while True:
        status = json.loads(lab.run(desk, [PY, "-c", "import urllib.request; print(urllib.request.urlopen("
                                           "'http://127.0.0.1:8740/status', timeout=30).read().decode())"]))  # fmt: skip
        if len(status["edges"]) == 3 or time.monotonic() > deadline:
            break
        time.sleep(1)
    lanes = {(e["from"], e["to"]): (e.get("kind"), e.get("lane"), e.get("lane_note")) for e in status["edges"]}
    print("lanes:", lanes)
    assert len(lanes) == 3 and {lane for _, lane, _ in lanes.values()} == {"tcp"}, lanes
