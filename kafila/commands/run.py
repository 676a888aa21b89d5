"""`kafila run`: one process, S shards of a model chained in order, greedy decode, streamed."""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from backends.errors import BadInput
from kafila.commands import _options

DEFAULT_MAX_TOKENS = 128
PROMPT_IDS_MAX_CHARS = 8 << 20  # --prompt-ids JSON text at most (a context of ~1M ids)


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run a model as S chained shards in this process",
                              description="Cut the model into S contiguous block ranges, chain them in this "
                                          "process and decode greedily, streaming tokens as they come.")
    _options.add_model(p)
    p.add_argument("--stages", type=int, default=1, help="number of shards (default 1)")
    _options.add_backend(p, per_stage=True)
    _options.add_precision(p)
    _options.add_kquant(p)
    _options.add_max_tokens(p, DEFAULT_MAX_TOKENS)
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true",
                   help='print one line {"text", "thinking", "tokens", "tok_s", "stages", "ids", "prompt_ids", "ttft_ms", '
                        '"memory"} instead of streaming: thinking is a harmony model\'s (gpt-oss) analysis channel '
                        '(null for others; text is then the reply alone), ids the generated token ids (EOS not included), '
                        'prompt_ids the prompt\'s ids as fed (chat-templated unless --raw), ttft_ms the time '
                        'from the start of the prefill (the shards built) to the first token, memory this '
                        'process\'s RSS, peak RSS and PSS in bytes right after the last token')
    p.add_argument("--prompt-ids", metavar="JSON",
                   help="feed these token ids (a JSON list of ints) instead of PROMPT: no chat template, no "
                        "tokenizer needed (a file whose tokenizer Kafila cannot read prints ids, not text)")
    p.add_argument("prompt", metavar="PROMPT", nargs="?")
    p.set_defaults(handler=run)


def run(args) -> int:
    from backends.gguf import open_model
    from kafila.engine.chain import LocalChain, parse_backends
    from kafila.models import load_tokenizer, resolve_model

    if (args.prompt is None) == (args.prompt_ids is None):
        raise BadInput("give either a PROMPT or --prompt-ids JSON (one of the two)")
    if args.prompt is not None and not args.prompt.strip():
        raise BadInput("the prompt is empty: give some text to continue")
    if args.max_tokens < 1:
        raise BadInput(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    if args.stages < 1:
        raise BadInput(f"--stages must be at least 1 (got {args.stages})")
    parse_backends(args.backend, args.stages)  # reject a bad list before loading anything
    index = open_model(resolve_model(args.model))
    index.split_blocks(args.stages)  # --stages larger than the block count → BadInput
    if args.prompt_ids is not None:
        ids = parse_prompt_ids(args.prompt_ids, index.hparams.vocab)
        try:
            tokenizer = load_tokenizer(index)
        except BadInput:  # e.g. llama.cpp's random models: a dummy vocabulary; ids are still served
            tokenizer = None
    else:
        tokenizer = load_tokenizer(index)
        text = args.prompt if args.raw else tokenizer.render_chat([{"role": "user", "content": args.prompt}])
        ids = tokenizer.encode(text)
        if not ids:
            raise BadInput("the prompt encodes to no tokens")
    if len(ids) + args.max_tokens > index.hparams.context_length:
        raise BadInput(f"prompt ({len(ids)} tokens) + --max-tokens exceeds the model's context of "
                       f"{index.hparams.context_length}")

    chain = LocalChain.build(index.path, args.stages, args.backend, args.precision, index=index, kquant=args.kquant)
    eos = tokenizer.eos_ids if tokenizer is not None else ()
    # a chat-templated prompt's answer: a harmony model's (gpt-oss) thinking apart from its reply
    channels = args.prompt_ids is None and not args.raw
    answer = Answer(tokenizer, channels, out=None if args.json else sys.stdout, prompt_ids=ids)
    first_at = None
    started = time.perf_counter()  # the prompt's prefill starts here (the build is done)
    for token in chain.generate(ids, args.max_tokens, stop=eos):
        if first_at is None:
            first_at = time.perf_counter()
        if token in eos:
            break
        answer.push(token)
    answer.close()
    tokens = answer.tokens
    elapsed = time.perf_counter() - first_at if first_at is not None else 0.0
    tok_s = (len(tokens) - 1) / elapsed if len(tokens) > 1 and elapsed > 0 else 0.0  # decode rate
    if args.json:
        from kafila.session.ring.memory import process_memory

        print(json.dumps({"text": answer.text(), "thinking": answer.thinking(), "tokens": len(tokens),
                          "tok_s": round(tok_s, 2), "stages": chain.stages,
                          "ids": tokens, "prompt_ids": list(ids),
                          "ttft_ms": None if first_at is None else round((first_at - started) * 1000, 1),
                          "memory": process_memory()}))
    else:
        print(f"[{len(tokens)} tokens, {tok_s:.1f} tok/s, {args.stages} stage(s): {args.backend}]", file=sys.stderr)
    return 0


class Answer:
    """The generated ids, and their text as it streams to `out` (None: kept only): decoded safely
    across UTF-8 pieces; with `channels`, a harmony model's or a leading <think> block's thinking
    apart from the reply (as `kafila chat` shows it); ids themselves when there is no tokenizer."""

    def __init__(self, tokenizer, channels: bool, out: TextIO | None, prompt_ids: list[int] = ()) -> None:
        from kafila.api import TextStream
        from kafila.api._think import think_mode
        from kafila.commands.chat import THINKING_FIELD, AnswerWriter

        self.tokens: list[int] = []
        think = think_mode(tokenizer, list(prompt_ids)) if channels and tokenizer is not None else None
        self.stream = TextStream(tokenizer, (), channels, think=think) if tokenizer is not None else None
        self.writer = AnswerWriter(out) if out is not None else None
        self.thinking_field = THINKING_FIELD
        self.reply: list[str] = []
        self.thought: list[str] = []

    def push(self, token: int) -> None:
        self.tokens.append(token)
        reply, thinking = self.stream.push(token) if self.stream is not None else (f"{token} ", "")
        self._show(reply, thinking)

    def close(self) -> None:
        if self.stream is not None:
            from kafila.engine import GenerationStats

            self._show(self.stream.end(GenerationStats())[0], "")
        if self.writer is not None:
            self.writer.close()

    def text(self) -> str | None:
        return "".join(self.reply) if self.stream is not None else None

    def thinking(self) -> str | None:
        """The thinking (a harmony model's analysis channel), or None when there was none."""
        return "".join(self.thought) or None

    def _show(self, reply: str, thinking: str) -> None:
        self.thought.append(thinking)
        self.reply.append(reply)
        if self.writer is not None:
            self.writer.write(self.thinking_field, thinking)
            self.writer.write("content", reply)


def parse_prompt_ids(raw: str, vocab: int) -> list[int]:
    """--prompt-ids: a non-empty JSON list of token ids, each in 0..vocab − 1."""
    if len(raw) > PROMPT_IDS_MAX_CHARS:
        raise BadInput(f"--prompt-ids is over {PROMPT_IDS_MAX_CHARS} characters")
    try:
        ids = json.loads(raw)
    except ValueError as exc:
        raise BadInput(f"--prompt-ids is not JSON ({exc}): give a list of token ids like [1, 2, 3]") from None
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise BadInput("--prompt-ids must be a non-empty JSON list of integers, like [1, 2, 3]")
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise BadInput(f"--prompt-ids holds {bad}, outside the model's vocabulary 0..{vocab - 1}")
    return ids
