"""`kafila inspect`: what a GGUF file holds, and whether (and if not, why not) Kafila serves it.

The description is read from the GGUF header directly (backends.gguf.header), so it works on
files Kafila refuses — a vocabulary-only GGUF, an unsupported architecture or quant type. Whether
Kafila serves the file is `open_model`'s verdict: its BadInput message is the reason when it refuses.

`--json` prints one line with these fields (null where the header does not say):
  path            the file, absolute
  file_bytes      its size
  name            general.name
  architecture    general.architecture
  file_type       general.file_type as llama.cpp names it (e.g. "MOSTLY_Q4_1")
  blocks          {arch}.block_count
  hidden          {arch}.embedding_length
  heads, kv_heads {arch}.attention.head_count, head_count_kv (kv_heads = heads when absent)
  head_dim        {arch}.attention.key_length, else rope.dimension_count, else hidden / heads
  ffn             {arch}.feed_forward_length
  vocab           {arch}.vocab_size, else the token list's length, else token_embd's rows
  context         {arch}.context_length
  tensors         number of tensors
  tensor_bytes    bytes of all tensor data
  quant_types     {type: {"tensors", "bytes", "share"}}, share = bytes / tensor_bytes, largest first
  tokenizer       {"model", "pre", "tokens"}: tokenizer.ggml.model, .pre and the token count
  served          true when Kafila serves the file as is
  why_not         null when served, else the one-line reason Kafila refuses it
  block_bytes     β_block: bytes of the largest block's tensors (the planner's; ModelIndex when served)
  head_bytes      β_head: token_embd + output_norm + output (ModelIndex when served)
  kv_bytes_per_token_per_block   the planner's KV bytes per token per block (f16 values; the mean
                  over blocks: a hybrid's delta-net layers and windowed layers hold none per token)
  state_bytes_per_request_per_block   what the plan prices per request, the mean per block: a hybrid
                  model's recurrent state, the live state and its copies (f32;
                  backends.memory.RECURRENT_STATE_COPIES), and a sliding-window model's windowed KV,
                  its window and kept windows (backends.memory.window_held_positions); null for others

Exit 0 for any readable GGUF, served or not; 2 when the file is missing, not a GGUF or damaged.
"""

from __future__ import annotations

import json
import os
import re

from backends.errors import BadInput

BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")
HEAD_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")
KV_BYTES_PER_VALUE = 2  # the planner's default (f16 KV)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect", help="describe a GGUF file and say whether Kafila serves it",
        description=__doc__.split("\n\n", 1)[0] + " (see the module docstring for the --json fields)",
    )  # fmt: skip
    p.add_argument("model", metavar="GGUF", help="a GGUF path or a model alias (see `kafila models`)")
    p.add_argument("--json", action="store_true",
                   help="one line: path, file_bytes, name, architecture, file_type, blocks, hidden, heads, "
                        "kv_heads, head_dim, ffn, vocab, context, tensors, tensor_bytes, quant_types "
                        "{type: {tensors, bytes, share}}, tokenizer {model, pre, tokens}, served, why_not, "
                        "block_bytes, head_bytes, kv_bytes_per_token_per_block, state_bytes_per_request_per_block")
    p.set_defaults(handler=run)


def run(args) -> int:
    from kafila.models import resolve_model

    info = describe(resolve_model(args.model))
    if args.json:
        print(json.dumps(info))
    else:
        print(render(info))
    return 0


def _int(value) -> int | None:
    return int(value) if isinstance(value, (int, float)) else None


def _count(value) -> int | list | None:
    """An integer hyperparameter, or its per-layer list as is (OpenELM stores heads and FFN per layer)."""
    return value if isinstance(value, list) else _int(value)


def describe(path: str) -> dict:
    """Everything `kafila inspect --json` prints, for the GGUF at `path` (BadInput if unreadable).

    A served file is described from its ModelIndex (the header parsed once); a refused one from
    header directly (backends.gguf.header), as far as it can be read.
    """
    from backends.gguf import open_model
    from backends.gguf.header import read_header

    try:
        index = open_model(path)
    except BadInput as exc:
        why_not = str(exc)
    else:
        tensors = [(t.name, t.qtype, t.n_bytes, t.shape[0]) for t in index.tensors.values()]
        info = summarize(path, index.metadata, tensors)
        planner = index.planner_model()
        info.update(served=True, block_bytes=int(planner["block_bytes"]), head_bytes=int(planner["head_bytes"]),
                    kv_bytes_per_token_per_block=planner["kv_bytes_per_token_per_block"],
                    state_bytes_per_request_per_block=planner.get("state_bytes_per_request_per_block"))
        return info

    header = read_header(path)  # BadInput (exit 2) when missing, not a GGUF or damaged
    tensors = []
    for t in header.tensors:
        if t.offset + t.n_bytes > header.file_bytes:
            raise BadInput(f"GGUF {path} is truncated: tensor {t.name} ends past the end of the file")
        rows = t.dims[1] if len(t.dims) > 1 else t.dims[0]  # ggml order: (cols, rows, ...)
        tensors.append((t.name, t.type_name, t.n_bytes, rows))
    info = summarize(path, header.metadata, tensors)
    info["why_not"] = why_not
    return info


