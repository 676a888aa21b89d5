"""Build NAT topologies out of Linux network namespaces, run processes in them, tear them down.

Theory of operation
-------------------
One lab = one "internet" namespace holding a bridge `br0` with the rendezvous address
(100.64.0.1/16, and 100.64.0.2 for a rendezvous that tests filtering by address), plus, per member, either

* a router namespace (WAN `wan` on the bridge at 100.64.1.N/16, LAN `lan` at 10.N.0.1/24, NAT
  rules from `nat.py`) and a member namespace (`eth0` at 10.N.0.2/24, default route via the
  router), or
* a public member namespace (`eth0` on the bridge at 100.64.2.N/16, no NAT).

Several members may share one router's LAN (a bridge `lanbr` inside the router namespace).
Nothing in the lab is linked to the host's own namespace: every veth pair joins two lab
namespaces, so no packet can leave the lab whatever a member sends. Namespace names carry the
creating process id (`knl<pid>x<lab>-<role><n>`): names are unique per run, and a later run deletes
namespaces whose creator is gone (`reap_stale`). `Lab.close()` kills every process the lab
started and deletes its namespaces; it runs on `with` exit, on garbage collection and at exit.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from natlab_tests import nat

NS_PREFIX = "knl"
RENDEZVOUS_IP = "100.64.0.1"
RENDEZVOUS_ALT_IP = "100.64.0.2"  # a second rendezvous address, for RFC 5780 address tests
INTERNET_PREFIX_LEN = 16
CMD_TIMEOUT_S = 20.0
REPO_ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "driver.py"

_lab_ids = itertools.count(1)


class LabError(RuntimeError):
    """A lab command failed (the command and its stderr are in the message)."""


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    if sys.platform != "linux":
        return "the NAT lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces, veth, nftables)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"the NAT lab needs `{tool}` (install iproute2 and nftables)"
    probe = f"{NS_PREFIX}{os.getpid()}probe"
    made = subprocess.run(
        ["ip", "netns", "add", probe], check=False, capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        rules = subprocess.run(
            ["ip", "netns", "exec", probe, "nft", "-f", "-"],
            check=False,
            input="table ip t {\n chain c {\n  type nat hook postrouting priority 100\n  masquerade\n }\n}\n",
            capture_output=True,
            text=True,
        )
        if rules.returncode != 0:
            return f"nftables NAT does not work in a namespace: {rules.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _sh(argv: Sequence[str], stdin: str | None = None) -> str:
    done = subprocess.run(
        list(argv), check=False, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT_S
    )
    if done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _netns_list() -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], check=False, capture_output=True, text=True
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def reap_stale() -> list[str]:
    """Delete lab namespaces left behind by lab processes that no longer exist."""
    reaped = []
    for ns in _netns_list():
        if not ns.startswith(NS_PREFIX):
            continue
        pid = "".join(itertools.takewhile(str.isdigit, ns[len(NS_PREFIX) :]))
        if pid and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
            reaped.append(ns)
    return reaped


def lab_namespaces() -> list[str]:
    """Lab namespaces of this process (for checks that teardown left nothing)."""
    mine = f"{NS_PREFIX}{os.getpid()}x"
    return [ns for ns in _netns_list() if ns.startswith(mine)]


@dataclass(frozen=True)
class Router:
    """A NAT router: namespace, public (WAN) address, LAN prefix."""

    ns: str
    kind: str
    wan_ip: str
    lan_net: int  # the N of 10.N.0.0/24

    def nft(self, *args: str) -> str:
        return _sh(["ip", "netns", "exec", self.ns, "nft", *args])

    def counter(self, name: str) -> int:
        """Packets counted by one of the router's named nft counters (see nat.py)."""
        out = json.loads(self.nft("-j", "list", "counter", "ip", "natlab", name))
        for item in out["nftables"]:
            if "counter" in item:
                return int(item["counter"]["packets"])
        raise LabError(f"no counter {name} in {self.ns}")


@dataclass(frozen=True)
class Node:
    """A member's namespace and address, and the router it sits behind (None when public)."""

    name: str
    ns: str
    kind: str
    ip: str
    router: Router | None

    @property
    def public_ip(self) -> str:
        return self.router.wan_ip if self.router else self.ip


