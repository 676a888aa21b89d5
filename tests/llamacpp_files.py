"""llama.cpp's own files for the external-reference tests, obtained at test time (never committed).

The llama-cpp-python sdist carries llama.cpp's tokenizer test vectors under
`vendor/llama.cpp/models/ggml-vocab-*.gguf` with `.inp` / `.out` files, and real models' chat
templates under `vendor/llama.cpp/models/templates/`. `vocab_dir()` downloads that
sdist once with pip (the same pinned version the test extra installs) into a cache directory and
extracts only those files; later runs reuse them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # keep equal to the pin in pyproject.toml's test extra
VOCAB_PREFIX = "vendor/llama.cpp/models/ggml-vocab-"
TEMPLATES_PREFIX = "vendor/llama.cpp/models/templates/"


def cache_root() -> Path:
    base = os.environ.get("KAFILA_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kafila-tests"
    )
    return Path(base) / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"


def _sdist(root: Path) -> Path:
    found = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[0]
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(root)],
        check=True, timeout=900,
    )  # fmt: skip
    found = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no llama-cpp-python sdist in {root}")
    return found[0]


def vocab_dir() -> Path:
    """A directory holding llama.cpp's ggml-vocab-*.gguf files and their .inp/.out test vectors."""
    return _extracted("models", VOCAB_PREFIX)


def templates_dir() -> Path:
    """A directory holding llama.cpp's chat templates of real models (models/templates/*.jinja)."""
    return _extracted("templates", TEMPLATES_PREFIX)


def _extracted(name: str, prefix: str) -> Path:
    """The sdist's files under `prefix`, extracted once into cache_root()/name."""
    root = cache_root()
    out = root / name
    done = out / ".complete"
    if done.exists():
        return out
    sdist = _sdist(root)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            _, _, inner = member.name.partition("/")
            if member.isfile() and inner.startswith(prefix):
                target = out / os.path.basename(inner)
                with tar.extractfile(member) as src, open(target, "wb") as dst:  # type: ignore[union-attr]
                    dst.write(src.read())
    done.write_text("ok\n")
    return out


def vocab_file(name: str) -> Path:
    """The path of `ggml-vocab-<name>.gguf` (e.g. name = "llama-bpe")."""
    path = vocab_dir() / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        raise FileNotFoundError(f"llama.cpp {LLAMA_CPP_PYTHON_VERSION} ships no {path.name}")
    return path


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test vectors for one vocabulary: (text, expected ids) pairs.

    The .inp file separates its strings with a line `__ggml_vocab_test__`; the .out file has one
    line of space-separated ids per string (see llama.cpp's tests/test-tokenizer-0.cpp).
    """
    base = vocab_dir() / f"ggml-vocab-{name}.gguf"
    texts = Path(f"{base}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":  # the file ends with a separator
        texts.pop()
    outs = Path(f"{base}.out").read_text(encoding="utf-8").split("\n")
    if outs and outs[-1] == "":
        outs.pop()
    if len(texts) != len(outs):
        raise RuntimeError(f"{base.name}: {len(texts)} strings but {len(outs)} id lines")
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]
