"""DiP-SD on a 3-member session: 4 users each drafting at their own member vs batched plain decoding.

    .venv/bin/python -m bench.dipsd [--latency 20,50] [--users 4] [--max-tokens 48] [--rounds 3]
                                    [--requests 1] [--precision serving|f32] [--speculate origin|ngram|draft]
                                    [--model M] [--draft D] [--kquant exact|ggml|…] [--json]

The real pair (issue 37): `--model qwen2.5-coder-1.5b-q4_k_m --draft qwen2.5-coder-0.5b` (names of
kafila.tooling.pypi_gguf, fetched on first use; any alias or path works too):
    python -m bench.dipsd --model qwen2.5-coder-1.5b-q4_k_m --draft qwen2.5-coder-0.5b --latency 20 --users 4
    python -m bench.dipsd --model qwen2.5-coder-1.5b-q4_k_m --draft qwen2.5-coder-0.5b --latency 50 --users 1 \
        --speculate draft
With --draft every member gets the draft model (`kafila join --draft`): with --speculate origin
each member drafts the requests typed at it with it, on a thread of its own while the ring works
(kafila/session/ring/speculation/origin.py); with --speculate draft the head drafts every request
with it (speculation/draft.py).

One loopback session of separate processes per hop latency (kafila demo's launcher, as
bench.multiuser and bench.spec), started with `--speculate origin` and batched decode rows on.
`--users` users start together, user i typing grounded prompt i of bench/spec_prompts.json at
member m1, m2, m3 in turn (bench.multiuser.one_level), greedy, each asking for --max-tokens. Each
round measures the same users twice, in alternating order (A B, then B A): A with speculation
(`"speculate": true`: drafts made at each request's origin member ride its activations to the
head, the head's n-grams where they are stale; kafila/session/ring/speculation/origin.py), B with `"speculate":
false` (plain decoding, the same micro-batched rows). Reported per latency, median over rounds:
aggregate committed tok/s (every user's tokens ÷ first request sent → last token received,
prefill included), A ÷ B, the same for decoding only (tokens after each user's first ÷ the
earliest first token → the last token), the sum of the users' own rates (each user's tokens ÷ its
request → its last token: the throughput of users who keep asking, DiP-SD's measure; the
aggregate above is bound by the slowest answer), the acceptance (accepted ÷ drafted), tokens per trip, the share of
drafting steps whose drafts came from the origin (the rest: the head's fallback), and how many
answers were the same text as plain decoding (at serving precision a K+1-row step can flip a
near-tie; at --precision f32 they are the same, tests/test_origin_session.py).
`--speculate ngram` runs the same with every draft made at the head (the comparison: what
drafting at the origin costs or gains against the head's own n-grams).
With a draft model the run ends with this machine's bound (bench/ring_bound.py: its docstring
has the formulas): the session's stages' batched steps (1 to 36 rows) and the draft model's
one-token step, timed in one process after the session has gone, the head's network time per
trip H (the median after the plain rounds: after speculating ones it holds the drafters' wait for
the cores) and the acceptance α the speculating rounds measured give what plain decoding and
speculation could deliver here at best (decoding only), their ratio, and each measured
decoding-only rate over its bound. On one machine every member's drafts and stages share its
cores, so the bound ratio, not a fixed 2×, is what this machine allows speculation.
`--requests K`: every user asks K prompts one after another (prompts i, i + 1, … : with K = 4 and
the 4 grounded prompts, every user asks all four, in a different order), so a round is users who
keep asking and its aggregate (all tokens ÷ first request → last token) is their sustained rate:
one answer that speculates badly no longer sets the wall time alone (with K = 1 it does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from backends import DEFAULT_KQUANT, KQUANTS
from bench._report import header
from bench.multiuser import one_level
from bench.spec import PROMPTS

BOUND_ROWS = [1, 2, 4, 8, 16, 24, 36]  # rows of one batched step priced for the bound: up to 4 users × 9


def spec_totals(levels: list[dict]) -> dict:
    """Every speculating answer's counts together."""
    keys = ("drafted", "accepted", "origin_steps", "fallback_steps")
    tot = dict.fromkeys(keys, 0)
    per_trip = []
    for level in levels:
        for s in level["speculation"]:
            for k in keys:
                tot[k] += (s or {}).get(k) or 0
            if s and s.get("tokens_per_trip"):
                per_trip.append(s["tokens_per_trip"])
    steps = tot["origin_steps"] + tot["fallback_steps"]
    return {**tot, "acceptance": tot["accepted"] / tot["drafted"] if tot["drafted"] else None,
            "tokens_per_trip": statistics.mean(per_trip) if per_trip else None,
            "origin_share": tot["origin_steps"] / steps if steps else None}  # fmt: skip


