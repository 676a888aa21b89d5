"""Each architecture Kafila serves computes what llama.cpp computes from the same GGUF.

Small random F32 models of each kind (tests/arch_gguf.py: llama, llama with llama3 rope_freqs,
llama with linear RoPE scaling, qwen2 with biases, qwen3 with q/k norms and head size ≠
hidden/heads) get a 420-id random prompt; the greedy continuation of llama.cpp (llama-cpp-python,
f32 weights and f32 KV cache, tests/llamacpp_ref.py) is the yardstick for the float64 reference,
the OpenVINO shard (f32) and the MLX shard (f32).

Refusals: what llama.cpp would compute differently from Kafila (another architecture, experts,
YaRN / LongRoPE scaling) is refused with one line that names it.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import ShardSpec, load_shard, status
from backends.errors import BadInput
from tests.arch_gguf import KINDS, write_arch_gguf

PROMPT_IDS = [int(i) for i in np.random.default_rng(1).integers(0, 100_000, 420)]
N_TOKENS = 20
# Logits reach ≈ 40 on these models; llama.cpp computes in f32 (its RoPE angles by repeated f32
# products), the reference in float64, OpenVINO/MLX in f32. Measured largest |Δlogit| against
# llama.cpp over 20 steps: reference 6e-5…1.1e-3, OpenVINO 7e-5…4.6e-4, MLX 7e-5…6e-4 (all
# ids equal). The bound leaves ≈ 9× room while catching any wrong formula (errors ≫ 1).
LOGITS_ABS_BOUND = 1e-2
# MLX (f32 on CPU, fused RoPE/SDPA kernels) is held to the same logits bound; its ids must equal
# llama.cpp's except at a step where llama.cpp's top-2 margin is under 2 × the bound (a near-tie
# f32 kernels may break either way; measured: all 20 ids equal on every kind).


def _llamacpp_available() -> str:
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # ImportError, or a shared library that fails to load
        return f"llama-cpp-python is unavailable ({type(exc).__name__}: {exc}); install the test extra"
    return ""


LLAMACPP_MISSING = _llamacpp_available()


def needs_llamacpp(test):
    """Compares with llama.cpp: slow (a few seconds per model), skipped without llama-cpp-python."""
    return pytest.mark.slow(pytest.mark.skipif(bool(LLAMACPP_MISSING), reason=LLAMACPP_MISSING)(test))


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory):
    """arch_model(kind) → (path, index, llama.cpp's (ids, logits)), each built once per module."""
    from backends.gguf import open_model
    from tests.llamacpp_ref import greedy_run

    root = tmp_path_factory.mktemp("arch")
    built: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in built:
            path = write_arch_gguf(root / f"{kind}.gguf", kind)
            ids, logits = greedy_run(path, PROMPT_IDS, N_TOKENS)
            built[kind] = (path, open_model(path), ids, logits)
        return built[kind]

    return get


def kafila_greedy(shard, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy ids and the logits each was taken from, feeding the prompt then one id per step."""
    slot = shard.open_slot()
    x, total, ids, rows = np.asarray(prompt, np.int64), 0, [], []
    for _ in range(n):
        total += len(x)
        hidden = shard.forward(slot, x, np.arange(total - len(x), total), np.ones(total, np.int64))
        logits = np.asarray(shard.logits(hidden[-1:])[0], np.float64)
        ids.append(int(np.argmax(logits)))
        rows.append(logits)
        x = np.asarray(ids[-1:], np.int64)
    shard.close_slot(slot)
    return ids, np.stack(rows)


def check_against_llamacpp(ours: tuple[list[int], np.ndarray], ref_ids: list[int], ref_logits: np.ndarray,
                           exact_ids: bool = True, bound: float = LOGITS_ABS_BOUND) -> float:
    """Assert ids equal (or, unless exact_ids, equal wherever llama.cpp's choice is clear) and the
    logits close while the two continuations agree; returns the largest logit difference."""
    ids, logits = ours
    agree = 0
    while agree < len(ids) and ids[agree] == ref_ids[agree]:
        agree += 1
    worst = float(np.max(np.abs(logits[: agree + 1] - ref_logits[: agree + 1])))
    assert worst < bound, (worst, ids, ref_ids)
    if exact_ids:
        assert ids == ref_ids
    elif agree < len(ids):  # a divergence is allowed only at a near-tie of llama.cpp's top two
        top2 = np.sort(ref_logits[agree])[-2:]
        assert top2[1] - top2[0] < 2 * LOGITS_ABS_BOUND, (agree, ids, ref_ids)
    return worst


@needs_llamacpp
@pytest.mark.parametrize("kind", KINDS)
def test_reference_matches_llamacpp(arch_model, kind):
    from backends.reference import ReferenceShard

    path, index, ref_ids, ref_logits = arch_model(kind)
    assert len(set(ref_ids)) > N_TOKENS // 2, ref_ids  # the random model is not degenerate
    shard = ReferenceShard(ShardSpec(path, 0, index.hparams.n_blocks, True, True), index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


@needs_llamacpp
@pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
@pytest.mark.parametrize("kind", KINDS)
def test_openvino_matches_llamacpp(arch_model, kind):
    path, index, ref_ids, ref_logits = arch_model(kind)
    n = index.hparams.n_blocks
    head = load_shard("openvino", ShardSpec(path, 0, n, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(head, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


@needs_llamacpp
@pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)
@pytest.mark.parametrize("kind", KINDS)
def test_mlx_matches_llamacpp(arch_model, kind):
    path, index, ref_ids, ref_logits = arch_model(kind)
    n = index.hparams.n_blocks
    shard = load_shard("mlx", ShardSpec(path, 0, n, True, True), "f32", index=index)
    check_against_llamacpp(kafila_greedy(shard, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits, exact_ids=False)


class _Chain:
    """Shards in ring order as one shard: the first embeds and holds the head (kafila.engine.chain's shape)."""

    def __init__(self, shards: list) -> None:
        self.shards = shards

    def open_slot(self) -> list[int]:
        return [s.open_slot() for s in self.shards]

    def close_slot(self, slots: list[int]) -> None:
        for s, slot in zip(self.shards, slots):
            s.close_slot(slot)

    def forward(self, slots, x, positions, mask):
        for s, slot in zip(self.shards, slots):
            x = s.forward(slot, x, positions, mask)
        return x

    def logits(self, hidden):
        return self.shards[0].logits(hidden)


@needs_llamacpp
@pytest.mark.skipif(not (status("openvino").available and status("mlx").available),
                    reason=status("openvino").reason or status("mlx").reason)
@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_split_ring_of_openvino_and_mlx_matches_llamacpp(arch_model, kind):
    """Block 0 (+ embedding and head) on OpenVINO, block 1 on MLX: the second stage needs
    rope_freqs / q-k norms without the head's tensors, and hidden states cross backends."""
    path, index, ref_ids, ref_logits = arch_model(kind)
    chain = _Chain([load_shard("openvino", ShardSpec(path, 0, 1, True, True), "f32", index=index),
                    load_shard("mlx", ShardSpec(path, 1, 2, False, False), "f32", index=index)])  # fmt: skip
    check_against_llamacpp(kafila_greedy(chain, PROMPT_IDS, N_TOKENS), ref_ids, ref_logits, exact_ids=False)


@needs_llamacpp
@pytest.mark.parametrize("variant", ["llama3", "llama-linear"])
def test_rope_variants_change_llamacpps_answer(arch_model, variant):
    """The llama3 factors and the linear scaling are not inert on these files: with the same
    weights, llama.cpp answers differently without them (so the tests above do test them)."""
    assert arch_model(variant)[2] != arch_model("llama")[2]


@pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)
@pytest.mark.parametrize("kind", KINDS)
def test_mlx_rope_at_arbitrary_positions_equals_the_fused_kernel(tmp_path, kind):
    """MLX's hand-written RoPE (non-consecutive positions, after a rewind) equals mx.fast.rope."""
    import mlx.core as mx

    from backends.mlx.model import rope
    from backends.mlx.shard import MLXShard

    path = write_arch_gguf(tmp_path / "m.gguf", kind, tiny_vocab=256)
    dims = MLXShard(ShardSpec(path, 0, 1, False, False), "f32").dims
    x = mx.array(np.random.default_rng(0).standard_normal((1, 2, 5, dims.head_dim)).astype(np.float32))
    fused = rope(x, 300, dims)
    by_hand = rope(x, mx.arange(300, 305, dtype=mx.int32), dims)
    np.testing.assert_allclose(np.array(by_hand), np.array(fused), atol=2e-4)


def _refusal(tmp_path, **options) -> str:
    kind = options.pop("kind", "llama")
    path = write_arch_gguf(tmp_path / "m.gguf", kind, tiny_vocab=256, **options)
    from backends.gguf import open_model

    with pytest.raises(BadInput) as err:
        open_model(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unsupported_architecture_is_refused_naming_it_and_what_is_served(tmp_path):
    message = _refusal(tmp_path, arch="gemma")
    assert "'gemma'" in message and "llama, qwen2, qwen3" in message


def test_experts_of_a_dense_only_architecture_are_refused(tmp_path):
    """qwen2 has a MoE sibling (qwen2moe) but no experts of its own in llama.cpp."""
    from gguf import GGUFValueType as T

    experts = {"qwen2.expert_count": (8, T.UINT32), "qwen2.expert_used_count": (2, T.UINT32)}
    message = _refusal(tmp_path, kind="qwen2", extra_kv=experts,
                       extra_tensors={"blk.0.ffn_gate_exps.weight": (8, 128, 64)})  # fmt: skip
    assert "8 experts" in message and "MoE" in message and "qwen3moe" in message


def test_llama_experts_without_their_tensors_are_refused(tmp_path):
    from gguf import GGUFValueType as T

    experts = {"llama.expert_count": (8, T.UINT32), "llama.expert_used_count": (2, T.UINT32)}
    message = _refusal(tmp_path, extra_kv=experts, extra_tensors={"blk.0.ffn_gate_exps.weight": (8, 128, 64)})
    assert "ffn_gate_inp" in message


def test_expert_tensors_without_expert_count_are_refused(tmp_path):
    message = _refusal(tmp_path, extra_tensors={"blk.1.ffn_gate_inp.weight": (8, 64)})
    assert "blk.1.ffn_gate_inp.weight" in message


@pytest.mark.parametrize("scaling", ["yarn", "longrope"])
def test_unserved_rope_scaling_is_refused(tmp_path, scaling):
    from gguf import GGUFValueType as T

    message = _refusal(tmp_path, extra_kv={"llama.rope.scaling.type": (scaling, T.STRING),
                                           "llama.rope.scaling.factor": (4.0, T.FLOAT32)})  # fmt: skip
    assert f"'{scaling}'" in message and "linear" in message


def test_rope_attention_factor_is_refused(tmp_path):
    from gguf import GGUFValueType as T

    message = _refusal(tmp_path, extra_kv={"llama.rope.scaling.attn_factor": (1.5, T.FLOAT32)})
    assert "attn_factor" in message


def test_rope_freqs_on_qwen_is_refused(tmp_path):
    """llama.cpp's qwen2/qwen3 graphs read no rope_freqs: a file with one is not what Kafila serves."""
    message = _refusal(tmp_path, kind="qwen2", extra_tensors={"rope_freqs.weight": (8,)})
    assert "rope_freqs.weight" in message


def test_qwen3_without_qk_norms_is_refused(tmp_path):
    message = _refusal(tmp_path, kind="qwen2", arch="qwen3")  # qwen2's tensors (biases, no norms)
    assert "attn_q_norm" in message or "attn_q.bias" in message


def test_served_hyperparameters(tmp_path):
    from backends.gguf import open_model

    h3 = open_model(write_arch_gguf(tmp_path / "q3.gguf", "qwen3", tiny_vocab=256)).hparams
    assert (h3.head_dim, h3.rope_neox, h3.qk_norm, h3.qkv_bias) == (32, True, True, False)
    lin = open_model(write_arch_gguf(tmp_path / "lin.gguf", "llama-linear", tiny_vocab=256)).hparams
    assert (lin.rope_neox, lin.rope_scale, lin.rope_freq_factors) == (False, 0.25, False)
    l3 = open_model(write_arch_gguf(tmp_path / "l3.gguf", "llama3", tiny_vocab=256))
    assert l3.hparams.rope_freq_factors
    assert "rope_freqs.weight" in [t.name for t in l3.shard_tensors(1, 2, head=False)]
