"""The planner's memory model (issue 10): a fixed per-process term, the weights in the serving
backend's forms and the head's extra; the factors checked against the constants the OpenVINO
backend really builds; the build's row-block decoding equal to one pass."""

import numpy as np
import pytest

from backends.gguf import open_model
from backends.gguf import quant
from backends.memory import (
    HEAD_WORK_BYTES_PER_VOCAB,
    PREFILL_WORK_BYTES,
    PROCESS_BYTES,
    RESIDENT_BYTES_PER_WEIGHT,
    TOKENIZER_BYTES_PER_VOCAB,
    bytes_per_weight,
    resident_bytes,
)
from planner import PlanInputError, block_limit, member_bytes, parse_fleet, short_bytes, slots_that_fit
from tests.synthetic_gguf import write_llama_gguf

MODEL = {"name": "m", "blocks": 8, "block_bytes": 100.0, "head_bytes": 50.0, "kv_bytes_per_token_per_block": 1.0}


def fleet(memory_gb=1e-6, **model):
    return parse_fleet({"context": 10, "concurrency": 2, "anchor": "a", "model": {**MODEL, **model},
                        "devices": [{"name": "a", "memory_gb": memory_gb}]})  # fmt: skip


def test_without_the_new_fields_memory_is_the_files_bytes_as_before():
    f = fleet()
    assert (f.model.process_bytes, f.model.block_memory, f.model.head_memory) == (0.0, 100.0, 50.0)
    assert member_bytes(f.model, 3, True, 20) == 3 * (100 + 20) + 50
    assert block_limit(f.device("a"), f, is_head=True) == (1000 - 50) // 120


def test_process_term_and_resident_forms_price_every_member():
    f = fleet(process_bytes=300.0, block_resident_bytes=150.0, head_resident_bytes=80.0)
    m = f.model
    assert member_bytes(m, 2, False, 20) == 300 + 2 * (150 + 20)
    assert member_bytes(m, 2, True, 0) == 300 + 2 * 150 + 80
    assert member_bytes(m, 0, False, 20) == 0  # a member without blocks holds nothing of the model
    a = f.device("a")  # 1000 bytes
    assert block_limit(a, f, is_head=False) == (1000 - 300) // 170
    assert block_limit(a, f, is_head=True) == (1000 - 380) // 170
    assert short_bytes(a, f, 4, is_head=True) == 300 + 4 * 170 + 80 - 1000
    # slots: (1000 − 300 − 80 − 2·150) / (2 blocks · 10 positions) = 16, capped at 8
    assert slots_that_fit(f, {"a": 2}, "a", 8) == 8
    assert slots_that_fit(f, {"a": 2}, "a", 100) == 16


def test_the_anchor_carries_its_extra():
    f = parse_fleet({"context": 10, "concurrency": 1, "anchor": "a",
                     "model": {**MODEL, "process_bytes": 300.0, "anchor_bytes": 100.0},
                     "devices": [{"name": "a", "memory_gb": 1e-6}, {"name": "b", "memory_gb": 1e-6}]})  # fmt: skip
    assert member_bytes(f.model, 2, False, 10, is_anchor=True) == 300 + 100 + 2 * 110
    assert block_limit(f.device("a"), f, is_head=False) == (1000 - 400) // 110
    assert block_limit(f.device("b"), f, is_head=False) == (1000 - 300) // 110
    assert short_bytes(f.device("a"), f, 7, is_head=False) == 400 + 7 * 110 - 1000


@pytest.mark.parametrize("key", ["process_bytes", "anchor_bytes", "block_resident_bytes", "head_resident_bytes"])
@pytest.mark.parametrize("bad", [-1, "x", float("inf"), True])
def test_bad_memory_fields_are_one_line_errors(key, bad):
    with pytest.raises(PlanInputError, match=key):
        fleet(**{key: bad})


