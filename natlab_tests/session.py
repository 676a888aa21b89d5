"""Kafila sessions in the lab: a rendezvous in the internet namespace, members behind NATs,
edges between them, bytes through them. Used by the natlab tests and bench/edges.py."""

from __future__ import annotations

import hashlib
import itertools
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from natlab_tests import nat
from natlab_tests.lab import DRIVER, Lab, LabError, Node, Proc

KAFILA_DRIVER = str(DRIVER.parent / "kafila_driver.py")
RENDEZVOUS_PORT = 3478
START_TIMEOUT_S = 60.0  # interpreter start + imports on a loaded 2-core machine
EDGE_TIMEOUT_S = 30.0
TRANSFER_CHUNK_BYTES = 64 * 1024


# What the issue asks of each ordered pair of NAT kinds (Kafila Table III with both ordinary
# variants, public as a fifth kind): "direct" or "relay".
def expected_kind(a: str, b: str) -> str:
    if {a, b} == {nat.RESTRICTIVE} or {a, b} == {nat.ORDINARY_APDF, nat.RESTRICTIVE}:
        return "relay"
    return "direct"


def predicted_by_class(a: str, b: str) -> str:
    """The class rule (Kafila §V-B): direct if one side is permissive or both are ordinary."""
    classes = {
        nat.PERMISSIVE: "p",
        nat.PUBLIC: "p",
        nat.ORDINARY_APDF: "o",
        nat.ORDINARY_ADF: "o",
        nat.RESTRICTIVE: "r",
    }
    ca, cb = classes[a], classes[b]
    return "direct" if "p" in (ca, cb) or (ca == cb == "o") else "relay"


def payload_sha256(n_bytes: int, seed: int) -> str:
    """The digest of what kafila_driver's `send` writes for (n_bytes, seed)."""
    rng = random.Random(seed)
    digest = hashlib.sha256()
    left = n_bytes
    while left > 0:
        size = min(TRANSFER_CHUNK_BYTES, left)
        digest.update(rng.randbytes(size))
        left -= size
    return digest.hexdigest()


@dataclass
class LabRendezvous:
    proc: Proc
    address: str  # "ip:port" (signaling TCP + STUN/relay UDP)
    stun_port2: int


