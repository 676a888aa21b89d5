"""`kafila plan`: divide a model's blocks among a fleet's devices (planner issue, §V).

    kafila plan --fleet FLEET.json [--model NAME] [--policy kafila|uniform|memory]
                [--json] [--compare]
    kafila plan dipsd --users USERS.json [--json]      (DiP-SD offline: plan_dipsd.py)

Exit 0 when the plan is feasible, 3 when it is refused (the plan is still printed, with the
devices that cannot hold their share), 2 on bad input.
`--json` prints the plan contract; with `--compare` it prints {policy: plan} for all three.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from backends.errors import EXIT_OK, EXIT_REFUSED, BadInput

POLICIES = ("kafila", "uniform", "memory")
POLICY_LABELS = {"kafila": "Kafila", "uniform": "Uniform (GPipe)", "memory": "Mem-prop. (exo)"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="divide a model's blocks among measured devices",
        description="Plan a session: ring order, head, block division and admission.",
    )
    # --fleet is required unless the `dipsd` subcommand is given (checked in run, with
    # argparse's own message, so `kafila plan` without it fails exactly as it always has).
    parser.add_argument("--fleet", type=Path, help="fleet description (JSON)")
    parser.add_argument("--model", help='the fleet\'s "models" entry to plan')
    parser.add_argument("--policy", choices=POLICIES, default="kafila", help="division policy")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--compare", action="store_true", help="compare the planner against both baselines"
    )
    parser.set_defaults(handler=run, plan_parser=parser)
    from kafila.commands import plan_dipsd

    plan_dipsd.register(parser.add_subparsers(dest="plan_command", metavar="{dipsd}"))


def read_json(path: Path, what: str, hint: str = "") -> Any:
    """The JSON in a file the person named; a missing, non-UTF-8 or invalid file is one BadInput
    line naming `what` (e.g. "fleet file"), with `hint` (what the file should hold) appended."""
    tail = f"; {hint}" if hint else ""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read {what} {path}: {exc.strerror or exc}{tail}") from None
    except UnicodeDecodeError:
        raise BadInput(f"{what} {path} is not UTF-8 text{tail}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{what} {path} is not valid JSON: {exc.msg} at line {exc.lineno} "
                       f"column {exc.colno}{tail}") from None  # fmt: skip


def load_fleet(path: Path, model: str | None) -> Any:
    """Read and validate a fleet file; every problem becomes one BadInput line."""
    from planner import PlanInputError, parse_fleet

    data = read_json(path, "fleet file")
    try:
        return parse_fleet(data, model)
    except PlanInputError as exc:
        raise BadInput(f"fleet file {path}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from planner import Policy, compare, make_plan

    if args.fleet is None:
        args.plan_parser.error("the following arguments are required: --fleet")  # exits 2
    fleet = load_fleet(args.fleet, args.model)
    if args.compare:
        plans = compare(fleet)
        if args.json:
            print(json.dumps({p.value: plan.to_json() for p, plan in plans.items()}, indent=1))
        else:
            _print_compare(fleet, plans)
        chosen = plans[Policy(args.policy)]
    else:
        chosen = make_plan(fleet, args.policy)
        if args.json:
            print(json.dumps(chosen.to_json(), indent=1))
        else:
            _print_plan(fleet, chosen)
    if not chosen.feasible:
        print(f"kafila plan: refused: {_refusal_line(chosen)}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK


def _refusal_line(plan: Any) -> str:
    parts = [
        f"{r.device} is short by {r.short_bytes} bytes ({r.short_bytes / 1e9:.2f} GB)"
        for r in plan.refused
    ]
    return "; ".join(parts) + " at the declared context and concurrency"


def _console() -> Any:
    """A rich console; wide when writing to a file or pipe so tables do not wrap."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _print_plan(fleet: Any, plan: Any) -> None:
    from rich.table import Table

    console = _console()
    title = (
        f"{fleet.model.name}: {plan.policy.value} plan, {plan.tier.value} tier, "
        f"{'feasible' if plan.feasible else 'REFUSED'}"
    )
    table = Table(title=title)
    for column in ("member", "role", "blocks", "range", "stage ms", "next edge", "edge ms"):
        table.add_column(column, justify="left" if column in ("member", "role") else "right")
    ranges = plan.block_ranges()
    stages = plan.stage_ms or (None,) * len(plan.ring)
    edges = list(plan.edges) or [None] * len(plan.ring)
    short = {r.device: r.short_bytes for r in plan.refused}
    for name, n, stage, edge in zip(plan.ring, plan.blocks, stages, edges, strict=True):
        role = "head" if name == plan.head else ""
        if name in short:
            role = (role + " " if role else "") + f"short {short[name] / 1e9:.2f} GB"
        start, end = ranges[name]
        table.add_row(
            name,
            role,
            str(n),
            f"{start}–{end - 1}",
            _fmt(stage, ".2f"),
            f"{edge.kind.value} → {edge.dst}" if edge else "",
            _fmt(edge.ms if edge else None, ".1f"),
        )
    console.print(table)
    console.print(model_bytes_line(fleet.model))
    console.print(
        f"bottleneck {_fmt(plan.bottleneck_ms, '.2f')} ms, "
        f"utilisation {_fmt(_pct(plan.utilisation), '.0f')}%, "
        f"predicted {_fmt(plan.predicted_tok_s, '.1f')} tok/s"
    )


