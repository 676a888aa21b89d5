"""`kafila host --model M …`: open a session, plan it when the members are in, serve."""

from __future__ import annotations

import argparse

from kafila.commands import _options
from kafila.commands.join import add_common, check_backend, common_config


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "host", help="open a session for a model and serve it with the members who join",
        description="Register a session (an embedded rendezvous unless --rendezvous is given), "
        "print its code, wait for --expect members (or Enter), plan, send each member its "
        "weights, and serve until SIGINT/SIGTERM.",
    )
    _options.add_model(p)
    p.add_argument("--expect", type=int, default=0, metavar="N",
                   help="session size, the host included; plan as soon as N are in")
    _options.add_context(p)
    _options.add_concurrency(p)
    p.add_argument("--max-queued", default="64", metavar="N",
                   help="requests that may wait for a slot (default 64); one more is answered HTTP 429 "
                        "with Retry-After")
    _options.add_speculate(p)
    _options.add_policy(p)
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
    _options.add_prompt_cache(p, " on every member")
    _options.add_precision(p)
    _options.add_kquant(p)
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
    from kafila.session.control.host import HostParticipant, session_context
    from kafila.session.control.system import stdin_is_terminal
    from kafila.session.ring.slots import parse_concurrency, parse_max_queued

    if args.expect < 0:
        raise BadInput("--expect N: N is the session size, the host included (1 or more)")
    check_backend(args.backend)
    concurrency = parse_concurrency(args.concurrency)  # 0, negative, not a number: one line, exit 2
    max_queued = parse_max_queued(args.max_queued)
    cfg = common_config(args, host=True)
    cfg = replace(cfg, model_path=resolve_model(args.model), expect=args.expect, context=args.context,
                  concurrency=concurrency, max_queued=max_queued, batch_rows=args.batch_rows == "on", dipsd=args.dipsd == "on", prompt_cache=args.prompt_cache == "on", speculate=args.speculate, precision=args.precision, kquant=args.kquant, policy=args.policy, code_file=args.code_file, auto_replan=args.auto_replan, code_words=args.words,
                  embedded_listen=parse_host_port(args.listen))  # fmt: skip
    index = open_model(cfg.model_path)  # a missing or bad model: one line, exit 2, before anything starts
    session_context(args.context, index.hparams.context_length, index.name)  # so is a --context it lacks
    from kafila.session.ring.speculation.draft import check_drafting

    check_drafting(args.speculate, cfg.draft_path, index)  # no draft model, another vocabulary: one line, exit 2
    if args.expect == 0 and not stdin_is_terminal():
        raise BadInput("give --expect N (the session size, host included): standard input is not "
                       "a terminal, so nobody can press Enter to start planning")
    console = TerminalConsole()
    host = HostParticipant(cfg, console.console, view=console)  # one console: lines print above its table
    console.host = host
    return host.run()


class TerminalConsole:
    """The host in a terminal (a HostView, kafila.session.control.host): the members in a live
    table while it waits, a bar per member's weights while a plan forms, and Enter read from
    standard input (plan now; while serving, replan with the machines that joined). Anywhere
    else (scripts, CI: stdin not a terminal) it shows nothing and reads nothing."""

    def __init__(self) -> None:
        from rich.console import Console

        from kafila.session.control.system import stdin_is_terminal

        self.console = Console(stderr=True)
        self.takes_enter = stdin_is_terminal()
        self.host = None  # the HostParticipant Enter goes to
        self._reading = False
        self._live = None
        self._bars = None
        self._bar_ids: dict[str, int] = {}

    def _read_enter(self) -> None:
        """Once the host's loop runs: Enter calls host.enter()."""
        import asyncio
        import sys

        if self._reading or not self.takes_enter or self.host is None:
            return
        self._reading = True
        loop = asyncio.get_running_loop()

        def on_enter() -> None:
            if not sys.stdin.readline():  # the terminal went away: nobody presses Enter now
                loop.remove_reader(sys.stdin.fileno())
                self._reading = False
                return
            self.host.enter()

        loop.add_reader(sys.stdin.fileno(), on_enter)

    def waiting(self, rows: list[dict], title: str) -> None:
        from rich.live import Live

        from kafila.session.control.preview import members_table

        self._read_enter()
        if not (self.takes_enter and self.console.is_terminal):
            return
        if self._live is None:
            self._live = Live(members_table(rows, title), console=self.console, auto_refresh=False)
            self._live.start()
        self._live.update(members_table(rows, title), refresh=True)

    def waiting_done(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def transfers(self, totals: dict[str, int]) -> None:
        """A bar per member (MB/s, ETA) in a terminal, for as long as the plan forms."""
        if not totals or not self.console.is_terminal:
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )  # fmt: skip

        self._bars = Progress(TextColumn("weights to {task.description}"), BarColumn(), DownloadColumn(),
                              TransferSpeedColumn(), TimeRemainingColumn(), console=self.console)  # fmt: skip
        self._bar_ids = {name: self._bars.add_task(name, total=total) for name, total in totals.items()}
        self._bars.start()

    def transfer(self, name: str, done: int, total: int) -> None:
        if self._bars is not None and name in self._bar_ids:
            self._bars.update(self._bar_ids[name], completed=done, total=total)

    def transfers_done(self) -> None:
        if self._bars is not None:
            self._bars.stop()
            self._bars = None

    def close(self) -> None:
        import asyncio
        import sys

        self.waiting_done()
        self.transfers_done()
        if self._reading:
            self._reading = False
            try:
                asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
            except (RuntimeError, ValueError, OSError) as exc:  # no loop, or stdin already closed
                import logging

                logging.getLogger(__name__).debug("Enter no longer read: %r", exc)