@dataclass
class Proc:
    """A process inside a namespace that speaks JSON lines on stdin/stdout."""

    argv: list[str]
    popen: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)
    stderr_tail: list[str] = field(default_factory=list)
    answers: dict = field(default_factory=dict)  # id -> answer read while waiting for another
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _pump_err(self) -> None:
        for line in self.popen.stderr:
            self.stderr_tail.append(line)
            del self.stderr_tail[:-40]

    def read_line(self, timeout_s: float) -> str:
        """The next stdout line, whatever it holds."""
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise LabError(f"no output from {self.argv[-4:]} within {timeout_s} s") from None
        if line is None:
            raise LabError(f"{self.argv[-4:]} exited; stderr: {self.stderr()}")
        return line

    def read_json(self, timeout_s: float) -> dict:
        """The next JSON object the process prints (other stdout lines are skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise LabError(
                    f"no JSON from {self.argv[-4:]} within {timeout_s} s; stderr: {self.stderr()}"
                ) from None
            if line is None:
                self.popen.wait(timeout=5)
                raise LabError(
                    f"{self.argv[-4:]} exited {self.popen.returncode} before printing JSON; "
                    f"stderr: {self.stderr()}"
                )
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def submit(self, op: str, **fields: object) -> int:
        """Send one command {"id", "op", ...}; collect its answer with result(id)."""
        cmd_id = next(self.ids)
        self.send_json({"id": cmd_id, "op": op, **fields})
        return cmd_id

    def result(self, cmd_id: int, timeout_s: float) -> dict:
        """The answer carrying `cmd_id` (answers to other commands are kept for later)."""
        deadline = time.monotonic() + timeout_s
        while cmd_id not in self.answers:
            got = self.read_json(max(deadline - time.monotonic(), 0.001))
            self.answers[got.get("id")] = got
        return self.answers.pop(cmd_id)

    def request(self, op: str, timeout_s: float = 60.0, **fields: object) -> dict:
        return self.result(self.submit(op, **fields), timeout_s)

    def send_json(self, obj: dict) -> None:
        self.popen.stdin.write(json.dumps(obj) + "\n")
        self.popen.stdin.flush()

    def stderr(self) -> str:
        return "".join(self.stderr_tail)[-3000:]

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class Lab:
    """One lab: an internet namespace plus routers and members added on demand."""

    def __init__(self) -> None:
        self.id = f"{NS_PREFIX}{os.getpid()}x{next(_lab_ids)}"
        self.inet_ns = f"{self.id}-inet"
        self.rendezvous_ip = RENDEZVOUS_IP
        self.rendezvous_alt_ip = RENDEZVOUS_ALT_IP
        self._namespaces: list[str] = []
        self._procs: list[Proc] = []
        self._routers = itertools.count(1)
        self._publics = itertools.count(10)
        self._ports = itertools.count(1)
        self._closed = False
        self._finalizer = weakref.finalize(self, _teardown, self._namespaces, self._procs)
        atexit.register(self._finalizer)
        try:
            self._ns(self.inet_ns)
            self._ip(self.inet_ns, "link add br0 type bridge")
            self._ip(self.inet_ns, f"addr add {RENDEZVOUS_IP}/{INTERNET_PREFIX_LEN} dev br0")
            self._ip(self.inet_ns, f"addr add {RENDEZVOUS_ALT_IP}/{INTERNET_PREFIX_LEN} dev br0")
            self._ip(self.inet_ns, "link set br0 up")
        except BaseException:
            self.close()
            raise

    # -- building ---------------------------------------------------------------------------
    def _ns(self, name: str) -> None:
        _sh(["ip", "netns", "add", name])
        self._namespaces.append(name)
        self._ip(name, "link set lo up")

    def _ip(self, ns: str, command: str) -> None:
        _sh(["ip", "-n", ns, *command.split()])

    def _sysctl(self, ns: str, key: str, value: str) -> None:
        _sh(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"])

    def _wire_to_internet(self, ns: str, ifname: str, address: str, gateway: str | None) -> None:
        port = f"p{next(self._ports)}"
        self._ip(ns, f"link add {ifname} type veth peer name {port} netns {self.inet_ns}")
        self._ip(self.inet_ns, f"link set {port} master br0")
        self._ip(self.inet_ns, f"link set {port} up")
        self._ip(ns, f"addr add {address}/{INTERNET_PREFIX_LEN} dev {ifname}")
        self._ip(ns, f"link set {ifname} up")
        if gateway:
            self._ip(ns, f"route add default via {gateway}")

    def add_router(self, kind: str) -> Router:
        """A NAT router of `kind` (see nat.NAT_KINDS) with an empty LAN."""
        if kind not in nat.NAT_KINDS:
            raise ValueError(f"unknown NAT kind {kind!r}")
        n = next(self._routers)
        if n > 250:
            raise LabError("at most 250 routers per lab")
        router = Router(ns=f"{self.id}-r{n}", kind=kind, wan_ip=f"100.64.1.{n}", lan_net=n)
        self._ns(router.ns)
        self._sysctl(router.ns, "net.ipv4.ip_forward", "1")
        self._wire_to_internet(router.ns, "wan", router.wan_ip, RENDEZVOUS_IP)
        self._ip(router.ns, "link add lanbr type bridge")
        self._ip(router.ns, f"addr add 10.{n}.0.1/24 dev lanbr")
        self._ip(router.ns, "link set lanbr up")
        rules = nat.ruleset(kind, f"10.{n}.0.2")
        _sh(["ip", "netns", "exec", router.ns, "nft", "-f", "-"], stdin=rules)
        return router

    def add_member(self, kind: str, router: Router | None = None, name: str = "") -> Node:
        """A member behind a new router of `kind`, behind `router` (shared LAN), or public."""
        if kind == nat.PUBLIC:
            n = next(self._publics)
            ns = f"{self.id}-p{n}"
            self._ns(ns)
            ip = f"100.64.2.{n}"
            self._wire_to_internet(ns, "eth0", ip, RENDEZVOUS_IP)
            return Node(name or f"p{n}", ns, kind, ip, None)
        if router is None:
            router = self.add_router(kind)
        elif router.kind != kind:
            raise ValueError(f"router {router.ns} is {router.kind}, not {kind}")
        members = sum(1 for ns in self._namespaces if ns.startswith(f"{router.ns}m"))
        host = 2 + members
        ns = f"{router.ns}m{host}"
        self._ns(ns)
        port = f"l{host}"
        self._ip(ns, f"link add eth0 type veth peer name {port} netns {router.ns}")
        self._ip(router.ns, f"link set {port} master lanbr")
        self._ip(router.ns, f"link set {port} up")
        ip = f"10.{router.lan_net}.0.{host}"
        self._ip(ns, f"addr add {ip}/24 dev eth0")
        self._ip(ns, "link set eth0 up")
        self._ip(ns, f"route add default via 10.{router.lan_net}.0.1")
        return Node(name or f"m{router.lan_net}.{host}", ns, kind, ip, router)

    # -- running ----------------------------------------------------------------------------
    def spawn(self, ns: str | Node, argv: Sequence[str], env: dict | None = None) -> Proc:
        """Start `argv` inside a namespace (its own process group; killed on close)."""
        ns_name = ns.ns if isinstance(ns, Node) else ns
        full = ["ip", "netns", "exec", ns_name, *argv]
        run_env = dict(os.environ)
        run_env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + run_env.get("PYTHONPATH", "")
        run_env["PYTHONUNBUFFERED"] = "1"
        run_env.update(env or {})
        popen = subprocess.Popen(
            full,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=run_env,
            start_new_session=True,
        )
        proc = Proc(full, popen)
        self._procs.append(proc)
        return proc

    def driver(self, ns: str | Node, *args: str) -> Proc:
        """Run `python natlab_tests/driver.py ARGS` inside a namespace."""
        return self.spawn(ns, [sys.executable, str(DRIVER), *args])

    def run(self, ns: str | Node, argv: Sequence[str]) -> str:
        ns_name = ns.ns if isinstance(ns, Node) else ns
        return _sh(["ip", "netns", "exec", ns_name, *argv])

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _teardown(namespaces: list[str], procs: list[Proc]) -> None:
    for proc in procs:
        proc.kill()
    procs.clear()
    for ns in reversed(namespaces):
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
    namespaces.clear()
