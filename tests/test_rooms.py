"""The session's rooms import only downward: control -> ring, weights -> wire (kafila/session/__init__.py).

ring/speculation/ is part of ring/ and may import only wire/ of the session, so the drafting rules
stay usable without a ring node. Checked on the source (ast), so a violation fails here, not at
some later import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SESSION = ROOT / "kafila" / "session"
# room -> the rooms of kafila.session it may import besides itself
ALLOWED = {
    "control": {"ring", "ring.speculation", "weights", "wire"},
    "ring": {"wire"},
    "ring.speculation": {"wire"},
    "weights": {"wire"},
    "wire": set(),
}


def _room(module: str) -> str | None:
    """The room of a dotted `kafila.session.X[.Y…]` module name, or None outside the session."""
    parts = module.split(".")
    if parts[:2] != ["kafila", "session"] or len(parts) < 3:
        return None
    if parts[2] == "ring" and len(parts) > 3 and parts[3] == "speculation":
        return "ring.speculation"
    return parts[2]


def _modules() -> list[Path]:
    return sorted(p for p in SESSION.rglob("*.py") if p.parent != SESSION)


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_every_module_lives_in_a_room():
    assert [p.name for p in SESSION.glob("*.py")] == ["__init__.py"]
    for room in ALLOWED:
        assert (SESSION / room.replace(".", "/") / "__init__.py").is_file(), room


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SESSION)))
def test_a_room_imports_only_downward(path: Path):
    own = _room("kafila.session." + ".".join(path.relative_to(SESSION).with_suffix("").parts))
    allowed = ALLOWED[own] | {own}
    if own == "ring":
        allowed |= {"ring.speculation"}
    wrong = sorted(m for m in _imported(path) if (r := _room(m)) is not None and r not in allowed)
    assert not wrong, f"{path.relative_to(ROOT)} ({own}) imports {wrong}"