def payload_windows(n_bytes: int, seed: int, count: int = 24, width: int = 32) -> list[bytes]:
    """`count` byte strings of `width` taken at spread offsets of what `send` writes."""
    data = b""
    rng = random.Random(seed)
    while len(data) < n_bytes:
        data += rng.randbytes(min(TRANSFER_CHUNK_BYTES, n_bytes - len(data)))
    step = max(1, (n_bytes - width) // count)
    return [data[i : i + width] for i in range(0, n_bytes - width, step)][:count]


def start_rendezvous(
    lab: Lab, port: int = RENDEZVOUS_PORT, alternate: bool = True
) -> LabRendezvous:
    """The rendezvous in the internet namespace (Python API, so the alternate IP can be given)."""
    args = ["rendezvous", "--listen", f"{lab.rendezvous_ip}:{port}"]
    if alternate:
        args += ["--alternate-ip", lab.rendezvous_alt_ip]
    proc = lab.spawn(lab.inet_ns, [sys.executable, KAFILA_DRIVER, *args])
    ready = proc.read_json(START_TIMEOUT_S)
    return LabRendezvous(proc, ready["address"], int(ready["stun_port2"] or 0))


@dataclass
class LabMember:
    name: str
    node: Node
    proc: Proc
    ready: dict  # {"code", "nat", "seconds"}


def start_session(
    lab: Lab,
    rendezvous: str,
    nodes: Sequence[Node],
    names: Sequence[str] | None = None,
    send_delay_ms: float = 0.0,
) -> list[LabMember]:
    """nodes[0] hosts; the others join with its code (started in parallel once the code is known);
    returns once every member is ready and the host's roster holds them all."""
    names = list(names or [f"m{i}" for i in range(len(nodes))])
    common = ["--rendezvous", rendezvous, "--send-delay-ms", str(send_delay_ms)]
    host = lab.spawn(
        nodes[0], [sys.executable, KAFILA_DRIVER, "member", "--name", names[0], "--host", *common]
    )
    host_ready = host.read_json(START_TIMEOUT_S)
    if host_ready.get("ev") != "ready":
        raise LabError(f"host not ready: {host_ready}")
    code = host_ready["code"]
    procs = [
        lab.spawn(
            node, [sys.executable, KAFILA_DRIVER, "member", "--name", name, "--join", code, *common]
        )
        for node, name in zip(nodes[1:], names[1:])
    ]
    members = [LabMember(names[0], nodes[0], host, host_ready)]
    for node, name, proc in zip(nodes[1:], names[1:], procs):
        ready = proc.read_json(START_TIMEOUT_S)
        if ready.get("ev") != "ready":
            raise LabError(f"{name} not ready: {ready}")
        members.append(LabMember(name, node, proc, ready))
    wait_roster(members, set(names))
    return members


def wait_roster(members: Sequence[LabMember], names: set[str], timeout_s: float = 30.0) -> None:
    """Until every member's roster shows every name."""
    deadline = time.monotonic() + timeout_s
    for m in members:
        while True:
            roster = check(m.proc.request("roster", timeout_s=timeout_s))["roster"]
            if names <= set(roster):
                break
            if time.monotonic() > deadline:
                raise LabError(f"{m.name}'s roster lacks {sorted(names - set(roster))}")
            time.sleep(0.1)


def check(answer: dict) -> dict:
    if not answer.get("ok"):
        raise LabError(f"member command failed: {answer}")
    return answer


def open_edges(
    pairs: Sequence[tuple[LabMember, LabMember]], timeout_s: float = EDGE_TIMEOUT_S
) -> list[tuple[dict, dict]]:
    """Open an edge from each pair's first member (initiator) to its second (all at once)."""
    pending = []
    for a, b in pairs:
        pending.append((a, a.proc.submit("connect", peer=b.name), b, b.proc.submit("accept")))
    out = []
    accepted: dict[tuple[str, str], dict] = {}
    failed = []
    for a, a_id, b, b_id in pending:
        got_a = a.proc.result(a_id, timeout_s)
        out.append([got_a, None])
        if not got_a.get("ok"):
            failed.append((a.name, b.name, got_a.get("error")))
            continue
        got = check(b.proc.result(b_id, timeout_s))
        accepted[(b.name, str(got.get("peer")))] = got
    if failed:
        raise LabError(f"edges failed to open (initiator, responder, error): {failed}")
    for row, (a, b) in zip(out, pairs):
        row[1] = accepted.get((b.name, a.name))
        if row[1] is None:
            raise LabError(f"{b.name} accepted no edge from {a.name}: {accepted}")
    return [tuple(row) for row in out]  # type: ignore[misc]


def wait_direct(
    pairs: Sequence[tuple[LabMember, LabMember]], timeout_s: float
) -> list[tuple[dict, dict]]:
    pending = [
        (
            a.proc.submit("wait_direct", peer=b.name, timeout_s=timeout_s),
            b.proc.submit("wait_direct", peer=a.name, timeout_s=timeout_s),
        )
        for a, b in pairs
    ]
    return [
        (check(a.proc.result(ia, timeout_s + 30)), check(b.proc.result(ib, timeout_s + 30)))
        for (a, b), (ia, ib) in zip(pairs, pending)
    ]


_seeds = itertools.count(1)


def exchange(
    pairs: Sequence[tuple[LabMember, LabMember]],
    n_bytes: int,
    timeout_s: float = 120.0,
    seeds: Sequence[int] | None = None,
) -> list[dict]:
    """n_bytes each way over each pair's edge at once; checks length and digest of every stream.
    Stream k uses seeds[k] when given (a->b then b->a for each pair), else a fresh seed."""
    jobs = []
    given = iter(seeds or ())
    for a, b in pairs:
        for src, dst in ((a, b), (b, a)):
            seed = next(given, None) or next(_seeds) + 1000
            recv_id = dst.proc.submit("recv", peer=src.name, op_timeout_s=timeout_s)
            send_id = src.proc.submit(
                "send", peer=dst.name, bytes=n_bytes, seed=seed, op_timeout_s=timeout_s
            )
            jobs.append((src, dst, seed, send_id, recv_id))
    results = []
    for src, dst, seed, send_id, recv_id in jobs:
        sent = check(src.proc.result(send_id, timeout_s + 30))
        got = check(dst.proc.result(recv_id, timeout_s + 30))
        want = payload_sha256(n_bytes, seed)
        results.append(
            {
                "from": src.name,
                "to": dst.name,
                "sent": sent["bytes"],
                "received": got["bytes"],
                "intact": got["bytes"] == n_bytes and got["sha256"] == want == sent["sha256"],
                "seconds": got["seconds"],
            }
        )
    return results


def quit_all(members: Sequence[LabMember]) -> None:
    for m in members:
        if m.proc.popen.poll() is None:
            try:
                m.proc.send_json({"op": "quit"})
            except (BrokenPipeError, OSError):
                pass
    deadline = time.monotonic() + 10
    for m in members:
        try:
            m.proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - the lab kills what does not stop
            m.proc.kill()
