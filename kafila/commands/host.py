"""`kafila host --model M …`: open a session, plan it when the members are in, serve."""

from __future__ import annotations

import argparse

from kafila.commands.join import add_common, check_backend, common_config


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "host", help="open a session for a model and serve it with the members who join",
        description="Register a session (an embedded rendezvous unless --rendezvous is given), "
        "print its code, wait for --expect members (or Enter), plan, send each member its "
        "weights, and serve until SIGINT/SIGTERM.",
    )
    p.add_argument("--model", default="smollm2-135m", help="GGUF path or alias (default smollm2-135m)")
    p.add_argument("--expect", type=int, default=0, metavar="N",
                   help="session size, the host included; plan as soon as N are in")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="positions per request, prompt and answer (default 2048, or the model's own "
                        "context if shorter)")
    p.add_argument("--concurrency", default="auto", metavar="N|auto",
                   help="requests served at once, each with a KV slot on every member: N (1..64), or auto "
                        "(default): as many as the members' memory holds at the context, at most 32")
    p.add_argument("--max-queued", default="64", metavar="N",
                   help="requests that may wait for a slot (default 64); one more is answered HTTP 429 "
                        "with Retry-After")
    p.add_argument("--speculate", choices=("off", "ngram", "draft", "origin"), default="off",
                   help="speculative decoding: off, ngram (drafts looked up in the request's own prompt "
                        "and output), draft (a draft model, --draft, at the head) or origin (n-gram drafts "
                        "made at the member where each request was typed, carried to the head on its "
                        "activations; the head's own n-grams where they are stale); drafts are verified "
                        "in one trip round the ring, as many as pay (none when they do not)")
    p.add_argument("--policy", choices=("kafila", "uniform", "memory"), default="kafila",
                   help="how blocks are divided (default kafila: the planner)")
    p.add_argument("--batch-rows", choices=("on", "off"), default="on",
                   help="batched decode rows (default on): decode steps of several requests that are "
                        "ready together go round the ring as one micro-batch, each stage running them as "
                        "one forward (its weights read once for all); off: every step travels alone. At --precision "
                        "serving a batched answer can part from its solo answer at a near-tie (bf16 sums "
                        "differ with the batch, as in llama.cpp's and vLLM's batching); f32 gives the same")
    p.add_argument("--dipsd", choices=("on", "off"), default="on",
                   help="with --speculate ngram and several requests speculating at once, the head's live "
                        "DiP-SD optimiser chooses their draft lengths and micro-batches together "
                        "(default on); off: each request's draft length is chosen alone")
    p.add_argument("--prompt-cache", choices=("on", "off"), default="on",
                   help="prompt caching (default on): a finished request's KV stays on every member, "
                        "and a prompt that starts the same way (the next turn of a conversation, a "
                        "shared system prompt) feeds only the rest; off: every prompt is fed whole")
    p.add_argument("--precision", choices=("serving", "f32"), default="serving",
                   help="every stage's compute: serving (the backend's fast defaults: bf16 and a u8 KV "
                        "cache where the CPU has them) or f32 (slower; greedy answers do not depend on "
                        "how steps are batched, e.g. by --speculate)")
    p.add_argument("--auto-replan", action="store_true",
                   help="add a machine that joins the serving session at once (a replan: requests in "
                        "flight pause and resume); without it, joiners are added when a member leaves")
    p.add_argument("--code-file", metavar="F", help="also write the code to F, mode 0600 (for scripts: "
                   "`kafila join --code-file F`)")
    p.add_argument("--words", type=int, choices=(3, 4), default=3,
                   help="words in the session code: 3 (default), or 4 for a session that stays open long "
                   "(each code admits one wrong guess, then a new one is needed)")
    p.add_argument("--listen", default="0.0.0.0:7473", metavar="HOST:PORT",
                   help="where the embedded rendezvous listens when no --rendezvous is given")
    add_common(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from backends.errors import BadInput
    from backends.gguf import open_model
    from kafila.commands.rendezvous import parse_host_port
    from kafila.models import resolve_model
    from kafila.session.host import HostParticipant, session_context
    from kafila.session.participant import stdin_is_terminal
    from kafila.session.slots import parse_concurrency, parse_max_queued

    if args.expect < 0:
        raise BadInput("--expect N: N is the session size, the host included (1 or more)")
    check_backend(args.backend)
    concurrency = parse_concurrency(args.concurrency)  # 0, negative, not a number: one line, exit 2
    max_queued = parse_max_queued(args.max_queued)
    cfg = common_config(args, host=True)
    cfg = replace(cfg, model_path=resolve_model(args.model), expect=args.expect, context=args.context,
                  concurrency=concurrency, max_queued=max_queued, batch_rows=args.batch_rows == "on", dipsd=args.dipsd == "on", prompt_cache=args.prompt_cache == "on", speculate=args.speculate, precision=args.precision, policy=args.policy, code_file=args.code_file, auto_replan=args.auto_replan, code_words=args.words,
                  embedded_listen=parse_host_port(args.listen))  # fmt: skip
    index = open_model(cfg.model_path)  # a missing or bad model: one line, exit 2, before anything starts
    session_context(args.context, index.hparams.context_length, index.name)  # so is a --context it lacks
    if args.speculate == "draft" and not cfg.draft_path:
        raise BadInput("--speculate draft needs --draft GGUF (a small model of the same vocabulary)")
    if cfg.draft_path:
        from kafila.session.draft import open_draft

        open_draft(cfg.draft_path, index)  # another vocabulary: one line, exit 2
    if args.expect == 0 and not stdin_is_terminal():
        raise BadInput("give --expect N (the session size, host included): standard input is not "
                       "a terminal, so nobody can press Enter to start planning")
    return HostParticipant(cfg).run()
