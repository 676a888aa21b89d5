"""Many users at once on a 3-member session: aggregate tok/s and per-user time per token.

    .venv/bin/python -m bench.multiuser [--users 1,2,4,8,16] [--latency 0,20] [--max-tokens 48]
                                        [--rounds 2] [--batch-rows on,off] [--ring-lane auto,quic] [--json]

One loopback session of separate processes (kafila demo's launcher, `--concurrency auto`) per
hop latency. For each number of users n, n greedy chat requests (different prompts, typed at
the head's member first and then at the other members in turn, as a household would;
one user types at the head) start together and stream; each round of each n runs
back to back with the others, 1 user first and 1 user again last (the machine's load drifts: the
single-user figure is the mean of both). Reported per n, median over --rounds:
- aggregate tok/s: every user's tokens ÷ the wall time from the first request sent to the last
  token received (prefill included: what the household sees), and its ratio to one user's;
- per-user TPOT (time per output token: first to last token ÷ tokens after the first), the
  median user's and the slowest user's, as ratios to one user's.
A number of users above the session's slots (its `/status` concurrency) is left out and said so.
The bound (--bound on, the default): after a session's rounds, its stages (the plan's blocks, the
head's with the embedding and lm_head) are built in this process and each one's batched decode
step is timed for the row counts that matter (bench/ring_bound.py); with the head's measured
network time per trip H, bound(N) = max over g micro-batches of N / max(g·C(⌈N/g⌉), C(⌈N/g⌉) + H),
C(b) = Σ_s t_s(b): what one machine computing one stage at a time could deliver, decode only. The
table prints it beside the rate while all N answers decode together (steady_rate: from the last
first token to the first last token, the prefill of users who started later is outside it, as
it is outside the bound) and beside the measured decode aggregate (tokens after each user's
first ÷ the earliest first token → the last token, which holds the later users' prefill), with
their ratios to it.
--batch-rows on,off runs a session with batched decode rows (`kafila host --batch-rows on`, the
default: ready decode steps go round as micro-batches, one forward per stage) and one without,
one after the other at each latency, and prints on ÷ off per number of users. --ring-lane
auto,quic does the same for the ring's frames: over the TCP lane where it connects (`auto`, the
default) and over the QUIC edges only (`kafila join --ring-lane quic`), printing auto ÷ quic.
--core-lock on,off does the same for the members' compute lock (kafila/session/ring/cores.py: one
stage computes at a time on a machine; off: KAFILA_CORE_LOCK=0 in the members' environment).
--prompt-cache on,off does the same for prompt caching (`kafila host --prompt-cache`). Every
request's text is new (it starts "Request <n>:"), so a round never finds an earlier round's
prompt cached: what users share is the chat template's system prompt, as users of one app do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time

from bench._report import header, markdown

PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works.",
    "Describe a walk through a busy market in a city you like.",
    "Write a long letter to a friend about your summer holiday.",
    "Explain how plants turn sunlight into food, step by step.",
    "Tell the story of a cat who wants to learn to fly.",
    "Describe how to bake bread at home, from flour to loaf.",
    "Write a long poem about the mountains in winter.",
    "Explain why the seasons change through the year.",
    "Write a story about two robots who become friends.",
    "Describe the life of a honeybee from egg to adult.",
    "Explain how a computer stores numbers and text.",
    "Write a long diary entry of a sailor crossing the ocean.",
    "Describe the history of the bicycle in a few paragraphs.",
    "Tell a fairy tale about a brave girl and a dragon.",
    "Explain how rain forms and falls from the clouds.",
]


_SERIAL = itertools.count(1)
STEADY_MIN_S = 0.2  # the shortest window of all answers decoding that steady_rate measures


def unique(text: str) -> str:
    """`text` as a request of its own: no earlier request of the run has typed it."""
    return f"Request {next(_SERIAL)}: {text}"


def run_users(session, texts: list[str] | list[list[str]], max_tokens: int, extra: dict | None = None,
              members: list[str] | None = None) -> list[dict]:  # fmt: skip
    """Users started together, user i typing at members[i mod len(members)] (default: the
    session's members in order) texts[i]: one text, or a list of texts asked one after another
    (each when the last answer is done); `extra`: more fields of each request's body. Each
    client's stream_chat results, user by user."""
    from kafila.tooling.launch import stream_chat

    members = members or session.names
    seqs = [[t] if isinstance(t, str) else list(t) for t in texts]
    results: list[list[dict]] = [[] for _ in seqs]
    start = threading.Barrier(len(seqs))

    def user(i: int) -> None:
        api = session.api(members[i % len(members)])
        start.wait()
        for text in seqs[i]:
            results[i].append(stream_chat(api, text, max_tokens, extra=extra))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(seqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    missing = sum(len(s) - len(r) for s, r in zip(seqs, results))
    if missing:
        raise RuntimeError(f"{missing} of {sum(map(len, seqs))} requests got no answer (see the logs)")
    return [r for rs in results for r in rs]


def one_level(session, users: int, max_tokens: int, prompts: list[str] = PROMPTS, extra: dict | None = None,
              requests: int = 1, members: list[str] | None = None) -> dict:  # fmt: skip
    """`users` users started together, user i typing at members[i mod len(members)] (run_users)
    `requests` prompts one after another (prompts[i], prompts[i + 1], … : with as many requests
    as prompts every user asks them all); `extra`: more fields of each request's body. Their
    timings as seen by each client."""
    seqs = [[unique(prompts[(i + j) % len(prompts)]) for j in range(requests)] for i in range(users)]
    flat = run_users(session, seqs, max_tokens, extra, members)
    results = [flat[i * requests:(i + 1) * requests] for i in range(users)]  # user by user
    tokens = sum(r["tokens"] or 0 for r in flat)
    wall = max(r["last_s"] for r in flat) - min(r["started_s"] for r in flat)
    tpots = [1000.0 / r["tok_s"] for r in flat if r["tok_s"]]
    # decode only: tokens after each answer's first ÷ (the earliest first token → the last token)
    decode_wall = max(r["last_s"] for r in flat) - min(r["started_s"] + r["ttft_ms"] / 1000 for r in flat)
    return {"users": users, "requests": requests, "tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall,
            "decode_aggregate_tok_s": (tokens - len(flat)) / decode_wall if decode_wall > 0 else None,
            "steady_tok_s": steady_rate(flat),
            # steady state (users who keep asking, DiP-SD's throughput): each user's tokens ÷ its own time
            "users_tok_s_sum": sum(sum(r["tokens"] or 0 for r in rs) / (rs[-1]["last_s"] - rs[0]["started_s"])
                                   for rs in results),
            "tpot_ms_median": statistics.median(tpots), "tpot_ms_max": max(tpots),
            "ttft_ms_median": statistics.median(r["ttft_ms"] for r in flat),
            "short_answers": sum((r["tokens"] or 0) < max_tokens for r in flat),
            "texts": [r["text"] for r in flat], "speculation": [r["speculation"] for r in flat]}  # fmt: skip


def steady_rate(answers: list[dict]) -> float | None:
    """Pieces a second while every answer is decoding: from the last first piece to the first
    last piece, each answer's pieces in that window (a piece is a token's text, merged where a
    token ends mid-character). What bound(N) prices (N rows decoding, no prefill); None when the
    answers do not all decode together for STEADY_MIN_S."""
    times = [r["times"] for r in answers if r.get("times")]
    if len(times) != len(answers):
        return None
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    if end - start < STEADY_MIN_S:
        return None
    return sum(sum(1 for x in t if start < x <= end) for t in times) / (end - start)


def _median_known(rows: list[dict], key: str) -> float | None:
    known = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(known) if known else None


def run_latency(latency_ms: float, levels: list[int], max_tokens: int, rounds: int, model: str,
                batch_rows: bool = True, ring_lane: str = "auto", core_lock: bool = True,
                prompt_cache: bool = True, with_bound: bool = True) -> dict:  # fmt: skip
    from kafila.models.registry import resolve_model
    from kafila.tooling.launch import LocalSession, get_json, stream_chat

    os.environ["KAFILA_CORE_LOCK"] = "1" if core_lock else "0"  # the members inherit it

    s = LocalSession(members=3, model=model, latency_ms=latency_ms, batch_rows=batch_rows, ring_lane=ring_lane,
                     prompt_cache=prompt_cache,
                     log_dir=tempfile.mkdtemp(prefix="kafila-bench-logs-"),
                     cache_root=tempfile.mkdtemp(prefix="kafila-bench-cache-"))  # fmt: skip
    t0 = time.monotonic()
    s.start(timeout_s=600)
    try:
        st = get_json(s.api("m1"), "/status")
        slots = st["session"]["concurrency"]
        head = st["plan"]["head"]
        for name in s.names:  # warm-up: first steps of each shape compile kernels
            stream_chat(s.api(name), PROMPTS[0], 8)
        # users type at the head first, then at the others: the one-user baseline is always the
        # user at the head (the planner places the head from probes that differ between sessions;
        # typed elsewhere, one user crosses three more hops before its first token)
        at = s.names[s.names.index(head):] + s.names[:s.names.index(head)]
        served = [n for n in levels if n <= slots]
        runs: dict[int, list[dict]] = {n: [] for n in served}
        solo_after: list[dict] = []
        for _ in range(rounds):
            for n in served:
                runs[n].append(one_level(s, n, max_tokens, members=at))
            if 1 in runs:
                solo_after.append(one_level(s, 1, max_tokens, members=at))
        head_status = get_json(s.api(head), "/status")
        load = head_status["load"]
    finally:
        s.stop()
    bounds = {}
    from bench.ring_bound import bound, session_ring, stage_costs

    stages, network_ms = session_ring(head_status)
    if with_bound:  # the session is gone: its stages' batched steps, one process, one at a time
        rows = sorted({1, 2, 4, 8, 16, *served} & set(range(1, max(served) + 1)))
        costs = stage_costs(resolve_model(model), stages, rows)
        bounds = {n: bound(costs, n, float(network_ms)) for n in served}
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    solo_rows = runs.get(1, []) + solo_after
    solo_agg, solo_tpot = med(solo_rows, "aggregate_tok_s"), med(solo_rows, "tpot_ms_median")
    table = []
    for n in served:
        rows = runs[n]
        table.append({"users": n, "aggregate_tok_s": med(rows, "aggregate_tok_s"),
                      "aggregate_ratio": med(rows, "aggregate_tok_s") / solo_agg,
                      "tpot_ms": med(rows, "tpot_ms_median"), "tpot_ratio": med(rows, "tpot_ms_median") / solo_tpot,
                      "tpot_max_ratio": med(rows, "tpot_ms_max") / solo_tpot, "ttft_ms": med(rows, "ttft_ms_median"),
                      "decode_tok_s": med(rows, "decode_aggregate_tok_s"),
                      "steady_tok_s": _median_known(rows, "steady_tok_s"),
                      "bound_tok_s": bounds[n]["tok_s"] if n in bounds else None,
                      "bound": bounds.get(n),
                      "short_answers": sum(r["short_answers"] for r in rows), "rounds": rows})  # fmt: skip
    return {"latency_ms": latency_ms, "batch_rows": batch_rows, "ring_lane": ring_lane, "core_lock": core_lock,
            "prompt_cache": prompt_cache,
            "slots": slots, "plan": st["plan"], "left_out": [n for n in levels if n > slots],
            "solo_tok_s": solo_agg, "solo_tpot_ms": solo_tpot, "table": table,
            "head_stage_batch_rows": (load["stages"].get(head) or {}).get("batch_rows"),
            "network_ms": network_ms,
            "session_s": round(time.monotonic() - t0, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.multiuser", description=__doc__.split("\n\n")[0])
    p.add_argument("--users", default="1,2,4,8,16", help="numbers of concurrent users, comma-separated")
    p.add_argument("--latency", default="0,20", help="hop latencies in ms, comma-separated")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens each user asks for")
    p.add_argument("--rounds", type=int, default=2, help="times each number of users is measured (median)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-rows", default="on", help="on, off or on,off (both, side by side)")
    p.add_argument("--ring-lane", default="auto", help="auto, quic or auto,quic (both, side by side)")
    p.add_argument("--core-lock", default="on", help="on, off or on,off (both, side by side)")
    p.add_argument("--prompt-cache", default="on", help="on, off or on,off (both, side by side)")
    p.add_argument("--bound", choices=("on", "off"), default="on",
                   help="time the plan's stages in this process after each session and print the bound")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="also print the results as one markdown table")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.batch_rows.split(",")]
    lanes = [m.strip() for m in args.ring_lane.split(",")]
    locks = [m.strip() for m in args.core_lock.split(",")]
    caches = [m.strip() for m in args.prompt_cache.split(",")]
    if not modes or any(m not in ("on", "off") for m in modes):
        print("bench.multiuser: --batch-rows takes on, off or on,off", file=sys.stderr)
        return 2
    if not lanes or any(m not in ("auto", "quic") for m in lanes):
        print("bench.multiuser: --ring-lane takes auto, quic or auto,quic", file=sys.stderr)
        return 2
    if not locks or any(m not in ("on", "off") for m in locks):
        print("bench.multiuser: --core-lock takes on, off or on,off", file=sys.stderr)
        return 2
    if not caches or any(m not in ("on", "off") for m in caches):
        print("bench.multiuser: --prompt-cache takes on, off or on,off", file=sys.stderr)
        return 2
    try:
        levels = sorted({int(x) for x in args.users.split(",")} | {1})
        latencies = [float(x) for x in args.latency.split(",")]
    except ValueError:
        print("bench.multiuser: --users and --latency take comma-separated numbers", file=sys.stderr)
        return 2
    if min(levels) < 1 or not 1 <= args.max_tokens <= 1024 or not 1 <= args.rounds <= 20:
        print("bench.multiuser: users ≥ 1, --max-tokens 1..1024, --rounds 1..20", file=sys.stderr)
        return 2
    print(header(), flush=True)
    print(f"3 members on loopback, {args.model}, {args.max_tokens} tokens per user, median of {args.rounds} "
          "rounds; aggregate = all users' tokens / (first request sent → last token)", flush=True)  # fmt: skip
    out = {}
    for ms, mode, lane, lock, cache in [(ms, mode, lane, lock, cache) for ms in latencies for mode in modes
                                        for lane in lanes for lock in locks for cache in caches]:  # fmt: skip
        key = (f"{ms:g} ms, rows {mode}" + (", ring lane quic" if lane == "quic" else "")
               + (", core lock off" if lock == "off" else "") + (", prompt cache off" if cache == "off" else ""))
        r = out[key] = run_latency(ms, levels, args.max_tokens, args.rounds, args.model, mode == "on", lane,
                                   lock == "on", cache == "on", args.bound == "on")  # fmt: skip
        print(f"\n{ms:g} ms/hop, batched rows {mode}, ring lane {lane}, core lock {lock}, prompt cache {cache}: "
              f"{r['slots']} slots (auto), ring {' → '.join(r['plan']['ring'])}, "
              f"1 user {r['solo_tok_s']:.1f} tok/s, TPOT {r['solo_tpot_ms']:.1f} ms", flush=True)
        if args.bound == "off":  # with the bound, its table below holds these figures
            print(f"{'users':>5} {'aggregate tok/s':>16} {'÷ 1 user':>9} {'TPOT ms':>8} {'÷ solo':>7} "
                  f"{'slowest ÷ solo':>15} {'TTFT ms':>8}")
        for row in r["table"] if args.bound == "off" else ():
            print(f"{row['users']:>5} {row['aggregate_tok_s']:>16.1f} {row['aggregate_ratio']:>8.2f}× "
                  f"{row['tpot_ms']:>8.1f} {row['tpot_ratio']:>6.2f}× {row['tpot_max_ratio']:>14.2f}× "
                  f"{row['ttft_ms']:>8.0f}" + (f"  ({row['short_answers']} answers ended early)"
                                               if row["short_answers"] else ""), flush=True)  # fmt: skip
        if r["left_out"]:
            print(f"  left out (more users than slots): {r['left_out']}")
        base = f"{ms:g} ms, rows {mode}" + (", ring lane quic" if lane == "quic" else "")
        plain = cache == "on"  # the other comparisons are between sessions with the cache on
        for other, what in ((out.get(f"{ms:g} ms, rows on") if mode == "off" and lane == "auto" and lock == "on"
                             and plain else None, "rows on ÷ off"),
                            (out.get(f"{ms:g} ms, rows {mode}") if lane == "quic" and lock == "on" and plain
                             else None, "ring lane auto ÷ quic"),
                            (out.get(base) if lock == "off" and plain else None, "core lock on ÷ off"),
                            (out.get(base + (", core lock off" if lock == "off" else "")) if not plain else None,
                             "prompt cache on ÷ off")):
            if other is not None:
                ratios = ", ".join(f"{a['users']}: {a['aggregate_tok_s'] / b['aggregate_tok_s']:.2f}×"
                                   for a, b in zip(other["table"], r["table"]))  # fmt: skip
                print(f"  aggregate tok/s, {what}, by users: {ratios}", flush=True)
    if args.bound == "on":
        print("\nbound: bench/ring_bound.py; H = the head's measured network ms per trip: "
              + ", ".join(f"{r['latency_ms']:g} ms/hop {r['network_ms']:.1f} ms" for r in out.values()))
        print("| hop ms | users | bound tok/s (g micro-batches × rows) | all decoding tok/s | ÷ bound "
              "| measured decode tok/s | measured ÷ bound "
              "| aggregate tok/s (prefill included) | TPOT ms | ÷ solo | slowest ÷ solo | TTFT ms |"
              "\n|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in out.values():
            for row in r["table"]:
                b, steady = row["bound"], row["steady_tok_s"]
                shown = "– | –" if steady is None else f"{steady:.1f} | {steady / b['tok_s']:.2f}"
                print(f"| {r['latency_ms']:g} | {row['users']} | {b['tok_s']:.1f} ({b['groups']} × {b['rows']}) "
                      f"| {shown} "
                      f"| {row['decode_tok_s']:.1f} | {row['decode_tok_s'] / b['tok_s']:.2f} "
                      f"| {row['aggregate_tok_s']:.1f} | {row['tpot_ms']:.1f} | {row['tpot_ratio']:.2f}× "
                      f"| {row['tpot_max_ratio']:.2f}× | {row['ttft_ms']:.0f} |")
    if args.markdown:
        print("\n" + markdown(["session", "users", "aggregate tok/s", "÷ 1 user", "TPOT ms", "÷ solo", "slowest ÷ solo",
                                "TTFT ms"],
                               [(key, row["users"], f"{row['aggregate_tok_s']:.1f}", f"{row['aggregate_ratio']:.2f}×",
                                 f"{row['tpot_ms']:.1f}", f"{row['tpot_ratio']:.2f}×", f"{row['tpot_max_ratio']:.2f}×",
                                 f"{row['ttft_ms']:.0f}") for key, r in out.items() for row in r["table"]]))
    if args.json:
        print(json.dumps(out, default=str))  # one line: bench.before_after reads the last
    return 0


if __name__ == "__main__":
    sys.exit(main())
