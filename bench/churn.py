"""Churn benchmark: what resuming costs when a member leaves a serving session (issue 14).

    .venv/bin/python -m bench.churn [--members 4] [--max-tokens 64] [--precision f32] [--model M]
        [--rendezvous-restart]

A LocalSession of --members processes on 127.0.0.1; 4 concurrent streaming requests, each at a
member other than the one that leaves, run once undisturbed (the reference), then again while
one member is killed (SIGKILL) mid-generation, then again while another leaves with SIGINT.
Reported per leave: detection (kill → the host's "left"), replan (→ every member serving again),
the longest fetch of missing tensors at a member (and MB moved in all), replay (serving again →
the first resumed token at an origin), the longest gap between two tokens of any request, and
whether every answer matched its reference token for token. With --rendezvous-restart the
session's rendezvous is a separate process, and a first round kills it (-9) mid-generation and
starts a new one on the same port: reported are each member's signaling outage (its /status),
the longest token gap and whether the answers matched.
"""

from __future__ import annotations

import argparse
import queue
import signal
import tempfile
import threading
import time

DETECT_TARGET_S = 5.0  # kill -9 → the host's "left": the watchdog's budget (was a bound in tests/test_churn.py)
PROMPTS = [
    "Count from one to forty in words.",
    "Write a short story about a lighthouse keeper.",
    "List ten fruits and their colours.",
    "Explain how a bicycle works, step by step.",
]


def drain(s) -> list[dict]:
    out = []
    for p in s.procs:
        while True:
            try:
                ev = p.events.get_nowait()
            except queue.Empty:
                break
            out.append({**ev, "who": p.name})
    return out


def ask_all(s, origins: list[str], prompts: list, max_tokens: int, raw: bool = False) -> tuple[list[threading.Thread], list]:
    """Every prompt at once, each at its origin, on threads; `raw`: prompts are completions'
    prompts (text or token ids), not chat messages."""
    from kafila.tooling.launch import stream_chat

    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = stream_chat(s.api(origins[i]), prompts[i], max_tokens, timeout_s=300, raw=raw)
        except Exception as exc:  # the test reports it with the others
            results[i] = {"error": str(exc)}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results


def wait_decoding(s, n: int, timeout_s: float = 120.0, after_s: float = 1.0, min_tokens: int = 2) -> None:
    """Until the head holds `n` requests that have each generated `min_tokens` tokens (their
    answers are streaming, not still in prefill: its /status `load.requests`), then `after_s` more."""
    from kafila.tooling.launch import get_json

    deadline = time.monotonic() + timeout_s
    host = s.procs[0].name
    while time.monotonic() < deadline:
        st = get_json(s.api(host), "/status")
        head = st["plan"]["head"]
        held = (get_json(s.api(head), "/status").get("load") or {}).get("requests") or []
        if sum(1 for r in held if (r.get("tokens") or 0) >= min_tokens) >= n:
            time.sleep(after_s)
            return
        time.sleep(0.1)
    raise TimeoutError(f"the head never held {n} requests decoding at once")


def pieces_around(results: list, at_pc: float, until_pc: float | None = None) -> list[tuple[int, int]]:
    """Per answer, (pieces streamed before `at_pc`, pieces after `until_pc` or `at_pc`), perf_counter
    times: an answer with both was in flight across the event, so the event hit it mid-answer."""
    until_pc = at_pc if until_pc is None else until_pc
    return [(sum(t < at_pc for t in (r or {}).get("times", [])), sum(t > until_pc for t in (r or {}).get("times", [])))
            for r in results]  # fmt: skip


def not_mid_answer(results: list, pieces: list[tuple[int, int]]) -> list[str]:
    """What contradicts "the event hit the answers mid-stream" (empty: nothing): every answer had
    streamed before it, every answer cut by max_tokens (so not ended by the model) streamed after
    it, and at least one did. An answer the model ended early may have finished before the event."""
    problems = [f"answer {i} had streamed nothing before" for i, (before, _) in enumerate(pieces) if not before]
    problems += [f"answer {i} ran to max_tokens but streamed nothing after" for i, ((_, after), r)
                 in enumerate(zip(pieces, results)) if (r or {}).get("finish_reason") == "length" and not after]
    if not any(before and after for before, after in pieces):
        problems.append("no answer streamed both before and after")
    return problems


def leave_round(s, victim: str, origins: list[str], prompts: list, max_tokens: int, sig: int,
                raw: bool = False) -> dict:  # fmt: skip
    """Ask every prompt at once, make `victim` leave with `sig` mid-generation, wait for every
    answer; returns the answers and the timings."""
    threads, results = ask_all(s, origins, prompts, max_tokens, raw)
    wait_decoding(s, len(prompts))
    drain(s)
    t_leave, pc_leave = time.monotonic(), time.perf_counter()
    if sig == signal.SIGKILL:
        s.kill(victim)
    else:
        s.signal(victim, sig)
    for t in threads:
        t.join(300)
    events = drain(s)
    host = s.procs[0].name
    left = next((e["at_s"] for e in events if e["who"] == host and e.get("event") == "left"), None)
    serving = [e["at_s"] for e in events if e.get("event") == "serving" and e.get("epoch")]
    weights = [e for e in events if e.get("event") == "weights"]
    back = max(serving) if serving else None
    # replay: from serving again to each origin's first token after it (perf_counter ↔ monotonic
    # share a clock on Linux; both are offsets from the leave here)
    replay = None
    if back is not None:
        back_pc = pc_leave + (back - t_leave)
        firsts = [next((t for t in r.get("times", []) if t > back_pc), None) for r in results if r]
        firsts = [t - back_pc for t in firsts if t is not None]
        replay = min(firsts) if firsts else None
    return {
        "results": results,
        "pieces": pieces_around(results, pc_leave),
        "detect_s": None if left is None else left - t_leave,
        "replan_s": None if back is None or left is None else back - left,
        "fetch_s": max((w.get("seconds", 0.0) for w in weights), default=0.0),
        "fetched_mb": sum(w.get("received_bytes", 0) for w in weights) / 1e6,
        "fetched_tensors": sum(w.get("fetched_tensors", 0) for w in weights),
        "replay_s": replay,
        "max_gap_s": max((r.get("max_gap_s", 0.0) for r in results if r), default=None),
    }


