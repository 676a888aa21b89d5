"""Split GGUFs (llama.cpp's gguf-split layout, PREFIX-00001-of-0000N.gguf): the default model is
split by gguf-py's own writer (llama.cpp's Python package), llama.cpp loads the parts and answers
as on the whole file, and Kafila, given the first part, joins them once into a file whose
metadata and tensor bytes are the original's and answers what llama.cpp answers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.errors import BadInput
from backends.gguf import open_model
from backends.gguf.split import SPLIT_KEYS, join_parts
from tests.default_model import MODEL, needs_default_model

PROMPT_IDS = [1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 3158, 30]
PARTS = 3


def write_split(src: str, out: Path, parts: int) -> list[Path]:
    """`src` rewritten by gguf.GGUFWriter into `parts` files (its split_max_tensors), every key
    and tensor copied as stored; the parts' paths in order."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    per_part = -(-len(r.tensors) // parts)
    w = gguf.GGUFWriter(out, arch, split_max_tensors=per_part)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.alignment"):
            continue
        kind = f.types[0]
        w.add_key_value(f.name, f.contents(), kind, sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    paths = [out.with_name(f"{out.stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]
    assert all(p.is_file() for p in paths), sorted(out.parent.iterdir())
    return paths


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> list[Path]:
    if MODEL is None:
        pytest.skip("default model not installed")
    return write_split(MODEL, tmp_path_factory.mktemp("split") / "smollm2.gguf", PARTS)


def tensor_digests(index) -> dict[str, tuple]:
    with open(index.path, "rb") as f:
        out = {}
        for name, t in index.tensors.items():
            f.seek(t.offset)
            out[name] = (t.qtype, t.shape, hashlib.sha256(f.read(t.n_bytes)).hexdigest())
        return out


@needs_default_model
def test_joined_parts_hold_the_original_metadata_and_tensor_bytes(parts, tmp_path):
    joined = join_parts(str(parts[0]), str(tmp_path))
    original, whole = open_model(MODEL), open_model(joined)
    assert tensor_digests(whole) == tensor_digests(original)
    assert list(whole.tensors) == list(original.tensors)  # the parts' order is the file's
    meta = {k: v for k, v in whole.metadata.items() if k != "general.alignment"}
    assert not set(meta) & set(SPLIT_KEYS)
    assert meta == {k: v for k, v in original.metadata.items() if k != "general.alignment"}
    assert whole.hparams == original.hparams


@needs_default_model
def test_joining_again_takes_the_joined_file_and_a_changed_part_joins_anew(parts, tmp_path):
    said: list[str] = []
    first = join_parts(str(parts[0]), str(tmp_path), said.append)
    stamp = os.stat(first).st_mtime_ns
    assert len(said) == 1 and "joining the 3 parts" in said[0], said
    assert join_parts(str(parts[0]), str(tmp_path), said.append) == first and len(said) == 1
    assert os.stat(first).st_mtime_ns == stamp
    os.utime(parts[1])  # a part downloaded again: its note no longer matches
    join_parts(str(parts[0]), str(tmp_path), said.append)
    assert len(said) == 2


@needs_default_model
def test_bad_splits_are_refused_in_one_line(parts, tmp_path):
    with pytest.raises(BadInput, match=r"part 2 of a 3-part split GGUF: give the first part, smollm2-00001-of-00003"):
        join_parts(str(parts[1]), str(tmp_path))
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / parts[0].name).symlink_to(parts[0])
    with pytest.raises(BadInput, match=r"part smollm2-00002-of-00003.gguf .* is missing \(2 of 3 parts missing\)"):
        join_parts(str(lone / parts[0].name), str(tmp_path))
    with pytest.raises(BadInput, match="is part 1 of a 3-part split GGUF: give the first part as the model"):
        open_model(str(parts[0]))  # a part alone is never indexed as if it were the model
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for i, p in enumerate(parts):  # parts 2 and 3 under each other's names
        (swapped / p.name).symlink_to(parts[{1: 2, 2: 1}.get(i, i)])
    with pytest.raises(BadInput, match="00002-of-00003.gguf says it is part 3 of 3, but its name says part 2 of 3"):
        join_parts(str(swapped / parts[0].name), str(tmp_path))


@needs_default_model
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kafila_run_on_the_first_part_answers_as_on_the_whole_file(parts, tmp_path):
    """llama.cpp loads the parts (its own split loader) and answers as on the whole file; `kafila
    run --model FIRST-PART` over 2 stages at f32 answers what it answers on the whole file (that
    one answers llama.cpp's ids on the same weights: tests/test_llamacpp_default.py)."""
    from tests.llamacpp_ref import greedy_ids

    assert greedy_ids(str(parts[0]), PROMPT_IDS, 12) == greedy_ids(MODEL, PROMPT_IDS, 12)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))

    def run(model: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kafila", "run", "--model", model, "--stages", "2",
                               "--precision", "f32", "--max-tokens", "12", "--json",
                               "--prompt-ids", json.dumps(PROMPT_IDS)],
                              capture_output=True, text=True, timeout=300, env=env)  # fmt: skip

    split, whole = run(str(parts[0])), run(MODEL)
    assert split.returncode == 0 and whole.returncode == 0, split.stderr + whole.stderr
    assert "joining the 3 parts of smollm2-00001-of-00003.gguf" in split.stderr, split.stderr
    ids = json.loads(split.stdout)["ids"]
    assert len(ids) == 12 and ids == json.loads(whole.stdout)["ids"]
    assert (tmp_path / "kafila" / "joined" / "smollm2.gguf").is_file()
