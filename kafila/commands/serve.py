"""`kafila serve --model M [--stages S] [--backend B] [--api HOST:PORT]`: one machine alone.

The whole model in this process (as a chain of S shards, the single-machine case of a ring)
behind the same HTTP API every session member serves. Runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from backends.errors import EXIT_OK, BadInput
from kafila.api import DEFAULT_API_HOST, DEFAULT_API_PORT, parse_hostport, start_api
from kafila.engine.local import DEFAULT_MAX_SLOTS, LocalEngine
from kafila.commands import _options


def handle(args) -> int:
    host, port = parse_hostport(args.api)
    if args.stages < 1:
        raise BadInput("--stages must be at least 1")
    if args.slots < 1:
        raise BadInput("--slots must be at least 1")
    if args.context is not None and args.context < 2:
        raise BadInput("--context must be at least 2 tokens")
    print(
        f"kafila serve: loading {args.model} ({args.stages} stage(s), {args.backend})…",
        file=sys.stderr,
        flush=True,
    )
    engine = LocalEngine.open(
        args.model,
        stages=args.stages,
        backend=args.backend,
        context=args.context,
        max_slots=args.slots,
        prompt_cache=args.prompt_cache == "on",
        kquant=args.kquant,
    )
    try:
        return asyncio.run(serve(engine, host, port))
    finally:
        engine.close()


async def serve(engine: LocalEngine, host: str, port: int) -> int:
    server = await start_api(engine, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"serving {engine.model_name} at {server.url}/v1 (OpenAI-compatible); "
          f"chat with: kafila chat --api {server.host}:{server.port}; Ctrl-C stops", flush=True)  # fmt: skip
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.close()
        await engine.aclose()
    print("kafila serve: stopped", file=sys.stderr)
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model from this machine alone over the HTTP API",
        description="One process, the whole model, the same OpenAI-compatible API as a session member.",
    )
    _options.add_model(p)
    p.add_argument(
        "--stages",
        type=int,
        default=1,
        metavar="S",
        help="shards chained in this process (default 1)",
    )
    _options.add_backend(p, metavar="B")
    _options.add_context(p, "the model's own context")
    p.add_argument(
        "--slots",
        type=int,
        default=DEFAULT_MAX_SLOTS,
        metavar="N",
        help=f"requests generating at once (default {DEFAULT_MAX_SLOTS})",
    )
    _options.add_prompt_cache(p, bound="; at most --slots are kept")
    p.add_argument(
        "--api",
        default=f"{DEFAULT_API_HOST}:{DEFAULT_API_PORT}",
        metavar="HOST:PORT",
        help=f"where to serve (default {DEFAULT_API_HOST}:{DEFAULT_API_PORT}; port 0: any free port)",
    )
    _options.add_kquant(p)
    p.set_defaults(handler=handle)
