"""`kafila plan dipsd`: the DiP-SD optimiser offline, against the paper's baselines.

    kafila plan dipsd --users USERS.json [--json] [--time-limit SECONDS]

USERS.json: the target's verification fit and one entry per user (format in planner/dipsd.py,
`parse_dipsd`; example fleets/dipsd-users.json). Prints a table of every method on the same
inputs (batches, draft lengths, expected tokens per round, span, tokens/s, solve time); `--json`
prints {"users", "target", "max_draft", "methods": {name: schedule or null}}. Exit 0, or 2 on bad
input. A MILP past its time limit is not an error: the row says it fell back to the greedy rule.
Not a top-level command: `kafila.commands.plan` registers it as a subcommand of `plan`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from backends.errors import EXIT_OK, BadInput

LABELS = {
    "dipsd": "DiP-SD (MILP + Dinkelbach)",
    "greedy": "greedy rule",
    "no-batching": "DiP-SD w/o batching (N=M)",
    "single-batch": "one batch of all users (N=1)",
    "fixed-l7": "DiP-SD w/ fixed l=7",
    "ad": "AD, no batching",
    "ad-greedy-batching": "AD w/ greedy batching",
}
FORMAT_HINT = "see fleets/dipsd-users.json for the format"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "dipsd",
        help="the DiP-SD optimiser offline (batches, draft lengths) against its baselines",
        description="Plan distributed pipelined speculative decoding (DiP-SD): the number of "
        "verification batches, each user's batch and draft length.",
    )
    parser.add_argument("--users", required=True, type=Path, help="users and target fit (JSON)")
    parser.add_argument("--json", action="store_true", help="print every method as JSON")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="MILP time per method, all MILPs together (default 30); past it: the greedy rule",
    )
    parser.set_defaults(handler=run)


def load_users(path: Path) -> Any:
    """Read and validate a users file; every problem becomes one BadInput line."""
    from planner import PlanInputError
    from planner.dipsd import parse_dipsd

    from kafila.commands.plan import read_json

    data = read_json(path, "users file", FORMAT_HINT)
    try:
        return parse_dipsd(data)
    except PlanInputError as exc:
        raise BadInput(f"users file {path}: {exc}; {FORMAT_HINT}") from None


def run(args: argparse.Namespace) -> int:
    from planner import PlanInputError
    from planner.dipsd import SolveLimits, compare_dipsd

    if args.fleet is not None or args.model is not None or args.compare:
        raise BadInput(
            "plan dipsd takes --users, not the fleet options (--fleet, --model, --compare)"
        )
    try:
        limits = SolveLimits(milp_s=min(5.0, args.time_limit), total_s=args.time_limit)
    except PlanInputError as exc:
        raise BadInput(f"--time-limit: {exc}") from None
    problem = load_users(args.users)
    results = compare_dipsd(problem, limits, time.perf_counter)
    if args.json:
        print(json.dumps(to_json(problem, results), indent=1))
    else:
        _print_table(problem, results)
    return EXIT_OK


def to_json(problem: Any, results: dict[str, Any]) -> dict[str, Any]:
    target = problem.target
    return {
        "users": [u.id for u in problem.users],
        "target": {
            "c_ms": target.c_ms,
            "beta_ms": target.beta_ms,
            "max_batch_users": target.max_batch_users,
            "padded": target.padded,
        },
        "max_draft": problem.max_draft,
        "methods": {name: None if s is None else s.to_json() for name, s in results.items()},
    }


def _print_table(problem: Any, results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    target = problem.target
    table = Table(
        title=f"DiP-SD on {len(problem.users)} users; target {target.c_ms:g} ms + "
        f"{target.beta_ms:g} ms/position, l ≤ {problem.max_draft}"
        + (f", ≤ {target.max_batch_users} per batch" if target.max_batch_users else "")
        + (", padded" if target.padded else "")
    )
    table.add_column("method")
    table.add_column("N", justify="right")
    table.add_column("batches (draft lengths)")
    table.add_column("tokens/round", justify="right")
    table.add_column("span ms", justify="right")
    table.add_column("tok/s", justify="right")
    table.add_column("vs DiP-SD", justify="right")
    table.add_column("solve s", justify="right")
    table.add_column("how")
    best = results["dipsd"].tokens_per_s
    for name, schedule in results.items():
        if schedule is None:
            table.add_row(
                LABELS[name], "—", "infeasible: more users than max_batch_users", *["—"] * 5, ""
            )
            continue
        lengths = dict(schedule.draft_lengths)
        batches = " | ".join(
            " ".join(f"{uid}({lengths[uid]})" for uid in batch) for batch in schedule.batches
        )
        how = schedule.method + (f" ({schedule.milps} MILPs)" if schedule.milps else "")
        if schedule.fallback:
            how += f": {schedule.fallback}"
        table.add_row(
            LABELS[name],
            str(schedule.n_batches),
            batches,
            f"{schedule.tokens_per_round:.2f}",
            f"{schedule.span_ms:.1f}",
            f"{schedule.tokens_per_s:.2f}",
            f"{schedule.tokens_per_s / best:.2f}×",
            "—" if schedule.solve_s is None else f"{schedule.solve_s:.3f}",
            how,
        )
    console = Console(width=None if sys.stdout.isatty() else 240)  # a file or pipe: no wrap
    console.print(table)
    chosen = results["dipsd"]
    state = "optimal" if chosen.optimal else f"not proven optimal ({chosen.fallback})"
    console.print(
        f"DiP-SD: {chosen.n_batches} batch(es), {chosen.tokens_per_s:.2f} tok/s expected, "
        f"{state}; solved in {chosen.solve_s:.3f} s"
    )
