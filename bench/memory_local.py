"""Memory of Kafila's 1-stage OpenVINO chain against openvino_genai.LLMPipeline, same harness, same run.

Each measurement is a fresh child process (`python -m bench.memory_local --child kafila|peer`,
killed after CHILD_TIMEOUT_S), run one after another and alternating A B A B … for ROUNDS rounds.
Both kinds of child import the same modules (OpenVINO with its telemetry declined, as kafila/cli.py
does, openvino_genai, kafila.engine.chain, kafila.models), then take the baseline — before opening the
model — then load and greedily generate NEW_TOKENS tokens with EOS ignored from the same chat
prompt, and read their memory again with the chain or pipeline still alive:

- RSS: /proc/self/status VmRSS; peak: VmHWM (the process's high-water mark, imports included);
- PSS: /proc/self/smaps_rollup Pss (shared pages divided among the processes that map them).

Growth = after − baseline; the ratio columns divide it by the GGUF's tensor bytes plus the KV cache
at prompt + NEW_TOKENS tokens with u8 values (as bench/local.py computes it; each row with its own
prompt length, the peer's from its perf metrics).

Why the peer's child "hung" in bench/local.py before: it was started as `--memory-child 0` and
`if args.memory_child:` read 0 as absent, so the child ran the whole speed benchmark, whose memory
part started `--memory-child 0` again — without end. Here the child is named, not numbered, and
every child has a hard timeout.

Run: `.venv/bin/python -m bench.memory_local`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

NEW_TOKENS = 32
ROUNDS = 3
CHILD_TIMEOUT_S = 300
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
KINDS = ("kafila", "peer")
NAMES = {"kafila": "kafila OpenVINO 1-stage", "peer": "openvino_genai LLMPipeline (peer)"}


# --- inside a child -----------------------------------------------------------------------------


def read_memory() -> dict[str, int]:
    """This process's VmRSS, VmHWM (status) and Pss (smaps_rollup), in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024  # kB
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "Pss":
                out["Pss"] = int(value.split()[0]) * 1024
    return out


def _import_all() -> None:
    """The same imports in every child, so every baseline counts the same libraries."""
    from kafila.cli import import_openvino_without_telemetry

    import_openvino_without_telemetry()
    import openvino_genai  # noqa: F401

    import kafila.engine.chain  # noqa: F401
    import kafila.models  # noqa: F401


def _kafila(path: str, job: dict) -> int:
    from backends.gguf import open_model
    from kafila.engine.chain import LocalChain

    index = open_model(path)
    chain = LocalChain.build(index.path, 1, "openvino", "serving", index=index)
    made = len(list(chain.generate(job["prompt_ids"], job["new_tokens"])))  # no stop ids: EOS ignored
    job["_keep"] = chain  # alive while memory is read
    return made


def _peer(path: str, job: dict) -> int:
    import openvino_genai as ov_genai

    pipe = ov_genai.LLMPipeline(path, "CPU")
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = job["new_tokens"]
    config.ignore_eos, config.do_sample, config.apply_chat_template = True, False, False
    metrics = pipe.generate([job["prompt_text"]], config).perf_metrics
    job["prompt_tokens"] = metrics.get_num_input_tokens()
    job["_keep"] = pipe
    return metrics.get_num_generated_tokens()


def child(kind: str, job: dict) -> dict:
    _import_all()
    before = read_memory()
    made = (_kafila if kind == "kafila" else _peer)(job["path"], job)
    after = read_memory()
    return {"kind": kind, "before": before, "after": after, "generated": made, "prompt_tokens": job["prompt_tokens"]}


# --- the parent ---------------------------------------------------------------------------------


