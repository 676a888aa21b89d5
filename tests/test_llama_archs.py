"""llama.cpp's own random model of every architecture Kafila serves gives llama.cpp's greedy ids
(issues 34 and 35: the external reference written by llama.cpp, not beside our code).

llama.cpp's tests/test-llama-archs.cpp writes a small random model per architecture (dense and
MoE variants) that carries every optional tensor llama.cpp's loader reads: per-matrix and
per-expert .scale factors (applied only where the architecture's graph passes them), the unused
.input_scale, biases, rope_freqs, fused gate+up experts, qwen3's classifier head. It is compiled
at test time from the llama-cpp-python sdist against that package's libllama
(tests/llamacpp_files.py), so the models are exactly what llama.cpp 0.3.36 writes.

Each model: a 40-id prompt (fed in chunks of 16, so chunk boundaries and decode both run) and 48
greedy ids from llama.cpp (f32 KV) against Kafila's OpenVINO and MLX stages at --precision f32, at
one stage (logits within the suite's bound at every step) and split over two stages (the same ids).
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import ShardSpec, load_shard, status
from backends.errors import BadInput
from backends.gguf import open_model
from tests.test_llamacpp_arch import check_against_llamacpp, kafila_greedy, needs_llamacpp

SERVED = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma3", "gpt-oss", "qwen35", "qwen35moe",
          "qwen3next")  # fmt: skip
MODELS = ("llama-dense", "llama-moe", "qwen2-dense", "qwen3-dense", "qwen2moe-moe", "qwen3moe-moe", "gemma3-dense",
          "gpt-oss-moe", "qwen35-dense", "qwen35moe-moe", "qwen3next-moe")  # fmt: skip
N_TOKENS = 48
CHUNK = 16
PROMPT_IDS = [int(i) for i in np.random.default_rng(1).integers(0, 128, 40)]  # the models' vocabulary is 128
needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)


@pytest.fixture(scope="module")
def models():
    from tests.llamacpp_files import llama_arch_models

    return llama_arch_models(SERVED)


@pytest.fixture(scope="module")
def reference(models):
    """name → (path, index, llama.cpp's ids, llama.cpp's logits)."""
    from tests.llamacpp_ref import greedy_run

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            path = str(models[name])
            ids, logits = greedy_run(path, PROMPT_IDS, N_TOKENS)
            cache[name] = path, open_model(path), ids, logits
        return cache[name]

    return get


def test_llamacpp_writes_a_model_of_every_served_architecture(models):
    assert set(MODELS) <= set(models), sorted(models)


@needs_llamacpp
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
@pytest.mark.parametrize("name", MODELS)
def test_one_and_two_stages_give_llamacpps_ids(reference, name, backend):
    from kafila.engine.chain import LocalChain

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    path, index, ref_ids, ref_logits = reference(name)
    n = index.hparams.n_blocks
    whole = load_shard(backend, ShardSpec(path, 0, n, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(whole, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)
    split = [load_shard(backend, ShardSpec(path, a, b, a == 0, a == 0), "f32", index=index)
             for a, b in ((0, n // 2), (n // 2, n))]  # fmt: skip
    assert list(LocalChain(split, chunk_tokens=CHUNK).generate(PROMPT_IDS, N_TOKENS)) == ref_ids


def test_the_scales_a_graph_ignores_are_read_and_not_applied(models):
    """qwen2's loader reads ffn_*.scale but its graph never passes them: they are no extras."""
    h = open_model(str(models["qwen2-dense"])).hparams
    assert not any(".ffn_" in n for n in h.extras) and "blk.0.attn_q.scale" in h.extras
    assert "output.bias" in h.extras
    h = open_model(str(models["qwen3-dense"])).hparams
    assert "blk.0.ffn_up.scale" in h.extras


@pytest.mark.parametrize("backend", ["reference"])
def test_backends_without_output_scales_refuse_them_in_one_line(models, backend):
    if not status(backend).available:
        pytest.skip(status(backend).reason)
    path = str(models["qwen3-dense"])
    line = rf"backend {backend} does not apply tensor blk\.0\.attn_k\.scale .*--backend openvino"
    with pytest.raises(BadInput, match=line):
        load_shard(backend, ShardSpec(path, 0, 1, True, True), "f32")