def restart_round(s, origins: list[str], prompts: list[str], max_tokens: int, down_s: float = 1.0) -> dict:
    """Ask every prompt at once, kill the rendezvous mid-generation and start a fresh one after
    down_s; returns the answers, each member's signaling outage and the longest token gap."""
    from kafila.tooling.launch import get_json

    threads, results = ask_all(s, origins, prompts, max_tokens)
    wait_decoding(s, len(prompts), after_s=0.3)
    killed_pc = time.perf_counter()
    s.restart_rendezvous(down_s=down_s)
    back_pc = time.perf_counter()  # a new rendezvous listens from here
    for t in threads:
        t.join(300)
    outage: dict[str, float | None] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sig = {n: get_json(s.api(n), "/status").get("signaling") or {} for n in s.names}
        outage = {n: v.get("last_outage_s") for n, v in sig.items()}
        if all(v.get("up") and v.get("resumes") for v in sig.values()):
            break
        time.sleep(0.2)
    return {"results": results, "outage_s": outage, "pieces": pieces_around(results, killed_pc, back_pc),
            "max_gap_s": max((r.get("max_gap_s", 0.0) for r in results if r), default=None)}


def main() -> None:
    from kafila.tooling.launch import LocalSession, get_json

    ap = argparse.ArgumentParser()
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--precision", default="f32", choices=("f32", "serving"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rendezvous-restart", action="store_true",
                    help="first restart the rendezvous (a separate process) under the serving session")
    args = ap.parse_args()
    from bench._report import header

    print(header(), flush=True)
    names = [f"m{i + 1}" for i in range(args.members)]
    s = LocalSession(members=args.members, model=args.model, precision=args.precision, context=512,
                     log_dir=tempfile.mkdtemp(prefix="kafila-churn-logs-"),
                     cache_root=tempfile.mkdtemp(prefix="kafila-churn-cache-"),
                     rendezvous="process" if args.rendezvous_restart else "embedded")  # fmt: skip
    s.start(timeout_s=600)
    try:
        restart = None
        if args.rendezvous_restart:
            origins = [names[i % len(names)] for i in range(len(PROMPTS))]
            threads, ref = ask_all(s, origins, PROMPTS, args.max_tokens)
            for t in threads:
                t.join(300)
            restart = restart_round(s, origins, PROMPTS, args.max_tokens)
            restart["same"] = all(a and b and "text" in a and a["text"] == b.get("text")
                                  for a, b in zip(ref, restart["results"]))  # fmt: skip
        rows = []
        for sig, label in ((signal.SIGKILL, "kill -9"), (signal.SIGINT, "SIGINT")):
            ring = get_json(s.api(names[0]), "/status")["plan"]["ring"]
            victim = next(n for n in reversed(ring) if n != names[0])
            live = [p.name for p in s.procs if p.popen.poll() is None and p.name != victim]
            origins = [live[i % len(live)] for i in range(len(PROMPTS))]
            threads, ref = ask_all(s, origins, PROMPTS, args.max_tokens)
            for t in threads:
                t.join(300)
            r = leave_round(s, victim, origins, PROMPTS, args.max_tokens, sig)
            same = all(a and b and "text" in a and a["text"] == b.get("text") for a, b in zip(ref, r["results"]))
            rows.append((label, victim, len(ring), r, same))
        print(f"\n{args.model}, {args.members} members, --precision {args.precision}, "
              f"{len(PROMPTS)} concurrent requests of {args.max_tokens} tokens\n")
        print(f"| leave | member | ring before | answers hit mid-answer | detection s (target < {DETECT_TARGET_S:g}) "
              "| replan s | fetch s (MB, tensors) | replay s | longest token gap s | answers identical |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        f = lambda v: "?" if v is None else f"{v:.2f}"
        for label, victim, n, r, same in rows:
            hit = sum(1 for before, after in r["pieces"] if before and after)  # the rest: ended by the model
            met = "" if r["detect_s"] is None else (" (met)" if r["detect_s"] < DETECT_TARGET_S else " (MISSED)")
            print(f"| {label} | {victim} | {n} | {hit} of {len(r['pieces'])} | {f(r['detect_s'])}{met} "
                  f"| {f(r['replan_s'])} | {f(r['fetch_s'])} "
                  f"({r['fetched_mb']:.1f} MB, {r['fetched_tensors']}) | {f(r['replay_s'])} | "
                  f"{f(r['max_gap_s'])} | {'yes' if same else 'NO'} |")
        if restart is not None:
            print("\n| event | signaling outage s per member | longest token gap s | answers identical |")
            print("|---|---|---|---|")
            outages = ", ".join(f"{n} {f(v)}" for n, v in restart["outage_s"].items())
            print(f"| rendezvous kill -9, new one after 1 s | {outages} | {f(restart['max_gap_s'])} | "
                  f"{'yes' if restart['same'] else 'NO'} |")
    finally:
        s.stop()


if __name__ == "__main__":
    main()
