"""`kafila models`: the model aliases and whether each is installed."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    p = subparsers.add_parser("models", help="list model aliases and what is installed")
    p.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    p.set_defaults(handler=models)


def models(args) -> int:
    from kafila.models import ALIASES, DEFAULT_MODEL
    from kafila.models.registry import alias_path

    rows = []
    for alias in ALIASES.values():
        path = alias_path(alias)
        rows.append({"alias": alias.name, "default": alias.name == DEFAULT_MODEL, "installed": path is not None,
                     "path": path, "install": alias.install, "description": alias.description})
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        mark = "*" if r["default"] else " "
        where = r["path"] if r["installed"] else f"not installed: {r['install']}"
        print(f"{mark} {r['alias']:<16} {r['description']}\n    {where}")
    print("--model also takes a path to any GGUF file: llama, qwen2 or qwen3 in F32, F16, BF16, Q8_0, "
          "Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K (`kafila inspect FILE` says whether it is served).")
    return 0
