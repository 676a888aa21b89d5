"""backends.gguf.header reads what gguf.GGUFReader reads, and refuses damaged headers in one line."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from backends.errors import BadInput
from backends.gguf.header import read_header
from tests.synthetic_gguf import write_llama_gguf

T = gguf.GGUFValueType


def same(a, b) -> bool:
    """Equal values of the same Python types, lists compared item by item."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_matches_gguf_reader(path: str) -> None:
    header, reader = read_header(path), gguf.GGUFReader(path, "r")
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(header.metadata) == keys
    for key in keys:
        assert same(header.metadata[key], reader.fields[key].contents()), key
    ours = [(t.name, t.type_name, t.dims, t.offset, t.n_bytes) for t in header.tensors]
    theirs = [(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
              for t in reader.tensors]  # fmt: skip
    assert ours == theirs


def test_model_header_matches_gguf_reader(tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", blocks=2, hidden=256, ffn=512, qtype="Q4_K", embed_qtype="Q8_0",
                            tensor_types={"attn_v.weight": "Q6_K", "ffn_down.weight": "Q5_K", "attn_k.weight": "BF16",
                                          "attn_q.weight": "F16"})  # fmt: skip
    assert_matches_gguf_reader(path)
    header = read_header(path)
    assert header.tensors[0].shape == (260, 256) and header.data_offset % 32 == 0


def test_every_value_type_matches_gguf_reader(tmp_path):
    path = str(tmp_path / "v.gguf")
    w = gguf.GGUFWriter(path, "llama")
    values = [("u8", 200, T.UINT8), ("i8", -100, T.INT8), ("u16", 60000, T.UINT16), ("i16", -30000, T.INT16),
              ("u32", 4_000_000_000, T.UINT32), ("i32", -2_000_000_000, T.INT32), ("f32", 1e-5, T.FLOAT32),
              ("bool", True, T.BOOL), ("str", "héllo ▁world", T.STRING), ("u64", 2**63 + 5, T.UINT64),
              ("i64", -(2**62), T.INT64), ("f64", 0.1, T.FLOAT64)]  # fmt: skip
    for key, value, kind in values:
        w.add_key_value(f"x.{key}", value, kind)
    w.add_key_value("x.strs", ["a", "", "▁b", "<|im_end|>"], T.ARRAY, T.STRING)
    w.add_key_value("x.ints", [1, -2, 3], T.ARRAY, T.INT32)
    w.add_key_value("x.floats", [0.5, -1.25], T.ARRAY, T.FLOAT32)
    w.add_key_value("x.bools", [True, False], T.ARRAY, T.BOOL)
    w.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_matches_gguf_reader(path)
    md = read_header(path).metadata
    assert md["x.f32"] == float(np.float32(1e-5)) and md["x.bool"] is True and md["x.u64"] == 2**63 + 5


def test_keep_skips_other_values_and_tensors(tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", blocks=1)
    header = read_header(path, lambda key: key.startswith("tokenizer.ggml.t"), tensors=False)
    assert set(header.metadata) == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}
    assert header.tensors == ()


# --- damaged files, written byte by byte ---------------------------------------------------------


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, kind: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", kind) + payload


def tensor(name: str, dims: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    return s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


def gguf_bytes(kvs: list[bytes], tensors: list[bytes], *, version: bytes = struct.pack("<I", 3),
               counts: tuple[int, int] | None = None, data: bytes = b"\0" * 4096) -> bytes:
    n_tensors, n_kv = counts or (len(tensors), len(kvs))
    head = b"GGUF" + version + struct.pack("<QQ", n_tensors, n_kv) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % 32) + data


GOOD_KV = kv("general.architecture", 8, s("llama"))
DAMAGED = {
    "empty": (b"", "bad magic"),
    "zip": (b"PK\x03\x04" + b"\0" * 60, "bad magic"),
    "short": (b"GGUF\x03\x00\x00\x00\x00", "truncated"),
    "version-1": (gguf_bytes([GOOD_KV], [], version=struct.pack("<I", 1)), "version 1"),
    "big-endian": (gguf_bytes([GOOD_KV], [], version=struct.pack(">I", 3)), "big-endian"),
    "huge-counts": (gguf_bytes([GOOD_KV], [], counts=(0, 2**40)), "cannot fit"),
    "string-past-end": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 10**6) + b"abc" + b"\0" * 40,
                        "past the end"),
    "value-type": (gguf_bytes([kv("x", 13, b"\0" * 8)], []), "unknown value type 13"),
    "duplicate-key": (gguf_bytes([GOOD_KV, GOOD_KV], []), "duplicate key general.architecture"),
    "key-not-utf8": (gguf_bytes([kv(b"x\xff", 4, b"\0" * 4)], []), "UnicodeDecodeError"),
    "alignment-0": (gguf_bytes([kv("general.alignment", 4, struct.pack("<I", 0))], []), "power of two"),
    "alignment-type": (gguf_bytes([kv("general.alignment", 10, struct.pack("<Q", 32))], []), "not a u32"),
    "duplicate-tensor": (gguf_bytes([GOOD_KV], [tensor("t", (4,)), tensor("t", (4,), offset=32)]),
                         "duplicate tensor t"),
    "tensor-type": (gguf_bytes([GOOD_KV], [tensor("t", (32,), type_id=4)]), "unknown type 4"),
    "dims": (gguf_bytes([GOOD_KV], [tensor("t", (1, 1, 1, 1, 1))]), "5 dimensions"),
    "misaligned": (gguf_bytes([GOOD_KV], [tensor("t", (4,), offset=8)]), "alignment 32"),
    "rows": (gguf_bytes([GOOD_KV], [tensor("t", (128, 2), type_id=12)]), "row length 128 is not a multiple of Q4_K"),
    "cut-tensor-infos": (gguf_bytes([GOOD_KV], [tensor("t", (4,))], data=b"")[:-40], "damaged or truncated"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(DAMAGED))
