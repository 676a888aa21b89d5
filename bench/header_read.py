"""How long opening a model's index takes: the lean GGUF header read on big tokenizers.

    .venv/bin/python -m bench.header_read [--models llama-3.2-1b,llama-3-8b,smollm2-135m] [--repeats 5]

Each model is a tests/big_gguf shape (a synthetic Q4_K_M file with the real model's tensors and
llama.cpp's 128,256-token Llama 3 tokenizer: 280k merges) or a kafila alias/path. Per model:
the median and min of `--repeats` calls in this process (page cache warm) of
`kafila.models.open_model` (the header read, tensor checks and hyperparameters: it walks past
the vocabulary arrays without decoding them), of `read_header` of every key (the 128k tokens and
280k merges decoded) and of open_model + load_tokenizer (what a head does), and the first
`open_model` of a fresh `python` process (imports excluded; median of 3 processes).
Target (issue 10): under 0.2 s for an 8B file.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _resolve(name: str) -> str:
    from kafila.models import resolve_model
    from tests.big_gguf import SHAPES, big_model

    return big_model(name) if name in SHAPES else resolve_model(name)


def _times(fn, path: str, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(path)
        out.append(time.perf_counter() - start)
    return out


def _first_open_s(path: str) -> float:
    code = ("import time, sys\nfrom kafila.models import open_model\nt = time.perf_counter()\n"
            "open_model(sys.argv[1])\nprint(time.perf_counter() - t)")  # fmt: skip
    return float(subprocess.run([sys.executable, "-c", code, path], check=True, capture_output=True,
                                text=True).stdout)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b,smollm2-135m")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from backends.gguf import open_model
    from backends.gguf.header import read_header
    from kafila.models import load_tokenizer

    print("| model | file GB | tokens | open_model s (median, min) | read_header, all keys s | open_model + "
          "load_tokenizer s | first open_model, fresh process s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        path = _resolve(name)
        index = open_model(path)  # warms the page cache
        tokens = len(index.metadata.get("tokenizer.ggml.tokens") or ())
        opens = _times(open_model, path, args.repeats)
        reads = _times(read_header, path, args.repeats)
        tokenizer = _times(lambda p: load_tokenizer(open_model(p)), path, args.repeats)
        first = statistics.median(_first_open_s(path) for _ in range(3))
        print(f"| {name} | {index.file_bytes / 1e9:.2f} | {tokens} | {statistics.median(opens):.3f}, {min(opens):.3f} "
              f"| {statistics.median(reads):.3f} | {statistics.median(tokenizer):.3f} | {first:.3f} |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
