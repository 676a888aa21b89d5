"""Plain-UDP scenarios on the lab (no Kafila): they prove the NAT kinds behave as specified."""

from __future__ import annotations

from collections.abc import Sequence

from natlab_tests.lab import Lab, Node, Proc

STUN_PORT = 3478


def start_echo(lab: Lab, port: int = STUN_PORT) -> Proc:
    """The STUN-like echo on `port` and `port + 1` of the rendezvous address."""
    echo = lab.driver(lab.inet_ns, "stun", "--host", lab.rendezvous_ip, "--port", str(port))
    echo.read_json(10)
    return echo


def classify(lab: Lab, node: Node, port: int = STUN_PORT) -> dict:
    return lab.driver(node, "classify", "--server", f"{lab.rendezvous_ip}:{port}").read_json(15)


def punch_many(
    lab: Lab, pairs: Sequence[tuple[Node, Node]], port: int = STUN_PORT, timeout_s: float = 3.0
) -> list[tuple[dict, dict]]:
    """For each pair, two plain sockets punch towards each other's candidates (all pairs at once)."""
    server = f"{lab.rendezvous_ip}:{port}"
    args = ("punch", "--server", server, "--timeout", str(timeout_s))
    procs = [(lab.driver(a, *args), lab.driver(b, *args)) for a, b in pairs]
    for pa, pb in procs:
        ha, hb = pa.read_json(30), pb.read_json(30)
        pa.send_json({"candidates": [hb["local"], hb["mapped"]]})
        pb.send_json({"candidates": [ha["local"], ha["mapped"]]})
    return [(pa.read_json(timeout_s + 30), pb.read_json(timeout_s + 30)) for pa, pb in procs]


def listen(lab: Lab, node: Node, seconds: float, port: int = STUN_PORT) -> Proc:
    """A socket behind `node` keeping its mapping alive; read_json() once for its mapped address,
    again for what reached it from anyone but the echo."""
    return lab.driver(
        node, "listen", "--server", f"{lab.rendezvous_ip}:{port}", "--seconds", str(seconds)
    )


def spray(
    lab: Lab, ns: str | Node, target: str, ports: str, rounds: int = 1, source_port: int = 0
) -> dict:
    proc = lab.driver(
        ns,
        "spray",
        "--target",
        target,
        "--ports",
        ports,
        "--rounds",
        str(rounds),
        "--source-port",
        str(source_port),
    )
    return proc.read_json(60)
