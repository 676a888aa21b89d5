"""Start a whole session on this machine: a host (with its embedded rendezvous) and N−1 members,
each a separate `kafila` process on 127.0.0.1. Used by `kafila demo`, the session tests and
bench/session.py. Every process it starts is stopped by `stop()` (SIGINT, then SIGKILL), also
when starting fails; CPU-quota cgroups are removed after their process exits.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from backends import DEFAULT_KQUANT
from backends.errors import KafilaError, Refused
from kafila.tooling.throttle import CpuQuota

STOP_GRACE_S = 10.0


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n ports free for both TCP and UDP right now (the rendezvous uses both, plus port+1 UDP)."""
    out: list[int] = []
    while len(out) < n:
        p = free_port()
        try:
            for kind in (socket.SOCK_DGRAM,):
                with socket.socket(socket.AF_INET, kind) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        if p not in out:
            out.append(p)
    return out


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    events: queue.Queue = field(default_factory=queue.Queue)
    log_path: str = ""
    quota: CpuQuota | None = None
    api: str | None = None

    def stderr_tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def _pump(proc: Proc) -> None:
    for line in proc.popen.stdout:  # type: ignore[union-attr]
        line = line.strip()
        if line.startswith("{"):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                ev.setdefault("at_s", time.monotonic())  # when it was printed, for timings (bench/churn.py)
                proc.events.put(ev)
        elif line:
            proc.events.put({"event": "line", "text": line, "at_s": time.monotonic()})
    proc.events.put({"event": "exit"})


