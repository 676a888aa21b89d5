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


ARCHS_SOURCES = ("vendor/llama.cpp/tests/test-llama-archs.cpp", "vendor/llama.cpp/common/",
                 "vendor/llama.cpp/include/", "vendor/llama.cpp/ggml/include/", "vendor/llama.cpp/src/",
                 "vendor/llama.cpp/vendor/")  # fmt: skip
# what test-llama-archs.cpp needs of llama.cpp's common library (the rest of it goes unlinked)
ARCHS_COMMON = ("common/log.cpp", "common/common.cpp", "common/json.cpp")


def llama_archs_tool() -> Path:
    """llama.cpp's tests/test-llama-archs (it writes a small random model of each architecture
    llama.cpp knows, `-a REGEX -o DIR`), compiled once from the sdist against llama-cpp-python's
    own libllama (whose internal symbols the tool links to, as llama.cpp's build links it)."""
    import llama_cpp

    root = cache_root()
    tool = root / "test-llama-archs"
    if tool.exists():
        return tool
    src = root / "archs-src"
    if not (src / ".complete").exists():
        with tarfile.open(_sdist(root)) as tar:
            for m in tar.getmembers():
                inner = m.name.partition("/")[2]
                if m.isfile() and inner.startswith(ARCHS_SOURCES):
                    m.name = inner.removeprefix("vendor/llama.cpp/")
                    tar.extract(m, src, filter="data")
        (src / ".complete").write_text("ok\n")
    info = (src / "common/build-info.cpp.in").read_text()
    for key, value in (("LLAMA_BUILD_NUMBER", "0"), ("LLAMA_BUILD_COMMIT", LLAMA_CPP_PYTHON_VERSION),
                       ("BUILD_COMPILER", "c++"), ("BUILD_TARGET", sys.platform)):  # fmt: skip
        info = info.replace(f"@{key}@", value)
    (src / "build-info.cpp").write_text(info)
    lib = Path(llama_cpp.__file__).parent / "lib"
    partial = tool.with_suffix(".tmp")
    subprocess.run(["c++", "-O1", "-std=c++17", "-ffunction-sections", "-fdata-sections",
                    *(f"-I{src / d}" for d in ("common", "include", "ggml/include", "src", "vendor")),
                    str(src / "tests/test-llama-archs.cpp"), *(str(src / f) for f in ARCHS_COMMON),
                    str(src / "build-info.cpp"), f"-L{lib}", "-lllama", "-lggml", "-lggml-base",
                    "-Wl,--gc-sections", f"-Wl,-rpath,{lib}", "-lpthread", "-o", str(partial)],
                   check=True, timeout=900, capture_output=True)  # fmt: skip
    os.replace(partial, tool)
    return tool


def llama_arch_models(archs: tuple[str, ...], seed: int = 1) -> dict[str, Path]:
    """llama.cpp's random models of `archs` ({"qwen35moe-moe": path, "llama-dense": path, …}),
    written once by test-llama-archs with `seed` into the cache."""
    out = cache_root() / f"arch-models-{seed}"
    done = out / ("." + "-".join(archs))
    if not done.exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(llama_archs_tool()), "-a", f"^({'|'.join(archs)})$", "-s", str(seed), "-o", str(out)],
                       check=True, timeout=300, capture_output=True)  # fmt: skip
        done.write_text("ok\n")
    return {p.stem: p for p in sorted(out.glob("*.gguf")) if p.stem.rsplit("-", 1)[0] in archs}
