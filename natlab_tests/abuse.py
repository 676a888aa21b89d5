"""Hostile traffic at a rendezvous, run inside a lab namespace (robustness test).

    python abuse.py --rendezvous HOST:PORT --port2 P2 [--seconds S] [--joins N] [--avoid NAMEPLATE,...]

It runs, concurrently and for about --seconds:
  * UDP garbage at both STUN ports: malformed STUN (bad lengths, bad attributes, truncated headers),
    relay frames for edges that do not exist, BIND with random tokens, punch frames, random bytes
    of every first-byte class, and oversized datagrams (2 KB, 8 KB, 60 KB: IP-fragmented);
  * TCP signaling garbage: random bytes, a frame announcing 2 GB, undecodable msgpack, unknown
    tags, fields out of bounds, a slow-loris connection that says nothing;
  * joins to unknown nameplates, and --joins bogus join attempts: Join to a decoy session the
    abuser opens itself, followed by garbage PAKE bodies (never to a nameplate in --avoid).
Prints one JSON object: what it sent and how the rendezvous answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import struct
import time

from rendezvous import messages as m
from rendezvous.limits import MAX_NAMEPLATE

STUN_COOKIE = b"\x21\x12\xa4\x42"


def parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def udp_garbage(rng: random.Random) -> bytes:
    choice = rng.randrange(9)
    if choice == 0:  # STUN header claiming more attributes than present
        return struct.pack("!HH", 0x0001, 400) + STUN_COOKIE + os.urandom(12) + os.urandom(8)
    if choice == 1:  # truncated STUN header
        return b"\x00\x01\x00" + STUN_COOKIE[: rng.randrange(4)]
    if choice == 2:  # STUN with a nonsense attribute block (bad lengths)
        body = struct.pack("!HH", 0x0003, 0xFFF0) + os.urandom(16)
        return struct.pack("!HH", 0x0001, len(body)) + STUN_COOKIE + os.urandom(12) + body
    if choice == 3:  # CHANGE-REQUEST with a 1-byte value
        body = struct.pack("!HH", 0x0003, 1) + b"\x06\x00\x00\x00"
        return struct.pack("!HH", 0x0001, len(body)) + STUN_COOKIE + os.urandom(12) + body
    if choice == 4:  # relay DATA for an edge that does not exist
        return b"\x12" + os.urandom(8) + os.urandom(rng.randrange(1, 1200))
    if choice == 5:  # BIND with a random token, and a short one
        return b"\x10" + os.urandom(rng.choice((16, 3)))
    if choice == 6:  # punch frames
        return bytes([rng.choice((0x20, 0x21))]) + os.urandom(rng.randrange(0, 64))
    if choice == 7:  # QUIC-looking junk
        return bytes([0xC0 | rng.randrange(64)]) + os.urandom(rng.randrange(1, 1300))
    return os.urandom(rng.randrange(0, 1500))


async def udp_flood(target: tuple[str, int], port2: int, seconds: float, stats: dict) -> None:
    rng = random.Random(1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    end = time.monotonic() + seconds
    ports = (target[1], port2)
    while time.monotonic() < end:
        for _ in range(50):
            data = udp_garbage(rng)
            if rng.random() < 0.05:
                data = os.urandom(rng.choice((2000, 8000, 60000)))
                stats["oversized"] += 1
            try:
                sock.sendto(data, (target[0], rng.choice(ports)))
                stats["udp_sent"] += 1
            except OSError:
                stats["udp_errors"] += 1
        try:  # drain whatever comes back (it should be nothing)
            while True:
                sock.recvfrom(65535)
                stats["udp_answers"] += 1
        except BlockingIOError:
            pass
        await asyncio.sleep(0.005)
    sock.close()


async def tcp_once(
    target: tuple[str, int], payload: bytes, stats: dict, key: str, read_s: float = 1.0
) -> bytes:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*target), 5)
    except (TimeoutError, OSError):
        stats["tcp_connect_failed"] += 1
        return b""
    answer = b""
    try:
        writer.write(payload)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), read_s)
    except (TimeoutError, OSError):
        pass
    finally:
        writer.close()
    stats[key] += 1
    label = answer_label(answer)
    stats["answers"][label] = stats["answers"].get(label, 0) + 1
    return answer


def answer_label(answer: bytes) -> str:
    """ "closed" (no answer), an Error's code, or the name of the message that came back."""
    import msgpack

    if len(answer) < 5:
        return "closed"
    try:
        items = msgpack.unpackb(answer[4 : 4 + m.LENGTH_PREFIX.unpack(answer[:4])[0]], raw=False)
    except Exception:  # noqa: BLE001 - a truncated read: label it, do not fail
        return "unparsed"
    if isinstance(items, list) and items and items[0] == m.Error.TAG:
        return f"error:{items[1]}"
    tags = {cls.TAG: cls.__name__ for cls in (m.Opened, m.Joined, m.Deliver, m.SessionClosed)}
    return tags.get(items[0] if isinstance(items, list) and items else None, "other")


