"""planner/ is pure: it imports nothing that does I/O, keeps time, or reaches the network."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PLANNER = Path(__file__).resolve().parents[1] / "planner"
FORBIDDEN = {"socket", "asyncio", "time", "os", "sys", "subprocess", "threading", "random", "io"}
FORBIDDEN |= {"pathlib", "datetime", "logging", "json", "kafila", "numpy"}


def test_planner_modules_import_nothing_impure() -> None:
    files = sorted(PLANNER.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & FORBIDDEN, f"{path.name} imports {roots & FORBIDDEN}"


def test_planner_imports_the_milp_solver_only_inside_functions() -> None:
    """pyscipopt (SCIP) is a heavy native library: planner.dipsd_milp imports it where it
    solves, so importing the planner (or planner.dipsd) never loads it."""
    files = sorted(PLANNER.glob("*.py"))
    assert {"dipsd.py", "dipsd_milp.py"} <= {p.name for p in files}
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:  # module level only
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert "pyscipopt" not in roots, f"{path.name} imports pyscipopt at module level"


def test_importing_the_planner_loads_no_network_or_event_loop() -> None:
    code = (
        "import sys; import planner, planner.dipsd, planner.dipsd_milp; "
        "bad = [m for m in ('socket', 'asyncio', 'ssl', 'pyscipopt') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
