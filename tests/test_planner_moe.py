"""Mixture-of-experts priced honestly (issue 34 item 4): a block holds every expert (memory,
admission) and a token reads its dense part and k of E experts (time); B rows read the expected
union. The named shapes (gpt-oss-120b, Qwen3-30B-A3B) in fleets/, and a MoE GGUF's header."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from planner import make_plan, parse_fleet, stage_cost
from planner.cost import Tier
from tests.test_planner_support import GB, device, fleet

ROOT = Path(__file__).resolve().parents[1]
FLEETS = ROOT / "fleets"
MOE = {"name": "moe", "blocks": 10, "block_bytes": 8.5 * GB, "head_bytes": 1 * GB,
       "kv_bytes_per_token_per_block": 0, "expert_count": 16, "experts_used": 2, "expert_bytes": 0.5 * GB}  # fmt: skip


def test_a_token_reads_the_dense_part_and_k_experts() -> None:
    model = parse_fleet(fleet(device("a", 200), model=MOE)).model
    assert model.block_read_bytes == pytest.approx(0.5 * GB + 2 * 0.5 * GB)
    # B rows read the union: E·(1 − (1 − k/E)^B) experts; never more than all of them
    assert model.read_bytes(4) == pytest.approx(0.5 * GB + 16 * (1 - (14 / 16) ** 4) * 0.5 * GB)
    assert model.block_read_bytes < model.read_bytes(4) < model.read_bytes(64) <= model.block_bytes
    dense = replace(model, expert_count=0, experts_used=0, expert_bytes=0.0)
    assert dense.read_bytes(8) == dense.block_read_bytes == dense.block_bytes


def test_time_is_priced_by_bytes_read_and_memory_by_bytes_held() -> None:
    parsed = parse_fleet(fleet(device("a", 100, 100.0), device("b", 100, 100.0), model=MOE))
    cost = stage_cost(parsed.devices[0], parsed, Tier.FULL, is_head=False)
    assert cost.per_ms == pytest.approx(1.5 * GB / (100 * 1e6))  # 1.5 GB read, not 8.5 GB held
    # memory: 85 GB of blocks do not fit two 40 GB members, whatever a token reads
    small = parse_fleet(fleet(device("a", 40, 100.0), device("b", 40, 100.0), model=MOE))
    assert not make_plan(small).feasible


def test_the_division_balances_compute_not_held_bytes() -> None:
    """A fast member with little memory beside a slow one with much: the division is bounded by
    memory (held bytes) on the fast one and priced by read bytes."""
    parsed = parse_fleet(fleet(device("fast", 40, 400.0), device("slow", 200, 100.0), model=MOE))
    plan = make_plan(parsed)
    assert plan.feasible
    blocks = dict(zip(plan.ring, plan.blocks, strict=True))
    assert blocks["fast"] == 4  # lim: (40 GB − the 1 GB head) / 8.5 GB held a block
    roomy = make_plan(parse_fleet(fleet(device("fast", 200, 400.0), device("slow", 200, 100.0), model=MOE)))
    assert dict(zip(roomy.ring, roomy.blocks, strict=True))["fast"] == 8  # by read bytes: 4× the bandwidth
    stages = dict(zip(plan.ring, plan.stage_ms, strict=True))
    assert stages["slow"] == pytest.approx(0.02 + blocks["slow"] * 1.5 * GB / 100e6, rel=1e-6)


@pytest.mark.parametrize("fleet_file", ["lan.json", "us-central.json", "intercontinental.json"])
@pytest.mark.parametrize(("model", "read_mb", "held_gb"),
                         [("gpt-oss-120b", 81.2, 61.8), ("qwen3-30b-a3b", 34.8, 18.1)])  # fmt: skip
def test_named_moe_shapes_show_both_figures(
    fleet_file: str, model: str, read_mb: float, held_gb: float
) -> None:
    cmd = ["plan", "--fleet", str(FLEETS / fleet_file), "--model", model]
    out = subprocess.run([sys.executable, "-m", "kafila", *cmd], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode in (0, 3), out.stderr
    text = " ".join(out.stdout.split())
    assert f"a token reads {read_mb} MB" in text and f"hold {held_gb} GB" in text
    data = json.loads((FLEETS / fleet_file).read_text())
    parsed = parse_fleet(data, model)
    assert parsed.model.block_read_bytes < parsed.model.block_bytes / 10  # k of E: a small share


def _write_moe_gguf(path: Path, experts: int, used: int) -> None:
    """A header-complete GGUF of a qwen3moe-like block 0: expert tensors [E, F, H] beside dense ones."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("qwen3moe.expert_count", experts)
    w.add_uint32("qwen3moe.expert_used_count", used)
    rng = np.random.default_rng(0)
    for name, shape in (("token_embd.weight", (32, 16)), ("output.weight", (32, 16)),
                        ("blk.0.attn_q.weight", (16, 16)), ("blk.0.ffn_gate_inp.weight", (experts, 16)),
                        ("blk.0.ffn_gate_exps.weight", (experts, 8, 16)), ("blk.0.ffn_up_exps.weight", (experts, 8, 16)),
                        ("blk.0.ffn_down_exps.weight", (experts, 16, 8))):  # fmt: skip
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_moe_gguf_header_gives_the_expert_figures(tmp_path: Path) -> None:
    from backends.gguf.header import read_header
    from kafila.session.control.pricing import reads_from

    path = tmp_path / "moe.gguf"
    _write_moe_gguf(path, experts=8, used=2)
    header = read_header(str(path))
    got = reads_from(header.metadata, {t.name: t.n_bytes for t in header.tensors})
    assert got["expert_count"] == 8 and got["experts_used"] == 2
    assert got["expert_bytes"] == 3 * 8 * 16 * 4  # gate, up, down of one expert, f32
    assert got["head_read_bytes"] == 32 * 16 * 4  # the lm_head, not the embedding too
    dense = reads_from({"general.architecture": "llama"}, {"token_embd.weight": 100})
    assert dense == {"head_read_bytes": 100.0}  # tied: the embedding is the lm_head
