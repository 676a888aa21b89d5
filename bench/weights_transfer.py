"""Weight transfer host → member on loopback: MB/s, each member's memory while it receives, and
the CPU both ends spend on it.

    .venv/bin/python -m bench.weights_transfer [--shape llama-3.2-1b] [--members 2] [--backend openvino]
                                               [--quic-members N]

A `kafila demo`-style session (kafila.tooling.launch.LocalSession: the host and its members as
separate processes on 127.0.0.1) on a tests/big_gguf shape, every member's weight cache empty,
so each member fetches its whole shard (header + its tensors) from the host over the QUIC edge.
While it forms, a sampler polls every member's /status (its live transfer figures) and
/proc/PID every 50 ms: the member's largest RSS while its weights arrive, its VmHWM when they
are all in (its peak so far: process start, probe and the transfer; the shard build comes after),
and the CPU seconds the member and the host used during the transfer. MB/s = bytes that crossed
the edge / the member's fetch seconds (kafila.session.weights.transfer.fetch_weights' own figures).

Each member fetches over the bulk lane (TCP, kafila.session.weights.bulk) when the host offers it, as
in any session; `--quic-members N` makes the last N members fetch over the QUIC stream only
(`kafila join --weights-lane quic`), so both lanes run side by side in one run. The `lane`
column is what each member's /status says carried its weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request

POLL_S = 0.05


def _proc(pid: int) -> tuple[int, int, float] | None:
    """(VmRSS, VmHWM) bytes and CPU seconds (user + system) of `pid`."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    pairs = (line.split(":", 1) for line in status.splitlines())
    kib = {k: int(v.split()[0]) for k, v in pairs if k in ("VmRSS", "VmHWM")}
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return kib["VmRSS"] * 1024, kib["VmHWM"] * 1024, cpu_s


def _weights(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=1) as r:
            return json.loads(r.read()).get("weights")
    except (OSError, ValueError):
        return None


def _api_port(proc) -> int:
    args = list(proc.popen.args)
    return int(args[args.index("--api") + 1].rsplit(":", 1)[1])


