"""Kafila programs run inside lab namespaces: the rendezvous and a scriptable member.

rendezvous --listen HOST:PORT [--alternate-ip IP]
    start rendezvous.Rendezvous; print {"address", "stun_port2"}; run until stdin closes
member --rendezvous HOST:PORT --name NAME (--host | --join CODE)
    host or join a session, print {"ev": "ready", "code", "nat"}, then obey JSON commands on
    stdin, each {"id": N, "op": ...}, answered by one JSON line carrying the same id:
      connect {peer}          -> {"kind", "predicted", "time_to_data_s", ...}
      accept {}               -> the same for the next edge a peer opened to us
      wait_direct {peer, timeout_s} -> {"kind", "time_to_direct_s"} once direct or timed out
      send {peer, bytes, seed} -> open a stream, write `bytes` pseudo-random bytes, close it
      recv {peer}             -> accept a stream, read it to its end: {"bytes", "sha256"}
      stats {peer}            -> edge.stats()
      roster {}               -> member.roster()
      quit {}
    Commands run concurrently (send and recv on the same edge at once), so answers may come
    out of order: match them by id.
probe-raw --rendezvous HOST:PORT
    kafila.net.natcheck.NatProbe over a plain socket (the classification logic without the CLI)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import socket
import sys
import time

CHUNK_BYTES = 64 * 1024


def emit(**obj: object) -> None:
    print(json.dumps(obj, default=str), flush=True)


def parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def stdin_lines():
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        yield line


# -- rendezvous -------------------------------------------------------------------------------
async def run_rendezvous(args: argparse.Namespace) -> None:
    from rendezvous import Rendezvous

    host, port = parse_addr(args.listen)
    kwargs = {"alternate_ip": args.alternate_ip} if args.alternate_ip else {}
    service = await Rendezvous.start(host, port, **kwargs)
    emit(
        ev="ready",
        address=f"{service.address[0]}:{service.address[1]}",
        stun_port2=getattr(service, "stun_port2", None),
    )
    try:
        async for _ in stdin_lines():
            pass
    finally:
        await service.close()


# -- NAT probe without the CLI ----------------------------------------------------------------
def run_probe_raw(args: argparse.Namespace) -> None:
    from kafila.net.natcheck import NatProbe

    server = parse_addr(args.rendezvous)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    sock.setblocking(False)
    probe = NatProbe(server, time.monotonic())
    while not probe.done:
        now = time.monotonic()
        for data, addr in probe.datagrams_to_send(now):
            sock.sendto(data, addr)
        timer = probe.get_timer()
        wait = 0.05 if timer is None else max(0.0, min(timer - now, 0.05))
        import select

        if select.select([sock], [], [], wait)[0]:
            data, src = sock.recvfrom(2048)
            probe.receive(data, src, time.monotonic())
        else:
            probe.handle_timer(time.monotonic())
    emit(**probe.report().as_dict())


# -- member -----------------------------------------------------------------------------------
def payload(n_bytes: int, seed: int):
    rng = random.Random(seed)
    left = n_bytes
    while left > 0:
        size = min(CHUNK_BYTES, left)
        yield rng.randbytes(size)
        left -= size


def edge_info(edge) -> dict:
    info = {}
    for name in ("peer", "kind", "predicted", "time_to_data_s", "time_to_direct_s"):
        value = getattr(edge, name, None)
        info[name] = value if isinstance(value, (str, int, float, type(None))) else str(value)
    return info


class MemberDriver:
    def __init__(self, member) -> None:
        self.member = member
        self.edges: dict[str, object] = {}
        self.tasks: set[asyncio.Task] = set()

    def _edge(self, peer: str):
        if peer not in self.edges:
            raise KeyError(f"no edge to {peer!r} (have {sorted(self.edges)})")
        return self.edges[peer]

    async def op_connect(self, cmd: dict) -> dict:
        started = time.monotonic()
        edge = await self.member.connect(cmd["peer"])
        self.edges[cmd["peer"]] = edge
        return {**edge_info(edge), "connect_s": round(time.monotonic() - started, 4)}

    async def op_accept(self, cmd: dict) -> dict:
        edge = await self.member.accept()
        peer = getattr(edge, "peer", None)
        self.edges[str(peer)] = edge
        return edge_info(edge)

    async def op_wait_direct(self, cmd: dict) -> dict:
        edge = self._edge(cmd["peer"])
        deadline = time.monotonic() + float(cmd.get("timeout_s", 5.0))
        while edge.kind != "direct" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return edge_info(edge)

    async def op_send(self, cmd: dict) -> dict:
        edge = self._edge(cmd["peer"])
        started = time.monotonic()
        _reader, writer = await edge.open_stream()
        digest = hashlib.sha256()
        sent = 0
        for chunk in payload(int(cmd["bytes"]), int(cmd.get("seed", 0))):
            writer.write(chunk)
            digest.update(chunk)
            sent += len(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        await writer.drain()
        return {
            "bytes": sent,
            "sha256": digest.hexdigest(),
            "seconds": round(time.monotonic() - started, 3),
        }

    async def op_recv(self, cmd: dict) -> dict:
        edge = self._edge(cmd["peer"])
        started = time.monotonic()
        reader, _writer = await edge.accept_stream()
        digest = hashlib.sha256()
        got = 0
        while chunk := await reader.read(CHUNK_BYTES):
            digest.update(chunk)
            got += len(chunk)
        return {
            "bytes": got,
            "sha256": digest.hexdigest(),
            "seconds": round(time.monotonic() - started, 3),
        }

    async def op_stats(self, cmd: dict) -> dict:
        stats = self._edge(cmd["peer"]).stats()
        return {
            "stats": stats if isinstance(stats, dict) else getattr(stats, "__dict__", str(stats))
        }

    async def op_roster(self, cmd: dict) -> dict:
        roster = self.member.roster()
        if asyncio.iscoroutine(roster):
            roster = await roster
        return {"roster": roster}

    async def run_one(self, cmd: dict) -> None:
        handler = getattr(self, f"op_{cmd.get('op')}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown op {cmd.get('op')!r}")
            timeout_s = float(cmd.get("op_timeout_s", 120))
            result = await asyncio.wait_for(handler(cmd), timeout_s)
            emit(id=cmd.get("id"), ok=True, **result)
        except Exception as exc:  # noqa: BLE001 - reported to the orchestrator, which fails the test
            emit(id=cmd.get("id"), ok=False, error=f"{type(exc).__name__}: {exc}")

    async def serve(self) -> None:
        async for line in stdin_lines():
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                break
            task = asyncio.create_task(self.run_one(cmd))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def trace_unrouted_quic(member_cls) -> None:
    """Diagnosis only: log QUIC datagrams the member drops for want of an edge (stderr)."""
    from kafila.net.edge import quic_destination_cid

    original = member_cls._on_quic

    def on_quic(self, data, src):
        try:
            cid, initial = quic_destination_cid(data)
        except Exception:  # noqa: BLE001 - diagnosis only
            cid, initial = b"?", None
        edge = self._table._cids.get(cid)  # noqa: SLF001 - diagnosis only
        if edge is None:
            print(
                f"TRACE dropped QUIC from {src}: unknown cid {cid.hex()} initial={initial}",
                file=sys.stderr,
                flush=True,
            )
        original(self, data, src)

    member_cls._on_quic = on_quic


async def run_member(args: argparse.Namespace) -> None:
    try:
        from kafila.net import Member
    except ImportError:  # before kafila.net re-exports it
        from kafila.net.member import Member

    if os.environ.get("KAFILA_LAB_TRACE_DROPS"):
        trace_unrouted_quic(Member)
    rendezvous = parse_addr(args.rendezvous)
    descriptor = {"name": args.name, "lab": True}
    kwargs = {"bind_host": "0.0.0.0", "send_delay_ms": args.send_delay_ms}
    started = time.monotonic()
    if args.host:
        member = await Member.host(rendezvous, args.name, descriptor, **kwargs)
    else:
        member = await Member.join(args.join, rendezvous, args.name, descriptor, **kwargs)
    nat = member.nat
    nat = nat.as_dict() if hasattr(nat, "as_dict") else nat
    emit(
        ev="ready",
        code=getattr(member, "code", None),
        nat=nat,
        seconds=round(time.monotonic() - started, 3),
    )
    try:
        await MemberDriver(member).serve()
    finally:
        closed = member.close()
        if asyncio.iscoroutine(closed):
            await closed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("rendezvous")
    p.add_argument("--listen", required=True)
    p.add_argument("--alternate-ip")
    p = sub.add_parser("member")
    p.add_argument("--rendezvous", required=True)
    p.add_argument("--name", required=True)
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--host", action="store_true")
    role.add_argument("--join")
    p.add_argument("--send-delay-ms", type=float, default=0.0)
    p = sub.add_parser("probe-raw")
    p.add_argument("--rendezvous", required=True)
    args = parser.parse_args()
    if os.environ.get("KAFILA_LAB_DEBUG"):
        logging.basicConfig(
            level=logging.WARNING, format="%(relativeCreated)d %(name)s %(message)s"
        )
        for name in os.environ["KAFILA_LAB_DEBUG"].split(","):  # e.g. "kafila,quic"
            logging.getLogger(name).setLevel(logging.DEBUG)
    if args.cmd == "rendezvous":
        asyncio.run(run_rendezvous(args))
    elif args.cmd == "member":
        asyncio.run(run_member(args))
    else:
        run_probe_raw(args)


if __name__ == "__main__":
    main()