def model_path(name: str | None) -> str | None:
    """A kafila.tooling.pypi_gguf name fetched (first use: pip), else the alias or path as given."""
    from kafila.tooling.pypi_gguf import MODELS, fetch

    return str(fetch(name)) if name in MODELS else name


def run_latency(latency_ms: float, users: int, max_tokens: int, rounds: int, model: str, precision: str,
                speculate: str = "origin", requests: int = 1, draft: str | None = None,
                kquant: str = DEFAULT_KQUANT) -> dict:  # fmt: skip
    from kafila.tooling.launch import LocalSession, get_json, stream_chat

    prompts = json.loads(PROMPTS.read_text())["grounded"]
    s = LocalSession(members=3, model=model_path(model), latency_ms=latency_ms, speculate=speculate,
                     precision=precision, kquant=kquant, draft=model_path(draft), batch_rows=True,
                     log_dir=tempfile.mkdtemp(prefix="kafila-bench-logs-"),
                     cache_root=tempfile.mkdtemp(prefix="kafila-bench-cache-"))  # fmt: skip
    t0 = time.monotonic()
    s.start(timeout_s=600)
    try:
        st = get_json(s.api("m1"), "/status")
        head = st["plan"]["head"]
        for name in s.names:  # warm-up: the backends prepare kernels per new step shape at first use
            stream_chat(s.api(name), prompts[0], 16, extra={"speculate": True})
        one_level(s, users, 8, prompts, {"speculate": True})  # and the batched shapes
        spec, plain, plain_h = [], [], []
        for r in range(rounds):
            order = [(spec, True), (plain, False)] if r % 2 == 0 else [(plain, False), (spec, True)]
            for rows, flag in order:
                rows.append(one_level(s, users, max_tokens, prompts, {"speculate": flag}, requests))
                if not flag:  # H for the bound: the trip's network time after plain rounds (the drafters'
                    # contention for a shared machine's cores would count as network after speculating ones)
                    plain_h.append(get_json(s.api(head), "/status").get("network_ms"))
        head_status = get_json(s.api(head), "/status")
    finally:
        s.stop()
    session_spec = head_status.get("speculation")
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    same = sum(a == b for x, y in zip(spec, plain) for a, b in zip(x["texts"], y["texts"]))
    ratios = [a["aggregate_tok_s"] / b["aggregate_tok_s"] for a, b in zip(spec, plain)]
    totals = spec_totals(spec)
    from bench.ring_bound import session_ring

    stages, network_ms = session_ring(head_status)
    known_h = [h for h in plain_h if h is not None]
    bounds = machine_bounds(stages, statistics.median(known_h) if known_h else network_ms, model, draft, users,
                            totals["acceptance"], precision, kquant)  # fmt: skip
    return {"bounds": bounds, "latency_ms": latency_ms, "users": users, "plan": st["plan"], "slots": st["session"]["concurrency"],
            "plain_tok_s": med(plain, "aggregate_tok_s"), "origin_tok_s": med(spec, "aggregate_tok_s"),
            "ratio": med(spec, "aggregate_tok_s") / med(plain, "aggregate_tok_s"),
            "ratio_per_round": ratios, "plain_decode_tok_s": med(plain, "decode_aggregate_tok_s"),
            "origin_decode_tok_s": med(spec, "decode_aggregate_tok_s"),
            "decode_ratio": med(spec, "decode_aggregate_tok_s") / med(plain, "decode_aggregate_tok_s"),
            "ttft_ms": [med(plain, "ttft_ms_median"), med(spec, "ttft_ms_median")],
            "users_sum": [med(plain, "users_tok_s_sum"), med(spec, "users_tok_s_sum")], "plain_tpot_ms": med(plain, "tpot_ms_median"),
            "origin_tpot_ms": med(spec, "tpot_ms_median"), **totals,
            "same_text": same, "answers": users * requests * rounds, "requests": requests,
            "short_answers": sum(r["short_answers"] for r in spec + plain), "session_speculation": session_spec,
            "rounds": {"origin": spec, "plain": plain}, "session_s": round(time.monotonic() - t0, 1)}  # fmt: skip