@dataclass
class LocalSession:
    members: int = 3
    model: str = "smollm2-135m"
    backend: str = "openvino"
    policy: str = "kafila"
    context: int | None = None  # None: the host's default (2048, or the model's own context if shorter)
    concurrency: int | str = "auto"  # kafila host --concurrency: N, or auto (as many as memory holds)
    max_queued: int | None = None  # kafila host --max-queued (None: its default)
    batch_rows: bool = True  # kafila host --batch-rows on|off
    dipsd: bool = True  # kafila host --dipsd on|off (passed only when off: older trees lack it)
    prompt_cache: bool = True  # kafila host --prompt-cache on|off (passed only when off)
    latency_ms: float = 0.0
    speculate: str = "off"  # kafila host --speculate: "off" | "ngram" | "draft" | "origin"
    precision: str = "serving"  # every stage's compute (kafila host --precision)
    kquant: str = DEFAULT_KQUANT  # every OpenVINO stage's K-quant form (kafila host --kquant)
    draft: str | None = None  # a draft model every member gets (--speculate draft: the head runs it)
    throttle: dict[str, float] = field(default_factory=dict)
    weights_lane: dict[str, str] = field(default_factory=dict)  # name → "quic": no TCP lane (--weights-lane)
    ring_lane: str = "auto"  # "quic": every member's ring frames over its QUIC edges (--ring-lane)
    cache_root: str = ""  # per-member weight caches live in cache_root/<name>
    log_dir: str = ""
    names: list[str] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    code: str | None = None
    plan: dict | None = None
    rendezvous_port: int = 0
    debug: bool = False
    auto_replan: bool = False  # kafila host --auto-replan: a late joiner (join()) is planned in at once
    # "embedded": the host's own rendezvous (--listen); "process": a `kafila rendezvous` process
    # every member (the host too) reaches with --rendezvous, which restart_rendezvous() can kill
    rendezvous: str = "embedded"
    rendezvous_proc: Proc | None = None

    def __post_init__(self) -> None:
        if not self.names:
            self.names = [f"m{i + 1}" for i in range(self.members)]
        unknown = set(self.throttle) - set(self.names)
        if unknown:
            from backends.errors import BadInput

            raise BadInput(f"--throttle names {sorted(unknown)} but the members are {', '.join(self.names)}")

    def _spawn(self, name: str, args: list[str], api_port: int) -> Proc:
        cmd = [sys.executable, "-m", "kafila"] + (["--debug"] if self.debug else []) + args + [
            "--name", name, "--bind", "127.0.0.1", "--api", f"127.0.0.1:{api_port}", "--json-events",
            "--backend", self.backend, "--cache-dir", os.path.join(self.cache_root, name),
        ]  # fmt: skip
        if self.latency_ms:
            cmd += ["--latency-ms", str(self.latency_ms)]
        if self.draft:
            cmd += ["--draft", self.draft]
        if name in self.weights_lane:
            cmd += ["--weights-lane", self.weights_lane[name]]
        if self.ring_lane != "auto":
            cmd += ["--ring-lane", self.ring_lane]
        quota = CpuQuota.create(name, self.throttle[name]) if name in self.throttle else None
        log_path = os.path.join(self.log_dir, f"{name}.log")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        join_quota = quota.preexec() if quota else None

        def preexec() -> None:
            _die_with_parent()
            if join_quota is not None:
                join_quota()

        with open(log_path, "w") as err:
            popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                     text=True, env=env, start_new_session=True, preexec_fn=preexec)  # fmt: skip
        proc = Proc(name, popen, log_path=log_path, quota=quota)
        threading.Thread(target=_pump, args=(proc,), daemon=True).start()
        self.procs.append(proc)
        return proc

    def _wait(self, proc: Proc, kind: str, deadline: float, forming: bool = False) -> dict:
        """`proc`'s next `kind` event. `forming`: every process started is still forming the
        session, so any of them exiting ends the wait (the host waits for all its members; a
        member that died, in its probe say, would leave it waiting until the deadline)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Refused(f"{proc.name} did not reach '{kind}' in time; its log ends:\n{proc.stderr_tail()}")
            try:
                ev = proc.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                gone = next((p for p in self.procs if forming and p is not proc and p.popen.poll() is not None), None)
                if gone is not None:
                    raise Refused(f"{gone.name} exited with {gone.popen.returncode} while the session formed; "
                                  f"its log ends:\n{gone.stderr_tail()}")  # fmt: skip
                continue
            if ev.get("event") == "plan":
                self.plan = ev.get("plan")
            if ev.get("event") == kind:
                return ev
            if ev.get("event") == "exit":
                code = proc.popen.wait()
                raise Refused(f"{proc.name} exited with {code} before '{kind}'; its log ends:\n{proc.stderr_tail()}")

    def start(self, timeout_s: float = 300.0) -> LocalSession:
        """Start everything and wait until every member serves; stop all on any failure."""
        import tempfile

        if not self.log_dir:
            self.log_dir = tempfile.mkdtemp(prefix="kafila-session-logs-")
        if not self.cache_root:
            self.cache_root = tempfile.mkdtemp(prefix="kafila-session-cache-")
        deadline = time.monotonic() + timeout_s
        try:
            ports = free_ports(len(self.names) + 1)
            self.rendezvous_port = ports[0]
            where = ["--listen", f"127.0.0.1:{self.rendezvous_port}"]
            if self.rendezvous == "process":
                self.start_rendezvous(deadline)
                where = ["--rendezvous", f"127.0.0.1:{self.rendezvous_port}"]
            host = self._spawn(self.names[0], [
                "host", "--model", self.model, "--expect", str(len(self.names)), *where, "--policy", self.policy,
                *(["--context", str(self.context)] if self.context is not None else []),
                "--concurrency", str(self.concurrency),
                *(["--max-queued", str(self.max_queued)] if self.max_queued is not None else []),
                "--batch-rows", "on" if self.batch_rows else "off",
                *(["--dipsd", "off"] if not self.dipsd else []),
                *(["--prompt-cache", "off"] if not self.prompt_cache else []),
                "--speculate", self.speculate, "--precision", self.precision, "--kquant", self.kquant,
                *(["--auto-replan"] if self.auto_replan else []),
            ], ports[1])  # fmt: skip
            self.code = self._wait(host, "code", deadline)["code"]
            for name, port in zip(self.names[1:], ports[2:]):
                self._spawn(name, ["join", self.code, "--rendezvous", f"127.0.0.1:{self.rendezvous_port}"], port)
            for proc in self.procs:
                proc.api = self._wait(proc, "serving", deadline, forming=True)["api"]
        except BaseException:
            self.stop()
            raise
        return self

    def start_rendezvous(self, deadline: float) -> Proc:
        """A `kafila rendezvous` process on rendezvous_port (rendezvous="process")."""
        cmd = [sys.executable, "-m", "kafila", "rendezvous", "--listen", f"127.0.0.1:{self.rendezvous_port}"]
        log_path = os.path.join(self.log_dir, "rendezvous.log")
        with open(log_path, "a") as err:
            popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                     start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
        proc = Proc("rendezvous", popen, log_path=log_path)
        threading.Thread(target=_pump, args=(proc,), daemon=True).start()
        self.rendezvous_proc = proc
        while True:  # it prints one line once it listens
            ev = proc.events.get(timeout=max(0.1, deadline - time.monotonic()))
            if ev.get("event") == "line" and "listening" in ev.get("text", ""):
                return proc
            if ev.get("event") == "exit":
                raise Refused(f"the rendezvous exited with {popen.wait()}: {proc.stderr_tail()}")

    def restart_rendezvous(self, down_s: float = 1.0, sig: int = signal.SIGKILL) -> None:
        """Stop the rendezvous process (SIGKILL: a crash), wait down_s, start a new one on the
        same port: it knows nothing of the session."""
        assert self.rendezvous_proc is not None, "rendezvous='process' only"
        with_suppress(os.killpg, self.rendezvous_proc.popen.pid, sig)
        self.rendezvous_proc.popen.wait(timeout=STOP_GRACE_S)
        time.sleep(down_s)
        self.start_rendezvous(time.monotonic() + 30)

    def join(self, name: str) -> Proc:
        """Start one more member that joins the running session (a late joiner)."""
        port = free_ports(1)[0]
        self.names.append(name)
        return self._spawn(name, ["join", self.code, "--rendezvous", f"127.0.0.1:{self.rendezvous_port}"], port)

    def signal(self, name: str, sig: int = signal.SIGINT) -> None:
        """Send `sig` to one member (SIGINT: it leaves gracefully) and wait for it to exit."""
        p = self.proc(name)
        with_suppress(os.killpg, p.popen.pid, sig)
        p.popen.wait(timeout=STOP_GRACE_S)

    def api(self, name: str) -> str:
        return next(p.api for p in self.procs if p.name == name)

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL one member (a machine that vanished)."""
        p = self.proc(name)
        with_suppress(os.killpg, p.popen.pid, signal.SIGKILL)
        p.popen.wait()

    def stop(self) -> dict[str, int]:
        """SIGINT everyone (members first), wait, SIGKILL stragglers; returns exit codes."""
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                with_suppress(os.killpg, p.popen.pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_GRACE_S
        codes = {}
        for p in self.procs:
            try:
                codes[p.name] = p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with_suppress(os.killpg, p.popen.pid, signal.SIGKILL)
                codes[p.name] = p.popen.wait()
            if p.quota is not None:
                p.quota.remove()
        if self.rendezvous_proc is not None and self.rendezvous_proc.popen.poll() is None:
            with_suppress(os.killpg, self.rendezvous_proc.popen.pid, signal.SIGINT)
            try:
                self.rendezvous_proc.popen.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with_suppress(os.killpg, self.rendezvous_proc.popen.pid, signal.SIGKILL)
        return codes

    def __enter__(self) -> LocalSession:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM (and leaves its session cleanly) if the launcher dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def with_suppress(fn, *args) -> None:
    try:
        fn(*args)
    except (ProcessLookupError, PermissionError, OSError):
        pass


__all__ = ["KafilaError", "LocalSession", "free_port", "free_ports"]


def stream_chat(api: str, prompt: str | list[dict], max_tokens: int, timeout_s: float = 300.0, raw: bool = False,
                extra: dict | None = None) -> dict:  # fmt: skip
    """One streamed chat completion (or a raw completion) from `api`, timed at the client;
    `prompt`: the user's message, or a conversation's messages; `extra`: more fields of the
    request body (e.g. {"speculate": False}).

    Returns {"text", "tokens", "prompt_tokens", "cached_tokens", "ttft_ms", "tok_s", "wall_s",
    "finish_reason", "speculation", "max_gap_s" (the longest wait between two pieces),
    "started_s", "last_s" (perf_counter)}; raises Refused with the server's error message on an
    HTTP error."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(api)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    model = json.loads(_get(conn, "/v1/models"))["data"][0]["id"]
    if raw:
        path, body = "/v1/completions", {"prompt": prompt}
    else:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        path, body = "/v1/chat/completions", {"messages": messages}
    body.update(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, **(extra or {}))
    start = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        data = resp.read().decode(errors="replace")
        try:
            message = json.loads(data)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = data[:300]
        raise Refused(f"the session answered HTTP {resp.status}: {message}")
    text, first, last, tokens, finish = [], None, None, None, None
    max_gap = 0.0  # the longest wait between two pieces of the answer (a resume shows here)
    times: list[float] = []  # perf_counter of every piece after the first
    speculation = prompt_tokens = cached = None
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise Refused(f"the session failed mid-answer: {chunk['error'].get('message')}")
        if chunk.get("usage"):
            tokens = chunk["usage"].get("completion_tokens")
            speculation = chunk["usage"].get("speculation")
            prompt_tokens = chunk["usage"].get("prompt_tokens")
            cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if not raw else choice.get("text")
            if piece:
                now = time.perf_counter()
                if last is not None:
                    max_gap = max(max_gap, now - last)
                times.append(now)
                first = first or now
                last = now
                text.append(piece)
            finish = choice.get("finish_reason") or finish
    conn.close()
    ttft = None if first is None else (first - start) * 1000
    tok_s = None
    if tokens and tokens > 1 and first is not None and last > first:
        tok_s = (tokens - 1) / (last - first)
    return {"text": "".join(text), "tokens": tokens, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "ttft_ms": ttft, "tok_s": tok_s, "finish_reason": finish,
            "speculation": speculation, "wall_s": None if last is None else last - start,
            "max_gap_s": max_gap, "started_s": start, "last_s": last, "times": times}


def _get(conn, path: str) -> bytes:
    conn.request("GET", path)
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise Refused(f"GET {path} answered HTTP {resp.status}")
    return data


def get_json(api: str, path: str, timeout_s: float = 10.0) -> dict:
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(api)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        return json.loads(_get(conn, path))
    finally:
        conn.close()
