"""`kafila rendezvous [--listen HOST:PORT] [--alternate-ip IP]`: run the rendezvous until stopped."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from backends.errors import BadInput, Refused

DEFAULT_PORT = 7473


def parse_host_port(text: str, *, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """'host:port', 'host', ':port' or '[v6]:port' -> (host, port); BadInput otherwise."""
    host, port = text, default_port
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise BadInput(f"bad address {text!r}: expected [IPv6]:PORT")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise BadInput(f"bad address {text!r}: expected [IPv6]:PORT")
            port = _port(rest[1:], text)
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = _port(port_text, text)
    return (host or "0.0.0.0"), port


def _port(text: str, whole: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise BadInput(f"bad port in {whole!r}: expected 0-65535")
    return int(text)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rendezvous",
        help="run the rendezvous: session registry, signaling, STUN, ciphertext relay",
        description="Run the rendezvous service until SIGINT/SIGTERM. It listens on HOST:PORT "
        "(TCP signaling + UDP STUN/relay) and on a second UDP port for NAT classification.",
    )
    parser.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", metavar="HOST:PORT",
                        help=f"address to listen on (default 0.0.0.0:{DEFAULT_PORT}; port 0 = any)")
    parser.add_argument("--alternate-ip", default=None, metavar="IP",
                        help="a second local IP to answer STUN change-IP requests from, so "
                        "netcheck can tell address-dependent from independent filtering")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    host, port = parse_host_port(args.listen)
    return asyncio.run(_serve(host, port, args.alternate_ip))


async def _serve(host: str, port: int, alternate_ip: str | None) -> int:
    from rendezvous.service import Rendezvous

    try:
        service = await Rendezvous.start(host, port, alternate_ip=alternate_ip)
    except OSError as exc:
        raise Refused(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound_host, bound_port = service.address
    print(f"rendezvous listening on {bound_host}:{bound_port} (tcp+udp), "
          f"stun also on udp {service.stun_port2}", flush=True)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(RuntimeError, ValueError):  # the loop is closing
                loop.remove_signal_handler(sig)
        await service.close()
    print("rendezvous stopped", file=sys.stderr, flush=True)
    return 0
