"""Options several commands share, each declared once, so it means the same and says the same in
every command that takes it (host, join, demo, run, serve). A command adds the ones it takes;
what differs between commands (a default, a word about where it goes) is an argument here."""

from __future__ import annotations

import argparse

from kafila.models.registry import DEFAULT_MODEL

MODEL_FORMS = ("a GGUF path, an alias (`kafila models`), ollama:NAME[:TAG] (the local Ollama store), "
               "hf:ORG/REPO/FILE.gguf (the local Hugging Face cache) or lmstudio:PUB/REPO/FILE.gguf")
SPECULATE_HELP = ("speculative decoding: off, ngram (drafts looked up in the request's own prompt and "
                  "output), draft (a draft model, --draft, at the head), mtp (the model's own multi-token-"
                  "prediction layer, at the head: Qwen3.5 files that carry one) or origin (drafts made at the "
                  "member where each request was typed: n-grams, or its draft model where it joined with "
                  "--draft, carried to the head on its activations; the head's own n-grams where they are "
                  "stale); drafts are verified in one trip round the "
                  "ring, as many as pay (none when they do not)")


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL_FORMS} (default {DEFAULT_MODEL})")


def add_backend(p: argparse.ArgumentParser, per_stage: bool = False, metavar: str | None = None) -> None:
    each = ", or one per stage as B1,B2,..." if per_stage else ""
    p.add_argument("--backend", default="openvino", metavar=metavar,
                   help=f"shard runtime: openvino (default), mlx or reference{each}")


def add_precision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=("serving", "f32"), default="serving",
                   help="every stage's compute: serving (f32 activations with the CPU's int8 dot products where it "
                        "has them, and an f16 KV cache, as llama.cpp's) or f32 (f32 compute and KV; slower; greedy "
                        "answers do not depend on how steps are batched, e.g. by --speculate)")


def add_kquant(p: argparse.ArgumentParser) -> None:
    from backends import DEFAULT_KQUANT, KQUANTS

    p.add_argument("--kquant", choices=KQUANTS, default=DEFAULT_KQUANT,
                   help=f"how OpenVINO stages compute quantized matrices (default {DEFAULT_KQUANT}): exact "
                        "(the file's weights to f32 rounding: llama.cpp's greedy tokens at --precision f32, "
                        "and an answer that does not depend on how its prompt was cut into steps), ggml "
                        "(ggml's own CPU kernels on the file's blocks: llama.cpp's arithmetic and speed, "
                        "1.8x faster decoding, 1.3x faster prefill, less memory; built at install, needs llama-cpp-python and a C++ "
                        "compiler), auto (ggml at serving precision where it builds, else exact), or fast "
                        "(Q4_K/Q5_K offsets rounded to integer zero points, as openvino_genai does)")  # fmt: skip


def add_speculate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", choices=("off", "ngram", "draft", "origin", "mtp"), default="off", help=SPECULATE_HELP)


def add_draft(p: argparse.ArgumentParser, where: str = "this member drafts with: as the head of a session "
              "started with --speculate draft, and for the requests typed here with --speculate origin") -> None:
    p.add_argument("--draft", metavar="GGUF", default=None, help=f"a small model of the same vocabulary {where}")


def add_context(p: argparse.ArgumentParser, default: str = "the model's own context, capped by what the members' "
                "memory holds; a --context it cannot hold is refused, exit 3") -> None:
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help=f"positions per request, prompt and answer (default {default})")


def add_concurrency(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="auto", metavar="N|auto",
                   help="requests served at once, each with a KV slot on every member: N (1..64), or auto "
                        "(default): as many as the members' memory holds at the context, at most 32")


def add_prompt_cache(p: argparse.ArgumentParser, where: str = "", bound: str = "") -> None:
    p.add_argument("--prompt-cache", choices=("on", "off"), default="on",
                   help=f"prompt caching (default on): a finished request's KV stays{where}, and a prompt that "
                        "starts the same way (the next turn of a conversation, a shared system prompt) feeds "
                        f"only the rest{bound}; off: every prompt is fed whole")


def add_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=("kafila", "uniform", "memory"), default="kafila",
                   help="how blocks are divided (default kafila: the planner)")


def add_latency(p: argparse.ArgumentParser, who: str = "this member") -> None:
    p.add_argument("--latency-ms", type=float, default=0.0, metavar="L",
                   help=f"{who} delays each datagram it sends by L ms (WAN emulation)")


def add_max_tokens(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--max-tokens", type=int, default=default, metavar="N", help=f"new tokens at most (default {default})")


__all__ = ["add_backend", "add_concurrency", "add_context", "add_draft", "add_latency", "add_max_tokens", "add_model",
           "add_policy", "add_precision", "add_prompt_cache", "add_speculate"]  # fmt: skip