class Sampler(threading.Thread):
    """Per member: max RSS while fetching, VmHWM and CPU at the end, the host's CPU meanwhile."""

    def __init__(self, session) -> None:
        super().__init__(daemon=True)
        self.session, self.stop = session, threading.Event()
        self.rows: dict[str, dict] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            procs = list(self.session.procs)
            host = procs[0] if procs else None
            for p in procs[1:]:
                row = self.rows.setdefault(p.name, {"state": "waiting", "peak_rss": 0})
                if row["state"] == "done":
                    continue
                w = _weights(_api_port(p)) or {}
                mem, hmem = _proc(p.popen.pid), _proc(host.popen.pid)
                if mem is None or hmem is None:
                    continue
                if w.get("state") == "fetching" or (w.get("state") == "done" and "start_cpu" not in row):
                    if "start_cpu" not in row:
                        row.update(start_cpu=mem[2], host_start_cpu=hmem[2], start_t=time.monotonic())
                    row["peak_rss"] = max(row["peak_rss"], mem[0])
                if w.get("state") == "done" and "start_cpu" in row:
                    row.update(state="done", peak_rss=max(row["peak_rss"], mem[0]), hwm=mem[1],
                               cpu_s=mem[2] - row["start_cpu"], host_cpu_s=hmem[2] - row["host_start_cpu"],
                               wall_s=time.monotonic() - row["start_t"])  # fmt: skip
            time.sleep(POLL_S)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        import platform

        return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b", help="a tests/big_gguf shape")
    ap.add_argument("--model", help="a model alias or GGUF path instead of --shape (e.g. smollm2-135m: quick)")
    ap.add_argument("--members", type=int, default=2, help="session size, host included")
    ap.add_argument("--backend", default="openvino")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="for the session to form")
    ap.add_argument("--quic-members", type=int, default=0, metavar="N",
                    help="the last N members fetch over the QUIC stream only (the other lane, side by side)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from bench._report import header
    from kafila.tooling.launch import LocalSession

    print(header(), flush=True)
    from tests.big_gguf import big_model, cache_dir

    if not 0 <= args.quic_members <= args.members - 1:
        ap.error(f"--quic-members: choose 0..{args.members - 1}")
    if args.model:
        from kafila.models import resolve_model

        model = resolve_model(args.model)
    else:
        model = big_model(args.shape)
    cache_dir().mkdir(parents=True, exist_ok=True)  # big_model makes it; --model does not
    caches = tempfile.mkdtemp(prefix="weights-transfer-", dir=cache_dir())  # a real disk, not tmpfs
    names = [f"m{i + 1}" for i in range(args.members)]
    quic = {n: "quic" for n in names[len(names) - args.quic_members:]} if args.quic_members else {}
    session = LocalSession(members=args.members, model=model, backend=args.backend, context=512, concurrency=1,
                           cache_root=caches, weights_lane=quic)  # fmt: skip
    sampler = Sampler(session)
    sampler.start()
    failed: list[BaseException] = []

    def start() -> None:
        try:
            session.start(timeout_s=args.timeout_s)
        except BaseException as exc:  # noqa: BLE001 (reported below unless we stopped it ourselves)
            failed.append(exc)

    starter = threading.Thread(target=start, daemon=True)
    rows = []
    try:
        starter.start()
        # the transfers are what is measured: stop as soon as every member has its weights
        # (not after the shard builds, which take minutes and gigabytes on the 8B shape)
        while starter.is_alive() and not (len(sampler.rows) == args.members - 1
                                          and all(r["state"] == "done" for r in sampler.rows.values())):
            time.sleep(0.2)
        if failed and not sampler.rows:
            raise failed[0]
        sampler.stop.set()
        sampler.join()
        for p in session.procs[1:]:
            w = _weights(_api_port(p)) or {}
            s = sampler.rows.get(p.name, {})
            mb = w.get("received_bytes", 0) / 1e6
            rows.append({"member": p.name, "lane": w.get("lane", "?"), "blocks": session.plan["blocks"][p.name] if session.plan else None,
                         "tensor_mb": w.get("tensor_bytes", 0) / 1e6, "received_mb": mb,
                         "seconds": w.get("seconds"), "mb_s": mb / max(w.get("seconds") or 1e-9, 1e-9),
                         "peak_rss_mb": s.get("peak_rss", 0) / 1e6, "hwm_mb": s.get("hwm", 0) / 1e6,
                         "member_cpu_s": s.get("cpu_s"), "host_cpu_s": s.get("host_cpu_s"),
                         "sampled_wall_s": s.get("wall_s")})  # fmt: skip
    finally:
        sampler.stop.set()
        session.stop()
        starter.join(timeout=30)
        shutil.rmtree(caches, ignore_errors=True)
    print(f"{args.model or args.shape} ({os.path.getsize(model) / 1e6:.1f} MB), {args.members} members, loopback, "
          f"CPU {_cpu_model()} ({os.cpu_count()} cores)")
    print("| member | lane | blocks | tensors MB | received MB | s | MB/s | peak RSS receiving MB | VmHWM at end MB "
          "| member CPU s | host CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = lambda v, d=1: "?" if v is None else f"{v:.{d}f}"  # noqa: E731
        print(f"| {r['member']} | {r['lane']} | {r['blocks']} | {f(r['tensor_mb'])} | {f(r['received_mb'])} | {f(r['seconds'])} "
              f"| {f(r['mb_s'])} | {f(r['peak_rss_mb'], 0)} | {f(r['hwm_mb'], 0)} | {f(r['member_cpu_s'])} "
              f"| {f(r['host_cpu_s'])} |")  # fmt: skip
    if args.json:
        print(json.dumps(rows))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