def test_bytes_per_weight_of_the_named_forms():
    assert bytes_per_weight("openvino", "Q4_K") == 0.75 and bytes_per_weight("openvino", "Q6_K") == 1.25
    assert bytes_per_weight("mlx", "Q6_K") == 2.0 and bytes_per_weight("reference", "Q4_K") == 8.0
    assert set(PROCESS_BYTES) >= set(RESIDENT_BYTES_PER_WEIGHT)


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("kq") / "kq.gguf"
    return write_llama_gguf(path, blocks=2, hidden=256, heads=4, kv_heads=2, ffn=512, qtype="Q4_K",
                            embed_qtype="Q6_K", tensor_types={"attn_v.weight": "Q6_K"})  # fmt: skip


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_openvino_factor_is_the_constants_it_builds(tmp_path, qtype):
    """The bytes WeightBank.pack keeps for a matrix = n_weights × the planner's factor."""
    pytest.importorskip("openvino")
    from backends.openvino.weights import WeightBank

    index = open_model(write_llama_gguf(tmp_path / "m.gguf", blocks=1, hidden=256, heads=4, kv_heads=2,
                                        ffn=512, qtype=qtype, embed_qtype="Q8_0"))  # fmt: skip
    name = "blk.0.ffn_up.weight"
    bank = WeightBank(index)
    bank.pack(index.blocks_of(name))
    kept = sum(a.nbytes for a in bank.keep)
    weights = int(np.prod(index.tensors[name].shape))
    assert kept == pytest.approx(weights * bytes_per_weight("openvino", qtype), rel=1e-9)


