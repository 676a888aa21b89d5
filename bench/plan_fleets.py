"""The planner against GPipe's and exo's divisions on the paper's fleets (its Table IV), predicted.

    .venv/bin/python -m bench.plan_fleets [--fleets DIR] [--tables] [--compact]

For the three fleets in fleets and qwen3-8b/14b/32b, runs
`kafila plan --fleet F --model M --compare --json` (and, with --tables, the rich table each
prints without --json). Everything printed is *predicted* by eq. 2 from the fleet files; nothing
is measured: the devices are the paper's, and the models are shapes only (block and head bytes
in fleets/*.json; the runtime serves the qwen3 architecture, but no Qwen3 8B/14B/32B weights
were loaded or served for these figures). It prints first the median over fleet × model cells
of the planner's predicted bottleneck reduction and predicted tok/s against uniform and
memory-proportional divisions, then one markdown row per cell and policy (`--compact`: one row
per cell, Kafila's division with the baselines' bottlenecks as multiples of its own), then the
largest reduction beside the paper's own (measured) figure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLEETS = ("lan", "us-central", "intercontinental")
MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")
LABELS = {"kafila": "Kafila", "uniform": "Uniform (GPipe)", "memory": "Mem-prop. (exo)"}
BASELINES = ("uniform", "memory")
# the seed paper's own measurement (../shared/seeds/004_*), quoted, never this project's
PAPER = "Rangwala, Sinnott and Buyya, arXiv:2609.34045, measured on their fleets"
PAPER_REDUCTION = {"uniform": 5.2, "memory": 3.0}


def kafila_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafila", "plan", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def metrics(plan: dict[str, Any]) -> dict[str, float]:
    """Table IV's columns from a plan's JSON (NaN where the memory tier priced nothing)."""
    stages = [s for s in plan["stage_ms"].values() if s is not None]
    edges = sum(e["ms"] for e in plan["edges"] if e["ms"] is not None)
    if not stages:
        return dict.fromkeys(("bneck", "imbal", "util", "tok_s"), math.nan)
    bneck = max(stages)
    return {
        "bneck": bneck,
        "imbal": bneck / min(stages),
        "util": sum(stages) / len(stages) / bneck,
        "tok_s": 1000.0 / (sum(stages) + edges),
    }


def spread(values: list[float]) -> str:
    """median (min–max) of values, or – when there are none."""
    if not values:
        return "–"
    return f"{statistics.median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", type=Path, default=ROOT / "fleets")
    parser.add_argument("--tables", action="store_true", help="also print each rich table")
    parser.add_argument("--compact", action="store_true", help="one row per fleet and model")
    args = parser.parse_args()
    from bench._report import header

    print(header(), flush=True)

    rows, compact = [], []
    reduction: dict[str, list[float]] = {b: [] for b in BASELINES}  # cells where both fit
    speedup: dict[str, list[float]] = {b: [] for b in BASELINES}
    kafila_tok_s: list[float] = []
    skipped: dict[str, list[str]] = {b: [] for b in BASELINES}
    for fleet in FLEETS:
        path = str(args.fleets / f"{fleet}.json")
        for model in MODELS:
            if args.tables:
                print(f"$ kafila plan --fleet {fleet}.json --model {model} --compare")
                print(kafila_plan("--fleet", path, "--model", model, "--compare").stdout)
            done = kafila_plan("--fleet", path, "--model", model, "--compare", "--json")
            if done.returncode not in (0, 3):
                raise SystemExit(f"kafila plan failed on {fleet}/{model}: {done.stderr.strip()}")
            plans = json.loads(done.stdout)
            ours = metrics(plans["kafila"])
            if plans["kafila"]["feasible"]:
                kafila_tok_s.append(ours["tok_s"])
            theirs = {b: metrics(plans[b])["bneck"] / ours["bneck"] for b in BASELINES}
            compact.append(f"| {fleet} | {model} | {plans['kafila']['head']}: "
                           + "/".join(str(n) for n in plans["kafila"]["blocks"].values())
                           + f" | {ours['bneck']:.2f} | {ours['tok_s']:.1f} | "
                           + " | ".join(f"{theirs[b]:.2f}×{'' if plans[b]['feasible'] else ' (no fit)'}" for b in BASELINES)
                           + f" | {'yes' if plans['kafila']['feasible'] else 'no'} |")  # fmt: skip
            for policy in ("kafila", "memory", "uniform"):
                m = metrics(plans[policy])
                plan = plans[policy]
                blocks = "/".join(str(n) for n in plan["blocks"].values())
                ratio = "" if policy == "kafila" else f"{m['bneck'] / ours['bneck']:.2f}×"
                if policy in BASELINES:
                    if plan["feasible"] and plans["kafila"]["feasible"]:
                        reduction[policy].append(m["bneck"] / ours["bneck"])
                        speedup[policy].append(ours["tok_s"] / m["tok_s"])
                    else:
                        skipped[policy].append(f"{fleet}/{model}")
                rows.append(
                    f"| {fleet} | {model} | {LABELS[policy]} | {plan['head']}: {blocks} "
                    f"| {m['imbal']:.2f} | {m['bneck']:.2f} | {ratio} | {100 * m['util']:.0f}% "
                    f"| {m['tok_s']:.1f} | {'yes' if plan['feasible'] else 'no'} |"
                )
    cells = len(FLEETS) * len(MODELS)
    print(f"All figures predicted by eq. 2 (no run): {len(FLEETS)} fleets × {len(MODELS)} shapes.")
    for b in BASELINES:
        left = ""
        if skipped[b]:
            left = f"; {len(skipped[b])} left out, a plan does not fit: {', '.join(skipped[b])}"
        print(
            f"Kafila vs {LABELS[b]}, median (min–max) over {len(reduction[b])} of {cells} cells: "
            f"predicted bottleneck {spread(reduction[b])} shorter, predicted tok/s "
            f"{spread(speedup[b])} higher{left}"
        )
    print(
        f"Kafila predicted tok/s, median over {len(kafila_tok_s)} cells: "
        f"{statistics.median(kafila_tok_s):.1f} "
        f"({min(kafila_tok_s):.1f}–{max(kafila_tok_s):.1f})\n"
    )
    if args.compact:
        print("| fleet | model (shape only) | Kafila's blocks (head first, ring order) | pred. bneck ms | pred. tok/s "
              "| GPipe's bneck × Kafila's | exo's bneck × Kafila's | fits |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(compact))
    else:
        print("| fleet | model (shape only) | allocation | blocks (head first, ring order) "
              "| pred. imbal. max/min | pred. bneck ms | pred. bneck vs Kafila | pred. util. "
              "| pred. tok/s | fits |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    largest = {b: max(reduction[b], default=math.nan) for b in BASELINES}
    print(
        f"\nlargest predicted bottleneck reduction (cells where both fit): "
        f"{largest['uniform']:.2f}× against uniform, {largest['memory']:.2f}× against "
        f"memory-proportional; the paper ({PAPER}) reports up to "
        f"{PAPER_REDUCTION['uniform']}× and {PAPER_REDUCTION['memory']}×"
    )


if __name__ == "__main__":
    main()