def run_child(kind: str, job: dict, timeout_s: float = CHILD_TIMEOUT_S) -> dict:
    """One fresh child; its last stdout line is its JSON result. A child past timeout_s is killed."""
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.memory_local", "--child", kind],
                              input=json.dumps(job), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"bench.memory_local: the {kind} child ran past {timeout_s:.0f} s "
                         "and was killed") from exc
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise SystemExit(f"bench.memory_local: the {kind} child exited {proc.returncode}: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(model: str, rounds: int, new_tokens: int) -> tuple[list[dict], dict]:
    from backends.gguf import open_model
    from kafila.models import load_tokenizer, resolve_model

    index = open_model(resolve_model(model))
    tok = load_tokenizer(index)
    prompt_text = tok.render_chat([{"role": "user", "content": PROMPT}])
    prompt_ids = tok.encode(prompt_text)
    job = {"path": index.path, "prompt_text": prompt_text, "prompt_ids": prompt_ids,
           "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens}
    kv_per_token = index.hparams.n_blocks * index.kv_bytes_per_token_per_block(bytes_per_value=1)
    model_info = {"gguf_bytes": sum(t.n_bytes for t in index.tensors.values()), "kv_bytes_per_token": kv_per_token}
    results = []
    for r in range(rounds):
        for kind in KINDS:  # A B A B …
            res = run_child(kind, job)
            if res["generated"] != new_tokens:
                raise SystemExit(f"bench.memory_local: the {kind} child generated {res['generated']} "
                                 f"tokens, not {new_tokens}")
            res["round"] = r + 1
            res["kv_bytes"] = model_info["kv_bytes_per_token"] * (res["prompt_tokens"] + new_tokens)
            results.append(res)
    return results, model_info


def table(results: list[dict], model_info: dict) -> str:
    mb = 1e6
    lines = ["| process (round) | baseline RSS | RSS after | RSS growth | baseline PSS | PSS after | PSS growth | "
             "peak (VmHWM) | KV | RSS growth / (GGUF + KV) | PSS growth / (GGUF + KV) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        b, a = res["before"], res["after"]
        denom = model_info["gguf_bytes"] + res["kv_bytes"]
        rss_g, pss_g = a["VmRSS"] - b["VmRSS"], a["Pss"] - b["Pss"]
        lines.append(f"| {NAMES[res['kind']]} ({res['round']}) | {b['VmRSS'] / mb:.1f} | {a['VmRSS'] / mb:.1f} | "
                     f"{rss_g / mb:.1f} | {b['Pss'] / mb:.1f} | {a['Pss'] / mb:.1f} | {pss_g / mb:.1f} | "
                     f"{a['VmHWM'] / mb:.1f} | {res['kv_bytes'] / mb:.2f} | {rss_g / denom:.2f} | {pss_g / denom:.2f} |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """Kafila over the peer, per round (the A and B of one round), then the median over rounds."""
    def growth(res: dict, key: str) -> int:
        return res["after"][key] - res["before"][key]

    by_round: dict[int, dict[str, dict]] = {}
    for res in results:
        by_round.setdefault(res["round"], {})[res["kind"]] = res
    out = []
    for key, label in (("VmRSS", "RSS growth"), ("Pss", "PSS growth"), ("VmHWM", "peak")):
        if key == "VmHWM":
            ratios = [p["kafila"]["after"][key] / p["peer"]["after"][key] for p in by_round.values()]
        else:
            ratios = [growth(p["kafila"], key) / growth(p["peer"], key) for p in by_round.values()]
        out.append(f"kafila / peer, {label}: median {statistics.median(ratios):.2f} "
                   f"(per round {', '.join(f'{x:.2f}' for x in ratios)})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.memory_local", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="A B rounds (each a fresh process per side)")
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, json.loads(sys.stdin.read()))))
        return 0

    from bench._report import header
    from bench.llamacpp_speed import machine

    print(header(), flush=True)
    results, model_info = measure(args.model, args.rounds, args.tokens)
    print(f"model {args.model}: GGUF tensor bytes {model_info['gguf_bytes'] / 1e6:.1f} MB; "
          f"{args.tokens} new tokens, greedy, EOS ignored; MB = 10^6 bytes")
    print(table(results, model_info))
    print(summary(results))
    print(machine().rsplit("; ", 1)[-1] + " (at the end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
