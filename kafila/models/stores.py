"""Where people already keep GGUF files: the Ollama store, the Hugging Face cache, LM Studio's folder.

`--model` takes, besides a path or an alias (kafila.models.registry):
- `ollama:NAME[:TAG]` — Ollama's store ($OLLAMA_MODELS, else ~/.ollama/models): the manifest
  manifests/registry.ollama.ai/library/NAME/TAG (NAME may be NAMESPACE/NAME, or HOST/NAMESPACE/NAME
  as `ollama pull hf.co/ORG/REPO` stores it; TAG defaults to `latest`) is JSON whose layer of
  mediaType application/vnd.ollama.image.model names the GGUF blob, blobs/sha256-<hex>;
- `hf:ORG/REPO/FILE.gguf` — the Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else
  ~/.cache/huggingface/hub): models--ORG--REPO/snapshots/<commit>/FILE, the commit refs/main names
  first, then any snapshot holding the file;
- `lmstudio:PUBLISHER/REPO/FILE.gguf`, or that relative path alone — LM Studio's models folder
  (~/.lmstudio/models, ~/.cache/lm-studio/models).
A name that is not found is one line of BadInput (exit 2) saying where it was looked for.
`find_models()` lists every GGUF these stores hold (`kafila models`). Reading only: nothing is
downloaded or written. Manifests are bounded in size and their digests checked for form, so a
damaged store cannot point outside its blobs folder.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from backends.errors import BadInput
from backends.gguf.split import split_part

OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
MANIFEST_MAX_BYTES = 1 << 20  # Ollama's are under 2 kB
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # one path component: no "..", no separators
STORE_PREFIXES = ("ollama:", "hf:", "lmstudio:")
LIST_MAX_FILES = 10_000  # `kafila models` stops looking after this many files per store


@dataclass(frozen=True)
class Found:
    """A GGUF file found in a store: its --model name, the store, the file's path."""

    name: str
    source: str  # "ollama", "hf", "lmstudio"
    path: str


# ---- where each store lives ------------------------------------------------------------------


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def hf_root() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "huggingface" / "hub"


def lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


# ---- resolving a name ------------------------------------------------------------------------


def is_store_name(name: str) -> bool:
    return name.startswith(STORE_PREFIXES)


def resolve_store(name: str) -> str:
    """`ollama:…`, `hf:…` or `lmstudio:…` → the GGUF file's path (BadInput when not found)."""
    if name.startswith("ollama:"):
        return _ollama(name[len("ollama:"):])
    if name.startswith("hf:"):
        return _hf(name[len("hf:"):])
    found = lmstudio_file(name[len("lmstudio:"):])
    if found is None:
        raise BadInput(f"model {name!r} is not in LM Studio's models folder (looked in "
                       f"{' and '.join(str(r) for r in lmstudio_roots())}); `kafila models` lists what is there")
    return found


def _parts(text: str, what: str, name: str) -> list[str]:
    parts = text.split("/")
    if not text or not all(NAME_PART.fullmatch(p) for p in parts):
        raise BadInput(f"model {name!r}: {what} {text!r} is not a valid name (letters, digits, '.', '_', '-' "
                       f"between slashes)")
    return parts


def _ollama(spec: str) -> str:
    name = f"ollama:{spec}"
    repo, _, tag = spec.rpartition(":") if ":" in spec else (spec, "", "latest")
    parts = _parts(repo, "the model name", name)
    _parts(tag, "the tag", name)
    if len(parts) == 1:
        parts = [OLLAMA_HOST, "library", *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, *parts]
    elif len(parts) > 3:
        raise BadInput(f"model {name!r}: an Ollama name is NAME, NAMESPACE/NAME or HOST/NAMESPACE/NAME")
    root = ollama_root()
    manifest = root.joinpath("manifests", *parts, tag)
    if not manifest.is_file():
        raise BadInput(f"model {name!r} is not in the Ollama store (no manifest {manifest}; the store is "
                       f"$OLLAMA_MODELS or ~/.ollama/models); `ollama pull {spec}` fetches it")
    return _ollama_blob(root, manifest, name)