def test_damaged_headers_are_one_line_bad_input(tmp_path, name):
    content, needle = DAMAGED[name]
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(BadInput) as exc:
        read_header(str(path))
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg, msg


def test_missing_and_directory(tmp_path):
    with pytest.raises(BadInput, match="not found"):
        read_header(str(tmp_path / "nope.gguf"))
    with pytest.raises(BadInput, match="not a file"):
        read_header(str(tmp_path))


def test_strings_that_are_not_utf8_are_replaced(tmp_path):
    path = tmp_path / "v.gguf"
    path.write_bytes(gguf_bytes([GOOD_KV, kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + s("a") + s(b"\xff"))],
                                []))  # fmt: skip
    assert read_header(str(path)).metadata["tokenizer.ggml.tokens"] == ["a", "\ufffd"]


@pytest.mark.parametrize("items", [
    [],
    [b""],
    [b"", b"", b"a"],
    [b"\xe2\x82", b"b", b"\xe2\x82\xac", b"\xf0"],  # a sequence cut at a string's end stays in that string
    [b"a\x00b", b"c"],  # a NUL inside a string (the one-decode path's separator): decoded one by one
    [bytes([i]) for i in range(1, 256)],
])  # fmt: skip
def test_string_arrays_decode_each_string_on_its_own(tmp_path, items):
    path = tmp_path / "v.gguf"
    body = struct.pack("<IQ", 8, len(items)) + b"".join(s(x) for x in items)
    path.write_bytes(gguf_bytes([GOOD_KV, kv("tokenizer.ggml.tokens", 9, body), kv("x.after", 4, b"\x07\0\0\0")], []))
    md = read_header(str(path)).metadata
    assert md["tokenizer.ggml.tokens"] == [x.decode("utf-8", "replace") for x in items]
    assert md["x.after"] == 7


def test_open_model_walks_past_the_vocabulary_until_it_is_asked_for(tmp_path):
    from backends.gguf import open_model
    from backends.gguf.index import VOCABULARY_KEYS
    from kafila.models import load_tokenizer

    path = write_llama_gguf(tmp_path / "m.gguf", blocks=1)
    index = open_model(path)
    assert not VOCABULARY_KEYS & set(index.lean_metadata)  # never decoded by the open
    assert set(index.lean_metadata) == set(read_header(path).metadata) - VOCABULARY_KEYS
    assert index.metadata == read_header(path, tensors=False).metadata  # every key, on first use
    assert load_tokenizer(index).encode("abc") == load_tokenizer(open_model(path)).encode("abc")
