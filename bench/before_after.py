"""A benchmark run on an earlier commit and on this checkout, alternated in one run.

    .venv/bin/python -m bench.before_after --base REV [--rounds 3] [--metric session.tok_s] \
        -- bench.session --skip-latency --skip-hetero --runs 3 --json

For changes that must not cost speed (a refactor): `git archive REV` is unpacked into a
temporary directory, and the benchmark module given after `--` runs there and here in turn,
before, after, before, after … (the machine's load drifts; each ratio compares neighbours). Both
use this checkout's virtual environment, so only the code differs. The benchmark must print one
JSON object as its last stdout line (`--json`); `--metric` is a dotted path into it. Prints each
round, the median after ÷ before ratio and its range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.llamacpp_speed import machine

REPO = Path(__file__).resolve().parents[1]


def unpack(rev: str, into: str) -> None:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)


def measure(cwd: Path, module_args: list[str], metrics: list[str]) -> list[float]:
    run = subprocess.run([sys.executable, "-m", *module_args], cwd=cwd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(module_args)} failed in {cwd} (exit {run.returncode}):\n{run.stderr[-2000:]}")
    out = json.loads(run.stdout.strip().splitlines()[-1])
    values = []
    for metric in metrics:
        value = out
        for key in metric.split("."):
            value = value[key]
        values.append(float(value))
    return values


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("give the benchmark after --, e.g. -- bench.session --skip-latency --skip-hetero --json", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--metric", default="session.tok_s",
                   help="dotted paths into the benchmark's JSON, comma-separated; the first is the one compared")
    args = p.parse_args(argv[:split])
    module_args = argv[split + 1:]
    if args.rounds < 1 or not module_args:
        print("--rounds must be at least 1, and a benchmark module must follow --", file=sys.stderr)
        return 2
    print(machine(), file=sys.stderr)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    metrics = args.metric.split(",")
    ratios = []
    with tempfile.TemporaryDirectory(prefix="kafila-before-") as old:
        unpack(args.base, old)
        for i in range(args.rounds):
            before = measure(Path(old), module_args, metrics)
            after = measure(REPO, module_args, metrics)
            ratios.append(after[0] / before[0])
            for metric, b, a in zip(metrics, before, after):
                print(f"round {i + 1}: {metric} before ({args.base}) {b:.2f}, after ({head}, working tree) {a:.2f}, "
                      f"after ÷ before {a / b:.3f}", file=sys.stderr, flush=True)  # fmt: skip
    print(f"{metrics[0]} after ÷ before, median of {len(ratios)} rounds: {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
