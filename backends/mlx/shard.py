"""MLXShard: a block range of a GGUF model on MLX, behind backends.base.Shard.

One KV cache per slot (model.SlotCache). Every forward is one lazy graph over all of the shard's
blocks, evaluated once together with the updated caches, then handed back as float32 numpy, the
form hidden states take between backends.

`forward_batch` runs several slots' steps as one graph: their new tokens one after another
along the token axis, each projection one matmul over all of them, the attention per slot on its
own cache (backends/mlx/model.py, `block_rows`); it needs no shared cache, so rows join and leave
freely.

Precision: "f32" converts the f16 quantization scales and biases to f32 (exact) so every product
is f32; "serving" keeps them f16 as they are in the file (activations and KV stay f32 on CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from backends import memory
from backends.base import HeadOps, ShardSpec
from backends.errors import BadInput
from backends.gguf import ModelIndex, open_model
from backends.kept import KeptStates
from backends.window import KeptWindow, check_window, drop_to, holds_window, needs_kept, window_start
from backends.gguf.families import Yarn, require_llama_blocks, yarn_magnitude, yarn_multipliers
from backends.gguf.gemma4 import carried_tail
from backends.mlx.gemma4 import Carried, block_dims, gemma4_block, kv_routes
from backends.mlx.hybrid import HybridDims, hybrid_block, init_state
from backends.mlx.model import Dims, SlotCache, attention_mask, block, block_rows, window_mask
from backends.mlx.weights import load_shard_weights, weight_bytes


@dataclass(frozen=True)
class SlotState:
    """A captured slot: its physical length and the used part of every block's K and V."""

    length: int
    keys: tuple[mx.array, ...]  # per block [1, Hkv, length, D]
    values: tuple[mx.array, ...]
    first: int  # the shard it came from: blocks [first, last)
    last: int
    recurrent: dict | None = None  # a hybrid model's states (backends/mlx/hybrid.py)
    dropped: int = 0  # columns the windowed blocks' K and V no longer hold (SlotCache)


