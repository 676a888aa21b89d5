"""`kafila netcheck [--rendezvous HOST:PORT] [--bind HOST] [--json]`: classify this machine's NAT."""

from __future__ import annotations

import argparse
import asyncio
import json

from backends.errors import BadInput
from kafila.commands.rendezvous import DEFAULT_PORT, parse_host_port

ADVICE = {
    "permissive": "edges to any member can go direct",
    "ordinary": "edges go direct to permissive and ordinary members; others may relay",
    "restrictive": "edges to restrictive (and some ordinary) members will relay through the "
    "rendezvous; a router with UPnP/port forwarding or another network avoids that",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "netcheck",
        help="classify this machine's NAT against a rendezvous",
        description="Probe the rendezvous from one fresh UDP socket: mapping (same mapped port "
        "towards both rendezvous ports?), filtering (does an answer from the other port arrive?) "
        "and the median round trip.",
    )
    parser.add_argument("--rendezvous", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                        help=f"the rendezvous to probe (default 127.0.0.1:{DEFAULT_PORT})")
    parser.add_argument("--bind", default="0.0.0.0", metavar="HOST",
                        help="local address to probe from (default: any)")
    parser.add_argument("--json", action="store_true",
                        help='one line: {"nat", "mapped", "rtt_ms", "filtering", "mapping"}')
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kafila.net.stunclient import netcheck

    host, port = parse_host_port(args.rendezvous)
    if host in ("0.0.0.0", "::"):
        raise BadInput("--rendezvous needs a host to reach, e.g. 203.0.113.5:7473")
    report = asyncio.run(netcheck((host, port), bind_host=args.bind))
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(f"NAT: {report.nat} ({ADVICE[report.nat]})")
        print(f"  mapped address  {report.mapped}")
        print(f"  mapping         {report.mapping}")
        print(f"  filtering       {report.filtering}")
        print(f"  rtt             {report.rtt_ms:.1f} ms")
    return 0
