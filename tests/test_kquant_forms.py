"""`--kquant fast|exact`: the OpenVINO stage's two forms of K-quant matrices (backends/openvino/
weights.py), and the option's way from the command line to the stage.

fast: Q4_K/Q5_K codes with each group's offset rounded to an integer u8 zero point, so every
weight moves by at most half its group's scale; checked on the constants themselves, by a bound
on one projection's error derived from that rounding, on a tiny model's logits, and on the
compiled FullyConnected layers. Exact stays the default and keeps its f32 zero points / split form.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from backends import DEFAULT_KQUANT, KQUANTS, ShardSpec, status
from backends.errors import BadInput
from backends.gguf import open_model
from backends.gguf.quant import split_blocks
from tests.synthetic_gguf import write_llama_gguf
from tests.test_run_cli import kafila
from tests.test_kquants import SMALL, random_raw

needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)


def _linear(kquant: str, b, x: np.ndarray) -> tuple[np.ndarray, object]:
    """x @ wᵀ through one projection of blocks b in form `kquant`, compiled at f32; (y, Packed)."""
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino.shard import F32_CONFIG, core
    from backends.openvino.weights import WeightBank

    bank = WeightBank(None, kquant=kquant)
    packed = bank.pack(b)
    x_in = ops.parameter([-1, x.shape[1]], ov.Type.f32)
    model = ov.Model([ops.result(bank.packed_linear(x_in.output(0), packed))], [x_in])
    compiled = core().compile_model(model, "CPU", F32_CONFIG)
    return compiled.create_infer_request().infer({0: x})[0].copy(), packed


@needs_openvino
@pytest.mark.parametrize("qtype, codes", [("Q4_K", "u4"), ("Q5_K", "u8")])
def test_fast_form_has_integer_zero_points_within_half_a_scale(qtype, codes):
    """Constants: codes u4 (Q4_K) / u8 (Q5_K), an f16 scale and a u8 zero point per 32 weights,
    no split offsets; the product differs from the exact one by at most Σ_g s_g/2·|Σ x_g| (each
    group's offset rounded to a whole scale; plus the f16 scale's rounding), and does differ."""
    import openvino as ov

    rows, cols = 16, 512
    rng = np.random.default_rng(3)
    d = lambda: rng.uniform(1e-3, 4e-3, (rows, cols // 256)).astype(np.float16).view(np.uint8)  # noqa: E731
    raw = random_raw(qtype, rows, cols, seed=1).reshape(rows, cols // 256, -1)
    raw[..., 0:2], raw[..., 2:4] = d().reshape(rows, -1, 2), d().reshape(rows, -1, 2)  # d, dmin > 0
    b = split_blocks(qtype, raw.reshape(rows, -1), rows, cols)
    x = rng.normal(0.3, 1, (4, cols)).astype(np.float32)

    fast, packed = _linear("fast", b, x)
    assert packed.q.get_output_element_type(0) == getattr(ov.Type, codes)
    assert packed.zero.get_output_element_type(0) == ov.Type.u8 and packed.offset is None
    assert packed.scale.get_output_element_type(0) == ov.Type.f16
    zero = packed.zero.get_data()[..., 0].astype(np.float64)
    live = b.scale != 0  # a scale-0 group (sc = 0 in the random bytes) is its offset: zero point 0
    assert np.array_equal(zero[live], np.clip(np.rint(-b.offset[live] / b.scale[live]), 0, 255))
    assert np.all(zero[~live] == 0)

    exact = x.astype(np.float64) @ b.dequantize(np.float64).T
    s = b.scale.astype(np.float64)  # [rows, groups]
    group_sums = x.astype(np.float64).reshape(len(x), -1, 32).sum(-1)  # [n, groups]
    bound = np.abs(group_sums) @ (s / 2).T + 2e-3 * np.abs(exact).max()  # f16 scales: 2⁻¹¹ relative
    diff = np.abs(fast - exact)
    assert np.all(diff <= bound), float((diff - bound).max())
    assert diff.max() > 1e-3 * np.abs(exact).max()


@needs_openvino
def test_fast_form_is_for_k_quants_only():
    """Q4_1/Q5_1 (the default model's type) and Q6_K keep their exact constants under fast."""
    from backends.openvino.weights import WeightBank, _forms

    q4_1 = np.random.default_rng(0).integers(0, 256, (4, 2, 20), dtype=np.uint8)  # f16 d, f16 m, 16 code bytes
    q4_1[..., :4] = np.full((4, 2, 2), 0.01, np.float16).view(np.uint8).reshape(4, 2, 4)
    for qtype, raw, rows, cols in (("Q6_K", random_raw("Q6_K", 4, 256), 4, 256), ("Q4_1", q4_1.reshape(4, -1), 4, 64)):
        b = split_blocks(qtype, raw, rows, cols)
        fast, exact = _forms(b, rows * cols, "fast"), _forms(b, rows * cols, "exact")
        for (a, ka), (e, ke) in zip(fast, exact):
            assert ka == ke and (a is None) == (e is None) and (a is None or np.array_equal(a, e))
    with pytest.raises(BadInput, match="--kquant"):
        WeightBank(None, kquant="quick")


@needs_openvino
def test_fast_stage_stays_close_to_exact_and_runs_u4_fully_connected(tmp_path):
    """A tiny Q4_K model: the fast stage's logits within 25% of the exact stage's largest logit
    (15% here: a random 2-block model, whose offsets' rounding adds up in every projection;
    without the zero points it is 550%), and not equal; every block projection
    still a compressed u4 FullyConnected with no f32 offset matmul beside it. What the form costs
    on a real model is bench/kquant_quality.py's to say."""
    from backends.openvino import OpenVINOShard
    from kafila.engine.chain import LocalChain
    from tests.test_kquants import _fc_precisions

    index = open_model(write_llama_gguf(tmp_path / "m.gguf", blocks=2, **SMALL, qtype="Q4_K", embed_qtype="Q4_K"))
    ids = [5, 60, 200, 7, 33, 91, 250, 12]
    logits = {}
    for kquant in ("exact", "fast"):
        chain = LocalChain.build(index.path, 1, "openvino", "f32", index=index, kquant=kquant)
        assert chain.shards[0]._bank.kquant == kquant
        cursor = chain.open()
        logits[kquant] = chain.head.logits(chain.feed(cursor, ids))
        chain.close(cursor)
    scale = np.abs(logits["exact"]).max()
    diff = np.abs(logits["fast"] - logits["exact"]).max()
    assert 0 < diff < 0.25 * scale, (diff, scale)
    shard = OpenVINOShard(ShardSpec(index.path, 0, 2, embed=True, head=False), "f32", index=index, kquant="fast")
    assert _fc_precisions(shard.runtime_model()) == Counter({"u4": 8})  # 4 per block: qkv, o, gate+up, down


def test_the_session_carries_the_hosts_kquant():
    from kafila.session.control.messages import ControlError, SessionTerms

    assert DEFAULT_KQUANT in KQUANTS
    terms = SessionTerms.from_json({"context": 64, "concurrency": 1, "kquant": "fast"})
    assert SessionTerms.from_json(terms.to_json()).kquant == "fast"
    assert SessionTerms.from_json({"context": 64, "concurrency": 1}).kquant == "exact"  # an older host
    with pytest.raises(ControlError, match="kquant"):
        SessionTerms.from_json({"context": 64, "concurrency": 1, "kquant": "quick"})


@pytest.mark.parametrize("command", ["serve", "host", "demo"])
def test_every_stage_building_command_offers_kquant(command):
    proc = kafila(command, "--help", timeout=60)
    assert proc.returncode == 0 and "--kquant {auto,exact,fast,ggml}" in proc.stdout, proc.stdout


@needs_openvino
def test_kafila_run_takes_kquant_and_refuses_a_bad_one(tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", blocks=2, **SMALL, qtype="Q4_K", embed_qtype="Q4_K")
    bad = kafila("run", "--model", path, "--kquant", "quick", "Hello")
    assert bad.returncode == 2 and "--kquant" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    runs = {k: kafila("run", "--model", path, "--kquant", k, "--precision", "f32", "--max-tokens", "4",
                      "--raw", "--json", "Hello") for k in KQUANTS}  # fmt: skip
    assert all(p.returncode == 0 for p in runs.values()), {k: p.stderr for k, p in runs.items()}
