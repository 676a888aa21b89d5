"""`kafila` entry point: dispatch to a subcommand and turn errors into exit codes."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import sys
import traceback

from backends.errors import EXIT_UNEXPECTED, KafilaError
from kafila.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kafila",
        description="Pool a trusted group's machines to serve one large language model.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:  # a command whose module fails to import is a bug: let it show
        importlib.import_module(f"kafila.commands.{name}").register(subparsers)
    for sub in subparsers.choices.values():  # `kafila run --prompt hi` must not read as --prompt-ids
        sub.allow_abbrev = False
    return parser




# Commands that never touch a model runtime; the others load OpenVINO up front (see below).
LIGHT_COMMANDS = frozenset({"plan", "rendezvous", "netcheck", "models", "chat", "inspect", "tokenize"})


def import_openvino_without_telemetry() -> None:
    """Import OpenVINO with its usage telemetry declined, for this process only.

    `import openvino` starts a telemetry sender that forks a process per event and SIGTERMs it
    after 3 s when there is no internet (common on members). That child shares asyncio's signal
    wakeup fd, so its SIGTERM reached our event loop and stopped `kafila host`/`join`. The sender
    decides consent once, at import, and declines in CI (CI=true); the variable is restored at
    once, so nothing else and no child process sees it. Reporting a private group's usage is not
    ours to do anyway.
    """
    previous = os.environ.get("CI")
    os.environ["CI"] = "true"
    try:
        importlib.import_module("openvino")
    except ImportError:
        pass  # the backend reports itself unavailable when it is asked for
    finally:
        if previous is None:
            del os.environ["CI"]
        else:
            os.environ["CI"] = previous


def _enable_faulthandler() -> None:
    """A crash in native code (OpenVINO, MLX) prints where each thread was, not nothing. Only
    where stderr is a real file (not when main() runs under a harness that captures it)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return
    faulthandler.enable()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse itself exits 2 with one line on bad arguments
    _enable_faulthandler()
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command not in LIGHT_COMMANDS:
        import_openvino_without_telemetry()
    try:
        return int(args.handler(args) or 0)
    except KafilaError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"kafila {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"kafila {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # an unexpected failure: the reason, the traceback only on request
        if args.debug:
            traceback.print_exc()
        print(
            f"kafila {args.command}: unexpected failure: {type(exc).__name__}: {exc} "
            "(rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