def machine_bounds(stages: list[tuple[int, int]], network_ms: float, model: str, draft: str | None, users: int,
                   alpha: float | None, precision: str, kquant: str) -> dict | None:  # fmt: skip
    """What this machine allows plain and speculating decoding (bench.ring_bound.bound and
    spec_bound), from the session's stages' batched steps and the draft model's one-token step,
    each timed here in one process after the session has gone, and H = `network_ms`. None
    without a draft model or a measured acceptance (n-gram drafts cost no model step to price)."""
    if draft is None or alpha is None:
        return None
    from backends.gguf import open_model
    from bench.ring_bound import bound, spec_bound, stage_costs
    from kafila.models.registry import resolve_model

    costs = stage_costs(resolve_model(model_path(model)), stages, BOUND_ROWS, precision=precision, kquant=kquant)
    draft_path = resolve_model(model_path(draft))
    whole = open_model(draft_path).hparams.n_blocks
    draft_ms = stage_costs(draft_path, [(0, whole)], [1], precision=precision, kquant=kquant)[0][1]
    plain, spec = bound(costs, users, network_ms), spec_bound(costs, users, network_ms, alpha, draft_ms)
    return {"network_ms": network_ms, "draft_ms": draft_ms, "plain": plain, "spec": spec,
            "ratio": spec["tok_s"] / plain["tok_s"], "stage_costs": costs}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.dipsd", description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", default="20,50", help="hop latencies in ms, comma-separated")
    p.add_argument("--users", type=int, default=4, help="concurrent users (typed at m1, m2, m3 in turn)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens each user asks for")
    p.add_argument("--rounds", type=int, default=3, help="A/B pairs measured per latency (median)")
    p.add_argument("--requests", type=int, default=1, help="prompts each user asks one after another in a round")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--precision", choices=("serving", "f32"), default="serving")
    p.add_argument("--speculate", choices=("origin", "ngram", "draft"), default="origin",
                   help="the session's drafting: at each request's member (default), n-grams at the head, "
                        "or the draft model (--draft) at the head")
    p.add_argument("--draft", default=None, help="a draft model every member gets (alias, path or pypi_gguf name)")
    p.add_argument("--kquant", choices=KQUANTS, default=DEFAULT_KQUANT,
                   help="the K-quant form every member computes in (kafila host --kquant)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        latencies = [float(x) for x in args.latency.split(",")]
    except ValueError:
        print("bench.dipsd: --latency takes comma-separated numbers", file=sys.stderr)
        return 2
    if args.speculate == "draft" and not args.draft:
        print("bench.dipsd: --speculate draft needs --draft MODEL", file=sys.stderr)
        return 2
    if (not 1 <= args.users <= 16 or not 1 <= args.max_tokens <= 1024 or not 1 <= args.rounds <= 20
            or not 1 <= args.requests <= 16 or min(latencies) < 0):
        print("bench.dipsd: --users 1..16, --max-tokens 1..1024, --rounds 1..20, --requests 1..16, latencies ≥ 0",
              file=sys.stderr)
        return 2
    print(header(), flush=True)
    print(f"3 members on loopback, {args.model} at {args.precision} precision, {args.users} users typed at m1, m2, m3 "
          f"in turn, grounded prompts, {args.requests} request(s) each one after another, {args.max_tokens} tokens "
          f"each, median of {args.rounds} A/B rounds, "
          f"--speculate {args.speculate}" + (f", draft model {args.draft}" if args.draft else "")
          + f", --kquant {args.kquant}", flush=True)
    fmt = lambda x, d=2: "—" if x is None else f"{x:.{d}f}"  # noqa: E731
    out = {}
    for ms in latencies:
        r = out[f"{ms:g}"] = run_latency(ms, args.users, args.max_tokens, args.rounds, args.model, args.precision,
                                         args.speculate, args.requests, args.draft, args.kquant)  # fmt: skip
        print(f"{ms:>4g} ms/hop  plain (batched rows) {r['plain_tok_s']:6.1f} tok/s  {args.speculate} drafting "
              f"{r['origin_tok_s']:6.1f} tok/s  ratio {r['ratio']:.2f}× (rounds "
              f"{', '.join(f'{x:.2f}' for x in r['ratio_per_round'])})  decoding only {r['plain_decode_tok_s']:.1f} → "
              f"{r['origin_decode_tok_s']:.1f} tok/s {r['decode_ratio']:.2f}×  users' own rates summed {r['users_sum'][0]:.1f} → {r['users_sum'][1]:.1f} tok/s "
              f"{r['users_sum'][1] / r['users_sum'][0]:.2f}×  TTFT {r['ttft_ms'][0]:.0f} / {r['ttft_ms'][1]:.0f} ms  acceptance {fmt(r['acceptance'])}  "
              f"tokens/trip {fmt(r['tokens_per_trip'])}  origin share {fmt(r['origin_share'])} "
              f"({r['origin_steps']} of {r['origin_steps'] + r['fallback_steps']} drafting steps)  "
              f"same text {r['same_text']}/{r['answers']}  TPOT {r['plain_tpot_ms']:.0f} → {r['origin_tpot_ms']:.0f} ms"
              + (f"  ({r['short_answers']} answers ended early)" if r["short_answers"] else ""), flush=True)  # fmt: skip
        if r["bounds"]:
            b = r["bounds"]
            print(f"{'':>4}   this machine's bound (bench/ring_bound.py; decoding only): plain {b['plain']['tok_s']:.1f} "
                  f"tok/s ({b['plain']['groups']} × {b['plain']['rows']}), speculating {b['spec']['tok_s']:.1f} tok/s "
                  f"({b['spec']['groups']} × {b['spec']['rows']}, {b['spec']['draft']} drafts), ratio {b['ratio']:.2f}×; "
                  f"H {b['network_ms']:.1f} ms a trip, draft step {b['draft_ms']:.1f} ms, α {r['acceptance']:.2f}; "
                  f"measured ÷ bound: plain {r['plain_decode_tok_s'] / b['plain']['tok_s']:.2f}, speculating "
                  f"{r['origin_decode_tok_s'] / b['spec']['tok_s']:.2f}", flush=True)  # fmt: skip
    print(f"\n| hop ms | users | drafting | plain tok/s | speculating tok/s | ratio | decoding-only ratio "
          "| this machine's bound ratio | decoding-only ratio ÷ bound ratio "
          "| acceptance | tokens/trip | same text |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ms, r in out.items():
        b = r["bounds"]
        print(f"| {ms} | {r['users']} | {args.speculate}{' + ' + args.draft if args.draft else ''} "
              f"| {r['plain_tok_s']:.1f} | {r['origin_tok_s']:.1f} | {r['ratio']:.2f}× | {r['decode_ratio']:.2f}× "
              f"| {fmt(b and b['ratio'])}{'×' if b else ''} | {fmt(b and r['decode_ratio'] / b['ratio'])} "
              f"| {fmt(r['acceptance'])} | {fmt(r['tokens_per_trip'])} | {r['same_text']}/{r['answers']} |")
    if args.json:
        print(json.dumps(out, default=str))  # one line: bench.before_after reads the last
    return 0


if __name__ == "__main__":
    sys.exit(main())
