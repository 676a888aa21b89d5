"""Files llama.cpp's own quantizer writes as Q2_K, Q3_K_M, IQ4_XS and IQ4_NL give llama.cpp's ids.

As tests/test_llamacpp_quant.py does for the K-quant mixes: a small random F32 Llama (hidden 256,
4 blocks) is quantized by llama_model_quantize; llama.cpp's yardstick runs an F32 copy of the
dequantized weights (its own kernels on a quantized file quantize the activations too) with an f32
KV cache. Kafila reads the quantized file itself: every tensor dequantizes bit for bit as ggml's
dequantize_row_* does, and the float64 reference, the OpenVINO shard at f32 (one stage, and three
stages of 2 + 1 + 1 blocks) and MLX (where llama.cpp's choice is clear) give llama.cpp's greedy ids
after a 72-id prompt. llama.cpp's file quantizer writes MXFP4 only for gpt-oss expert tensors, so
the MXFP4 file's matrices are quantized by ggml's own ggml_quantize_chunk instead (the same
weights otherwise).
"""

from __future__ import annotations

from collections import Counter

import gguf
import numpy as np
import pytest

from backends import ShardSpec, load_shard, status
from tests.ggml_quants import ggml_dequantize
from tests.synthetic_gguf import write_llama_gguf
from tests.test_llamacpp_arch import check_against_llamacpp, kafila_greedy
from tests.test_llamacpp_quant import write_f32_copy

# the type each file's mix must use for most matrices; llama.cpp adds higher types for some
FTYPES = {"Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "IQ4_XS": "IQ4_XS", "IQ4_NL": "IQ4_NL", "MXFP4": "MXFP4"}
WRITTEN_BY_GGML = ("MXFP4",)  # every matrix quantized by ggml_quantize_chunk (tests/synthetic_gguf.py)
PROMPT_IDS = [int(i) for i in np.random.default_rng(7).integers(0, 260, 72)]
N_TOKENS = 16
BLOCKS = 4
UNEVEN = ((0, 2), (2, 3), (3, 4))
SHAPE = {"blocks": BLOCKS, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512, "tied": False, "seed": 3}
needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
needs_mlx = pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized(ftype) → (path, index, llama.cpp's ids and logits on the F32 copy), once each."""
    from backends.gguf import open_model
    from tests.llamacpp_ref import greedy_run, quantize

    root = tmp_path_factory.mktemp("lcplow")
    src = write_llama_gguf(root / "f32.gguf", **SHAPE, qtype="F32", embed_qtype="F32")
    built: dict[str, tuple] = {}

    def get(ftype: str):
        if ftype not in built:
            if ftype in WRITTEN_BY_GGML:
                path = write_llama_gguf(root / f"{ftype}.gguf", **SHAPE, qtype=ftype, embed_qtype=ftype)
            else:
                path = quantize(src, str(root / f"{ftype}.gguf"), ftype)
            index = open_model(path)  # refuses a type Kafila does not serve
            ids, logits = greedy_run(write_f32_copy(path, str(root / f"{ftype}-f32.gguf")), PROMPT_IDS, N_TOKENS)
            built[ftype] = (path, index, ids, logits)
        return built[ftype]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("ftype", FTYPES)
def test_llamacpp_files_dequantize_as_llamacpp(quantized, ftype):
    """The file holds the type named (most matrices), and every tensor's f32 values are ggml's."""
    path, index, ids, _ = quantized(ftype)
    hist = Counter(t.qtype for t in index.tensors.values() if len(t.shape) == 2)
    assert hist.most_common(1)[0][0] == FTYPES[ftype], hist
    assert len(set(ids)) > 1, ids  # the continuation is not one token repeated
    for t in gguf.GGUFReader(path, "r").tensors:
        info = index.tensors[t.name]
        if info.qtype == "F32":
            continue
        theirs = ggml_dequantize(info.qtype, np.asarray(t.data).reshape(-1, t.data.shape[-1]), info.shape[-1])
        ours = index.dequantize(t.name, np.float32).reshape(theirs.shape)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), (t.name, info.qtype)


@pytest.mark.slow
@pytest.mark.parametrize("ftype", FTYPES)
def test_reference_matches_llamacpp(quantized, ftype):
    from backends.reference import ReferenceShard

    path, index, ref_ids, ref_logits = quantized(ftype)
    shard = ReferenceShard(ShardSpec(path, 0, BLOCKS, True, True), index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


class Chain:
    """Stages of one model as a single shard for kafila_greedy: stage 0 embeds and holds the head."""

    def __init__(self, shards):
        self.shards = shards

    def open_slot(self):
        return [s.open_slot() for s in self.shards]

    def forward(self, slots, x, positions, mask):
        for shard, slot in zip(self.shards, slots):
            x = shard.forward(slot, x, positions, mask)
        return x

    def logits(self, hidden):
        return self.shards[0].logits(hidden)

    def close_slot(self, slots):
        for shard, slot in zip(self.shards, slots):
            shard.close_slot(slot)


@pytest.mark.slow
@needs_openvino
@pytest.mark.parametrize("ftype", FTYPES)
def test_openvino_matches_llamacpp(quantized, ftype):
    path, index, ref_ids, ref_logits = quantized(ftype)
    one = load_shard("openvino", ShardSpec(path, 0, BLOCKS, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(one, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)
    three = Chain([load_shard("openvino", ShardSpec(path, a, b, i == 0, i == 0), "f32", index=index)
                   for i, (a, b) in enumerate(UNEVEN)])
    check_against_llamacpp(kafila_greedy(three, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


@pytest.mark.slow
@needs_mlx
@pytest.mark.parametrize("ftype", FTYPES)
def test_mlx_matches_llamacpp(quantized, ftype):
    path, index, ref_ids, ref_logits = quantized(ftype)
    shard = load_shard("mlx", ShardSpec(path, 0, BLOCKS, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits, exact_ids=False)