class MLXShard(HeadOps):
    def __init__(
        self, spec: ShardSpec, precision: str = "serving", index: ModelIndex | None = None, mtp: bool = False
    ):
        index = index if index is not None else open_model(spec.model_path)
        hp = index.hparams
        require_llama_blocks(hp, "mlx", experts=True, gemma=True, gpt_oss=True, biases=True, scales=True, gemma4=True)
        self.hybrid = None if hp.hybrid is None else _hybrid_dims(hp, spec)
        self._last: dict[int, tuple] = {}  # hybrid: a slot's last step of several positions (hybrid.py)
        self._kept: KeptStates[dict] = KeptStates()  # hybrid: a slot's kept states (backends/kept.py)
        if not 0 <= spec.first <= spec.last <= hp.n_blocks + (hp.hybrid.mtp_blocks if mtp and hp.hybrid else 0):
            raise BadInput(
                f"block range [{spec.first}, {spec.last}) is outside the model's {hp.n_blocks} blocks"
            )
        if spec.first == spec.last and not (spec.embed or spec.head):
            raise BadInput(f"shard [{spec.first}, {spec.last}) holds no blocks")
        self.spec = spec
        self.precision = precision
        self.hparams = hp
        self.index = index
        fam = hp.family
        freqs = _periods(hp.head_dim, hp.rope_base, fam.yarn)
        if hp.rope_freq_factors and hp.gemma4 is None:  # mx.fast.rope's freqs are periods: base^(2i/D)·factor_i
            half = np.arange(0, hp.head_dim, 2, dtype=np.float64) / hp.head_dim
            factors = index.dequantize("rope_freqs.weight", np.float64)
            freqs = mx.array((hp.rope_base**half * factors).astype(np.float32))
        self.dims = Dims(
            hp.hidden, hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.rope_base, hp.rms_eps,
            rope_traditional=not hp.rope_neox, rope_scale=hp.rope_scale, rope_freqs=freqs,
            experts_used=hp.family.n_experts_used, experts_renorm=hp.family.experts_renorm,
            experts_scale=hp.family.experts_scale, gelu=hp.family.ffn_act == "gelu_tanh",
            attn_scale=hp.family.attn_scale,
            swiglu_oai=fam.ffn_act == "swiglu_oai", gating=fam.experts_gating,
            rope_magnitude=yarn_magnitude(fam.yarn) if fam.yarn is not None else 1.0,
        )  # fmt: skip
        # windowed layers (Gemma 3, gpt-oss): their own RoPE base (Gemma: scale 1) and mask
        # (model.window_mask)
        self._windowed = tuple(fam.windowed(b) for b in range(spec.first, spec.last))
        self.dims_swa = dataclasses.replace(
            self.dims, rope_base=fam.rope_base_swa, rope_freqs=_periods(hp.head_dim, fam.rope_base_swa, fam.yarn),
            rope_scale=hp.rope_scale if fam.swa_rope_scaled else 1.0) if any(self._windowed) else self.dims  # fmt: skip
        # their KV holds the window, not every position (backends/window.py): 0 when it holds all
        self._window_size = fam.sliding_window if any(self._windowed) and hp.hybrid is None else 0
        # gemma4: each block its own heads, head size and RoPE (backends/mlx/gemma4.py)
        self._gemma4 = None if hp.gemma4 is None else block_dims(hp, index, spec.first, spec.last)
        self._routes = None if hp.gemma4 is None else kv_routes(hp.gemma4, spec.first, spec.last)
        self.weights = load_shard_weights(
            index.path, spec.first, spec.last, spec.embed, spec.head, f32=precision == "f32", index=index, mtp=mtp
        )
        self._slots: dict[int, SlotCache] = {}
        self._large = memory.LargeSteps(self.hparams.hidden)  # MLX's buffer cache keeps a large step's buffers

    @property
    def n_blocks(self) -> int:
        return self.spec.last - self.spec.first

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.weights)

    # --- slots -----------------------------------------------------------------------------

    def open_slot(self) -> int:
        slot = next(i for i in range(len(self._slots) + 1) if i not in self._slots)
        shapes = None if self._gemma4 is None else [(d.n_kv_heads, d.head_dim if kind != "read" else 0)
                                                    for d, (kind, _) in zip(self._gemma4, self._routes)]  # fmt: skip
        self._slots[slot] = SlotCache(self.n_blocks, self.dims, shapes=shapes,
                                      windowed=self._windowed if self._window_size else ())  # fmt: skip
        if self.hybrid is not None:
            init_state(self._slots[slot], self.hybrid)
        return slot

    def close_slot(self, slot: int) -> None:
        self._cache(slot)
        del self._slots[slot]
        self._last.pop(slot, None)
        self._kept.forget(slot)

    def cache_len(self, slot: int) -> int:
        return self._cache(slot).length

    def trim(self, slot: int, length: int) -> None:
        """Keep the slot's first `length` physical positions; the buffers stay, and the next
        steps write over the rest."""
        cache = self._cache(slot)
        if not 0 <= length <= cache.length:
            raise ValueError(f"slot {slot} holds {cache.length} positions, not {length}")
        kept = self._kept.back_to(slot, length)  # a cut drops the states kept after it
        if self.hybrid is not None and 0 < length < cache.length:  # the state cannot be masked back
            if kept is not None:  # back to the state kept where a prompt's messages ended
                cache.length, cache.recurrent = length, dict(kept)
                self._last.pop(slot, None)
            else:
                self._cut_recurrent(slot, cache, length)
            return
        if self._window_size:
            self._cut_window(slot, cache, length, kept)
        cache.length = length
        if self.hybrid is not None and length == 0:
            init_state(cache, self.hybrid)
            self._last.pop(slot, None)

    def checkpoint(self, slot: int) -> None:
        """Keep the slot's recurrent state (a sliding-window model's: its window) as it is now
        (backends.base.Shard): the arrays are immutable, so the dict of them is the copy."""
        cache = self._cache(slot)
        if self.hybrid is not None:
            self._kept.keep(slot, cache.length, dict(cache.recurrent))
        elif self._window_size:
            start = window_start(cache.seen, cache.length, self._window_size)
            a, b = start - cache.dropped, cache.length - cache.dropped
            arrays = {i: (cache.keys[i][:, :, a:b], cache.values[i][:, :, a:b])
                      for i, w in enumerate(cache.windowed) if w}  # fmt: skip
            mx.eval(arrays)
            self._kept.keep(slot, cache.length, KeptWindow(arrays, cache.seen[start:].copy()))

    def _cut_window(self, slot: int, cache: SlotCache, length: int, kept: KeptWindow | None) -> None:
        """A sliding-window slot cut to `length`: its windowed blocks still hold the window there,
        or go back to the window kept at that length (ValueError: neither)."""
        if length == 0 or length <= cache.dropped and holds_window(cache.seen, np.arange(length), cache.dropped,
                                                                 self._window_size):  # fmt: skip
            for i, w in enumerate(cache.windowed):  # nothing of them is needed: start afresh
                if w:
                    cache.keys[i] = cache.values[i] = None
            cache.dropped = length
        elif needs_kept(slot, cache.seen, np.arange(length), cache.dropped, self._window_size, kept):
            for i, (k, v) in kept.arrays.items():
                cache.keys[i], cache.values[i] = k, v
            cache.dropped, cache.seen = length - len(kept.seen), kept.mask(length)
        cache.seen = cache.seen[:length]

    def _fit(self, cache: SlotCache, mask: np.ndarray, before: int) -> None:
        """After a step on a sliding-window slot: drop the windowed columns no later query needs,
        when enough are due (backends.window.drop_to)."""
        cache.seen = np.asarray(mask, np.int64).reshape(-1)
        start = drop_to(cache.seen, before, cache.dropped, self._window_size)
        if start is not None:
            cache.drop(start)
            mx.eval(cache.arrays())

    def _cut_recurrent(self, slot: int, cache: SlotCache, length: int) -> None:
        """Back to `length` inside the slot's last step of several positions: its start state,
        then its first positions fed again (backends/openvino/recurrent.py's rule)."""
        step = self._last.pop(slot, None)
        if step is None or not step[0] <= length:
            raise ValueError(f"a hybrid model's slot {slot} (recurrent state) can be cut back only within its "
                             f"last step of several positions, not from {cache.length} to {length} positions")
        start, states, x, positions, mask = step
        cache.length, cache.recurrent = start, dict(states)
        if length > start:
            self.forward(slot, x[: length - start], positions[: length - start], mask[:length])

    def capture(self, slot: int) -> SlotState:
        cache = self._cache(slot)
        length, keys, values = cache.snapshot()
        return SlotState(length, keys, values, self.spec.first, self.spec.last, dict(cache.recurrent) or None,
                         cache.dropped)  # fmt: skip

    def restore(self, slot: int, state: SlotState) -> None:
        if not isinstance(state, SlotState) or (state.first, state.last) != (
            self.spec.first,
            self.spec.last,
        ):
            raise ValueError(
                "restore takes a state captured from an MLX shard of the same block range"
            )
        cache = self._cache(slot)
        cache.load(state.length, state.keys, state.values, state.dropped)
        self._kept.forget(slot)
        if self.hybrid is not None:
            cache.recurrent = dict(state.recurrent or {})
            self._last.pop(slot, None)
            self._kept.forget(slot)

    def _cache(self, slot: int) -> SlotCache:
        cache = self._slots.get(slot)
        if cache is None:
            raise ValueError(f"slot {slot} is not open")
        return cache

    # --- compute ---------------------------------------------------------------------------

    def forward(
        self, slot: int, x: np.ndarray, positions: np.ndarray, mask: np.ndarray
    ) -> np.ndarray:
        cache = self._cache(slot)
        n, pos, visible = self._row_inputs(slot, cache, x, positions, mask)
        if self._window_size:  # the keys the step's queries need are held
            check_window(np.asarray(mask).reshape(-1), cache.length, cache.dropped, self._window_size)
        if self.hybrid is not None:
            return self._forward_hybrid(slot, cache, x, positions, mask, visible)
        near = self._window(cache, positions, mask)
        self._mind_cache(1, n)
        carried = self._carried(x, n)
        h = self._embed(x, n)[None] if carried is None else carried.hidden  # [1, n, hidden]
        if carried is not None and self.weights.per_layer is not None:
            carried.per_layer_inputs(h, *self.weights.per_layer, self.dims.rms_eps)

        cache.reserve(n)
        for layer, w in enumerate(self.weights.blocks):
            if self._gemma4 is not None:
                h = gemma4_block(h, w, cache, layer, pos, near if self._windowed[layer] else visible, self._gemma4[layer],
                                 self._routes[layer], carried, self.spec.first + layer)  # fmt: skip
            elif self._windowed[layer]:
                h = block(h, w, cache, layer, pos, near, self.dims_swa)
            else:
                h = block(h, w, cache, layer, pos, visible, self.dims)
        cache.length += n
        if carried is not None:
            h = carried.row(h)
        mx.eval(h, cache.arrays())  # one evaluation: the hidden states and every block's KV
        if self._window_size:
            self._fit(cache, mask, cache.length - n)
        return np.array(h[0], dtype=np.float32)  # [n, hidden] (gemma4: a carried row's width)

    def forward_batch(
        self,
        slots: Sequence[int],
        xs: Sequence[np.ndarray],
        positions: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
    ) -> list[np.ndarray]:
        """`forward` on several slots at once, as one graph (see backends.base.Shard)."""
        slots = list(slots)
        if not (len(slots) == len(xs) == len(positions) == len(masks)) or not slots:
            raise ValueError(
                "forward_batch needs one x, positions and mask per slot, and at least one slot"
            )
        if len(set(slots)) != len(slots):
            raise ValueError(f"forward_batch got a slot twice: {slots}")
        if self.hybrid is not None or self._gemma4 is not None:  # recurrent states, gemma4's blocks: one slot at a time
            return [self.forward(*a) for a in zip(slots, xs, positions, masks)]
        caches = [self._cache(s) for s in slots]
        rows = [self._row_inputs(*a) for a in zip(slots, caches, xs, positions, masks)]
        for cache, m in zip(caches, masks) if self._window_size else ():
            check_window(np.asarray(m).reshape(-1), cache.length, cache.dropped, self._window_size)
        ns = [n for n, _, _ in rows]
        self._mind_cache(len(ns), max(ns))
        h = mx.concatenate([self._embed(x, n) for x, n in zip(xs, ns)])[None]  # [1, T, hidden]

        for cache, n in zip(caches, ns):
            cache.reserve(n)
        pos, visible = [p for _, p, _ in rows], [v for _, _, v in rows]
        near = [self._window(c, p, m) for c, p, m in zip(caches, positions, masks)]
        for layer, w in enumerate(self.weights.blocks):
            if self._windowed[layer]:
                h = block_rows(h, w, caches, layer, pos, near, ns, self.dims_swa)
            else:
                h = block_rows(h, w, caches, layer, pos, visible, ns, self.dims)
        arrays = []
        for cache, n in zip(caches, ns):
            cache.length += n
            arrays += cache.arrays()
        mx.eval(h, arrays)
        if self._window_size:
            for cache, m, n in zip(caches, masks, ns):
                self._fit(cache, m, cache.length - n)
        out = np.array(h[0], dtype=np.float32)  # [T, hidden]
        return np.split(out, np.cumsum(ns)[:-1])  # [n, hidden] per row

    def _forward_hybrid(self, slot: int, cache: SlotCache, x: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                        visible: mx.array | str | None) -> np.ndarray:
        n = len(x)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if n > 1:  # a step that may be cut back into: keep its start
            self._last[slot] = (cache.length, dict(cache.recurrent), np.array(x, copy=True), positions.copy(),
                                np.asarray(mask).reshape(-1).copy())  # fmt: skip
        else:
            self._last.pop(slot, None)
        self._mind_cache(1, n)
        h = self._embed(x, n)  # [n, hidden]
        cache.reserve(n)
        for layer, w in enumerate(self.weights.blocks):
            h = hybrid_block(h, w, cache, layer, positions, visible, self.dims, self.hybrid)
        cache.length += n
        mx.eval(h, cache.arrays())
        return np.array(h, dtype=np.float32)

    def _window(self, cache: SlotCache, positions: np.ndarray, mask: np.ndarray) -> mx.array | None:
        """A windowed layer's visibility for one slot's feed (None: the shard has no windowed layer)."""
        if not any(self._windowed):
            return None
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        return window_mask(np.asarray(mask).reshape(-1), cache.length, pos, self.hparams.family.sliding_window)

    @property
    def scratch_releases(self) -> int:
        return self._large.releases

    def _mind_cache(self, rows: int, length: int) -> None:
        """Before a step of `rows` × `length` positions: empty MLX's buffer cache after a long
        prompt (memory.LargeSteps), as mlx-lm's prefill loop does; it keeps serving in between."""
        if self._large.due(rows, length):
            mx.clear_cache()

    def _row_inputs(
        self, slot: int, cache: SlotCache, x: np.ndarray, positions: np.ndarray, mask: np.ndarray
    ) -> tuple[int, int | mx.array, mx.array | str | None]:
        """n, the RoPE positions (the first when consecutive) and the visibility of one slot's feed."""
        n = len(x)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        mask = np.asarray(mask).reshape(-1)
        if n == 0 or positions.shape != (n,):
            raise ValueError(
                f"forward needs n ≥ 1 inputs and n positions (got {n} and {positions.shape[0]})"
            )
        if mask.shape != (cache.length + n,):
            raise ValueError(
                f"mask covers {mask.shape[0]} positions; slot {slot} needs cache_len + n = {cache.length + n}"
            )
        first = int(positions[0])
        consecutive = bool((positions == first + np.arange(n)).all())
        pos: int | mx.array = first if consecutive else mx.array(positions.astype(np.int32))
        return n, pos, attention_mask(mask, cache.length, n)

    def _carried(self, x: np.ndarray, n: int) -> Carried | None:
        """A gemma4 step's carried row (backends/mlx/gemma4.py); None for every other model."""
        hp = self.hparams
        if hp.carried == hp.hidden:
            return None
        if not self.spec.embed:
            return Carried(hp.gemma4, hp.hidden, mx.array(np.asarray(x, dtype=np.float32).reshape(n, hp.carried))[None])
        tail = mx.array(carried_tail(self.index, np.asarray(x).reshape(n)))
        return Carried(hp.gemma4, hp.hidden, mx.concatenate([self._embed(x, n), tail], axis=-1)[None])

    def _embed(self, x: np.ndarray, n: int) -> mx.array:
        """Token ids (embed shard) or hidden states → f32 [n, hidden]."""
        if self.spec.embed and self.weights.embedding is not None:  # the tied lm_head's table
            h = self.weights.embedding.rows(
                mx.array(np.asarray(x, dtype=np.int32).reshape(n))
            )  # [n, hidden]
        elif self.spec.embed:  # read from the file, not held (load_shard_weights)
            h = mx.array(self.index.rows("token_embd.weight", np.asarray(x).reshape(n)))  # [n, hidden]
        else:
            h = mx.array(
                np.asarray(x, dtype=np.float32).reshape(n, self.dims.hidden)
            )  # [n, hidden]
        h = h.astype(mx.float32)
        if self.spec.embed and self.hparams.family.embed_scale != 1.0:  # Gemma: rows × sqrt(hidden)
            h = h * mx.array(np.float32(self.hparams.family.embed_scale))
        return h

    def _logits(self, hidden: np.ndarray) -> mx.array:
        if not self.spec.head:
            raise ValueError("logits needs the head shard (spec.head)")
        rows = np.asarray(hidden, dtype=np.float32).reshape(-1, self.hparams.carried)
        h = mx.array(rows[:, : self.dims.hidden])  # [n, hidden] (a carried row's first columns)
        h = mx.fast.rms_norm(h, self.weights.output_norm, self.dims.rms_eps)
        logits = self.weights.lm_head(h).astype(mx.float32)  # [n, vocab]
        cap = self.hparams.family.logit_softcap
        return logits if not cap else cap * mx.tanh(logits / cap)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return np.array(self._logits(hidden), dtype=np.float32)  # [n, vocab]

    def greedy(self, hidden: np.ndarray) -> int:
        """The top-1 token after the last row of hidden [n, hidden] (argmax in the graph: one id
        comes back, not V floats)."""
        return int(mx.argmax(self._logits(np.asarray(hidden)[-1:]), axis=-1).item())


def _periods(head_dim: int, base: float, yarn: Yarn | None) -> mx.array | None:
    """mx.fast.rope's `freqs` (periods) under YaRN: base^(2i/D) / YaRN's multiplier i (None
    without YaRN: mx.fast.rope takes the base)."""
    if yarn is None:
        return None
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) * yarn_multipliers(yarn, head_dim, base)
    return mx.array((1.0 / inv).astype(np.float32))


def _hybrid_dims(hp, spec: ShardSpec) -> HybridDims:
    """The shard's part of a hybrid model (backends/gguf/hybrid.py): which of its blocks are
    delta-net layers, the gated attention's partial RoPE frequencies, the delta rule's sizes."""
    hy = hp.hybrid
    return HybridDims(recurrent=hy.recurrent[spec.first:spec.last], rope_inv=hy.rope_inv_freq(hp.rope_base),
                      k_heads=hy.k_heads, v_heads=hy.v_heads, state=hy.state, conv_kernel=hy.conv_kernel,
                      interleaved=hy.interleaved)  # fmt: skip
