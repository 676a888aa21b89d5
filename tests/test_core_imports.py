"""The protocol cores are sans-I/O: they and every module of ours they import (transitively) import
no asyncio, sockets, threads, subprocesses or clocks. Time enters as a `now` argument, bytes and
events as arguments, and what to do comes back as actions (aioquic's and h11's shape).

Third-party codecs a core uses (msgpack, cryptography, spake2, numpy, aioice's STUN codec) are
leaves here: they are pure functions of their input. The planner has its own, stricter test
(tests/test_planner_imports.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("kafila", "rendezvous", "planner", "backends")
IO = {"asyncio", "socket", "selectors", "ssl", "threading", "subprocess", "concurrent", "time",
      "signal", "multiprocessing", "aiohttp", "aioquic"}
MAX_CORE_LINES = 550  # "no module over ~500 lines among the cores"; frames.py, nine wire kinds, is the largest

CORES = [
    "kafila/net/admission.py",
    "kafila/net/admission_messages.py",
    "kafila/net/joining.py",
    "kafila/net/edge_table.py",
    "kafila/net/punch.py",
    "kafila/net/natcheck.py",
    "kafila/net/roster.py",
    "kafila/net/handshake.py",
    "kafila/net/pieces.py",
    "kafila/net/bulk_records.py",
    "kafila/session/control/messages.py",
    "kafila/session/control/lifecycle.py",
    "kafila/session/control/lifecycle_events.py",
    "kafila/session/ring/head.py",
    "kafila/session/ring/picks.py",
    "kafila/session/ring/scheduler.py",
    "kafila/session/ring/microbatch.py",
    "kafila/session/ring/speculation/speculate.py",
    "kafila/session/ring/speculation/dipsd_live.py",
    "kafila/session/ring/speculation/origin.py",
    "kafila/session/control/replans.py",
    "kafila/session/wire/frames.py",
    "kafila/session/wire/fields.py",
    "kafila/session/ring/timing.py",
    "rendezvous/messages.py",
    "rendezvous/registry.py",
    "rendezvous/relay.py",
    "rendezvous/sources.py",
]


def _imports(path: Path, everywhere: bool) -> set[str]:
    """Dotted names this file imports: at any level, or only what runs on import (statements
    outside functions: a package's lazy `__getattr__` imports stay lazy)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree) if everywhere else _outside_functions(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _outside_functions(node: ast.AST):
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from _outside_functions(child)


def _file_of(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _closure(start: Path) -> dict[Path, set[str]]:
    """Every module of ours reached from `start` (package __init__ files included), with its imports."""
    seen: dict[Path, set[str]] = {}
    todo = [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = imports = _imports(path, everywhere=path == start)
        for dotted in imports:
            if dotted.split(".")[0] not in OURS:
                continue
            parts = dotted.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
                found = _file_of(".".join(parts[:i]))
                if found is not None and found not in seen:
                    todo.append(found)
    return seen


@pytest.mark.parametrize("core", CORES)
def test_core_and_what_it_imports_do_no_io(core: str) -> None:
    path = ROOT / core
    for module, imports in _closure(path).items():
        roots = {name.split(".")[0] for name in imports}
        assert not roots & IO, f"{core} reaches {module.relative_to(ROOT)}, which imports {roots & IO}"


@pytest.mark.parametrize("core", CORES)
def test_core_is_a_readable_size(core: str) -> None:
    lines = len((ROOT / core).read_text().splitlines())
    assert lines <= MAX_CORE_LINES, f"{core} has {lines} lines"


def test_the_check_catches_io() -> None:
    """The closure really follows our imports: the asyncio glue is reached from its entry point."""
    reached = _closure(ROOT / "kafila/net/member.py")
    assert any("asyncio" in {n.split(".")[0] for n in imports} for imports in reached.values())


# Who may import whom (docs/ARCHITECTURE.md, "Layers"): dependencies point down only.
MAY_IMPORT = {
    "backends": {"backends"},  # backends.gguf and backends.errors are the bottom
    "rendezvous": {"rendezvous"},
    "planner": {"planner"},
    "kafila": {"kafila", "backends", "planner", "rendezvous", "bench"},  # bench: `kafila bench local`
}


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_layers_import_only_what_lies_below(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    for path in files:
        for name in _imports(path, everywhere=True):
            root = name.split(".")[0]
            if root in OURS or root in {"tests", "bench", "natlab_tests"}:
                assert root in MAY_IMPORT[package], f"{path.relative_to(ROOT)} imports {name}"