def _ollama_blob(root: Path, manifest: Path, name: str) -> str:
    """The GGUF blob an Ollama manifest names (its model layer)."""
    if manifest.stat().st_size > MANIFEST_MAX_BYTES:
        raise BadInput(f"model {name!r}: the Ollama manifest {manifest} is larger than {MANIFEST_MAX_BYTES} bytes")
    try:
        data = json.loads(manifest.read_bytes())
        layers = data["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_MEDIA_TYPE)
    except StopIteration:
        raise BadInput(f"model {name!r}: the Ollama manifest {manifest} has no model layer "
                       f"({OLLAMA_MODEL_MEDIA_TYPE})") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BadInput(f"model {name!r}: the Ollama manifest {manifest} is not a manifest Kafila can read") from None
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise BadInput(f"model {name!r}: the Ollama manifest {manifest} names a malformed digest")
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise BadInput(f"model {name!r}: the Ollama store lacks the blob {blob} its manifest names")
    return str(blob)


def _hf(spec: str) -> str:
    name = f"hf:{spec}"
    parts = _parts(spec, "the path", name)
    if len(parts) < 3 or not parts[-1].endswith(".gguf"):
        raise BadInput(f"model {name!r}: give hf:ORG/REPO/FILE.gguf (the file as the repository names it)")
    org, repo, inner = parts[0], parts[1], parts[2:]
    repo_dir = hf_root() / f"models--{org}--{repo}"
    snapshots = repo_dir / "snapshots"
    order: list[Path] = []
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text(errors="replace").strip()
        if NAME_PART.fullmatch(commit):
            order.append(snapshots / commit)
    if snapshots.is_dir():
        order += sorted((p for p in snapshots.iterdir() if p not in order), key=_mtime, reverse=True)
    for snap in order:
        path = snap.joinpath(*inner)
        if path.is_file():
            return str(path)
    raise BadInput(f"model {name!r} is not in the Hugging Face cache (looked in {snapshots}/*/; the cache is "
                   f"$HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub); "
                   f"`huggingface-cli download {org}/{repo} {'/'.join(inner)}` fetches it")


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def lmstudio_file(relative: str) -> str | None:
    """PUBLISHER/REPO/FILE.gguf inside one of LM Studio's models folders, or None."""
    parts = relative.split("/")
    if not relative.endswith(".gguf") or not all(NAME_PART.fullmatch(p) for p in parts):
        return None
    for root in lmstudio_roots():
        path = root.joinpath(*parts)
        if path.is_file():
            return str(path)
    return None


# ---- listing ---------------------------------------------------------------------------------


def find_models() -> list[Found]:
    """Every GGUF the stores hold, by the name --model takes (split parts after the first left out)."""
    return [*_list_ollama(), *_list_hf(), *_list_lmstudio()]


def _list_ollama() -> list[Found]:
    root = ollama_root()
    out: list[Found] = []
    for manifest in sorted(root.glob("manifests/*/*/*/*"))[:LIST_MAX_FILES]:
        host, namespace, model, tag = manifest.relative_to(root / "manifests").parts
        if host == OLLAMA_HOST:
            repo = model if namespace == "library" else f"{namespace}/{model}"
        else:
            repo = f"{host}/{namespace}/{model}"
        name = f"ollama:{repo}:{tag}"
        try:
            out.append(Found(name, "ollama", _ollama_blob(root, manifest, name)))
        except (BadInput, OSError):
            continue  # a manifest without a GGUF model layer (a projector, a damaged store)
    return out


def _list_hf() -> list[Found]:
    root = hf_root()
    seen: dict[str, Found] = {}
    for path in sorted(glob.glob(str(root / "models--*" / "snapshots" / "*" / "**" / "*.gguf"), recursive=True))[:LIST_MAX_FILES]:
        rel = Path(path).relative_to(root).parts  # models--ORG--REPO, snapshots, commit, *inner
        org_repo = rel[0][len("models--"):].split("--", 1)
        if len(org_repo) != 2 or _later_split_part(rel[-1]):
            continue
        name = f"hf:{org_repo[0]}/{org_repo[1]}/{'/'.join(rel[3:])}"
        if name not in seen:
            try:
                seen[name] = Found(name, "hf", _hf(name[3:]))  # the snapshot --model would open
            except BadInput:
                continue
    return list(seen.values())


def _list_lmstudio() -> list[Found]:
    out: list[Found] = []
    for root in lmstudio_roots():
        for path in sorted(root.glob("*/*/*.gguf"))[:LIST_MAX_FILES]:
            rel = "/".join(path.relative_to(root).parts)
            if not _later_split_part(path.name) and lmstudio_file(rel) == str(path):
                out.append(Found(f"lmstudio:{rel}", "lmstudio", str(path)))
    return out


def _later_split_part(filename: str) -> bool:
    part = split_part(os.path.basename(filename))
    return part is not None and part[0] > 1
