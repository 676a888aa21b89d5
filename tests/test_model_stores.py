"""`--model` from where people keep models: the Ollama store, the Hugging Face cache, LM Studio.

Each store is built in a temporary directory in its real layout (Ollama: manifests/<host>/<namespace>/
<name>/<tag> JSON naming blobs/sha256-<hex>; Hugging Face: models--ORG--REPO/{refs/main,
snapshots/<commit>/FILE -> ../../blobs/<hash>}; LM Studio: models/PUBLISHER/REPO/FILE.gguf) holding
real tiny GGUF files, the environment variables (or $HOME) pointed at it; the real CLI opens them
by name, `kafila models` lists them with their inspect verdicts, and a name that is not there is
one line, exit 2, saying where it looked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends.errors import BadInput
from kafila.models import resolve_model
from kafila.models.stores import find_models
from tests.synthetic_gguf import write_llama_gguf

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_ollama(root: Path, model: Path, name: str, tag: str, namespace: str = "library") -> Path:
    """`ollama pull`'s layout: the GGUF as a content-addressed blob, a manifest naming its layers."""
    digest = sha256(model)
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / f"sha256-{digest}"
    shutil.copyfile(model, blob)
    params = root / "blobs" / f"sha256-{'1' * 64}"
    params.write_text('{"stop": ["<|im_end|>"]}')
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "2" * 64,
                   "size": 10},
        "layers": [{"mediaType": "application/vnd.ollama.image.params", "digest": "sha256:" + "1" * 64, "size": 24},
                   {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                    "size": blob.stat().st_size}],
    }  # fmt: skip
    where = root / "manifests" / "registry.ollama.ai" / namespace / name
    where.mkdir(parents=True, exist_ok=True)
    (where / tag).write_text(json.dumps(manifest))
    return blob


