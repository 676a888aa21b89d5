"""`kafila probe [--json] [--quick]`: measure this machine for the planner (see kafila.probe)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from backends.errors import EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="measure this machine's bandwidth, overhead, memory and throughput",
        description="Measure the terms the planner prices a device by, as medians with spread.",
    )
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument(
        "--quick", action="store_true", help="the under-two-seconds probe a session start runs"
    )
    parser.add_argument(
        "--backend", default="openvino", choices=("openvino", "mlx", "reference"),
        help="measure with the runtime a member will serve on (default openvino)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kafila.probe import probe_device

    result = probe_device(quick=args.quick, backend=args.backend)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        _print(result)
    for error in result.errors:
        print(f"kafila probe: not measured: {error}", file=sys.stderr)
    return EXIT_OK


def _print(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(value: float | None, spec: str) -> str:
        return "not measured" if value is None else format(value, spec)

    mode = "quick" if result.quick else "full"
    table = Table(
        title=f"probe ({mode}: {result.runs} runs, {result.threads} threads, "
        f"{result.buffer_mib} MiB buffer, LLC {result.llc_mib or '?'} MiB)"
    )
    table.add_column("measure")
    table.add_column("median", justify="right")
    table.add_column("spread (max − min)", justify="right")
    table.add_row(
        "memory bandwidth GB/s",
        fmt(result.bandwidth_gbps, ".1f"),
        fmt(result.bandwidth_spread, ".1f"),
    )
    table.add_row(
        f"dispatch overhead µs ({result.backend})",
        fmt(result.overhead_us, ".1f"),
        fmt(result.overhead_spread, ".1f"),
    )
    table.add_row("arithmetic TFLOP/s", fmt(result.tflops, ".3f"), fmt(result.tflops_spread, ".3f"))
    table.add_row("free memory GB", f"{result.memory_gb:.2f}", "")
    Console().print(table)
