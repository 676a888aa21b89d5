"""Session benchmark, everything measured side by side in one run on this machine.

    .venv/bin/python -m bench.session [--model M] [--local-stages 3] [--max-tokens 64] [--runs 3] [--pairs 3]
        [--skip-latency] [--skip-hetero] [--ring-lane auto|quic]

1. Speed: a 3-member loopback session (separate processes, QUIC edges; ring frames over the TCP
   lane, or the QUIC edges with `--ring-lane quic`) vs LocalChain with 3
   stages in one process (what `kafila run --stages 3` runs; `--local-stages 1`: one stage, as
   `kafila run --stages 1`), same prompt, same greedy tokens;
   decode tok/s (first to last token) and time to first token, medians of --runs after a warm-up.
2. WAN: the same session with every member delaying its datagrams by 20 ms (--latency-ms 20).
3. Heterogeneity: m2 under a CPU quota of a quarter of one core (kafila.tooling.throttle: needs root and
   the cgroup v1 cpu controller); the planner's division vs --policy uniform, formed alternately
   (kafila, uniform, kafila, uniform, … --pairs times) so that drifting load falls on both: m2's
   blocks, each session's tok/s, and the median (min–max) of the per-pair ratios. For comparison
   only, the seed paper's own measured LAN figure (Rangwala, Sinnott and Buyya, arXiv:2609.34045,
   on their machines): 1.56×.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def local_chain(model: str, stages: int, prompt_ids: list[int], max_tokens: int, runs: int, eos) -> dict:
    from kafila.engine.chain import LocalChain

    chain = LocalChain.build(model, stages)
    rates, ttfts, n = [], [], 0
    for i in range(runs + 1):
        start = time.perf_counter()
        first = last = None
        n = 0
        for t in chain.generate(prompt_ids, max_tokens, stop=eos):
            if t in eos:
                break
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
        if i == 0:
            continue  # warm-up
        ttfts.append((first - start) * 1000)
        rates.append((n - 1) / (last - first))
    return {"tok_s": statistics.median(rates), "ttft_ms": statistics.median(ttfts), "tokens": n}


def session_runs(runs: int, max_tokens: int, ask: str = "m3", **kw) -> dict:
    from kafila.tooling.launch import LocalSession, get_json, stream_chat

    s = LocalSession(members=3, log_dir=tempfile.mkdtemp(prefix="kafila-bench-logs-"),
                     cache_root=tempfile.mkdtemp(prefix="kafila-bench-cache-"), **kw)
    t0 = time.monotonic()
    s.start(timeout_s=600)
    formed_s = time.monotonic() - t0
    try:
        results = [stream_chat(s.api(ask), PROMPT, max_tokens) for _ in range(runs + 1)][1:]
        head = get_json(s.api("m1"), "/status")["plan"]["head"]
        status = get_json(s.api(head), "/status")  # the head measures every stage
    finally:
        s.stop()
    return {
        "tok_s": statistics.median(r["tok_s"] for r in results),
        "ttft_ms": statistics.median(r["ttft_ms"] for r in results),
        "tokens": results[-1]["tokens"],
        "text": results[-1]["text"],
        "plan": status["plan"],
        "stage_compute_ms": {n: v["compute_ms"] for n, v in status["stages"].items()},
        "network_ms": status["network_ms"],
        "edges": [(e["from"], e["to"], e.get("kind"), e.get("lane")) for e in status["edges"]],
        "formed_s": round(formed_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3, help="heterogeneity: kafila/uniform session pairs, alternated")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-hetero", action="store_true")
    p.add_argument("--skip-speed", action="store_true", help="skip the loopback speed comparison")
    p.add_argument("--local-stages", type=int, default=3,
                   help="stages of the in-process chain the session is compared with (1: `kafila run --stages 1`)")
    p.add_argument("--ring-lane", choices=("auto", "quic"), default="auto",
                   help="the speed and latency sessions' ring frames: auto (TCP lane) or quic")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print bench/_report.py's header and one markdown table")
    args = p.parse_args(argv)
    if args.markdown:
        from bench._report import header

        print(header(), flush=True)

    from backends.gguf import open_model
    from kafila.api import chat_prompt_ids
    from kafila.models import load_tokenizer, resolve_model

    path = resolve_model(args.model)
    tok = load_tokenizer(open_model(path))
    ids = chat_prompt_ids(tok, [{"role": "user", "content": PROMPT}])
    out: dict = {}
    local = None  # the in-process chain's tok/s, the mean of before and after the session

    def show(label: str, r: dict) -> None:
        print(f"{label:<44} {r['tok_s']:7.1f} tok/s   TTFT {r['ttft_ms']:7.1f} ms   {r.get('tokens')} tokens",
              file=sys.stderr, flush=True)

    if not args.skip_speed:
        stages = out["local_stages"] = args.local_stages  # (the keys say local_3 whatever it is: kept for bench.before_after)
        out["local_3"] = local_chain(path, stages, ids, args.max_tokens, args.runs, tok.eos_ids)
        show(f"LocalChain, {stages} stage(s), one process", out["local_3"])
        out["session"] = session_runs(args.runs, args.max_tokens, model=args.model, ring_lane=args.ring_lane)
        show("session, 3 processes, loopback", out["session"])
        out["local_3_after"] = local_chain(path, stages, ids, args.max_tokens, args.runs, tok.eos_ids)
        show(f"LocalChain, {stages} stage(s), one process (again)", out["local_3_after"])
        local = (out["local_3"]["tok_s"] + out["local_3_after"]["tok_s"]) / 2  # the machine's load drifts
        out["ratio_session_vs_local_3"] = out["session"]["tok_s"] / local
        print(f"  ratio session / local {stages}-stage (mean of before and after): "
              f"{out['ratio_session_vs_local_3']:.2f}×  (stage compute {out['session']['stage_compute_ms']}, "
              f"ring network {out['session']['network_ms']} ms/step)", file=sys.stderr)
    if not args.skip_latency:
        out["session_20ms"] = session_runs(args.runs, args.max_tokens, model=args.model, latency_ms=20,
                                           ring_lane=args.ring_lane)
        show("session, 3 processes, --latency-ms 20", out["session_20ms"])
        if local is not None:
            print(f"  ratio session at 20 ms / local {args.local_stages}-stage: "
                  f"{out['session_20ms']['tok_s'] / local:.2f}×", file=sys.stderr)  # fmt: skip
    if not args.skip_hetero:
        pairs = []
        for i in range(args.pairs):  # A B A B …: each ratio compares two neighbouring sessions
            pair = {}
            for policy in ("kafila", "uniform"):
                r = session_runs(args.runs, args.max_tokens, model=args.model, policy=policy, throttle={"m2": 0.25})
                pair[policy] = r
                show(f"pair {i + 1}: m2 at 25% CPU, policy {policy} (m2: {r['plan']['blocks']['m2']} blocks)", r)
            pair["ratio"] = pair["kafila"]["tok_s"] / pair["uniform"]["tok_s"]
            print(f"  pair {i + 1}: planner / uniform {pair['ratio']:.2f}×", file=sys.stderr, flush=True)
            pairs.append(pair)
        ratios = [pair["ratio"] for pair in pairs]
        out["hetero_pairs"] = pairs
        out["hetero_ratio"] = statistics.median(ratios)
        print(f"  planner / uniform with m2 throttled, median of {len(ratios)} per-pair ratios: "
              f"{out['hetero_ratio']:.2f}× (min {min(ratios):.2f}×, max {max(ratios):.2f}×)", file=sys.stderr)
    if args.markdown:
        from bench._report import markdown

        rows = []
        for key, label in (("local_3", f"LocalChain, {args.local_stages} stage(s), one process"),
                           ("session", "session, 3 processes, loopback"),
                           ("local_3_after", f"LocalChain, {args.local_stages} stage(s), one process (again)"),
                           ("session_20ms", "session, 3 processes, 20 ms per hop")):
            if key in out:
                r = out[key]
                ratio = f"{r['tok_s'] / local:.2f}×" if local and key.startswith("session") else ""
                rows.append((label, f"{r['tok_s']:.1f}", f"{r['ttft_ms']:.0f}", ratio))
        if "hetero_ratio" in out:
            rows.append(("m2 throttled: planner ÷ uniform (median of pairs)", "", "", f"{out['hetero_ratio']:.2f}×"))
        print(f"\n{args.model}, {args.max_tokens} tokens, greedy, median of {args.runs} answers after a warm-up\n")
        print(markdown(["run", "decode tok/s", "TTFT ms", "÷ one process (mean of both)"], rows))
    if args.json:
        print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
