"""An index of a GGUF model file: hyperparameters, tensors per block and head, byte ranges.

The index is what every other part needs to know about a model without loading its weights:
the planner takes β_block/β_head from it, the host serves tensors' byte ranges from it, and
each backend builds its shard from the tensors of its block range.
Anything Kafila cannot serve exactly is refused here, with one line that names what is wrong.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from backends.errors import BadInput
from backends.gguf.families import GPT_OSS, Family, family_of, ffn_tensors
from backends.gguf.gemma4 import GEMMA4, PLE_HEAD, Gemma4Params, gemma4_params
from backends.gguf.header import read_header
from backends.gguf.hybrid import HYBRID_ARCHITECTURES, HybridParams, hybrid_params, mtp_block_count
from backends.gguf.optional import HEAD_EXTRAS, optional_block_tensors, output_extras
from backends.gguf.quant import BLOCK_WEIGHTS, FLOAT_TYPES, QuantBlocks, bf16_to_f32, split_blocks

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", GEMMA4, "qwen3moe", "qwen2moe", GPT_OSS,
                           *HYBRID_ARCHITECTURES)  # fmt: skip
SUPPORTED_TYPES = (*FLOAT_TYPES, *BLOCK_WEIGHTS)  # every type backends/gguf/quant.py reads exactly
GGUF_MAGIC = b"GGUF"
BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
HEAD_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")
BLOCK_TENSOR_NAMES = (
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
)  # fmt: skip; and the FFN's with its norm (families.ffn_tensors)
OPTIONAL_BLOCK_TENSORS = ("attn_q.bias", "attn_k.bias", "attn_v.bias")  # Qwen2 (llama.cpp allows them on llama too)
QK_NORM_TENSORS = ("attn_q_norm.weight", "attn_k_norm.weight")  # Qwen3, Gemma 3: per-head RMSNorm of q and k
QK_NORM_ARCHITECTURES = ("qwen3", "gemma3", "qwen3moe")
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # llama3 per-dimension frequency factors (llama only)
# RoPE as llama.cpp applies it per architecture (llama_model_rope_type): llama rotates pairs
# (2i, 2i+1) of GGUF's permuted q/k rows ("normal"); qwen2/qwen3 rotate halves (i, i + D/2), "neox".
NEOX_ROPE_ARCHITECTURES = ("qwen2", "qwen3", "gemma3", GEMMA4, "qwen3moe", "qwen2moe", GPT_OSS, *HYBRID_ARCHITECTURES)
HASH_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: str  # one of SUPPORTED_TYPES
    shape: tuple[int, ...]  # numpy order: (rows=out, cols=in) for matrices, (n,) for vectors
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def byte_range(self) -> tuple[int, int]:
        return self.offset, self.offset + self.n_bytes


@dataclass(frozen=True)
class Hyperparams:
    arch: str
    n_blocks: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context_length: int
    rope_base: float
    rms_eps: float
    tied_embeddings: bool  # no output.weight: lm_head is the embedding
    qkv_bias: bool
    rope_neox: bool = False  # rotate halves (i, i + D/2) of un-permuted rows, else pairs (2i, 2i+1)
    rope_freq_factors: bool = False  # rope_freqs.weight [D/2]: θ_i = pos·base^(−2i/D) / factor_i
    rope_scale: float = 1.0  # linear RoPE scaling: positions × rope_scale (= 1 / scaling.factor)
    qk_norm: bool = False  # RMSNorm of each q and k head (weights [D]) after projection, before RoPE
    family: Family = Family()  # what the architecture adds to Llama's block (backends/gguf/families.py)
    hybrid: HybridParams | None = None  # delta-net layers beside attention (backends/gguf/hybrid.py)
    gemma4: Gemma4Params | None = None  # Gemma 4's blocks, each its own geometry (backends/gguf/gemma4.py)
    extras: tuple[str, ...] = ()  # output scales and biases besides q/k/v's (backends/gguf/optional.py)

    @property
    def carried(self) -> int:
        """The width of a row a stage takes and gives on the ring: the hidden size, and for Gemma 4
        files with per-layer embeddings or shared KV what travels with it (Gemma4Params.carried)."""
        return self.hidden if self.gemma4 is None else self.gemma4.carried(self.hidden)


# the tokenizer's per-token arrays: open_model walks past them (ModelIndex.metadata reads them)
VOCABULARY_KEYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                             "tokenizer.ggml.token_type"})  # fmt: skip


@dataclass(frozen=True)
class ModelIndex:
    path: str
    name: str
    file_bytes: int
    hparams: Hyperparams
    tensors: dict[str, TensorInfo]
    lean_metadata: dict[str, object] = field(repr=False)  # every key but VOCABULARY_KEYS

    @cached_property
    def metadata(self) -> dict[str, object]:
        """Every metadata key, the vocabulary arrays too: read from the file on first use (the
        tokenizer, `kafila inspect`). open_model skips VOCABULARY_KEYS: on Llama 3's tokenizer
        they are 408k strings, most of the time an open took."""
        return read_header(self.path, tensors=False).metadata

    @cached_property
    def _rows_file(self):
        """The model file, opened once for `rows` (read with pread: none of its pages are mapped
        into the process, so the rows a session has looked up do not gather in its RSS)."""
        return open(self.path, "rb", buffering=0)  # noqa: SIM115 (lives as long as the index)

    def block_tensors(self, block: int) -> list[TensorInfo]:
        prefix = f"blk.{block}."
        return [t for n, t in self.tensors.items() if n.startswith(prefix)]

    def head_tensors(self) -> list[TensorInfo]:
        # Gemma 4's per-layer embeddings: the first stage (the head's) computes every block's input
        return [self.tensors[n] for n in (*HEAD_TENSORS, *PLE_HEAD) if n in self.tensors]

    def shard_tensors(self, first: int, last: int, head: bool) -> list[TensorInfo]:
        """Every tensor a shard of blocks [first, last) needs (plus the head's when `head`)."""
        out = self.head_tensors() if head else []
        if first < last and ROPE_FREQS_TENSOR in self.tensors:  # every block's RoPE reads it
            out.append(self.tensors[ROPE_FREQS_TENSOR])
        for b in range(first, last):
            out.extend(self.block_tensors(b))
        return out

    def check_range(self, first: int, last: int) -> None:
        """BadInput unless [first, last) is a non-empty block range of this model."""
        n = self.hparams.n_blocks
        if not 0 <= first < last <= n:
            raise BadInput(f"block range [{first}, {last}) is not a non-empty part of the model's {n} blocks")

    def split_blocks(self, stages: int) -> list[tuple[int, int]]:
        """`stages` contiguous, near-equal block ranges covering the model in order."""
        n = self.hparams.n_blocks
        if not 1 <= stages <= n:
            raise BadInput(f"cannot cut {n} blocks into {stages} stages (choose 1..{n})")
        bounds = [round(i * n / stages) for i in range(stages + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    @cached_property
    def block_bytes(self) -> int:
        """β_block: bytes of the largest block (blocks of these models are all alike)."""
        return max(sum(t.n_bytes for t in self.block_tensors(b)) for b in range(self.hparams.n_blocks))

    @cached_property
    def head_bytes(self) -> int:
        """β_head: embedding + final norm + lm_head (the embedding once when tied)."""
        return sum(t.n_bytes for t in self.head_tensors())

    def _kv_values(self, b: int) -> int:
        """K and V values one position holds in block b's cache (0: a delta-net block)."""
        h = self.hparams
        if h.gemma4 is not None:  # each block its own KV heads and head size
            return h.gemma4.kv_values_per_token(b)
        if h.hybrid is not None and h.hybrid.trunk[b]:
            return 0
        return 2 * h.n_kv_heads * h.head_dim

    def _bounded_window(self, b: int) -> bool:
        """Whether block b is a windowed layer, whose KV holds its window only (backends/window.py)."""
        fam = self.hparams.family
        return self.hparams.hybrid is None and bool(fam.sliding_window) and fam.windowed(b)

    def kv_bytes_per_token_per_block(self, bytes_per_value: int = 2) -> float:
        """K and V of one position, the mean over blocks: a hybrid's delta-net blocks hold no KV,
        nor per token do windowed ones (window_bytes_per_request)."""
        n = self.hparams.n_blocks
        return sum(self._kv_values(b) for b in range(n) if not self._bounded_window(b)) * bytes_per_value / n

    def mtp_kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """K and V of one position in the multi-token-prediction block's cache (0: none): a full
        attention block after the trunk (backends/gguf/hybrid.py)."""
        h = self.hparams
        if h.hybrid is None or not h.hybrid.mtp_blocks:
            return 0
        return 2 * h.n_kv_heads * h.head_dim * bytes_per_value

    def window_bytes_per_request(self, first: int = 0, last: int | None = None, bytes_per_value: int = 2) -> int:
        """A request's windowed KV in blocks [first, last): each windowed layer's window and kept
        windows (backends.memory.window_held_positions)."""
        from backends.memory import window_held_positions

        last = self.hparams.n_blocks if last is None else last
        held = window_held_positions(self.hparams.family.sliding_window)
        return sum(self._kv_values(b) * held * bytes_per_value for b in range(first, last) if self._bounded_window(b))

    def state_bytes_per_request(self, first: int = 0, last: int | None = None) -> int:
        """A request's recurrent state (f32, as the OpenVINO stage holds it) in blocks
        [first, last): 0 unless the model is hybrid (backends/gguf/hybrid.py)."""
        hy = self.hparams.hybrid
        last = self.hparams.n_blocks if last is None else last
        return 0 if hy is None else sum(hy.state_bytes_per_request(b) for b in range(first, last))

    def planner_model(self, backend: str | None = None) -> dict:
        """The model entry of the planner's fleet format; with `backend`, also what a member
        holds resident on it (backends.memory): `process_bytes`, `block_resident_bytes` (a
        mean block) and `head_resident_bytes` (see `head_resident_bytes`)."""
        out = {
            "name": self.name,
            "blocks": self.hparams.n_blocks,
            "block_bytes": float(self.block_bytes),
            "head_bytes": float(self.head_bytes),
            "kv_bytes_per_token_per_block": self.kv_bytes_per_token_per_block(),
        }
        from backends.memory import RECURRENT_STATE_COPIES

        # a hybrid's live state and its copies, and windowed layers' KV held per request (backends.memory)
        state = self.state_bytes_per_request() * RECURRENT_STATE_COPIES + self.window_bytes_per_request()
        if state:
            out["state_bytes_per_request_per_block"] = state / self.hparams.n_blocks
        if backend is not None:
            from backends.memory import (ANCHOR_BYTES, PREFILL_WORK_BYTES, PROCESS_BYTES, TOKENIZER_BYTES_PER_VOCAB,
                                         resident_bytes)  # fmt: skip

            # the mean block, not the largest: Q4_K_M gives some blocks Q6_K tensors (Llama-3.2-1B:
            # 54.5 MB the largest, 50.1 MB the mean), and a share holds a mix of both kinds
            n = self.hparams.n_blocks
            blocks = sum(resident_bytes(backend, self.block_tensors(b)) for b in range(n))
            # the fixed part: the process, its tokenizer and the working set of a prompt's chunk
            fixed = PROCESS_BYTES[backend] + TOKENIZER_BYTES_PER_VOCAB * self.hparams.vocab + PREFILL_WORK_BYTES
            out.update(process_bytes=fixed,
                       anchor_bytes=ANCHOR_BYTES[backend], block_resident_bytes=blocks / n,
                       head_resident_bytes=self.head_resident_bytes(backend))  # fmt: skip
        return out

    def head_resident_bytes(self, backend: str) -> float:
        """The head's resident bytes on `backend`: lm_head (output.weight, or the tied embedding)
        and the final norm in the backend's form, and the logits/sampler buffers. An untied
        embedding table is not held: the shards read each step's rows from the file (`rows`), and
        so are Gemma 4's per-layer embeddings (its projection is held)."""
        from backends.memory import HEAD_WORK_BYTES_PER_VOCAB, resident_bytes

        lm = self.tensors.get("output.weight") or self.tensors.get("token_embd.weight")
        held = ("output_norm.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight")
        parts = [t for t in (lm, *(self.tensors.get(n) for n in held)) if t is not None]
        return resident_bytes(backend, parts) + HEAD_WORK_BYTES_PER_VOCAB * self.hparams.vocab

    @cached_property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            while chunk := f.read(HASH_CHUNK_BYTES):
                digest.update(chunk)
        return digest.hexdigest()

    # --- weights -------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the file (no copy)."""
        t = self.tensors[name]
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.n_bytes,))

    def blocks_of(self, name: str) -> QuantBlocks:
        t = self.tensors[name]
        rows, cols = t.shape
        return split_blocks(t.qtype, self.raw(name), rows, cols)

    def rows(self, name: str, ids: np.ndarray, dtype=np.float32) -> np.ndarray:
        """Rows `ids` of matrix `name`, exact, read from the file (an embedding lookup that holds
        no table: only those rows' bytes are read): ids [n] → [n, cols]."""
        t = self.tensors[name]
        rows, cols = t.shape
        ids = np.asarray(ids, np.int64).reshape(-1)
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < rows):
            raise ValueError(f"token ids must be in 0..{rows - 1}, got {int(ids.min())}..{int(ids.max())}")
        uniq, where = np.unique(ids, return_inverse=True)
        row_bytes = t.n_bytes // rows
        raw = np.empty((len(uniq), row_bytes), np.uint8)
        fd = self._rows_file.fileno()
        for i, r in enumerate(uniq.tolist()):
            if os.preadv(fd, [raw[i]], t.offset + r * row_bytes) != row_bytes:
                raise BadInput(f"{self.path}: the file ends inside {name}'s row {r} (truncated since it was opened?)")
        return exact_values(t.qtype, raw, (len(uniq), cols), dtype)[where]

    def dequantize(self, name: str, dtype=np.float64) -> np.ndarray:
        """The exact weights of a tensor, shaped as TensorInfo.shape."""
        t = self.tensors[name]
        return exact_values(t.qtype, self.raw(name), t.shape, dtype)


