"""Mixture-of-experts models in real sessions (issue 34): separate `kafila` processes on 127.0.0.1
serving a gpt-oss-shaped and a Qwen3-MoE-shaped file (tests/arch_gguf.py: 8 experts, top 2, random
F32 weights, a real tokenizer), a Gemma 4 MoE (tests/gemma4_gguf.py: blocks of two geometries), a
Gemma 4 with per-layer embeddings and shared KV (the E2B/E4B parts: rows on the ring carry them) and a
Qwen3.5-MoE hybrid (tests/hybrid_gguf.py, issue 35) at --precision f32.

A 4-member session answers two users at once with the ids one stage computes in this process
(prompts as token ids on /v1/completions, greedy); then a ring member is killed mid-answer, the
host replans with the other three, and both answers resume with exactly the same ids.
"""

from __future__ import annotations

import signal

import pytest

from backends import ShardSpec, load_shard, status
from bench.churn import ask_all, leave_round, not_mid_answer
from kafila.tooling.launch import LocalSession, get_json
from tests.arch_gguf import write_arch_gguf
from tests.gemma4_gguf import write_gemma4_gguf
from tests.hybrid_gguf import write_qwen35_gguf
from tests.test_llamacpp_arch import kafila_greedy

pytestmark = [pytest.mark.session, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)]
BLOCKS = 6
N_TOKENS = 96
PROMPTS = [[791, 6864, 315, 9822, 374], [16, 11, 17, 11, 18, 11, 19, 11, 20, 11]]


def one_stage_texts(path: str) -> list[str]:
    """What the answers must be: one stage in this process, greedy, cut at the first EOS."""
    from backends.gguf import open_model
    from kafila.models.tokenizer import load_tokenizer

    index = open_model(path)
    tokenizer = load_tokenizer(index)
    shard = load_shard("openvino", ShardSpec(path, 0, BLOCKS, True, True), "f32", index=index)
    texts = []
    for prompt in PROMPTS:
        ids, _ = kafila_greedy(shard, prompt, N_TOKENS)
        ends = [i for i, t in enumerate(ids) if t in tokenizer.eos_ids]
        texts.append(tokenizer.decode(ids[: ends[0]] if ends else ids))
    assert texts[0] != texts[1] and all(len(t) > 20 for t in texts), texts  # not degenerate
    return texts


@pytest.mark.parametrize("kind", ["gpt-oss", "qwen3moe", "gemma4", "gemma4-ple", "qwen35moe"])
def test_a_moe_session_answers_two_users_with_one_stages_ids_and_survives_a_kill(tmp_path, kind):
    """qwen35moe (issue 35): a hybrid, whose killed member held delta-net layers' recurrent
    state; the survivors rebuild it by replaying each request's history."""
    if kind == "qwen35moe":
        path = write_qwen35_gguf(tmp_path / f"{kind}.gguf", moe=True, blocks=BLOCKS, tokenizer=True)
    elif kind == "gemma4":
        path = write_gemma4_gguf(tmp_path / f"{kind}.gguf", moe=True, blocks=BLOCKS)
    elif kind == "gemma4-ple":  # blocks 4 and 5 share blocks 2's and 3's KV
        path = write_gemma4_gguf(tmp_path / f"{kind}.gguf", blocks=BLOCKS, per_layer=8, shared_kv=2)
    else:
        path = write_arch_gguf(tmp_path / f"{kind}.gguf", kind, blocks=BLOCKS)
    want = one_stage_texts(path)
    # 20 ms a hop: a tiny model's answer lasts seconds, so the kill lands mid-answer
    s = LocalSession(members=4, model=path, precision="f32", context=256, log_dir=str(tmp_path),
                     cache_root=str(tmp_path / "cache"), auto_replan=True, latency_ms=20)
    s.start(timeout_s=400)
    try:
        ring = get_json(s.api("m1"), "/status")["plan"]["ring"]
        assert len(ring) >= 3, ring  # the blocks are divided: a real ring, not one stage
        victim = next(n for n in reversed(ring) if n != "m1")
        origins = [n for n in s.names if n != victim][:2]
        threads, results = ask_all(s, origins, PROMPTS, N_TOKENS, raw=True)
        for t in threads:
            t.join(300)
        assert [r.get("text") for r in results] == want, results
        r = leave_round(s, victim, origins, PROMPTS, N_TOKENS, signal.SIGKILL, raw=True)
        assert [x.get("text") for x in r["results"]] == want, r["results"]
        assert r["detect_s"] is not None and r["replay_s"] is not None, r
        assert not not_mid_answer(r["results"], r["pieces"]), r["pieces"]
        assert victim not in get_json(s.api("m1"), "/status")["plan"]["ring"]
    finally:
        s.stop()