def model_bytes_line(model: Any) -> str:
    """What a block holds (memory, admission) beside what a token reads of it (time): the same
    for a dense model; an MoE block holds every expert and a token reads k of them."""
    held, read = model.block_bytes / 1e6, model.block_read_bytes / 1e6
    line = f"{model.name}: a block holds {held:,.1f} MB"
    if model.expert_count:
        line += (f" (every one of {model.expert_count} experts), a token reads {read:,.1f} MB of it "
                 f"(dense part + {model.experts_used} of {model.expert_count} experts), 4 rows "
                 f"{model.read_bytes(4) / 1e6:,.1f} MB (the union)")  # fmt: skip
    else:
        line += f", a token reads all of it"
    return line + f"; {model.blocks} blocks hold {model.blocks * held / 1e3:,.1f} GB"


def _pct(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def _print_compare(fleet: Any, plans: dict[Any, Any]) -> None:
    from rich.table import Table

    names = [d.name for d in fleet.devices]
    table = Table(
        title=f"{fleet.model.name} on {len(names)} devices ({_tier(plans)} tier); "
        f"per device: {' / '.join(names)}"
    )
    table.add_column("allocation")
    table.add_column("blocks", justify="right")
    table.add_column("stage ms", justify="right")
    table.add_column("imbal. max/min", justify="right")
    table.add_column("bneck ms", justify="right")
    table.add_column("util.", justify="right")
    table.add_column("tok/s", justify="right")
    table.add_column("head")
    table.add_column("fits")
    for policy, plan in plans.items():
        blocks = dict(zip(plan.ring, plan.blocks, strict=True))
        stages = dict(zip(plan.ring, plan.stage_ms or (None,) * len(plan.ring), strict=True))
        table.add_row(
            POLICY_LABELS[policy.value],
            " / ".join(str(blocks[n]) for n in names),
            " / ".join(_fmt(stages[n], ".1f") for n in names),
            _fmt(plan.imbalance, ".2f"),
            _fmt(plan.bottleneck_ms, ".2f"),
            _fmt(_pct(plan.utilisation), ".0f") + ("%" if plan.utilisation is not None else ""),
            _fmt(plan.predicted_tok_s, ".1f"),
            plan.head,
            "yes" if plan.feasible else "no: " + ", ".join(r.device for r in plan.refused),
        )
    console = _console()
    console.print(table)
    kafila = next(iter(plans.values())).bottleneck_ms
    ratios = []
    for policy, plan in list(plans.items())[1:]:
        if kafila and plan.bottleneck_ms:
            ratios.append(f"{plan.bottleneck_ms / kafila:.2f}× vs {POLICY_LABELS[policy.value]}")
    if ratios:
        console.print("Kafila's bottleneck is shorter by " + ", ".join(ratios))


def _tier(plans: dict[Any, Any]) -> str:
    return str(next(iter(plans.values())).tier.value)
