"""`kafila join CODE`: join a session, fetch this member's weights, hold a stage, serve prompts."""

from __future__ import annotations

import argparse
import os
import re
import socket


def default_name() -> str:
    name = re.sub(r"[^A-Za-z0-9._@+-]", "-", socket.gethostname())[:64].strip("-.")
    return name or "member"


API_DEFAULT_PORTS = 20  # 8740..8759 when --api is not given


def add_common(p: argparse.ArgumentParser) -> None:
    from kafila.commands import _options
    from kafila.session.control.config import DEFAULT_CACHE_DIR

    p.add_argument("--rendezvous", metavar="HOST:PORT", help="the rendezvous (default for join: 127.0.0.1:7473)")
    p.add_argument("--name", default=None, help="this member's name in the session (default: the host name)")
    _options.add_backend(p)
    p.add_argument("--api", default=None, metavar="HOST:PORT",
                   help="OpenAI-compatible API address (default 127.0.0.1:8740, or the next free port "
                   "up to 8759 when another member on this machine holds it; 'off' for none)")
    p.add_argument("--bind", default="0.0.0.0", metavar="IP", help="local address of the member's UDP socket")
    _options.add_latency(p)
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help=f"where fetched weights live (default {DEFAULT_CACHE_DIR})")
    p.add_argument("--json-events", action="store_true", help="one JSON line per lifecycle event on stdout")
    p.add_argument("--weights-lane", choices=("auto", "quic"), default="auto",
                   help="auto (default): weights over TCP when the peer is reachable, else the QUIC "
                   "edge; quic: the QUIC edge only")
    p.add_argument("--ring-lane", choices=("auto", "quic"), default="auto",
                   help="auto (default): ring frames to and from this member over TCP when the peer "
                   "is reachable, else the QUIC edge; quic: the QUIC edge only")
    _options.add_draft(p)


def common_config(args: argparse.Namespace, host: bool):
    from backends.errors import BadInput
    from kafila.api import parse_hostport
    from kafila.commands.rendezvous import parse_host_port
    from kafila.session.control.config import SessionConfig

    if args.latency_ms < 0 or args.latency_ms > 10_000:
        raise BadInput("--latency-ms L: choose 0..10000")
    rendezvous = parse_host_port(args.rendezvous) if args.rendezvous else (None if host else ("127.0.0.1", 7473))
    if rendezvous is not None and rendezvous[0] in ("0.0.0.0", ""):
        rendezvous = ("127.0.0.1", rendezvous[1])
    if args.api is None:  # the default: several members on one machine each find a port
        api, api_tries = parse_hostport("127.0.0.1:8740"), API_DEFAULT_PORTS
    else:
        api, api_tries = None if args.api.lower() in ("off", "none", "") else parse_hostport(args.api), 1
    draft = None
    if args.draft:
        from backends.gguf import open_model
        from kafila.models import resolve_model

        draft = resolve_model(args.draft)
        open_model(draft)  # missing or not a GGUF: one line, exit 2, before anything starts
    return SessionConfig(name=args.name or default_name(), rendezvous=rendezvous, backend=args.backend,
                         draft_path=draft,
                         api=api, api_tries=api_tries, bind_host=args.bind, send_delay_ms=args.latency_ms,
                         cache_dir=os.path.abspath(args.cache_dir), json_events=args.json_events,
                         weights_lane=args.weights_lane, ring_lane=args.ring_lane)  # fmt: skip


def check_backend(name: str) -> None:
    import backends
    from backends.errors import BadInput

    st = backends.status(name)
    if not st.available:
        raise BadInput(st.reason)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "join", help="join a session with its code and serve a part of the model",
        description="Join the session behind CODE: measure this device, receive the plan, fetch "
        "only this member's tensors from the host (or use --model when it is the same file), "
        "build the shard, join the ring, and serve prompts on --api until SIGINT/SIGTERM.",
    )
    p.add_argument("code", metavar="CODE", nargs="?", default=None,
                   help="the session code the host printed, e.g. 7-crossover-clockwork-pandora; "
                   "'-' or none: typed at a prompt (or read from stdin), so it stays out of `ps`")
    p.add_argument("--code-file", metavar="F", default=None,
                   help="read the code from F (keep it chmod 600) instead of the command line")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local copy of the model: used instead of a transfer when its SHA-256 matches")
    add_common(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from backends.errors import BadInput
    from kafila.net.code import parse_code
    from kafila.net.codefile import read_code
    from kafila.session.control.participant import Participant

    if args.code not in (None, "-") and args.code_file:
        raise BadInput("give the code once: as CODE or with --code-file")
    if args.code in (None, "-"):
        args.code = read_code(args.code_file)
    parse_code(args.code)  # a malformed code fails before anything is measured
    check_backend(args.backend)
    cfg = replace(common_config(args, host=False), local_model=args.model)
    p = Participant(cfg)
    p.code = args.code
    return p.run()
