"""The house rules every module of kafila/ keeps (issue 33): small modules, and no error
swallowed whole. Read from the source with `ast`, so each check is cheap and names the culprit."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 600
MODULES = sorted((ROOT / "kafila").rglob("*.py"))


def swallows_everything(source: str) -> list[int]:
    """Lines of `suppress(...)` calls (contextlib's, however imported) that list Exception or
    BaseException: they swallow real failures; name the errors meant and log the rest."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name != "suppress":
            continue
        for arg in node.args:
            caught = arg.attr if isinstance(arg, ast.Attribute) else arg.id if isinstance(arg, ast.Name) else None
            if caught in ("Exception", "BaseException"):
                lines.append(node.lineno)
    return lines


def test_there_are_modules_to_check() -> None:
    assert len(MODULES) > 100


def test_no_module_is_over_600_lines() -> None:
    big = {str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"split by responsibility: {big}"


def test_no_suppress_exception_anywhere() -> None:
    found = {str(p.relative_to(ROOT)): lines for p in MODULES if (lines := swallows_everything(p.read_text()))}
    assert not found, f"suppress(Exception) swallows real failures: {found}"


def test_the_check_finds_every_spelling_and_spares_narrow_ones() -> None:
    assert swallows_everything("import contextlib\nwith contextlib.suppress(Exception):\n    pass\n") == [2]
    assert swallows_everything("from contextlib import suppress\nwith suppress(OSError, Exception):\n    pass\n") == [2]
    assert swallows_everything("import asyncio, contextlib\nwith contextlib.suppress(asyncio.CancelledError,"
                               " BaseException):\n    pass\n") == [2]
    assert swallows_everything("import contextlib\nwith contextlib.suppress(OSError, TimeoutError):\n    pass\n") == []


def raw_messages(source: str) -> list[int]:
    """Lines of dict literals with a literal "t" kind (`{"t": "hello", …}`): a message that skips
    its typed codec (kafila/session/control/messages.py, kafila/net/admission_messages.py), whose
    generic `{"t": msg.T, …}` is the one place such a dict is made."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (isinstance(key, ast.Constant) and key.value == "t" and isinstance(value, ast.Constant)
                        and isinstance(value.value, str)):
                    lines.append(node.lineno)
    return lines


def test_no_raw_message_dict_in_code() -> None:
    found = {str(p.relative_to(ROOT)): lines for p in MODULES if (lines := raw_messages(p.read_text()))}
    assert not found, f"build messages with their typed codec: {found}"


def test_the_raw_message_check_finds_literals_and_spares_the_codecs() -> None:
    assert raw_messages('send({"t": "hello", "name": n})\n') == [1]
    assert raw_messages('def encode(msg):\n    return {"t": msg.T, **body}\n') == []
