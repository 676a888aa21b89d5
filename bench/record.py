"""docs/BENCHMARKS.md rebuilt from its commands: each section's command run, its stdout pasted verbatim.

    .venv/bin/python -m bench.record [--run] [--only TITLE[,TITLE…]] [--outputs DIR] [--doc PATH]

SECTIONS holds each section's title, question, command (run as `python -m …` with this
interpreter, from the checkout) and a line or two on what its table means. With --run each
command (or those --only names) runs in turn and its stdout is kept in --outputs
(default ~/.cache/kafila-bench/record/); without it the doc is rebuilt from the outputs kept
there. A section with no output kept here keeps its table in the doc as it is (a record made on
another machine, say), and is named. The text under each table is written for the run it
describes: after a new run, reread it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench._report import REPO

SECTIONS = [
  # (title, question, command, what its table means)
  ('Speed against llama.cpp',
   'How fast does one Kafila process decode and prefill the real Qwen2.5-Coder-1.5B Q4_K_M in each weight '
   'form, next to llama.cpp on the same file and threads?',
   'python -m bench.kquant_speed --file qwen1.5b --rows kafila-exact,kafila-fast,kafila-ggml,llamacpp --rounds 2',
   'Each row at its serving defaults, 2 threads, rows alternating round by round; llama.cpp runs in a '
   "process of its own (its OpenMP defaults). `kafila-ggml` is `--kquant ggml`: ggml's kernels on the file's"
   ' blocks inside the OpenVINO stage (backends/openvino/ggml_kernels.py). Each matrix is a ggml mul_mat '
   "node over a slice of its rows per plugin thread, so ggml picks llama.cpp's kernel: the repacked GEMM/GEMV"
   " (Q4_K here), its tiled K-quant GEMM for a prompt's rows (Q6_K), vec_dot for one row. A block's SwiGLU "
   "feed-forward is one node computed as llama.cpp's build_ffn (GgmlFfn). The last table before these two "
   '(commit d736276, `git log -p`) had the ggml form at 0.85x decode and 0.83x prefill. The openvino GGUF '
   'frontend row is not measured, for the reason printed.'),
  ('Speed against llama.cpp on an AVX2 CPU',
   'The same question on a CPU without AVX-512 or VNNI: does each form keep its ratio, and where does '
   'openvino_genai stand? (Run on an AVX2-only machine.)',
   'python -m bench.kquant_speed --file qwen1.5b --rows kafila-exact,kafila-fast,kafila-ggml,genai,llamacpp --rounds 2',
   'An AMD EPYC with AVX2 only, 2 threads. The ggml form keeps its decode ratio (0.86x here, 0.85x on the '
   "AVX-512 EPYC above): ggml's AVX2 kernels, repacked Q4_K included, are what llama.cpp runs here too. Its "
   "prefill (0.79x) is no faster than the exact form's on this CPU, and its two rounds spread widely (31 and"
   ' 52 tok/s; llama.cpp 46 and 57). The fast form gains nothing at decode: without VNNI the CPU plugin '
   'takes no int8-activation path. openvino_genai (its own GGUF reader, u4 with integer zero points) '
   'prefills at 0.97x and decodes at 0.51x.'),
  ('Speed against llama.cpp on a Xeon with AMX',
   'The same question on an Intel Xeon (AVX-512 VNNI and BF16, AMX), where llama.cpp as pip builds it '
   'crashes: with llama.cpp built without AMX, as a user of this machine would run it.',
   'python -m bench.kquant_speed --file qwen1.5b --rows kafila-exact,kafila-ggml,llamacpp --rounds 2 '
   '--llama-cpp /tmp/llama-noamx',
   "An Intel Xeon VM, 2 threads. llama-cpp-python's native build (AMX_INT8) dies here in its first "
   'inference (a general protection fault in ggml_backend_amx_mul_mat: ggml-org/llama.cpp#20824), so every '
   'row uses one built without AMX into /tmp/llama-noamx: `CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON '
   '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX_VNNI=ON -DGGML_AVX=ON '
   '-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF '
   '-DGGML_AMX_BF16=OFF" pip install --no-deps --target /tmp/llama-noamx llama-cpp-python==0.3.36` (its '
   "repacked AVX-512 kernels, as on the EPYC; the ggml form computes with the same build's ggml). "
   'Here the ggml form decodes at 0.86x and prefills at 0.93x; the exact form 0.57x and 0.89x. This VM decodes the 1.5B at a third of '
   "the EPYC's rate (llama.cpp 13.7 tok/s against 43.6), so its ratios are not the EPYC's."),
  ('The 8B shape against llama.cpp',
   "How fast does the ggml form decode and prefill a Llama-3-8B-shaped Q4_K_M file, next to llama.cpp?",
   'python -m bench.kquant_speed --file llama-3-8b --rows kafila-ggml,llamacpp --rounds 2',
   "tests/big_gguf.py's random-weight file of Llama-3-8B's shape in Q4_K_M's layout (4.9 GB: Q4_K, Q6_K for"
   " half the attn_v and ffn_down and the output), 2 threads. Its greedy ids part from llama.cpp's at once:"
   " random weights give near-tied logits, where float rounding picks the winner."),
  ('Mixture of experts against llama.cpp',
   'How fast does one Kafila process run a Qwen3-MoE file and a gpt-oss file (MXFP4 experts), next to '
   'llama.cpp on the same file?',
   'python -m bench.kquant_speed --file qwen3moe,gpt-oss --rows kafila-exact,kafila-ggml,llamacpp --rounds 2',
   "bench.llamacpp_speed's random files, 12 blocks, hidden 1024, 32 experts of FFN 256, top 4. Qwen3-MoE: "
   "Q4_K_M from llama.cpp's quantizer (experts Q4_K and Q6_K). gpt-oss: MXFP4_MOE (experts MXFP4, held in "
   "their 4.25 bits by the ggml form; the other matrices Q8_0; a 128,256-row vocabulary) with attention "
   "sinks. `kafila-ggml` runs the experts after the router as one GgmlMoe node, llama.cpp's build_moe_ffn "
   "on the file's blocks (mul_mat_id, so its tiled GEMM for a prompt's rows of an expert; ggml's GLU; the "
   "slots summed in order); the exact form Gathers and decompresses the picked experts to f32 first. Before"
   " GgmlMoe (commit b092aec) the ggml form had Qwen3-MoE at 1.25x decode and 1.03x prefill, gpt-oss at "
   "0.88x and 0.93x. The greedy ids part from the first token on these random files for every Kafila row "
   "(near-ties in the router's top-k are the suspect; at the tests' shapes every form gives llama.cpp's ids"
   " at f32)."),
  ('Hybrid (Qwen3.5-MoE) against llama.cpp',
   'How fast does one Kafila process run a hybrid file (gated delta-net layers, attention every 4th block, '
   'experts), next to llama.cpp on the same file?',
   'python -m bench.kquant_speed --file qwen35moe --rows kafila-exact,kafila-ggml,llamacpp --rounds 2',
   "bench.llamacpp_speed's random qwen35moe file (tests/hybrid_gguf.py's layout at hidden 1024: 12 blocks, 9"
   ' of them delta-net layers with 8 key and 16 value heads of 64; 32 experts of FFN 256, top 4, a shared '
   "expert; Qwen2's vocabulary), Q4_K_M from llama.cpp's quantizer. A request's live recurrent state is 2.58"
   " MB (215,040 bytes per block; the plan prices it six times, with a verify step's copy and the copies "
   "kept where the last 4 turns' messages ended, and tests/test_arch_hybrid.py checks the stage holds exactly"
   " that at its most). The delta "
   "rule runs as one op (KafilaDeltaRule, llama.cpp's sequential scan), the experts after the router as "
   "one GgmlMoe and the shared expert as one GgmlFfn: the ggml form went from 0.78x to 0.85x decode and "
   "0.68x to 1.46x prefill (commit c648420's table, `git log -p`). As for the MoE files, the greedy ids "
   "part from the first token on this random file at serving precision; at the tests' shapes every form "
   "gives llama.cpp's ids at f32. The GGUF frontend row is not measured (as above)."),
  ('Serving precision on this CPU',
   "Which inference precision should serving compile here: is bf16 (the plugin's default on AVX-512-BF16 and"
   ' AMX) faster, and does it keep a question asked again and a split chain answering as before?',
   'python -m bench.serving_precision --model qwen2.5-coder-1.5b-q4_k_m --rounds 3',
   'A Xeon with AMX (tiles for bf16 and int8), 2 threads. Both precisions on the same 1-stage chain, '
   'rounds alternating, in the default (exact) K-quant form. Here bf16 prefills 3.59x faster and decodes '
   "0.97x; its asked-again gap is 0.28 against f32's 0.0009. On the AVX-512-BF16 EPYC (commit 914e925's "
   "table, `git log -p`) bf16 prefilled 1.44x faster and decoded 0.90x, with a gap twice f32's, and on "
   'the default model 0.65 against 0.05, where it flipped the answer. Serving still compiles f32 on '
   'every CPU (backends/openvino/shard.py) for that agreement, so on AMX it leaves 3.6x of the default '
   "form's prefill to bf16 (`--kquant ggml` prefills with ggml's own kernels at either precision)."),
  ('Many users',
   "How does the aggregate rate grow, and each user's time per token, as more users ask at once, against what "
   "the machine's own compute allows?",
   'python -m bench.multiuser --users 1,4,8,16 --latency 0,20 --rounds 1',
   "One 3-member loopback session per hop latency, batched decode rows on. The bound (bench/ring_bound.py) is"
   " what a ring of the plan's stages on this one machine could deliver: each stage's batched step, the "
   "head's with its rows' token picks, timed in this process with the stages in turn as the ring runs them, "
   "and the head's measured network time per trip. It is not a strict ceiling at one user: there other runs"
   " measured 1.08-1.17 of it (one process's row set-up costs about what the ring's does). Timed alone and back to back instead, each"
   " stage finding its weights in the cache, and without the picks, the bound was 1.2-1.3x higher and the 0 ms"
   " session reached 0.59-0.63 of it (commit 4253c6e). 'All decoding' is the rate while every user's answer"
   " decodes (from the last first token to the first last token), which is what the bound prices; 'measured"
   " decode' starts at the earliest first token and so holds the later users' prefill (0.79-0.86 of the "
   "bound at 0 ms where all decoding is 0.94-1.00). At 20 ms a hop, 8 and 16 users reach 0.84-0.85: per-row"
   " work outside the forwards (token streaming, frames, the bench's own clients) on the same 2 cores."),
  ('DiP-SD with a draft model',
   'Do 4 users, each drafting with the real draft model at the member they typed at, get more tokens a '
   'second than batched plain decoding, 20 ms a hop, and how near what this machine allows?',
   'python -m bench.dipsd --model qwen2.5-coder-1.5b-q4_k_m --draft qwen2.5-coder-0.5b --latency 20 --users 4 '
   '--rounds 2',
   'The real pair (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, its 0.5B sibling drafting), a 3-member loopback session '
   "on this Xeon. All three members and their draft models share its 2 cores, so drafting is not hidden behind"
   " the ring's work as on machines of their own. The bound (bench/ring_bound.py's spec_bound: the stages' "
   "batched steps and the draft model's one-token step, 49 ms, timed after the session; H after the plain "
   "rounds) prices no draft worth its cores here: 1.00x. Measured 0.82x decoding only; plain decoding reached "
   '0.93 of its bound, speculating 0.76. The live optimiser counts a drafter on the busiest machine as that '
   "machine's time (DraftUser.serial) and plans few drafts (1.15 tokens a trip), the head tells each origin "
   'what it plans (frames.Tokens.want), and where members share a machine an origin drafts only the step\'s '
   'drafts, not the next step\'s too (origin.OriginDrafts.ahead; one run before it: 0.78x). What is left is '
   'the drafting during the prompts, before the first plan (TTFT 8.3 s against 5.5 s); starting it at the '
   'first token made TTFT equal but decoding 0.53-0.75x over three runs (reverted, 8bbe89e). On the AVX-512 '
   'EPYC (commit 81f6398, `git log -p`) 0.84x, 0.93x decoding only. Run with 814ca9c\'s code before its '
   'commit (the header\'s 8bbe89e+dirty).'),
  ('A draft model at the head',
   'Does one user, the draft model drafting at the head, get answers faster at 50 ms a hop?',
   'python -m bench.dipsd --model qwen2.5-coder-1.5b-q4_k_m --draft qwen2.5-coder-0.5b --latency 50 --users 1 '
   '--requests 4 --speculate draft --rounds 1',
   'The same pair and session; one user asks the 4 grounded prompts one after another, plain and drafting '
   'alternating. The head drafts ahead while each verifying step is out (head_driver._draft_ahead), and after'
   ' a rejection sends a short step at once and drafts the rest meanwhile. The bound lets this machine reach '
   '2.43x (3 drafts a trip at geometric acceptance 0.77, each draft step 39 ms on the cores the stages need); '
   'measured 1.89x decoding only, 0.78 of it. The acceptance is burstier than geometric (6.0 tokens a trip, '
   "where 0.77 gives at most 4.3), so the bound is the model's, not a strict ceiling. On the AVX-512 EPYC "
   "(commit 3336c70) 2.36x: this Xeon decodes the 1.5B at a third of the EPYC's rate, so its draft steps "
   'weigh more. The texts part at serving precision (2 of 4 the same): a near-tie can flip between a 1-row '
   'and a K+1-row step; at f32 drafting changes no token (tests/test_speculate.py). Run with ba3faf3\'s bench '
   'before its commit (3b5bfd3+dirty).'),
  ('Memory',
   "How much memory does Kafila's 1-stage chain take against openvino_genai for the same model?",
   'python -m bench.memory_local --rounds 1',
   'Each side is a fresh child process measured from the same baseline, 32 new tokens; one round (the '
   'default is more). Memory does not move with the load the way speed does: these ratios are the least '
   'noisy figures in this record.'),
  ("Memory of gpt-oss-20b's shape",
   "Does a 3-member session of gpt-oss-20b's shape (MXFP4 experts) hold the memory the planner prices, "
   'member by member?',
   'python -m bench.memory_big --shapes gpt-oss-20b --kquant ggml --members 3 --prompt-tokens 1000',
   "tests/big_gguf.py's gpt-oss-20b shape (11.6 GB: experts MXFP4, the rest Q8_0; Llama 3's vocabulary), "
   "every stage in the ggml form, which holds the file's own blocks (the exact form's experts would take "
   "2.1x the file). A member's experts are pages of the file, resident once a token is routed to them: after"
   ' a 32-token prompt the members held 0.78-0.90x the plan (commit 4e944bb), after this 999-token one '
   '0.91-0.95x, the head lowest by about the prefill working set (PREFILL_WORK_BYTES) that the plan holds '
   'and the shard hands back after a long prompt. tests/test_big_moe.py (KAFILA_BIG=1) asserts 0.90-1.10x.'),
  ('Planner',
   "Does the planner's division beat GPipe's (uniform) and exo's (memory-proportional) on the paper's "
   'fleets?',
   "python -m bench.plan_fleets --compact",
   "Predicted by the planner's cost model from fleets/*.json, nothing measured: the CPU line only says where"
   ' the command ran.'),
  ('Predictions',
   "Does the plan predict what each stage measures, and the answer's tok/s?",
   'python -m bench.plan_predict --cases demo,1b,throttled,1.5b --tokens 128',
   "Each case a 3-member session on this machine, planned from the members' probes and the host's timing of"
   " the model's own blocks (kafila/session/control/calibrate.py); measured: each stage's decode compute (the "
   "median over the answer of the head's moving average) and the answer's tok/s. The quota'd member (25 %, "
   "10 ms periods) computes on one thread and is priced, for one request, at the burst its quota lets through"
   " (planner.cost.quota_alone_ms); before, at its sustained rate, it was off by 212 % (f89dfdb). Stages "
   "measure 0-27 % over their prediction: the other members' network work runs beside a forward on these 2 "
   "cores, which the host's block timing does not see; the tok/s prediction leaves out each hop's processing "
   "(about 0.8 ms a hop here), so it is 1.1-1.5x high. Over five full runs with these changes: median 8-14 %, worst 18-37 % (the 37 %: a demo stage in one run)."),
]

HEAD = """# Kafila benchmarks: the current record

