"""Small programs run inside lab namespaces (`ip netns exec NS python driver.py CMD ...`).

Each prints JSON objects, one a line, on stdout and reads its peer's details (when it needs them)
as one JSON line on stdin. The plain-UDP commands use only the standard library, so they prove
the lab itself without Kafila:

  stun     a STUN-like echo on two ports of the rendezvous address: answers {"mapped"} from the
           port asked to and, on request, from the other port (RFC 5780 filtering test)
  classify the member side of that test: filtering first (fresh socket), then mapping
  punch    learn the mapped address, read the peer's candidates, spray probes, answer every
           probe to its observed source, exchange a few data packets once a pong comes back
  listen   keep a mapping alive towards the echo and count packets from anyone else
  spray    send one datagram to every port of a range at a target address
  capture  sniff an interface and count frames holding any of a set of byte strings

The Kafila commands (member, netcheck) are in kafila_driver.py.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import time

PROBE_INTERVAL_S = 0.02
REPLY_WAIT_S = 0.4
MAX_DATAGRAM = 2048


def emit(**obj: object) -> None:
    print(json.dumps(obj), flush=True)


def addr_str(addr: tuple[str, int]) -> str:
    return f"{addr[0]}:{addr[1]}"


def parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def read_stdin_json() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("stdin closed before the peer's details arrived")
    return json.loads(line)


# -- the echo ---------------------------------------------------------------------------------
def cmd_stun(args: argparse.Namespace) -> None:
    socks = []
    for port in (args.port, args.port + 1):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((args.host, port))
        socks.append(s)
    emit(ready=True, ports=[args.port, args.port + 1])
    while True:
        readable, _, _ = select.select([*socks, sys.stdin], [], [])
        if sys.stdin in readable and not sys.stdin.readline():
            return  # the orchestrator is gone
        for i, s in enumerate(socks):
            if s not in readable:
                continue
            data, addr = s.recvfrom(MAX_DATAGRAM)
            try:
                req = json.loads(data)
            except ValueError:
                continue
            out = socks[1 - i] if req.get("from") == "other" else s
            reply = {"tid": req.get("tid"), "mapped": addr_str(addr), "via": out.getsockname()[1]}
            out.sendto(json.dumps(reply).encode(), addr)


def _ask(
    sock: socket.socket, server: tuple[str, int], tid: str, other: bool = False
) -> dict | None:
    req = json.dumps({"tid": tid, "from": "other" if other else "same"}).encode()
    for _ in range(3):
        sock.sendto(req, server)
        deadline = time.monotonic() + REPLY_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([sock], [], [], left)[0]:
                break
            data, _ = sock.recvfrom(MAX_DATAGRAM)
            try:
                reply = json.loads(data)
            except ValueError:
                continue
            if reply.get("tid") == tid:
                return reply
    return None


def cmd_classify(args: argparse.Namespace) -> None:
    host, port = parse_addr(args.server)
    # Filtering first, from a fresh socket: no earlier flow to the other port may exist.
    fresh = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fresh.bind(("0.0.0.0", 0))
    answered = _ask(fresh, (host, port), "filter", other=True) is not None
    fresh.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    one = _ask(sock, (host, port), "m1")
    two = _ask(sock, (host, port + 1), "m2")
    if one is None or two is None:
        emit(error="no answer from the echo")
        return
    independent = one["mapped"] == two["mapped"]
    if not independent:
        nat_class = "restrictive"
    elif answered:
        nat_class = "permissive"
    else:
        nat_class = "ordinary"
    emit(
        local=addr_str(sock.getsockname()),
        mapped=one["mapped"],
        mapped2=two["mapped"],
        mapping="endpoint-independent" if independent else "endpoint-dependent",
        filtering="address-dependent-or-open" if answered else "port-dependent",
        nat=nat_class,
    )


# -- the punch --------------------------------------------------------------------------------
def local_ip_towards(host: str) -> str:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((host, 9))
    ip = probe.getsockname()[0]
    probe.close()
    return ip


def cmd_punch(args: argparse.Namespace) -> None:
    server = parse_addr(args.server)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    me = f"{os.getpid()}"
    reply = _ask(sock, server, "map")
    if reply is None:
        emit(error="no answer from the echo")
        return
    local = f"{local_ip_towards(server[0])}:{sock.getsockname()[1]}"
    emit(local=local, mapped=reply["mapped"])
    peer = read_stdin_json()
    targets = {parse_addr(c) for c in peer["candidates"]}
    start = time.monotonic()
    deadline = start + args.timeout
    via = None
    observed_by_peer = None
    probes_from: set[str] = set()
    data_got = 0
    data_sent_at = None
    next_probe = start
    while True:
        now = time.monotonic()
        if via is None and now >= deadline:
            break
        if via is not None and data_sent_at is not None and now - data_sent_at > args.linger:
            break
        if via is None and now >= next_probe:
            for t in targets:
                sock.sendto(json.dumps({"t": "probe", "id": me}).encode(), t)
            next_probe = now + PROBE_INTERVAL_S
        wait = max(0.0, min(next_probe, deadline) - now) if via is None else 0.05
        if not select.select([sock], [], [], wait)[0]:
            continue
        data, addr = sock.recvfrom(MAX_DATAGRAM)
        try:
            msg = json.loads(data)
        except ValueError:
            continue
        if msg.get("t") == "probe" and msg.get("id") != me:
            probes_from.add(addr_str(addr))
            targets.add(addr)  # adopt the observed source: it is the one that works
            pong = {"t": "pong", "id": me, "observed": addr_str(addr)}
            sock.sendto(json.dumps(pong).encode(), addr)
        elif msg.get("t") == "pong" and msg.get("id") != me and via is None:
            via = addr
            observed_by_peer = msg["observed"]
            elapsed = time.monotonic() - start
            for seq in range(args.data):
                sock.sendto(json.dumps({"t": "data", "seq": seq}).encode(), via)
            data_sent_at = time.monotonic()
        elif msg.get("t") == "data":
            data_got += 1
    emit(
        direct=via is not None,
        via=addr_str(via) if via else None,
        observed_by_peer=observed_by_peer,
        time_s=round(elapsed, 3) if via else None,
        probes_from=sorted(probes_from),
        data_received=data_got,
    )


# -- unsolicited traffic ----------------------------------------------------------------------
def cmd_listen(args: argparse.Namespace) -> None:
    server = parse_addr(args.server)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    reply = _ask(sock, server, "map")
    if reply is None:
        emit(error="no answer from the echo")
        return
    emit(local=addr_str(sock.getsockname()), mapped=reply["mapped"])
    end = time.monotonic() + args.seconds
    keepalive = 0.0
    others: dict[str, int] = {}
    while (left := end - time.monotonic()) > 0:
        if time.monotonic() >= keepalive:
            sock.sendto(json.dumps({"tid": "keep"}).encode(), server)
            keepalive = time.monotonic() + 0.5
        if select.select([sock], [], [], min(left, 0.1))[0]:
            _, addr = sock.recvfrom(MAX_DATAGRAM)
            if addr != server:
                others[addr_str(addr)] = others.get(addr_str(addr), 0) + 1
    emit(unsolicited=sum(others.values()), sources=others)


def cmd_spray(args: argparse.Namespace) -> None:
    lo, _, hi = args.ports.partition("-")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", args.source_port))
    sent = 0
    for _ in range(args.rounds):
        for port in range(int(lo), int(hi or lo) + 1):
            try:
                sock.sendto(b'{"t":"probe","id":"intruder"}', (args.target, port))
                sent += 1
            except OSError:
                pass  # ICMP unreachable reported on a later send
    emit(sent=sent)


def cmd_capture(args: argparse.Namespace) -> None:
    """Sniff every frame on an interface (AF_PACKET) until stdin closes or --seconds pass; report
    frames, bytes, and how many contain any of the hex needles given on stdin."""
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniff.bind((args.interface, 0))
    sniff.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)
    emit(ready=True)
    needles = [bytes.fromhex(h) for h in read_stdin_json()["needles"]]
    frames = total = hits = udp_frames = udp_hits = 0
    end = time.monotonic() + args.seconds
    while (left := end - time.monotonic()) > 0:
        readable, _, _ = select.select([sniff, sys.stdin], [], [], left)
        if sys.stdin in readable and not sys.stdin.readline():
            break
        if sniff in readable:
            frame = sniff.recv(65535)
            frames += 1
            total += len(frame)
            udp = len(frame) > 23 and frame[12:14] == b"\x08\x00" and frame[23] == 17
            udp_frames += udp
            if any(n in frame for n in needles):
                hits += 1
                udp_hits += udp  # (an ICMP error quoting a datagram is a hit, not a UDP one)
    emit(frames=frames, bytes=total, udp_frames=udp_frames, needle_hits=hits, udp_hits=udp_hits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("stun")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p = sub.add_parser("classify")
    p.add_argument("--server", required=True)
    p = sub.add_parser("punch")
    p.add_argument("--server", required=True)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--linger", type=float, default=1.0)
    p.add_argument("--data", type=int, default=20)
    p = sub.add_parser("listen")
    p.add_argument("--server", required=True)
    p.add_argument("--seconds", type=float, default=3.0)
    p = sub.add_parser("spray")
    p.add_argument("--target", required=True)
    p.add_argument("--ports", required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--source-port", type=int, default=0)
    p = sub.add_parser("capture")
    p.add_argument("--interface", required=True)
    p.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    {
        "capture": cmd_capture,
        "stun": cmd_stun,
        "classify": cmd_classify,
        "punch": cmd_punch,
        "listen": cmd_listen,
        "spray": cmd_spray,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
