"""`kafila bench local`: the local benchmark (bench/local.py) from the installed command."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks that print ratios measured side by side")
    p.add_argument("which", choices=("local",), help="local: Kafila chains vs openvino_genai in one process")
    p.add_argument("options", nargs="*", help="passed to the benchmark (e.g. -- --stages 1,3 --no-memory)")
    p.set_defaults(handler=bench)


def bench(args) -> int:
    from bench import local

    return local.main(args.options)
