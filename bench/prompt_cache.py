"""A conversation on a 3-member session, prompt caching on and off: each turn's time to first token.

    .venv/bin/python -m bench.prompt_cache [--model smollm2-135m] [--turns 6] [--max-tokens 48]
                                           [--again 0] [--rounds 2] [--latency 0] [--serve] [--json]

A chat client sends the whole conversation every turn, so without a cache turn k prefills every
earlier turn again. One loopback session of separate processes (kafila demo's launcher) with
`kafila host --prompt-cache on` (the default) and one with `off`, one after the other, in every
round (the order alternates: on, off, off, on, …, so the machine's drift hits both). In each
session a user holds a conversation of --turns turns typed at m2 (the answers greedy, --max-tokens
each, appended to the history as the page and `kafila chat` do), then a second user types a new
question at m3 (a new conversation: only the chat template's system prompt can be shared), then
the first user asks its last turn again --again times (a client's "regenerate": the slot is cut
back to the prompt and the answer decodes again). Reported per request, medians over the rounds:
the prompt's tokens, the tokens the head found cached (usage.prompt_tokens_details.cached_tokens),
TTFT and decode tok/s with the cache on and off, and off ÷ on. --serve measures `kafila serve`
(one process, the whole model, `--prompt-cache on|off`) instead of a session.
The answers must be the same text with the cache on and off (greedy; a near-tie at serving
precision can part them, and the bench says how many did).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from bench.llamacpp_speed import machine

QUESTIONS = [
    "Tell me about the moon.",
    "Why does it change shape through the month?",
    "How far away is it?",
    "Could people live there?",
    "What would they need to bring?",
    "Write a short poem about it.",
    "Summarise what we talked about.",
    "Thank you. One more fact, please.",
]
NEW_USER = "What is the capital of Italy?"


def conversation(session, turns: int, max_tokens: int, again: int = 0) -> list[dict]:
    """One user's conversation at m2, then a new user's question at m3, then the first user's
    last turn asked `again` times: each request's figures."""
    from kafila.tooling.launch import stream_chat

    history: list[dict] = []
    out = []
    for k in range(turns):
        history.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
        r = stream_chat(session.api("m2"), list(history), max_tokens)
        history.append({"role": "assistant", "content": r["text"]})
        out.append(r)
    out.append(stream_chat(session.api("m3"), NEW_USER, max_tokens))
    for _ in range(again):
        out.append(stream_chat(session.api("m2"), list(history[:-1]), max_tokens))
    return out


def one_session(prompt_cache: bool, model: str, turns: int, max_tokens: int, latency_ms: float,
                again: int = 0) -> list[dict]:
    from kafila.tooling.launch import LocalSession, stream_chat

    s = LocalSession(members=3, model=model, latency_ms=latency_ms, prompt_cache=prompt_cache,
                     log_dir=tempfile.mkdtemp(prefix="kafila-bench-logs-"),
                     cache_root=tempfile.mkdtemp(prefix="kafila-bench-cache-"))  # fmt: skip
    s.start(timeout_s=1800)
    try:
        for name in s.names:  # warm-up: first steps of each shape compile kernels
            stream_chat(s.api(name), "Hello.", 4)
        return conversation(s, turns, max_tokens, again)
    finally:
        s.stop()


