"""Single-stream and 8-user speed of two commits side by side in one run: did a refactor change behaviour?

    .venv/bin/python -m bench.before_after --base a9fd47a [--after 3ba472b] [--rounds 2] [--max-tokens 48]

`git worktree add --detach` checks each commit out into a temporary directory (`--after` omitted:
this checkout, working tree included). Each round runs, for before and then after, with that tree
first on PYTHONPATH (the members the launcher spawns import it too), the same venv and the same
default model:
- single stream: `bench.session --skip-latency --skip-hetero --json`, a 3-member loopback session's
  decode tok/s and its greedy answer, beside the same split run in one process (LocalChain);
- 8 users: `bench.multiuser --users 8 --latency 0 --json`, aggregate tok/s and median TPOT.
The machine's load drifts, so the rounds alternate before, after, before, after … and each ratio
compares neighbours; the table gives each figure's medians and the median after ÷ before with
its range over rounds, and whether the single-stream greedy answers were the same text.
Prints bench/_report.py's header (CPU, ISA, commit) and one markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._report import REPO, header, markdown

# (label, dotted path into the module's JSON, format)
SINGLE = [("1 user: 3-member session, decode tok/s", "session.tok_s", "{:.1f}"),
          ("1 user: same split in one process, tok/s", "local_3.tok_s", "{:.1f}")]  # fmt: skip
MULTI = [("8 users: aggregate tok/s", "table.aggregate_tok_s", "{:.1f}"),
         ("8 users: median TPOT ms", "table.tpot_ms", "{:.1f}")]  # fmt: skip


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def run_json(tree: Path, module_args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    run = subprocess.run([sys.executable, "-m", *module_args], cwd=tree, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(module_args)} failed in {tree} (exit {run.returncode}):\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def dig(out: dict, path: str) -> float:
    value = out
    for key in path.split("."):
        value = value[key]
    return float(value)


def measure(tree: Path, max_tokens: int, runs: int) -> tuple[dict[str, float], str]:
    """One round on one tree: every figure by label, and the session's greedy answer."""
    single = run_json(tree, ["bench.session", "--skip-latency", "--skip-hetero", "--runs", str(runs),
                             "--max-tokens", str(max_tokens), "--json"])  # fmt: skip
    multi = run_json(tree, ["bench.multiuser", "--users", "8", "--latency", "0", "--rounds", "1",
                            "--max-tokens", str(max_tokens), "--json"])  # fmt: skip
    (session,) = multi.values()  # one latency, one mode: one session
    row = next(r for r in session["table"] if r["users"] == 8)
    figures = {label: dig(single, path) for label, path, _ in SINGLE}
    figures |= {label: dig({"table": row}, path) for label, path, _ in MULTI}
    return figures, single["session"]["text"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.before_after", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--after", help="the later commit (default: this checkout, working tree included)")
    p.add_argument("--rounds", type=int, default=2, help="before/after pairs, alternated (1..10)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (8..512)")
    p.add_argument("--runs", type=int, default=2, help="single-stream answers per session (median; 1..10)")
    args = p.parse_args(argv)
    if not (1 <= args.rounds <= 10 and 8 <= args.max_tokens <= 512 and 1 <= args.runs <= 10):
        print("bench.before_after: --rounds 1..10, --max-tokens 8..512, --runs 1..10", file=sys.stderr)
        return 2
    try:
        base = git("rev-parse", "--short", args.base)
        after = git("rev-parse", "--short", args.after) if args.after else None
    except subprocess.CalledProcessError:
        print(f"bench.before_after: {args.base if args.after is None else args.base + ' or ' + args.after} "
              "is not a commit of this repository", file=sys.stderr)  # fmt: skip
        return 2
    print(header(), flush=True)
    worktrees: list[Path] = []
    try:
        trees = {}
        for label, rev in ((base, base), (after, after)):
            if rev is None:
                continue
            path = Path(tempfile.mkdtemp(prefix=f"kafila-{rev}-"))
            git("worktree", "add", "--detach", str(path), rev)
            worktrees.append(path)
            trees[label] = path
        before_tree, after_tree = trees[base], trees.get(after, REPO)
        after_name = after or "this checkout"
        rows: dict[str, list[tuple[float, float]]] = {}
        same = []
        for i in range(args.rounds):
            b, b_text = measure(before_tree, args.max_tokens, args.runs)
            a, a_text = measure(after_tree, args.max_tokens, args.runs)
            same.append(a_text == b_text)
            for label in b:
                rows.setdefault(label, []).append((b[label], a[label]))
            print(f"round {i + 1}: " + "; ".join(f"{k} {b[k]:.1f} → {a[k]:.1f}" for k in b), file=sys.stderr,
                  flush=True)  # fmt: skip
    finally:
        for path in worktrees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], capture_output=True)
    fmt = {label: f for label, _, f in SINGLE + MULTI}
    table = []
    for label, pairs in rows.items():
        ratios = [a / b for b, a in pairs]
        table.append((label, fmt[label].format(statistics.median(b for b, _ in pairs)),
                      fmt[label].format(statistics.median(a for _, a in pairs)),
                      f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"))  # fmt: skip
    table.append(("1 user: greedy answer the same text", "", "", f"{sum(same)} of {len(same)} rounds"))
    print(f"\nsmollm2-135m, 3 members on loopback, {args.max_tokens} tokens per answer, {args.rounds} rounds "
          f"alternated (before, after, …); medians over rounds\n")  # fmt: skip
    print(markdown(["figure", f"before ({base})", f"after ({after_name})", "after ÷ before (range)"], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