def make_hf(hub: Path, model: Path, org: str, repo: str, filename: str) -> Path:
    """huggingface_hub's cache: the file is a blob, the snapshot a relative symlink to it."""
    base = hub / f"models--{org}--{repo}"
    blob = base / "blobs" / sha256(model)
    blob.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model, blob)
    link = base / "snapshots" / COMMIT / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(blob, link.parent), link)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(COMMIT)
    return link


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A home with all three stores: a served model in each, a refused one in Ollama and LM Studio."""
    top = tmp_path_factory.mktemp("stores")
    served = Path(write_llama_gguf(top / "tiny.gguf", blocks=2))
    refused = Path(write_llama_gguf(top / "odd.gguf", blocks=1, odd_tensor=("blk.0.attn_k.weight", "Q8_1")))
    home = top / "home"
    ollama = top / "ollama-models"
    make_ollama(ollama, served, "tiny", "q4")
    make_ollama(ollama, refused, "odd", "latest", namespace="someone")
    hub = top / "hf-home" / "hub"
    make_hf(hub, served, "kafila-test", "Tiny-GGUF", "tiny-q4.gguf")
    lms = home / ".lmstudio" / "models" / "kafila-test" / "Tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copyfile(served, lms / "tiny-q4.gguf")
    shutil.copyfile(refused, lms / "odd.gguf")
    env = {"HOME": str(home), "OLLAMA_MODELS": str(ollama), "HF_HOME": str(top / "hf-home")}
    return env, served, refused


@pytest.fixture
def in_stores(stores, monkeypatch):
    env, served, refused = stores
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return stores


def kafila(env: dict, *args: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    full.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "kafila", *args], capture_output=True, text=True, timeout=120,
                          env=full)  # fmt: skip


def same_file(a: str, b: Path) -> bool:
    return Path(a).read_bytes() == b.read_bytes()


def test_names_resolve_to_the_stored_files(in_stores):
    env, served, refused = in_stores
    blob = resolve_model("ollama:tiny:q4")
    assert Path(blob).parent == Path(env["OLLAMA_MODELS"]) / "blobs" and same_file(blob, served)
    assert same_file(resolve_model("ollama:someone/odd"), refused)  # tag latest, a user namespace
    hf = resolve_model("hf:kafila-test/Tiny-GGUF/tiny-q4.gguf")
    assert COMMIT in hf and same_file(hf, served)
    for name in ("lmstudio:kafila-test/Tiny-GGUF/tiny-q4.gguf", "kafila-test/Tiny-GGUF/tiny-q4.gguf"):
        path = resolve_model(name)
        assert path.startswith(env["HOME"]) and same_file(path, served)


def test_hf_hub_cache_wins_over_hf_home(in_stores, monkeypatch, tmp_path):
    env, served, _ = in_stores
    make_hf(tmp_path / "hub", served, "kafila-test", "Other", "x.gguf")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("hf:kafila-test/Other/x.gguf").startswith(str(tmp_path))
    with pytest.raises(BadInput, match=str(tmp_path / "hub")):
        resolve_model("hf:kafila-test/Tiny-GGUF/tiny-q4.gguf")  # HF_HOME's cache is not read then


@pytest.mark.parametrize("name, needles", [
    ("ollama:tiny:7b", ["not in the Ollama store", "registry.ollama.ai/library/tiny/7b"]),
    ("ollama:../../etc:passwd", ["not a valid name"]),
    ("hf:kafila-test/Tiny-GGUF/missing.gguf", ["not in the Hugging Face cache", "models--kafila-test--Tiny-GGUF"]),
    ("hf:kafila-test/Tiny-GGUF", ["give hf:ORG/REPO/FILE.gguf"]),
    ("lmstudio:kafila-test/Tiny-GGUF/missing.gguf", ["not in LM Studio's models folder", ".lmstudio/models"]),
    ("Model-00001-of-00003.gguf", ["part Model-00001-of-00003.gguf of the split GGUF", "3 of 3 parts missing"]),
])  # fmt: skip
def test_a_name_not_found_says_where_it_looked(in_stores, name, needles):
    with pytest.raises(BadInput) as err:
        resolve_model(name)
    line = str(err.value)
    assert "\n" not in line and all(n in line for n in needles), line


@pytest.mark.slow
def test_cli_a_name_not_found_is_one_line_exit_2(stores):
    env, _, _ = stores
    proc = kafila(env, "inspect", "ollama:tiny:7b")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "not in the Ollama store" in lines[0] and env["OLLAMA_MODELS"] in lines[0]


def test_damaged_manifests_are_refused(in_stores, tmp_path, monkeypatch):
    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    where = root / "manifests" / "registry.ollama.ai" / "library" / "bad"
    where.mkdir(parents=True)
    cases = {
        "notjson": "{", "nolayer": json.dumps({"layers": [{"mediaType": "x", "digest": "sha256:" + "a" * 64}]}),
        "escape": json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                          "digest": "sha256:../../../etc/passwd"}]}),
        "noblob": json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                          "digest": "sha256:" + "b" * 64}]}),
    }  # fmt: skip
    for tag, text in cases.items():
        (where / tag).write_text(text)
    (where / "huge").write_bytes(b" " * (2 << 20))
    for tag, needle in (("notjson", "not a manifest"), ("nolayer", "no model layer"), ("escape", "malformed digest"),
                        ("noblob", "lacks the blob"), ("huge", "larger than")):
        with pytest.raises(BadInput, match=needle):
            resolve_model(f"ollama:bad:{tag}")
    assert not [f for f in find_models() if f.source == "ollama"]  # none of them is listed


@pytest.mark.slow
def test_cli_opens_store_models(stores):
    env, served, _ = stores
    for name in ("ollama:tiny:q4", "hf:kafila-test/Tiny-GGUF/tiny-q4.gguf", "kafila-test/Tiny-GGUF/tiny-q4.gguf"):
        proc = kafila(env, "inspect", "--json", name)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["served"] is True
    proc = kafila(env, "tokenize", "--model", "ollama:tiny:q4", "--json", "hi")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ids"], proc.stderr


@pytest.mark.slow
def test_models_lists_every_store_with_its_verdict(stores):
    env, _, _ = stores
    proc = kafila(env, "models", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["smollm2-135m"]["source"] == "alias"
    found = {n: (r["source"], r["served"]) for n, r in rows.items() if r["source"] != "alias"}
    assert found == {
        "ollama:tiny:q4": ("ollama", True), "ollama:someone/odd:latest": ("ollama", False),
        "hf:kafila-test/Tiny-GGUF/tiny-q4.gguf": ("hf", True),
        "lmstudio:kafila-test/Tiny-GGUF/tiny-q4.gguf": ("lmstudio", True),
        "lmstudio:kafila-test/Tiny-GGUF/odd.gguf": ("lmstudio", False),
    }  # fmt: skip
    assert "Q8_1" in rows["ollama:someone/odd:latest"]["why_not"]
    text = kafila(env, "models").stdout
    assert "ollama:tiny:q4" in text and "refused: " in text and "hf:kafila-test/Tiny-GGUF/tiny-q4.gguf" in text