class Served:
    """`kafila serve --prompt-cache on|off` on a free loopback port, as a session's stand-in:
    every member name is its one API."""

    def __init__(self, model: str, prompt_cache: bool) -> None:
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.names = ["m1"]
        self.proc = subprocess.Popen([sys.executable, "-m", "kafila", "serve", "--model", model, "--api",
                                      f"127.0.0.1:{port}", "--prompt-cache", "on" if prompt_cache else "off"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
        for line in self.proc.stdout:  # "serving … at URL/v1 …" once it listens
            if line.startswith("serving"):
                return
        raise SystemExit(f"kafila serve exited ({self.proc.wait()}) before serving")

    def api(self, name: str) -> str:
        return self.url

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def one_served(prompt_cache: bool, model: str, turns: int, max_tokens: int, latency_ms: float,
               again: int = 0) -> list[dict]:
    from kafila.tooling.launch import stream_chat

    s = Served(model, prompt_cache)
    try:
        stream_chat(s.api("m1"), "Hello.", 4)  # warm-up
        return conversation(s, turns, max_tokens, again)
    finally:
        s.stop()


def run(model: str, turns: int, max_tokens: int, rounds: int, latency_ms: float, again: int = 0,
        serve: bool = False) -> dict:
    runs: dict[bool, list[list[dict]]] = {True: [], False: []}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            runs[on].append((one_served if serve else one_session)(on, model, turns, max_tokens, latency_ms, again))
    med = lambda rows, key: statistics.median(x[key] for x in rows)  # noqa: E731
    table = []
    for k in range(turns + 1 + again):
        on = [conv[k] for conv in runs[True]]
        off = [conv[k] for conv in runs[False]]
        name = k + 1 if k < turns else "new user" if k == turns else f"turn {turns} again ({k - turns})"
        table.append({"turn": name, "prompt_tokens": med(on, "prompt_tokens"),
                      "tok_s_on": med(on, "tok_s"), "tok_s_off": med(off, "tok_s"),
                      "cached_on": med(on, "cached_tokens"), "cached_off": med(off, "cached_tokens"),
                      "ttft_on_ms": med(on, "ttft_ms"), "ttft_off_ms": med(off, "ttft_ms"),
                      "ratio": med(off, "ttft_ms") / med(on, "ttft_ms"),
                      "same_text": sum(a["text"] == b["text"] for a, b in zip(on, off)), "of": len(on)})  # fmt: skip
    total_on = statistics.median(sum(x["ttft_ms"] for x in conv) for conv in runs[True])
    total_off = statistics.median(sum(x["ttft_ms"] for x in conv) for conv in runs[False])
    return {"model": model, "turns": turns, "max_tokens": max_tokens, "rounds": rounds, "latency_ms": latency_ms,
            "again": again, "serve": serve,
            "table": table, "ttft_total_on_ms": total_on, "ttft_total_off_ms": total_off}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.prompt_cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a model name or GGUF path")
    p.add_argument("--turns", type=int, default=6, help="turns of the conversation (1..16)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens each answer asks for")
    p.add_argument("--again", type=int, default=0, help="times the last turn is asked again (0..16)")
    p.add_argument("--rounds", type=int, default=2, help="sessions of each kind (median)")
    p.add_argument("--latency", type=float, default=0.0, help="ms added to every hop")
    p.add_argument("--serve", action="store_true", help="kafila serve (one process) instead of a session")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not 1 <= args.turns <= 16 or not 0 <= args.again <= 16 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--turns takes 1..16, --again 0..16, --rounds and --max-tokens at least 1")
    t0 = time.monotonic()
    if args.serve and args.latency:
        p.error("--latency is a session's: kafila serve has no hops")
    out = run(args.model, args.turns, args.max_tokens, args.rounds, args.latency, args.again, args.serve)
    out["machine"] = machine()
    out["wall_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"# {out['machine']}")
    where = "kafila serve" if args.serve else f"3 members, {args.latency:g} ms a hop"
    print(f"# {args.model}, {where}, {args.max_tokens} tokens an answer, "
          f"medians of {args.rounds} run(s) each; {out['wall_s']} s")  # fmt: skip
    print("| turn | prompt tokens | cached (on) | TTFT on ms | TTFT off ms | off ÷ on | decode tok/s on | off | "
          "on ÷ off | same text |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in out["table"]:
        print(f"| {row['turn']} | {row['prompt_tokens']:.0f} | {row['cached_on']:.0f} | {row['ttft_on_ms']:.0f} | "
              f"{row['ttft_off_ms']:.0f} | **{row['ratio']:.2f}×** | {row['tok_s_on']:.1f} | {row['tok_s_off']:.1f} | "
              f"{row['tok_s_on'] / row['tok_s_off']:.2f}× | {row['same_text']}/{row['of']} |")  # fmt: skip
    print(f"| all requests | | | {out['ttft_total_on_ms']:.0f} | {out['ttft_total_off_ms']:.0f} | "
          f"**{out['ttft_total_off_ms'] / out['ttft_total_on_ms']:.2f}×** | | | | |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
