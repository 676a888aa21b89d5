"""What every benchmark prints above its table: the CPU, its ISA flags and the commit measured.

docs/BENCHMARKS.md pastes a command's output verbatim, so the output must say where and on what
code it was measured: `header()` is those lines, `markdown(headers, rows)` one table.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip


def cpu() -> str:
    """CPU model, logical cores and the ISA flags the kernels care about."""
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:  # not Linux: the model from platform, no flags
        pass
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "?"
    return f"CPU: {model}, {os.cpu_count()} logical cores; ISA: {isa}"


def commit(repo: Path = REPO) -> str:
    """The checked-out commit, with `+dirty` when tracked files differ from it."""
    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else ""

    rev = git("rev-parse", "--short", "HEAD")
    if not rev:
        return "commit: unknown (not a git checkout)"
    dirty = "+dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"commit: {rev}{dirty}"


def header() -> str:
    """Three lines: CPU and ISA, load average now, commit."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu()}\nload average: {load}\n{commit()}"


def markdown(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table; floats keep the caller's formatting, so pass strings where it matters."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
