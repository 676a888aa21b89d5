"""`kafila tokenize`: a GGUF file's tokenization of some text, as llama.cpp's llama-tokenize gives it."""

from __future__ import annotations

import json
import sys

from backends.errors import BadInput


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "tokenize", help="show the token ids of a text with a GGUF file's tokenizer",
        description="Tokenize TEXT with the tokenizer stored in a GGUF file, as llama.cpp does "
                    "(a vocabulary-only GGUF is enough). By default BOS/EOS are added as the model asks "
                    "and special-token text such as <|im_start|> becomes its token, like llama-tokenize. "
                    "Pieces are the text each token stands for; bytes that are not whole UTF-8 "
                    "characters are shown as \\xNN.",
    )  # fmt: skip
    p.add_argument("--model", required=True, help="GGUF path or alias (see `kafila models`)")
    p.add_argument("--json", action="store_true", help='print one line {"ids": [...], "pieces": [...]}')
    p.add_argument("--no-bos", action="store_true",
                   help="add no BOS/EOS even where the model asks for them (default: add them)")
    p.add_argument("--no-parse-special", action="store_true",
                   help="treat control-token text (<|im_start|>, <s>, …) as plain text (default: parse it)")
    p.add_argument("--batch", action="store_true",
                   help="read a JSON array of strings from standard input and print one JSON line "
                        '{"ids", "pieces"} per string, in order (TEXT is not given)')
    p.add_argument("text", metavar="TEXT", nargs="?",
                   help="the text to tokenize; - reads it from standard input (all of it, newlines kept)")
    p.set_defaults(handler=tokenize)


def _pieces(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.piece(t, special=True).decode("utf-8", errors="backslashreplace") for t in ids]


def _texts(args) -> list[str]:
    if args.batch:
        if args.text is not None:
            raise BadInput("--batch reads its strings from standard input: give no TEXT")
        try:
            texts = json.loads(sys.stdin.buffer.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadInput(f"--batch wants a JSON array of strings on standard input: {exc}") from None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise BadInput("--batch wants a JSON array of strings on standard input")
        return texts
    if args.text is None:
        raise BadInput("give the TEXT to tokenize (or - to read it from standard input, or --batch)")
    if args.text != "-":
        return [args.text]
    try:
        return [sys.stdin.buffer.read().decode("utf-8")]
    except UnicodeDecodeError as exc:
        raise BadInput(f"standard input is not UTF-8 text: {exc}") from None


def tokenize(args) -> int:
    from kafila.models.registry import resolve_model
    from kafila.models.tokenizer import load_tokenizer_file

    texts = _texts(args)
    tokenizer = load_tokenizer_file(resolve_model(args.model))
    for text in texts:
        ids = tokenizer.encode(text, add_special=not args.no_bos, parse_special=not args.no_parse_special)
        pieces = _pieces(tokenizer, ids)
        if args.json or args.batch:
            print(json.dumps({"ids": ids, "pieces": pieces}))
        else:
            for token, piece in zip(ids, pieces):
                print(f"{token:>7} {json.dumps(piece, ensure_ascii=False)}")
            print(f"[{len(ids)} tokens]", file=sys.stderr)
    return 0
