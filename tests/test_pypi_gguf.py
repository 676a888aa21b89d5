"""The PyPI byte-slice fetcher (kafila/tooling/pypi_gguf.py): parts join in order, a wrong join is
refused, and a joined file is reused. Wheels are made here, so no download is needed."""

from __future__ import annotations

import zipfile

import pytest

from kafila.tooling import pypi_gguf as P


def _wheel(directory, package: str, payload: bytes) -> None:
    mod = package.replace("-", "_")
    with zipfile.ZipFile(directory / f"{mod}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{mod}/__init__.py", "")
        z.writestr(f"{mod}/data/part01.bin", payload)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    body = b"GGUF" + bytes(range(256)) * 40
    cuts = [body[:1000], body[1000:7000], body[7000:]]
    packages = ("x-part1", "x-part2", "x-part3")
    model = P.PartedModel("x", "x.gguf", packages, len(body), None, "test")
    monkeypatch.setitem(P.MODELS, "x", model)
    wheels = tmp_path / "x.wheels"
    wheels.mkdir()
    for package, cut in zip(packages, cuts):
        _wheel(wheels, package, cut)
    return tmp_path, body


def test_parts_join_in_order_and_the_join_is_reused(fake):
    root, body = fake
    path = P.fetch("x", root)
    assert path.read_bytes() == body
    assert not (root / "x.wheels").exists()  # the wheels are dropped once joined
    assert P.fetch("x", root) == path  # no wheels now: the cached join is what answers


def test_a_join_of_the_wrong_size_is_refused(fake, monkeypatch):
    root, body = fake
    monkeypatch.setitem(P.MODELS, "x", P.PartedModel("x", "x.gguf", P.MODELS["x"].packages, len(body) + 1, None, "t"))
    with pytest.raises(P.FetchError, match="bytes, expected"):
        P.fetch("x", root)
    assert not (root / "x.gguf").exists()