def test_planner_model_carries_the_resident_figures(kquant_model):
    index = open_model(kquant_model)
    plain = index.planner_model()
    assert "process_bytes" not in plain  # the file's bytes only, as before
    ov = index.planner_model("openvino")
    blocks = [resident_bytes("openvino", index.block_tensors(b)) for b in range(2)]
    assert ov["block_resident_bytes"] == pytest.approx(sum(blocks) / 2)
    assert ov["process_bytes"] == (PROCESS_BYTES["openvino"] + TOKENIZER_BYTES_PER_VOCAB * index.hparams.vocab
                                   + PREFILL_WORK_BYTES)  # fmt: skip
    # tied: the Q6_K table once, in OpenVINO's form (1.25 B/weight), plus the norm and the head's work
    embd = index.tensors["token_embd.weight"]
    assert ov["head_resident_bytes"] > np.prod(embd.shape) * 1.25
    assert ov["block_resident_bytes"] > plain["block_bytes"]  # 0.75/1.25 B a weight against 0.56/0.82


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_split_blocks_by_row_blocks_equals_one_pass(tmp_path, monkeypatch, qtype):
    index = open_model(write_llama_gguf(tmp_path / "m.gguf", blocks=1, hidden=256, heads=4, kv_heads=2,
                                        ffn=512, qtype=qtype, embed_qtype=qtype))  # fmt: skip
    t = index.tensors["token_embd.weight"]
    whole = index.blocks_of(t.name)
    monkeypatch.setattr(quant, "SPLIT_CHUNK_BYTES", 3 * t.n_bytes // t.shape[0] + 1)  # 3 rows a part, a short tail
    parts = index.blocks_of(t.name)
    for a, b in ((whole.q, parts.q), (whole.scale, parts.scale), (whole.offset, parts.offset)):
        if a is None:
            assert b is None
        else:
            assert a.dtype == b.dtype and np.array_equal(a, b)


def _const_arrays(packed):
    out = []
    for node in (packed.q, packed.scale, packed.zero, packed.offset):
        out.append(None if node is None else (str(node.get_element_type()), list(node.get_shape()),
                                              node.get_data().tobytes()))  # fmt: skip
    return out


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_openvino_pack_by_rows_builds_the_same_constants(tmp_path, monkeypatch, qtype, ov_form):
    pytest.importorskip("openvino")
    from backends.openvino import weights

    index = open_model(write_llama_gguf(tmp_path / "m.gguf", blocks=1, hidden=256, heads=4, kv_heads=2,
                                        ffn=512, qtype=qtype, embed_qtype=qtype))  # fmt: skip
    t = index.tensors["token_embd.weight"]
    first = weights.WeightBank(index, spill=True)  # kept: its constants point into its buffers
    whole = first.pack(index.blocks_of(t.name))
    monkeypatch.setattr(weights, "SPILL_ROWS_BYTES", 5 * t.n_bytes // t.shape[0])  # 5 rows a part
    bank = weights.WeightBank(index, spill=True)
    parts = bank.pack_by_rows(t.name)
    assert (parts.rows, parts.cols) == (whole.rows, whole.cols)
    assert _const_arrays(parts) == _const_arrays(whole)
    bank.release_pages()  # the constants stay readable after their pages are dropped
    assert _const_arrays(parts) == _const_arrays(whole)


def test_a_shard_built_by_rows_answers_as_before(tmp_path, monkeypatch, ov_form):
    """The whole head (embedding, tied Q6_K lm_head) built by row parts: the same f32 logits."""
    pytest.importorskip("openvino")
    from backends.base import ShardSpec
    from backends.openvino import weights
    from backends.openvino.shard import OpenVINOShard

    path = write_llama_gguf(tmp_path / "m.gguf", blocks=2, hidden=256, heads=4, kv_heads=2, ffn=512,
                            qtype="Q4_K", embed_qtype="Q6_K", tensor_types={"attn_v.weight": "Q6_K"})  # fmt: skip
    spec = ShardSpec(path, 0, 2, embed=True, head=True)
    ids, pos, mask = np.array([3, 17, 42, 99, 5]), np.arange(5), np.ones(5, np.int64)

    def logits():
        shard = OpenVINOShard(spec, "f32")
        return shard.logits(shard.forward(shard.open_slot(), ids, pos, mask))

    want = logits()
    monkeypatch.setattr(weights, "SPILL_ROWS_BYTES", 4096)
    assert np.array_equal(logits(), want)


def test_the_hosts_plan_prices_a_mixed_ring_by_its_largest_backend(kquant_model):
    from kafila.session.control.host import _resident_model

    index = open_model(kquant_model)
    ov, mlx = index.planner_model("openvino"), index.planner_model("mlx")
    both = _resident_model(index, {"openvino", "mlx"})
    for key in ("process_bytes", "anchor_bytes", "block_resident_bytes", "head_resident_bytes"):
        assert both[key] == max(ov[key], mlx[key])
    assert both["block_bytes"] == ov["block_bytes"]  # the cost side stays the file's bytes
    assert _resident_model(index, {"openvino"}) == ov
    fleet = parse_fleet({"context": 64, "concurrency": 1, "anchor": "a", "model": both,
                         "devices": [{"name": "a", "memory_gb": 1.0}]})  # fmt: skip
    assert fleet.model.block_memory == both["block_resident_bytes"]


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q5_0", "F16", "BF16"])
def test_embedding_rows_read_from_the_file_are_the_exact_rows(tmp_path, qtype):
    """ModelIndex.rows (the shards' embedding lookup): each id's row, exact, repeats and any
    order, without the table and without mapping the file (the rows a session looked up would
    gather in its RSS); an id outside the vocabulary is refused."""
    hidden = 256
    index = open_model(write_llama_gguf(tmp_path / "m.gguf", blocks=1, hidden=hidden, heads=4, kv_heads=2,
                                        ffn=512, qtype="Q8_0", embed_qtype=qtype))  # fmt: skip
    ids = np.array([7, 3, 7, 0, index.hparams.vocab - 1])
    got = index.rows("token_embd.weight", ids)
    want = index.dequantize("token_embd.weight", np.float32)[ids]
    assert got.dtype == np.float32 and got.shape == (5, hidden)
    assert np.array_equal(got, want)
    fresh = open_model(index.path)
    fresh.rows("token_embd.weight", ids)
    with open("/proc/self/maps") as maps:
        assert index.path not in maps.read()
    with pytest.raises(ValueError, match="token ids must be in"):
        index.rows("token_embd.weight", np.array([index.hparams.vocab]))


def test_openvino_holds_no_embedding_table(tmp_path):
    """An untied embedding table is not priced on the head: OpenVINO's first stage takes hidden
    states (its shard looks the rows up) and holds no table of vocabulary rows (the plugin kept
    its own copy of a Gather's table, issue 10)."""
    pytest.importorskip("openvino")
    from backends.base import ShardSpec
    from backends.openvino.shard import OpenVINOShard

    path = write_llama_gguf(tmp_path / "m.gguf", blocks=1, hidden=256, heads=4, kv_heads=2, ffn=512,
                            qtype="Q4_K", embed_qtype="Q4_K", tied=False)  # fmt: skip
    index = open_model(path)
    head = [index.tensors["output.weight"], index.tensors["output_norm.weight"]]
    vocab = index.hparams.vocab
    work = HEAD_WORK_BYTES_PER_VOCAB * vocab
    assert index.head_resident_bytes("openvino") == pytest.approx(resident_bytes("openvino", head) + work)
    assert index.head_resident_bytes("mlx") == pytest.approx(resident_bytes("mlx", head) + work)
    shard = OpenVINOShard(ShardSpec(path, 0, 1, embed=True, head=False), "f32")
    names = set().union(*(p.get_names() for p in shard.compiled.inputs))
    assert "hidden_states" in names and "input_ids" not in names
    shapes = [n.get_output_partial_shape(0) for n in shard.runtime_model().get_ops()
              if n.get_type_name() == "Const" or n.get_type_name() == "Constant"]
    assert not any(s.rank.get_length() >= 1 and s[0].is_static and s[0].get_length() == vocab for s in shapes)


def test_mlx_holds_no_untied_embedding_table(tmp_path):
    """The MLX head keeps a tied table (it is the lm_head) and reads an untied one's rows from
    the file: the same rows, exact, and no second table in its weights."""
    pytest.importorskip("mlx.core")
    from backends.base import ShardSpec
    from backends.mlx.shard import MLXShard

    ids = np.array([5, 0, 5, 200])
    for tied in (True, False):
        path = write_llama_gguf(tmp_path / f"m{tied}.gguf", blocks=1, hidden=256, heads=4, kv_heads=2, ffn=512,
                                qtype="Q4_K", embed_qtype="Q6_K", tied=tied)  # fmt: skip
        index = open_model(path)
        shard = MLXShard(ShardSpec(path, 0, 1, embed=True, head=True), "f32")
        assert (shard.weights.embedding is shard.weights.lm_head) if tied else shard.weights.embedding is None
        got = np.array(shard._embed(ids, len(ids)))
        assert np.array_equal(got, index.dequantize("token_embd.weight", np.float32)[ids])


def test_the_ggml_form_holds_the_files_own_blocks(kquant_model):
    """--kquant ggml keeps a matrix as the file's blocks (or ggml's repacked copy of them, the
    same bytes): a weight takes its GGUF type's bytes, as gguf-py (llama.cpp's) sizes its blocks;
    the host prices a ggml session by them, and the other forms by the constants."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from backends.memory import GGML_BYTES_PER_WEIGHT, GGML_KIND, memory_kind
    from kafila.session.control.host import _resident_model

    for qtype, per in GGML_BYTES_PER_WEIGHT.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        assert per == size / block, qtype
    assert memory_kind("openvino", "ggml") == GGML_KIND
    assert memory_kind("openvino", "exact") == memory_kind("openvino", "fast") == "openvino"
    assert memory_kind("mlx", "ggml") == "mlx"
    index = open_model(kquant_model)
    ggml = _resident_model(index, {GGML_KIND})
    blocks = [sum(t.n_bytes for t in index.block_tensors(b) if t.qtype != "F32") for b in range(2)]
    floats = [4 * sum(int(np.prod(t.shape)) for t in index.block_tensors(b) if t.qtype == "F32") for b in range(2)]
    assert ggml["block_resident_bytes"] == pytest.approx((sum(blocks) + sum(floats)) / 2)
    assert ggml["block_resident_bytes"] < index.planner_model("openvino")["block_resident_bytes"]
    assert ggml["process_bytes"] == index.planner_model("openvino")["process_bytes"]
