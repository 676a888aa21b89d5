"""The head's live DiP-SD optimiser against per-request choose_k: 4 users speculating at once.

    .venv/bin/python -m bench.dipsd_live [--users 4] [--latency 20] [--max-tokens 64] [--rounds 3] [--json]

Two 3-member loopback sessions of separate processes run side by side (kafila demo's launcher,
`--speculate ngram`, batched rows on): one with `kafila host --dipsd on` (the default: the live
optimiser chooses the speculating requests' draft lengths and micro-batches together,
kafila/session/ring/speculation/dipsd_live.py) and one with `--dipsd off` (each request's K is choose_k's alone).
Each round asks both the same: `--users` greedy requests of bench/spec_prompts.json's grounded
prompts (rotated each round), typed at m1, m2, m3 in turn and started together; the sessions
alternate (on, off, off, on, ...) so the machine's drifting load hits both alike. Reported per
mode, median over rounds: aggregate tok/s (every user's tokens ÷ first request sent → last token
received), per-user decode tok/s, tokens per trip and drafts per trip; on ÷ off per round; the
answers that stayed the same text; and what the optimiser chose (polled from the head's /status
`speculation.dipsd` during the rounds: N, lengths, method, solve ms, fallbacks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.llamacpp_speed import machine
from bench.multiuser import run_users

PROMPTS = Path(__file__).with_name("spec_prompts.json")


def one_round(session, texts: list[str], max_tokens: int) -> dict:
    results = run_users(session, texts, max_tokens, extra={"speculate": True})
    tokens = sum(r["tokens"] or 0 for r in results)
    wall = max(r["last_s"] for r in results) - min(r["started_s"] for r in results)
    spec = [r["speculation"] or {} for r in results]
    tpt = [s["tokens_per_trip"] for s in spec if s.get("tokens_per_trip")]
    dpt = [s["drafts_per_trip"] for s in spec if s.get("drafts_per_trip") is not None]
    return {"tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall,
            "user_tok_s": statistics.median(r["tok_s"] for r in results if r["tok_s"]),
            "tokens_per_trip": statistics.mean(tpt) if tpt else None,
            "drafts_per_trip": statistics.mean(dpt) if dpt else None,
            "texts": [r["text"] for r in results]}  # fmt: skip


class Poller:
    """Snapshots of the head's live schedule while a round runs (the schedule ends with it)."""

    def __init__(self, api: str) -> None:
        self.api, self.seen, self._stop = api, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from kafila.tooling.launch import get_json

        while not self._stop.wait(0.25):
            try:
                d = (get_json(self.api, "/status").get("speculation") or {}).get("dipsd")
            except OSError:
                continue
            if d and d.get("active"):
                self.seen.append(d)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def main(argv: list[str] | None = None) -> int:
    from kafila.tooling.launch import LocalSession, get_json

    p = argparse.ArgumentParser(prog="bench.dipsd_live", description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--latency", type=float, default=20.0, help="ms per hop")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode (median)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not 2 <= args.users <= 16 or not 1 <= args.max_tokens <= 1024 or not 1 <= args.rounds <= 20:
        print("bench.dipsd_live: --users 2..16, --max-tokens 1..1024, --rounds 1..20", file=sys.stderr)
        return 2
    grounded = json.loads(PROMPTS.read_text())["grounded"]
    print(machine(), flush=True)
    sessions = {mode: LocalSession(members=3, model=args.model, latency_ms=args.latency, speculate="ngram",
                                   dipsd=mode == "on", log_dir=tempfile.mkdtemp(prefix="kafila-bench-logs-"),
                                   cache_root=tempfile.mkdtemp(prefix="kafila-bench-cache-"))
                for mode in ("on", "off")}  # fmt: skip
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    seen: list[dict] = []
    try:
        for s in sessions.values():
            s.start(timeout_s=600)
        heads = {m: s.api(get_json(s.api("m1"), "/status")["plan"]["head"]) for m, s in sessions.items()}
        for s in sessions.values():  # warm-up: kernels for every step shape, the session's acceptance
            one_round(s, grounded[: args.users], 16)
        for i in range(args.rounds):
            texts = [grounded[(i + u) % len(grounded)] for u in range(args.users)]
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                with Poller(heads[mode]) as poll:
                    runs[mode].append(one_round(sessions[mode], texts, args.max_tokens))
                if mode == "on":
                    seen += poll.seen
            on, off = runs["on"][-1], runs["off"][-1]
            print(f"round {i + 1}: on {on['aggregate_tok_s']:.1f} tok/s, off {off['aggregate_tok_s']:.1f} tok/s, "
                  f"on ÷ off {on['aggregate_tok_s'] / off['aggregate_tok_s']:.2f}×", flush=True)
        final = {m: (get_json(h, "/status").get("speculation") or {}) for m, h in heads.items()}
    finally:
        for s in sessions.values():
            s.stop()
    med = lambda rows, k: statistics.median(r[k] for r in rows if r[k] is not None)  # noqa: E731
    same = sum(a == b for r_on, r_off in zip(runs["on"], runs["off"]) for a, b in zip(r_on["texts"], r_off["texts"]))
    ratios = [a["aggregate_tok_s"] / b["aggregate_tok_s"] for a, b in zip(runs["on"], runs["off"])]
    out = {"users": args.users, "latency_ms": args.latency, "max_tokens": args.max_tokens, "rounds": args.rounds,
           **{mode: {k: med(rows, k) for k in ("aggregate_tok_s", "user_tok_s", "tokens_per_trip", "drafts_per_trip")}
              for mode, rows in runs.items()},
           "ratio_median": statistics.median(ratios), "ratios": ratios,
           "same_text": f"{same}/{args.users * args.rounds}",
           "schedules": {"snapshots": len(seen),
                         "n_batches": sorted({d["n_batches"] for d in seen}),
                         "lengths": {l: sum(r["l"] == l for d in seen for r in d["requests"])
                                     for l in sorted({r["l"] for d in seen for r in d["requests"]})},
                         "verifier_ms_last": seen[-1].get("verifier_ms") if seen else None,
                         "solved_by": sorted({d["solved_by"] for d in seen}),
                         "fallbacks": sorted({d["fallback"] for d in seen if d["fallback"]}),
                         "solve_ms_median": statistics.median(d["solve_ms"] for d in seen) if seen else None,
                         "solve_ms_max": max((d["solve_ms"] for d in seen), default=None)},
           "solves": (final["on"].get("dipsd") or {}).get("solves"),
           "off_dipsd": final["off"].get("dipsd")}  # fmt: skip
    fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"\n{args.users} users, grounded prompts, {args.latency:g} ms/hop, {args.max_tokens} tokens each, "
          f"median of {args.rounds} rounds")
    for mode in ("on", "off"):
        v = out[mode]
        print(f"  dipsd {mode:<3} aggregate {v['aggregate_tok_s']:6.1f} tok/s  per user {v['user_tok_s']:5.1f} tok/s"
              f"  tokens/trip {fmt(v['tokens_per_trip'])}  drafts/trip {fmt(v['drafts_per_trip'])}")
    print(f"  on ÷ off: {out['ratio_median']:.2f}× (rounds: {', '.join(f'{r:.2f}' for r in ratios)}); "
          f"same text {out['same_text']}; solves {out['solves']}; schedules seen {out['schedules']}")
    if args.json:
        print(json.dumps(out, default=str))  # one line: bench.before_after reads the last
    return 0


if __name__ == "__main__":
    sys.exit(main())
