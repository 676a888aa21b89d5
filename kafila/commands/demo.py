"""`kafila demo`: a whole session on this machine — host, members, a prompt, the plan, tok/s."""

from __future__ import annotations

import argparse
import json
import os

from kafila.commands import _options

DEFAULT_PROMPT = "Name three uses of a pooled home computer cluster."
# Forming waits as long as a member waits to be ready (session/member.py READY_TIMEOUT_S: weights
# over a slow link and a shard build; an 8B shape's three builds on one small machine take minutes).
FORM_TIMEOUT_S = 900.0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="run a whole session on this machine and answer one prompt",
        description="Start a host (with its embedded rendezvous) and N-1 members as separate "
        "processes on 127.0.0.1, form the session, answer the prompt through the ring, print the "
        "plan and the measured speed, and stop everything.",
    )
    p.add_argument("--members", type=int, default=3, metavar="N", help="session size, host included (default 3)")
    _options.add_model(p)
    _options.add_backend(p)
    _options.add_policy(p)
    p.add_argument("--throttle", action="append", default=[], metavar="NAME=FRACTION",
                   help="run member NAME under a CPU quota (FRACTION of one CPU), e.g. m2=0.25")
    _options.add_latency(p, "every member")
    _options.add_context(p)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    _options.add_max_tokens(p, 64)
    _options.add_speculate(p)
    _options.add_draft(p, "every member gets: the head drafts with it (--speculate draft), each member for the requests typed at it (--speculate origin)")
    _options.add_precision(p)
    _options.add_kquant(p)
    p.add_argument("--ask", default=None, metavar="NAME", help="the member the prompt is typed at (default: the last)")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "kafila", "demo"),
                   help="members' weight caches (NAME/ below it; a rerun fetches only what changed)")
    p.add_argument("--json", action="store_true",
                   help='print {"text","tokens","tok_s","ttft_ms","plan","memory","prediction"} (memory: per member; '
                   'prediction: per stage predicted_ms, measured_ms, error, and tok_s likewise)')
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import signal

    from rich.console import Console

    from backends.errors import BadInput, KafilaError
    from backends.gguf import open_model
    from kafila.commands.join import check_backend
    from kafila.models import resolve_model
    from kafila.session.control.config import session_context
    from kafila.session.control.preview import plan_table, predicted_tok_s
    from kafila.tooling.launch import LocalSession, get_json, stream_chat
    from kafila.tooling.throttle import parse_throttle

    if not 1 <= args.members <= 9:
        raise BadInput("--members N: choose 1..9")
    if args.max_tokens < 1:
        raise BadInput("--max-tokens N: N must be at least 1")
    if not args.prompt.strip():
        raise BadInput("--prompt is empty")
    if not 0 <= args.latency_ms <= 10_000:
        raise BadInput("--latency-ms L: choose 0..10000")
    check_backend(args.backend)
    index = open_model(resolve_model(args.model))  # a missing or bad model fails here, before any process starts
    from kafila.session.ring.speculation.draft import check_drafting

    args.draft = resolve_model(args.draft) if args.draft else None
    check_drafting(args.speculate, args.draft, index)  # missing, not a GGUF or another vocabulary: one line
    session_context(args.context, index.hparams.context_length, index.name)  # a --context it lacks: one line
    throttle = dict(parse_throttle(t) for t in args.throttle)
    console = Console(stderr=True)
    session = LocalSession(members=args.members, model=args.model, backend=args.backend,
                           policy=args.policy, latency_ms=args.latency_ms, speculate=args.speculate,
                           precision=args.precision, kquant=args.kquant, draft=args.draft, throttle=throttle, context=args.context,
                           cache_root=args.cache_dir, debug=args.debug)  # fmt: skip
    ask = args.ask or session.names[-1]
    if ask not in session.names:
        raise BadInput(f"--ask {ask}: the members are {', '.join(session.names)}")

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupted)
    try:
        console.print(f"demo: starting {args.members} processes on 127.0.0.1 "
                      f"({', '.join(session.names)}; {session.names[0]} hosts)…")  # fmt: skip
        session.start(timeout_s=FORM_TIMEOUT_S)
        plan = session.plan or get_json(session.api(session.names[0]), "/status").get("plan")
        if not args.json:
            from planner import Plan

            console.print(plan_table(plan, Plan.from_json(plan).block_ranges()))
            console.print(f"demo: asking {ask}: {args.prompt}")
        stream_chat(session.api(ask), "Hi", 2)  # warm-up: a fresh stage's first inference is slow
        # no client-side timeout: the ring's watchdog bounds every step, longer for a longer one
        # (ring.hang_bound_s); a long prompt's prefill on a big model takes minutes (issue 10)
        answer = stream_chat(session.api(ask), args.prompt, args.max_tokens, timeout_s=None)
        status = get_json(session.api(plan["head"]), "/status")  # the head measures every stage
        # each member's memory while serving, after the answer (peak covers loading too)
        memory = {n: (status if n == plan["head"] else get_json(session.api(n), "/status")).get("memory")
                  for n in session.names}  # fmt: skip
    finally:
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not strand them
        try:
            codes = session.stop()
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old)
    from kafila.session.control.pricing import predictions

    # the planner's per-stage ms and tok/s beside the head's measured compute and this answer's rate
    measured = {n: v.get("compute_ms") for n, v in (status.get("stages") or {}).items() if v.get("compute_ms")}
    result = {"text": answer["text"], "tokens": answer["tokens"], "tok_s": _r(answer["tok_s"]),
              "ttft_ms": _r(answer["ttft_ms"]), "plan": plan, "memory": memory,
              "speculation": answer.get("speculation"),
              "prediction": predictions(plan, measured, answer["tok_s"])}  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print(answer["text"])
        predicted = predicted_tok_s(plan)
        stages = ", ".join(f"{n} {v['measured_ms']} ms (predicted {v['predicted_ms']})"
                           for n, v in result["prediction"]["stages"].items() if v.get("measured_ms") is not None)
        edges = ", ".join(f"{e['from']}→{e['to']} {e.get('kind')}" for e in status.get("edges", []))
        console.print(f"demo: {answer['tokens']} tokens, {result['tok_s']} tok/s measured"
                      f"{f' (planner predicted {predicted:.1f})' if predicted else ''}, "
                      f"time to first token {result['ttft_ms']} ms")  # fmt: skip
        if stages:
            console.print(f"demo: stage compute {stages}; ring network {status.get('network_ms')} ms per step")
        if edges:
            console.print(f"demo: edges {edges}")
        mem = ", ".join(f"{n} {memory_line(v)}" for n, v in memory.items() if v)
        if mem:
            console.print(f"demo: memory {mem}")
    failed = member_failures(codes, {n: session.proc(n).log_path for n in codes})
    if failed:
        raise KafilaError(failed)  # the answer above came, but the session did not end cleanly
    return 0


# How a member stopped by our SIGINT ends: a clean exit, or killed by the signal itself.
STOPPED_EXIT_CODES = (0, -2, 130)


def member_failures(codes: dict[str, int], logs: dict[str, str]) -> str | None:
    """One line naming each member that ended with an error, or None when all stopped cleanly."""
    bad = [f"member {name} ended with exit code {code} (its log: {logs.get(name) or 'none'})"
           for name, code in codes.items() if code not in STOPPED_EXIT_CODES]  # fmt: skip
    return "; ".join(bad) or None


def memory_line(m: dict) -> str:
    """'RSS 1.20 GB (1.10× shard+KV), peak 1.31 GB, PSS 1.15 GB' from a /status memory entry."""

    def gb(v):
        return "?" if v is None else f"{v / 1e9:.2f} GB"

    ratio = m.get("rss_per_shard_kv")
    return (f"RSS {gb(m.get('rss_bytes'))}" + ("" if ratio is None else f" ({ratio:.2f}× shard+KV)")
            + f", peak {gb(m.get('peak_rss_bytes'))}, PSS {gb(m.get('pss_bytes'))}")  # fmt: skip


def _r(v):
    return None if v is None else round(v, 2)
