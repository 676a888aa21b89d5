"""Speculative decoding on a 3-member session: tok/s with and without, side by side in one run.

    .venv/bin/python -m bench.spec [--latency 0,20,50] [--max-tokens 64] [--precision serving|f32] [--json]

One loopback session of separate processes (kafila demo's launcher) per hop latency, started
with `--speculate ngram`; every prompt of bench/spec_prompts.json is asked twice in a row at the
member that is not the head's neighbour, with the API's per-request `"speculate": false` and then
`true`, so a noisy machine hits both alike. Greedy: both answers are the same tokens at f32 (the
tests show it); at serving precision (bf16 compute, u8 KV where the CPU has them) a K+1-row
step runs other kernels than a 1-row step, so a near-tie can flip: the table counts the
answers that stayed the same text and where the others parted.
Reported per prompt set: decode tok/s (tokens after the first ÷ time from the first to the last,
as bench.session; the time to the first token, a prefill trip, is the same for both and is
shown once) plain and speculating, their ratio (median and minimum of the per-prompt ratios), the
acceptance rate, tokens per trip and drafts per trip (the K choose_k picked, on average: 0 when
it judged drafting not to pay). Two sets: input-grounded (quote, edit code, answer from a text,
reformat, summarise) and open chat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench._report import header, markdown

PROMPTS = Path(__file__).with_name("spec_prompts.json")


def run_latency(latency_ms: float, prompts: dict[str, list[str]], max_tokens: int, model: str,
                precision: str = "serving") -> dict:  # fmt: skip
    from kafila.tooling.launch import LocalSession, get_json, stream_chat

    s = LocalSession(members=3, model=model, latency_ms=latency_ms, speculate="ngram", precision=precision,
                     log_dir=tempfile.mkdtemp(prefix="kafila-bench-logs-"),
                     cache_root=tempfile.mkdtemp(prefix="kafila-bench-cache-"))  # fmt: skip
    s.start(timeout_s=600)
    try:
        ask = "m3"
        # warm-up: the backends prepare kernels per new step shape (1..K+1 positions) at first use
        for text in (prompts["grounded"][0], prompts["chat"][0]):
            stream_chat(s.api(ask), text, max_tokens, extra={"speculate": True})
        out = {}
        for name, texts in prompts.items():
            rows = []
            for text in texts:
                plain = stream_chat(s.api(ask), text, max_tokens, extra={"speculate": False})
                spec = stream_chat(s.api(ask), text, max_tokens, extra={"speculate": True})
                a, b = plain["text"], spec["text"]
                parted = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                rows.append({"plain_tok_s": plain["tok_s"], "spec_tok_s": spec["tok_s"], "tokens": spec["tokens"],
                             "plain_ttft_ms": plain["ttft_ms"], "spec_ttft_ms": spec["ttft_ms"],
                             "identical": a == b, "parted_at_char": None if a == b else parted,
                             **(spec["speculation"] or {})})  # fmt: skip
            out[name] = summarise(rows)
        head = get_json(s.api("m1"), "/status")["plan"]["head"]
        out["session_speculation"] = get_json(s.api(head), "/status").get("speculation")
        return out
    finally:
        s.stop()


def summarise(rows: list[dict]) -> dict:
    ratios = [r["spec_tok_s"] / r["plain_tok_s"] for r in rows]
    drafted = sum(r.get("drafted", 0) for r in rows)
    accepted = sum(r.get("accepted", 0) for r in rows)
    per_trip = [r["tokens_per_trip"] for r in rows if r.get("tokens_per_trip")]
    drafts = [r["drafts_per_trip"] for r in rows if r.get("drafts_per_trip") is not None]
    return {
        "plain_tok_s": statistics.median(r["plain_tok_s"] for r in rows),
        "spec_tok_s": statistics.median(r["spec_tok_s"] for r in rows),
        "ttft_ms": statistics.median(r["plain_ttft_ms"] for r in rows),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_trip": statistics.mean(per_trip) if per_trip else None,
        "drafts_per_trip": statistics.mean(drafts) if drafts else None,
        "prompts": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "parted_at_char": [r["parted_at_char"] for r in rows if not r["identical"]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", default="0,20,50", help="hop latencies in ms, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--precision", choices=("serving", "f32"), default="serving")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="also print the results as one markdown table")
    args = p.parse_args(argv)
    prompts = json.loads(PROMPTS.read_text())
    print(header(), flush=True)
    results = {}
    for ms in (float(x) for x in args.latency.split(",")):
        results[ms] = r = run_latency(ms, prompts, args.max_tokens, args.model, args.precision)
        for name in prompts:
            v = r[name]
            fmt = lambda x, d=2: "—" if x is None else f"{x:.{d}f}"  # noqa: E731
            print(f"{ms:>4.0f} ms/hop  {name:<9} TTFT {v['ttft_ms']:5.0f} ms  plain {v['plain_tok_s']:6.1f} tok/s  ngram {v['spec_tok_s']:6.1f} tok/s"
                  f"  ratio {v['ratio_median']:.2f}× (min {v['ratio_min']:.2f}×)  acceptance {fmt(v['acceptance'])}"
                  f"  tokens/trip {fmt(v['tokens_per_trip'])}  drafts/trip {fmt(v['drafts_per_trip'])}"
                  f"  same text {v['identical']}/{v['prompts']}", flush=True)
    if args.markdown:
        fmt = lambda x, d=2: "—" if x is None else f"{x:.{d}f}"  # noqa: E731
        print("\n" + markdown(["ms/hop", "prompts", "plain tok/s", "n-gram tok/s", "n-gram ÷ plain (min)",
                                "acceptance", "tokens/trip", "same text"],
                               [(f"{ms:g}", name, f"{v['plain_tok_s']:.1f}", f"{v['spec_tok_s']:.1f}",
                                 f"{v['ratio_median']:.2f}× ({v['ratio_min']:.2f}×)", fmt(v["acceptance"]),
                                 fmt(v["tokens_per_trip"]), f"{v['identical']}/{v['prompts']}")
                                for ms, r in results.items() for name, v in r.items() if name in prompts]))
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
