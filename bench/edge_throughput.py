"""One Kafila edge between two processes on loopback: MB/s (direct and relay-only) and the
round-trip time of a small frame.

    .venv/bin/python -m bench.edge_throughput [--mb 20] [--echo 300] [--size 2300] [--json]

The parent runs the rendezvous (and so the relay); a "host" and a "joiner" child process each
run one Member. The joiner opens an edge to the host and, on one stream each:
  * throughput: writes N MB (read by the host in 1 MiB readexactly calls), the host answers one
    byte when it has them all; MB/s = N / (first write .. answer);
  * rtt: writes a `--size` byte frame, the host echoes it, `--echo` times in turn (median and p90
    of write .. echo fully read: one hop there and back, i.e. ~2 activation hops).
Run once with the direct path (waits for the punch on loopback) and once with allow_direct=False
(every datagram through the rendezvous relay, in a third process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import sys
import time

LOOP = "127.0.0.1"
HDR = struct.Struct("!cQI")  # kind, count/bytes, size


async def _host(rv_port: int, relay_only: bool) -> None:
    from kafila.net import Member, MemberJoined

    host = await Member.host((LOOP, rv_port), "host", {}, bind_host=LOOP)
    host.allow_direct = not relay_only
    print(f"CODE {host.code}", flush=True)
    while not isinstance(await host.recv(), MemberJoined):
        pass
    edge = await host.accept()
    try:
        while True:
            reader, writer = await edge.accept_stream()
            kind, n, size = HDR.unpack(await reader.readexactly(HDR.size))
            if kind == b"T":
                left = n
                while left:
                    left -= len(await reader.readexactly(min(left, 1 << 20)))
                writer.write(b"k")
            elif kind == b"E":
                for _ in range(n):
                    writer.write(await reader.readexactly(size))
            elif kind == b"Q":
                writer.write(b"q")
                break
        await asyncio.sleep(0.2)
    except ConnectionError:
        pass
    finally:
        await host.close()


async def _joiner(rv_port: int, code: str, relay_only: bool, mb: float, echo: int,
                  size: int) -> None:  # fmt: skip
    from kafila.net import Member

    member = await Member.join(code, (LOOP, rv_port), "joiner", {}, bind_host=LOOP)
    member.allow_direct = not relay_only
    edge = await member.connect("host")
    deadline = time.monotonic() + 5.0
    while not relay_only and edge.kind != "direct" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    result: dict = {"kind": edge.kind}

    n = int(mb * 1_000_000)
    payload = os.urandom(1 << 20)
    reader, writer = await edge.open_stream()
    t0 = time.perf_counter()
    writer.write(HDR.pack(b"T", n, 0))
    left = n
    while left:
        chunk = payload[: min(left, len(payload))]
        writer.write(chunk)
        await writer.drain()
        left -= len(chunk)
    await reader.readexactly(1)
    seconds = time.perf_counter() - t0
    result["mb_per_s"] = round(n / seconds / 1e6, 2)
    result["seconds"] = round(seconds, 3)

    reader, writer = await edge.open_stream()
    writer.write(HDR.pack(b"E", echo, size))
    frame = os.urandom(size)
    rtts = []
    for _ in range(echo):
        t = time.perf_counter()
        writer.write(frame)
        got = await reader.readexactly(size)
        rtts.append((time.perf_counter() - t) * 1000.0)
        assert got == frame
    rtts.sort()
    result["rtt_ms_median"] = round(statistics.median(rtts), 3)
    result["rtt_ms_p90"] = round(rtts[int(len(rtts) * 0.9)], 3)
    result["stats"] = {k: edge.stats()[k] for k in ("kind", "bytes_sent", "bytes_received")}
    reader, writer = await edge.open_stream()
    writer.write(HDR.pack(b"Q", 0, 0))
    await reader.readexactly(1)
    print("RESULT " + json.dumps(result), flush=True)
    await member.close()


async def _run_once(args, relay_only: bool) -> dict:
    from rendezvous.service import Rendezvous

    rv = await Rendezvous.start(LOOP, 0)
    port = rv.address[1]
    flags = ["--relay-only"] if relay_only else []
    me = [sys.executable, "-m", "bench.edge_throughput"]
    host = await asyncio.create_subprocess_exec(
        *me, "--role", "host", "--rv", str(port), *flags, stdout=asyncio.subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(host.stdout.readline(), 30)).decode()
        code = line.split()[1]
        joiner = await asyncio.create_subprocess_exec(
            *me, "--role", "joiner", "--rv", str(port), "--code", code, "--mb", str(args.mb),
            "--echo", str(args.echo), "--size", str(args.size), *flags,
            stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(joiner.communicate(), 120)
        lines = [x for x in out.decode().splitlines() if x.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"joiner failed (rc {joiner.returncode})")
        await asyncio.wait_for(host.wait(), 10)
        return json.loads(lines[0][7:])
    finally:
        if host.returncode is None:
            host.kill()
        await rv.close()


async def _main(args) -> None:
    results = {"direct": await _run_once(args, False), "relay": await _run_once(args, True)}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"edge between two processes on loopback ({args.mb:g} MB one way; "
          f"{args.echo} x {args.size} B echo)")
    for name, r in results.items():
        print(f"  {name:6s} (kind={r['kind']:6s}): {r['mb_per_s']:7.2f} MB/s   "
              f"rtt median {r['rtt_ms_median']:.3f} ms  p90 {r['rtt_ms_p90']:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["host", "joiner"])
    p.add_argument("--rv", type=int)
    p.add_argument("--code")
    p.add_argument("--relay-only", action="store_true")
    p.add_argument("--mb", type=float, default=20.0)
    p.add_argument("--echo", type=int, default=300)
    p.add_argument("--size", type=int, default=2300)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    prof_dir = os.environ.get("KAFILA_BENCH_PROFILE")  # a folder: cProfile each child there
    if args.role and prof_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            _child(args)
        finally:
            profiler.disable()
            kind = "relay" if args.relay_only else "direct"
            profiler.dump_stats(os.path.join(prof_dir, f"{args.role}-{kind}.prof"))
        return
    if args.role:
        _child(args)
    else:
        asyncio.run(_main(args))


def _child(args) -> None:
    if args.role == "host":
        asyncio.run(_host(args.rv, args.relay_only))
    elif args.role == "joiner":
        asyncio.run(_joiner(args.rv, args.code, args.relay_only, args.mb, args.echo, args.size))


if __name__ == "__main__":
    main()