def frame(payload: bytes) -> bytes:
    return m.LENGTH_PREFIX.pack(len(payload)) + payload


async def tcp_garbage(target: tuple[str, int], seconds: float, stats: dict) -> None:
    import msgpack

    cases = [
        os.urandom(300),
        struct.pack("!I", 0x7FFFFFFF) + b"x" * 10,
        frame(b"\xc1\xc1\xc1"),
        frame(msgpack.packb([99, 1, 2])),
        frame(msgpack.packb([m.Join.TAG, -5, 1])),
        frame(msgpack.packb([m.Join.TAG, 10**9, 1])),
        frame(msgpack.packb([m.Send.TAG, 0, b"x" * 300_000])),
        frame(msgpack.packb({"a": 1})),
        frame(msgpack.packb([m.EdgeRequest.TAG, 1])),  # before Open/Join
    ]
    end = time.monotonic() + seconds
    slow = []
    for _ in range(5):  # slow-loris: connect and say nothing
        try:
            slow.append(await asyncio.open_connection(*target))
        except OSError:
            stats["tcp_connect_failed"] += 1
    while time.monotonic() < end:
        await asyncio.gather(*(tcp_once(target, c, stats, "tcp_garbage") for c in cases))
        await asyncio.sleep(0.05)
    for _, writer in slow:
        writer.close()


async def joins(target: tuple[str, int], n: int, avoid: set[int], stats: dict) -> None:
    rng = random.Random(2)
    # A decoy session of our own: the bogus members join it and send garbage "PAKE" bodies.
    decoy = None
    try:
        reader, writer = await asyncio.open_connection(*target)
        writer.write(m.encode(m.Open()))
        await writer.drain()
        head = await asyncio.wait_for(reader.readexactly(4), 5)
        body = await asyncio.wait_for(reader.readexactly(m.LENGTH_PREFIX.unpack(head)[0]), 5)
        import msgpack

        items = msgpack.unpackb(body, raw=False)  # [Opened.TAG, nameplate, rid, token, port2]
        decoy = items[1] if items and items[0] == m.Opened.TAG else None
        stats["decoy_nameplate"] = decoy
    except (TimeoutError, OSError, asyncio.IncompleteReadError, Exception) as exc:  # noqa: BLE001
        stats["decoy_error"] = f"{type(exc).__name__}: {exc}"
    semaphore = asyncio.Semaphore(40)

    async def one(i: int) -> None:
        async with semaphore:
            if decoy is not None and i % 2 == 0:
                nameplate = decoy
            else:
                nameplate = rng.randrange(1, MAX_NAMEPLATE + 1)
                while nameplate in avoid or nameplate == decoy:
                    nameplate = rng.randrange(1, MAX_NAMEPLATE + 1)
            payload = m.encode(m.Join(nameplate)) + m.encode(m.Send(0, os.urandom(64)))
            await tcp_once(target, payload, stats, "joins_sent", read_s=0.5)

    await asyncio.gather(*(one(i) for i in range(n)))
    if decoy is not None:
        writer.close()


async def targeted_joins(target: tuple[str, int], nameplate: int, n: int, stats: dict) -> None:
    """Bogus members of a real session: Join its nameplate, then a garbage PAKE message."""
    for _ in range(n):
        payload = m.encode(m.Join(nameplate)) + m.encode(m.Send(0, b"P" + os.urandom(40)))
        await tcp_once(target, payload, stats, "joins_sent", read_s=0.5)


async def main_async(args: argparse.Namespace) -> dict:
    target = parse_addr(args.rendezvous)
    stats: dict = {
        k: 0
        for k in (
            "udp_sent",
            "udp_errors",
            "udp_answers",
            "oversized",
            "tcp_garbage",
            "tcp_connect_failed",
            "joins_sent",
        )
    }
    stats["answers"] = {}
    avoid = {int(x) for x in args.avoid.split(",") if x}
    started = time.monotonic()
    if args.target:
        await targeted_joins(target, args.target, args.joins, stats)
        stats["seconds"] = round(time.monotonic() - started, 2)
        return stats
    await asyncio.gather(
        udp_flood(target, args.port2, args.seconds, stats),
        tcp_garbage(target, args.seconds, stats),
        joins(target, args.joins, avoid, stats),
    )
    stats["seconds"] = round(time.monotonic() - started, 2)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--port2", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--joins", type=int, default=1000)
    parser.add_argument("--avoid", default="")
    parser.add_argument(
        "--target",
        type=int,
        default=0,
        help="send every bogus join to this nameplate (no UDP or TCP garbage)",
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