One section per question: its one command (`.venv/bin/python -m bench.X …`), the table it printed
verbatim, the CPU with its ISA flags, and the commit. `python -m bench.record --run` reruns every
command and rebuilds this file; earlier runs are in git (`git log -p docs/BENCHMARKS.md`; the diary
that code comments cite by section name is `git show 3ba472b:docs/BENCHMARKS.md`, the rooms move's
`4fd7460`, the table against openvino_genai at 1 and 3 stages `3ddda38`; a ring against one process,
n-gram speculation and weight transfer `b9b7e05`; churn `5e1587d`). They ran on 2-core AMD EPYCs
(AVX-512 with VNNI and BF16; a section says where it ran on an AVX2-only EPYC or a Xeon with AMX) shared with other jobs: absolute figures are
noisy, and each benchmark measures its comparisons side by side, alternating.
"""

def render(out: str) -> str:
    lines = out.rstrip("\n").splitlines()
    parts, text, table = [], [], []
    def flush_text():
        while text and not text[-1].strip():
            text.pop()
        while text and not text[0].strip():
            text.pop(0)
        if text:
            parts.append("```text\n" + "\n".join(text) + "\n```")
        text.clear()
    def flush_table():
        if table:
            parts.append("\n".join(table))
        table.clear()
    for ln in lines:
        if ln.startswith("|"):
            flush_text(); table.append(ln)
        else:
            flush_table(); text.append(ln)
    flush_text(); flush_table()
    return "\n\n".join(parts)



def slug(title: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")


def build(outputs: Path, current: str = "") -> tuple[str, list[str]]:
    """The doc from the kept outputs, and the titles with none kept: those keep their section of
    `current` (the doc as it is), or are left out where it has none."""
    doc, missing = [HEAD], []
    old = {part.split("\n", 1)[0]: "## " + part.rstrip("\n") + "\n" for part in re.split(r"^## ", current, flags=re.M)[1:]}
    for title, question, command, means in SECTIONS:
        path = outputs / f"{slug(title)}.out"
        if not path.is_file() or not path.read_text().strip():
            missing.append(title)
            if title in old:
                doc.append(old[title])
            continue
        doc.append(f"## {title}\n\n{question}\n\n```sh\n{command}\n```\n\n{render(path.read_text())}\n\n{means}\n")
    return "\n".join(doc), missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.record", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="run the sections' commands first")
    p.add_argument("--only", help="comma-separated section titles to run (default: all)")
    p.add_argument("--outputs", type=Path, default=Path(os.path.expanduser("~/.cache/kafila-bench/record")))
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "BENCHMARKS.md")
    args = p.parse_args(argv)
    titles = [t for t, *_ in SECTIONS]
    only = titles if not args.only else [t.strip() for t in args.only.split(",")]
    unknown = [t for t in only if t not in titles]
    if unknown:
        print(f"bench.record: no section {', '.join(map(repr, unknown))}; the sections: {', '.join(titles)}",
              file=sys.stderr)  # fmt: skip
        return 2
    args.outputs.mkdir(parents=True, exist_ok=True)
    if args.run:
        for title, _, command, _ in SECTIONS:
            if title not in only:
                continue
            argv_ = shlex.split(command)
            print(f"running: {command}", file=sys.stderr, flush=True)
            env = dict(os.environ, PYTHONPATH=str(REPO))  # the members a session spawns import this tree too
            run = subprocess.run([sys.executable, *argv_[1:]], cwd=REPO, env=env, capture_output=True, text=True)
            if run.returncode != 0:
                print(f"bench.record: {title!r} failed (exit {run.returncode}); its old output is kept:\n"
                      f"{run.stderr[-2000:]}", file=sys.stderr)  # fmt: skip
                continue
            (args.outputs / f"{slug(title)}.out").write_text(run.stdout)
    doc, missing = build(args.outputs, args.doc.read_text() if args.doc.is_file() else "")
    args.doc.write_text(doc)
    print(f"wrote {args.doc} ({len(doc.splitlines())} lines)" + (f"; kept as they were (no output here): "
                                                                f"{', '.join(missing)}" if missing else ""),
          file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