def exact_values(qtype: str, raw: np.ndarray, shape: tuple[int, ...], dtype) -> np.ndarray:
    """The exact weights of type `qtype` whose bytes are `raw` (uint8), shaped `shape`."""
    if qtype in ("F32", "F16"):
        return raw.view(np.float32 if qtype == "F32" else np.float16).astype(dtype).reshape(shape)
    if qtype == "BF16":
        return bf16_to_f32(raw).astype(dtype).reshape(shape)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1  # a 3-D expert tensor: E·out rows
    return split_blocks(qtype, raw, rows, shape[-1]).dequantize(dtype).reshape(shape)


def open_model(path: str) -> ModelIndex:
    """Index a GGUF file, refusing with BadInput anything Kafila cannot serve exactly."""
    # BadInput when missing, not a GGUF, damaged or truncated
    header = read_header(path, lambda key: key not in VOCABULARY_KEYS)
    file_bytes, metadata = header.file_bytes, header.metadata
    parts, part = metadata.get("split.count", 1), metadata.get("split.no", 0)
    if isinstance(parts, int) and isinstance(part, int) and parts > 1:  # one part holds some tensors only
        raise BadInput(f"{path} is part {part + 1} of a {parts}-part split GGUF: give the first part as the "
                       "model (--model PREFIX-00001-of-…gguf) and Kafila joins the parts")
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise BadInput(
            f"unsupported architecture {arch!r} in {path}: Kafila serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def hp(key: str, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise BadInput(f"GGUF {path} lacks {arch}.{key}")
        return value

    tensors: dict[str, TensorInfo] = {}
    for t in header.tensors:
        qtype = t.type_name
        if qtype not in SUPPORTED_TYPES:
            raise BadInput(
                f"tensor {t.name} has quant type {qtype}, which Kafila does not serve "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        shape, offset = t.shape, t.offset
        if offset + t.n_bytes > file_bytes:
            raise BadInput(f"GGUF {path} is truncated: tensor {t.name} ends past the end of the file")
        if qtype in BLOCK_WEIGHTS and shape[-1] % BLOCK_WEIGHTS[qtype]:
            raise BadInput(f"tensor {t.name}: row length {shape[-1]} is not a multiple of {qtype}'s "
                           f"block of {BLOCK_WEIGHTS[qtype]} weights")
        tensors[t.name] = TensorInfo(t.name, qtype, shape, offset, t.n_bytes)

    hidden = int(hp("embedding_length"))
    n_blocks = int(hp("block_count"))
    hybrid = gemma4 = family = None
    if arch == GEMMA4:  # each block its own heads: block 0's stand for the model's where one is asked
        gemma4, family = gemma4_params(path, hp, tensors, n_blocks, hidden)
        g0 = gemma4.blocks[0]
        n_heads, n_kv_heads, head_dim = g0.n_heads, g0.n_kv_heads, g0.head_dim
    else:
        n_heads = int(hp("attention.head_count"))
        n_kv_heads = int(hp("attention.head_count_kv", n_heads))
    if arch in HYBRID_ARCHITECTURES:  # partial RoPE: the rotated dims are the hybrid part's
        head_dim = int(hp("attention.key_length", hidden // n_heads))
        if int(hp("attention.value_length", head_dim)) != head_dim:
            raise BadInput(f"GGUF {path}: {arch} key and value head sizes differ; Kafila serves them equal")
        mtp = mtp_block_count(path, arch, hp, n_blocks)
        n_blocks -= mtp  # the trunk: the MTP blocks after it only draft (--speculate mtp)
        hybrid = hybrid_params(path, arch, hp, tensors, n_blocks, head_dim, mtp)
    elif gemma4 is None:
        head_dim = _head_dim(path, arch, hp, hidden, n_heads)
    hparams = Hyperparams(
        arch=arch,
        n_blocks=n_blocks,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn=int(max(v if isinstance(v := hp("feed_forward_length"), list) else [v])),  # gemma4: one a block
        vocab=int(tensors["token_embd.weight"].shape[0]) if "token_embd.weight" in tensors else 0,
        context_length=int(hp("context_length")),
        rope_base=float(hp("rope.freq_base", 10000.0)),
        rms_eps=float(hp("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        rope_neox=arch in NEOX_ROPE_ARCHITECTURES,
        rope_freq_factors=ROPE_FREQS_TENSOR in tensors,
        rope_scale=_rope_scale(path, arch, hp),
        qk_norm=arch in (*QK_NORM_ARCHITECTURES, *HYBRID_ARCHITECTURES),
        family=family or family_of(path, arch, hp, n_blocks, hidden, n_heads, head_dim),
        hybrid=hybrid,
        gemma4=gemma4,
        extras=tuple(output_extras(arch, tensors)),
    )
    if hybrid is None and gemma4 is None:  # hybrid_params and gemma4_params checked theirs
        _check_complete(path, tensors, hparams)
        _check_arch(path, arch, hp, tensors, hparams)
    name = os.path.basename(path).removesuffix(".gguf")
    return ModelIndex(path=os.path.abspath(path), name=name, file_bytes=file_bytes,
                      hparams=hparams, tensors=tensors, lean_metadata=metadata)


def _check_complete(path: str, tensors: dict[str, TensorInfo], h: Hyperparams) -> None:
    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in tensors]
    for b in range(h.n_blocks):
        required = BLOCK_TENSOR_NAMES + ffn_tensors(h.arch, h.family)
        missing += [f"blk.{b}.{n}" for n in required if f"blk.{b}.{n}" not in tensors]
    if missing:
        raise BadInput(f"GGUF {path} lacks tensor {missing[0]} ({len(missing)} missing in all)")
    extra = [n for n in tensors if (m := BLOCK_TENSOR.match(n)) and int(m.group(1)) >= h.n_blocks]
    if extra:
        raise BadInput(f"GGUF {path} has tensor {extra[0]} beyond block_count {h.n_blocks}")
    if h.n_heads * h.head_dim != tensors["blk.0.attn_q.weight"].shape[0]:
        raise BadInput(f"GGUF {path}: head_count × head_dim does not match attn_q's rows")


def _head_dim(path: str, arch: str, hp, hidden: int, n_heads: int) -> int:
    """Head size as llama.cpp reads it: attention.key_length (default hidden / heads); the value
    length and the rotated dimensions must equal it (llama.cpp asserts both for these models)."""
    head_dim = int(hp("attention.key_length", hidden // n_heads))
    value_dim = int(hp("attention.value_length", head_dim))
    rope_dim = int(hp("rope.dimension_count", head_dim))
    if value_dim != head_dim:
        raise BadInput(f"GGUF {path}: {arch}.attention.value_length {value_dim} ≠ key_length {head_dim}; "
                       "Kafila serves equal key and value head sizes")
    if rope_dim != head_dim:
        raise BadInput(f"GGUF {path}: {arch}.rope.dimension_count {rope_dim} ≠ head size {head_dim} "
                       "(partial RoPE); Kafila rotates whole heads")
    return head_dim


def _rope_scale(path: str, arch: str, hp) -> float:
    """The position scale llama.cpp applies (freq_scale): 1/factor for linear scaling (its default
    type when a factor is given), 1 for none; gpt-oss's YaRN is the family's (Family.yarn: 1
    here); other scaling types are refused, never ignored."""
    kind = str(hp("rope.scaling.type", "linear"))
    if kind == "yarn" and arch == GPT_OSS:
        return 1.0
    if kind not in ("linear", "none"):
        raise BadInput(f"GGUF {path}: {arch}.rope.scaling.type {kind!r} is not served "
                       f"(Kafila implements linear RoPE scaling and none; yarn on {GPT_OSS})")
    attn_factor = float(hp("rope.scaling.attn_factor", 1.0))
    if attn_factor != 1.0:
        raise BadInput(f"GGUF {path}: {arch}.rope.scaling.attn_factor {attn_factor} is not served (only 1)")
    factor = float(hp("rope.scaling.factor", 0.0)) or float(hp("rope.scale_linear", 0.0))
    if kind == "none" or factor == 0.0:
        return 1.0
    if factor < 0:
        raise BadInput(f"GGUF {path}: {arch}.rope.scaling.factor {factor} is not positive")
    return 1.0 / factor


def _check_arch(path: str, arch: str, hp, tensors: dict[str, TensorInfo], h: Hyperparams) -> None:
    """Refuse what llama.cpp would compute for this architecture but Kafila does not: experts,
    extra biases, fused or unknown tensors; check the shapes of the optional tensors it serves."""
    allowed = set(BLOCK_TENSOR_NAMES) | set(OPTIONAL_BLOCK_TENSORS) | set(ffn_tensors(arch, h.family))
    if h.qk_norm:
        allowed |= set(QK_NORM_TENSORS)
    allowed |= optional_block_tensors(arch, allowed)
    for name in tensors:
        m = BLOCK_TENSOR.match(name)
        if m:
            known = m.group(2) in allowed
        else:
            known = (name in HEAD_TENSORS or (name == ROPE_FREQS_TENSOR and arch == "llama")
                     or name in HEAD_EXTRAS.get(arch, ()))  # fmt: skip
        if not known:
            raise BadInput(f"GGUF {path}: tensor {name} is not part of the {arch} model Kafila serves")
    D, q_rows, kv_rows = h.head_dim, h.n_heads * h.head_dim, h.n_kv_heads * h.head_dim
    expect = {"attn_k.weight": kv_rows, "attn_v.weight": kv_rows, "attn_q.bias": q_rows,
              "attn_k.bias": kv_rows, "attn_v.bias": kv_rows}  # fmt: skip
    if h.qk_norm:
        expect |= {n: D for n in QK_NORM_TENSORS}
    for b in range(h.n_blocks):
        if h.qk_norm:
            missing = [n for n in QK_NORM_TENSORS if f"blk.{b}.{n}" not in tensors]
            if missing:
                raise BadInput(f"GGUF {path} lacks tensor blk.{b}.{missing[0]} ({arch} normalizes q and k)")
        for n, rows in expect.items():
            t = tensors.get(f"blk.{b}.{n}")
            if t is not None and t.shape[0] != rows:
                raise BadInput(f"GGUF {path}: tensor {t.name} has {t.shape[0]} rows, expected {rows}")
    E = h.family.n_experts
    for b in range(h.n_blocks) if E else ():
        for n in ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
            t = tensors[f"blk.{b}.{n}"]
            if t.shape[0] != E or len(t.shape) != (2 if n == "ffn_gate_inp.weight" else 3):
                raise BadInput(f"GGUF {path}: tensor {t.name} has shape {t.shape}, expected {E} experts first")
        if arch == GPT_OSS:
            _check_gpt_oss_shapes(path, tensors, h, b)
    t = tensors.get(ROPE_FREQS_TENSOR)
    if t is not None and (t.shape != (D // 2,) or t.qtype != "F32"):
        raise BadInput(f"GGUF {path}: {ROPE_FREQS_TENSOR} is {t.qtype} {t.shape}, expected F32 ({D // 2},)")


def _check_gpt_oss_shapes(path: str, tensors: dict[str, TensorInfo], h: Hyperparams, b: int) -> None:
    """The shapes llama.cpp's gpt-oss loader requires of block b's sinks and biases."""
    p, E = f"blk.{b}.", h.family.n_experts
    F = tensors[p + "ffn_gate_exps.weight"].shape[1]
    want = {"attn_sinks.weight": (h.n_heads,), "attn_output.bias": (h.hidden,), "ffn_gate_inp.bias": (E,),
            "ffn_gate_exps.bias": (E, F), "ffn_up_exps.bias": (E, F), "ffn_down_exps.bias": (E, h.hidden)}  # fmt: skip
    for n, shape in want.items():
        t = tensors[p + n]
        if t.shape != shape:
            raise BadInput(f"GGUF {path}: tensor {t.name} has shape {t.shape}, expected {shape}")
