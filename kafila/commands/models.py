"""`kafila models`: the model aliases, whether each is installed, and the GGUF files found in the
Ollama store, the Hugging Face cache and LM Studio's models folder, each with its inspect verdict."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    p = subparsers.add_parser("models", help="list model aliases and the GGUF files found in local model stores")
    p.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    p.set_defaults(handler=models)


def verdict(path: str) -> tuple[bool, str | None]:
    """(served, why not): `kafila inspect`'s verdict on the file."""
    from backends.errors import BadInput
    from kafila.commands.inspect import describe

    try:
        info = describe(path)
    except BadInput as exc:  # unreadable: missing, not a GGUF, truncated
        return False, str(exc)
    return bool(info["served"]), info["why_not"]


def models(args) -> int:
    from kafila.models import ALIASES, DEFAULT_MODEL
    from kafila.models.registry import alias_path
    from kafila.models.stores import find_models

    rows = []
    for alias in ALIASES.values():
        path = alias_path(alias)
        rows.append({"alias": alias.name, "name": alias.name, "source": "alias", "default": alias.name == DEFAULT_MODEL,
                     "installed": path is not None, "path": path, "install": alias.install,
                     "description": alias.description})
    for found in find_models():
        served, why_not = verdict(found.path)
        rows.append({"alias": None, "name": found.name, "source": found.source, "default": False, "installed": True,
                     "path": found.path, "served": served, "why_not": why_not})
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        if r["source"] == "alias":
            mark = "*" if r["default"] else " "
            where = r["path"] if r["installed"] else f"not installed: {r['install']}"
            print(f"{mark} {r['alias']:<16} {r['description']}\n    {where}")
        else:
            state = "served" if r["served"] else f"refused: {r['why_not']}"
            print(f"  {r['name']}\n    {r['path']}\n    {state}")
    print("--model also takes a path to any GGUF file, ollama:NAME:TAG (the Ollama store), hf:ORG/REPO/FILE.gguf "
          "(the Hugging Face cache) or PUBLISHER/REPO/FILE.gguf in LM Studio's models folder "
          "(`kafila inspect FILE` says whether a file is served).")
    return 0
