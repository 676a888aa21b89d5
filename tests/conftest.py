"""Shared fixtures: the default model (skipped with the reason when it is not installed), its index,
and tiny synthetic GGUF models built at test time (tests/synthetic_gguf.py)."""

from __future__ import annotations

import os

import pytest

from tests.synthetic_gguf import write_llama_gguf

pytest_plugins = ["tests.strict_skips"]  # skips fail where KAFILA_NO_SKIPS is set (.ci/run)
BIG_ENV = "KAFILA_BIG"  # =1: also run the tests marked `big` (the 8B shape: 20+ min and 18 GB on 2 cores)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `big` are deselected (not skipped: nothing is promised by them in a default run)
    unless KAFILA_BIG=1; the README says how to run them and docs/BENCHMARKS.md records their run."""
    if os.environ.get(BIG_ENV) == "1":
        return
    big = [item for item in items if item.get_closest_marker("big")]
    if big:
        config.hook.pytest_deselected(items=big)
        items[:] = [item for item in items if not item.get_closest_marker("big")]


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from backends.errors import BadInput
    from kafila.models import resolve_model

    try:
        return resolve_model("smollm2-135m")
    except BadInput as exc:
        pytest.skip(f"default model not installed: {exc}")


@pytest.fixture(scope="session")
def default_index(default_model_path):
    from backends.gguf import open_model

    return open_model(default_model_path)


@pytest.fixture(scope="session")
def default_tokenizer(default_index):
    from kafila.models import load_tokenizer

    return load_tokenizer(default_index)


PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three uses of copper.",
    "Once upon a time, in a small village,",
    "What is 17 times 23?",
    "Explain photosynthesis to a child.",
    "Translate 'good morning' into Spanish.",
)  # fmt: skip


@pytest.fixture(scope="session")
def prompt_ids(default_tokenizer) -> list[list[int]]:
    """The 8 test prompts, chat-templated and tokenized as `kafila run` does."""
    tok = default_tokenizer
    return [tok.encode(tok.render_chat([{"role": "user", "content": p}])) for p in PROMPTS]


@pytest.fixture(scope="session")
def synthetic_model(tmp_path_factory) -> str:
    """A random 4-block Llama GGUF (hidden 64, Q4_1 matrices, Q8_0 embedding, tied lm_head)."""
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def synthetic_index(synthetic_model):
    from backends.gguf import open_model

    return open_model(synthetic_model)


@pytest.fixture(scope="session")
def chain_factory(default_index):
    """chain_factory(backend, stages, precision="serving", kquant=auto) → a LocalChain on the default model,
    compiled once per test session. An unavailable mlx skips with its install hint; any other
    backend is a dependency, so its absence fails."""
    from backends import DEFAULT_KQUANT, status
    from kafila.engine.chain import LocalChain

    built: dict = {}

    def make(backend: str, stages: int, precision: str = "serving", kquant: str = DEFAULT_KQUANT):
        for name in backend.split(","):
            st = status(name)
            if not st.available:
                (pytest.skip if name == "mlx" else pytest.fail)(st.reason)
        key = (backend, stages, precision, kquant)
        if key not in built:
            built[key] = LocalChain.build(default_index.path, stages, backend, precision, index=default_index,
                                          kquant=kquant)  # fmt: skip
        return built[key]

    return make


@pytest.fixture(params=["zero-point", "split"])
def ov_form(request, monkeypatch) -> str:
    """Both exact forms of OpenVINO's offset types (Q4_1, Q5_1, Q4_K, Q5_K; backends/openvino/
    weights.py) on every matrix, whatever its size: the split form is chosen by size, and the
    tests' models are small."""
    pytest.importorskip("openvino")
    from backends.openvino import weights

    monkeypatch.setattr(weights, "SPLIT_MIN_WEIGHTS", 0 if request.param == "split" else 1 << 62)
    return request.param


def default_ov_form() -> str:
    """The form this machine's CPU plugin gives the tests' small offset-type matrices by default
    (backends/openvino/weights.py split_min_weights: every matrix where it infers in f32)."""
    from backends.openvino import weights

    return "split" if weights.split_min_weights() == 0 else "zero-point"


def fc_precisions_in(form: str, zero_point_fcs: dict[str, int]) -> dict[str, int]:
    """The FullyConnected precisions a stage compiles to in `form`, from those of the zero point
    form: the split form's codes are signed (u4 → i4, u8 → i8), and each of those FullyConnected
    layers has a second one in f32 for the offsets."""
    if form == "zero-point":
        return dict(zero_point_fcs)
    out = {k: v for k, v in zero_point_fcs.items() if k not in ("u4", "u8")}
    for unsigned, signed in (("u4", "i4"), ("u8", "i8")):
        if zero_point_fcs.get(unsigned):
            out[signed] = out.get(signed, 0) + zero_point_fcs[unsigned]
            out["f32"] = out.get("f32", 0) + zero_point_fcs[unsigned]
    return out