def summarize(path: str, metadata: dict, tensors: list[tuple[str, str, int, int]]) -> dict:
    """The description from header fields and (name, quant type, bytes, rows) per tensor; `served`
    is False and β from the tensors here — `describe` fills in open_model's verdict."""
    import gguf

    arch = metadata.get("general.architecture")

    def hp(key: str):
        return metadata.get(f"{arch}.{key}") if isinstance(arch, str) else None

    sizes: dict[str, int] = {}
    counts: dict[str, int] = {}
    per_block: dict[int, int] = {}
    head_bytes = 0
    rows: dict[str, int] = {}
    for name, qtype, n_bytes, n_rows in tensors:
        sizes[qtype] = sizes.get(qtype, 0) + n_bytes
        counts[qtype] = counts.get(qtype, 0) + 1
        if m := BLOCK_TENSOR.match(name):
            per_block[int(m.group(1))] = per_block.get(int(m.group(1)), 0) + n_bytes
        elif name in HEAD_TENSORS:
            head_bytes += n_bytes
        rows[name] = n_rows
    tensor_bytes = sum(sizes.values())
    quant_types = {
        q: {"tensors": counts[q], "bytes": b, "share": round(b / tensor_bytes, 4) if tensor_bytes else 0.0}
        for q, b in sorted(sizes.items(), key=lambda kv: -kv[1])
    }

    hidden = _int(hp("embedding_length"))
    heads = _count(hp("attention.head_count"))
    kv_heads = _count(hp("attention.head_count_kv"))
    kv_heads = heads if kv_heads is None else kv_heads
    head_dim = _int(hp("attention.key_length")) or _int(hp("rope.dimension_count"))
    if head_dim is None and hidden and isinstance(heads, int) and heads:
        head_dim = hidden // heads
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = _int(hp("vocab_size")) or (len(tokens) if tokens else None) or rows.get("token_embd.weight")
    file_type = _int(metadata.get("general.file_type"))
    try:
        file_type_name = gguf.LlamaFileType(file_type).name if file_type is not None else None
    except ValueError:
        file_type_name = str(file_type)

    return {
        "path": os.path.abspath(path),
        "file_bytes": os.path.getsize(path),
        "name": metadata.get("general.name"),
        "architecture": arch,
        "file_type": file_type_name,
        "blocks": _int(hp("block_count")),
        "mtp_blocks": _int(hp("nextn_predict_layers")) or 0,  # counted in blocks (llama.cpp's n_layer_all)
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "ffn": _count(hp("feed_forward_length")),
        "vocab": vocab,
        "context": _int(hp("context_length")),
        "tensors": len(tensors),
        "tensor_bytes": tensor_bytes,
        "quant_types": quant_types,
        "tokenizer": {"model": metadata.get("tokenizer.ggml.model"), "pre": metadata.get("tokenizer.ggml.pre"),
                      "tokens": len(tokens) if tokens else 0},
        "served": False,
        "why_not": None,
        "block_bytes": max(per_block.values()) if per_block else None,
        "head_bytes": head_bytes or None,
        "kv_bytes_per_token_per_block": (2 * kv_heads * head_dim * KV_BYTES_PER_VALUE
                                         if isinstance(kv_heads, int) and head_dim else None),
        "state_bytes_per_request_per_block": None,
    }


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _blocks(info: dict) -> str:
    """"28 blocks", or "27 blocks + 1 multi-token-prediction (--speculate mtp)"."""
    blocks, mtp = info.get("blocks"), info.get("mtp_blocks") or 0
    if blocks is None:
        return "? blocks"
    if not mtp or mtp >= blocks:
        return f"{blocks} blocks"
    return f"{blocks - mtp} blocks + {mtp} multi-token-prediction (--speculate mtp)"


def render(info: dict) -> str:
    """The description as a person reads it ("?" where the header does not say)."""
    v = {k: "?" if x is None else x for k, x in info.items()}
    q = ", ".join(f"{t} {x['share'] * 100:.1f}% ({x['tensors']} tensors)" for t, x in info["quant_types"].items())
    tok = {k: "?" if x is None else x for k, x in info["tokenizer"].items()}
    lines = [
        f"{v['path']} ({_size(info['file_bytes'])})",
        f"  name          {v['name']}",
        f"  architecture  {v['architecture']}, {_blocks(info)}, file type {v['file_type']}",
        f"  shape         hidden {v['hidden']}, heads {v['heads']} (KV {v['kv_heads']}), "
        f"head dim {v['head_dim']}, FFN {v['ffn']}, vocab {v['vocab']}",
        f"  context       {v['context']} tokens",
        f"  tensors       {v['tensors']}, {_size(info['tensor_bytes'])}: {q or 'none'}",
        f"  tokenizer     {tok['model']} (pre {tok['pre']}), {tok['tokens']} tokens",
        f"  planner       β_block {_size(info['block_bytes'])}, β_head {_size(info['head_bytes'])}, "
        f"KV {v['kv_bytes_per_token_per_block']} bytes/token/block (f16)"
        + (f", per request {info['state_bytes_per_request_per_block']:.0f} bytes/block (recurrent state, windowed KV)"
           if info.get("state_bytes_per_request_per_block") else ""),
        "  served        yes" if info["served"] else f"  served        no: {info['why_not']}",
    ]
    return "\n".join(lines)
