"""One stage computes at a time on a machine that runs several members' stages.

Why. Members of one ring on one machine (`kafila demo`'s three, or network namespaces of one
host) each ask the CPU plugin for every core. With several requests in flight their stages
compute at the same time, and the plugins' worker threads then contend for the same cores: a
parallel step whose threads are descheduled in turn waits at each barrier for the slowest, so
two overlapping steps take much longer than the two one after the other (issue 13: in a 3-member
loopback session with 8 users, a row's compute cost about three times what one process alone
measures). The head already plans micro-batches as if such a machine computes one stage at a
time (HeadCore.pipeline_depth); this lock makes it so, across processes.

How. An advisory lock (flock) on a file named after the machine id and the user, taken by the
stage's compute thread around each forward and the head's token pick and released right after:
the kernel drops it when a process dies, so a crashed member never holds it. Members on other
machines take no lock. KAFILA_CORE_LOCK=0 in the environment turns it off (benchmarks compare
both).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
import time

log = logging.getLogger(__name__)
# A stage waits this long at most for other members' compute before its watchdog counts the wait
# (a member whose compute hangs keeps the lock: sessions beside it must not wait for ever)
MAX_WAIT_S = 1800.0


class CoreLock:
    """The machine's compute lock: `with lock:` runs the block while no other member of this
    machine computes. Reentrant within one thread is not needed: one compute thread a member."""

    def __init__(self, machine: str, directory: str | None = None) -> None:
        safe = "".join(c for c in machine if c.isalnum())[:32] or "machine"
        self.path = os.path.join(directory or tempfile.gettempdir(), f"kafila-cores-{os.getuid()}-{safe}.lock")
        self._fd: int | None = None
        self._wait_from: float | None = None  # monotonic time the compute thread began to wait
        self._waited = 0.0  # what the step holding the lock now waited for it

    @property
    def waiting(self) -> bool:
        """Whether the compute thread is waiting for another member's step now."""
        return self._wait_from is not None

    def wait_s(self) -> float:
        """Seconds the current step has waited for other members' compute (so far, or before it
        took the lock): the stage's hang watchdog does not count them (that member's own
        watchdog watches its step)."""
        start = self._wait_from
        return time.monotonic() - start if start is not None else self._waited

    def __enter__(self) -> CoreLock:
        if self._fd is None:
            self._fd = _own_file(self.path)
        if self._fd < 0:  # the path is not this user's file: no lock (never wait on a stranger's)
            return self
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._wait_from = time.monotonic()
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            finally:
                self._waited, self._wait_from = time.monotonic() - self._wait_from, None
        return self

    def __exit__(self, *exc) -> None:
        self._waited = 0.0
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)
        self._fd = None


def _own_file(path: str) -> int:
    """An fd of the lock file at `path` when it is a regular file of this user's (made if
    absent), else -1: in a shared temporary directory another user could have put a file or a
    link there, and holding its lock would stall this member's compute."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        log.warning("no compute lock (%s: %s): this machine's members compute side by side", path, exc)
        return -1
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        log.warning("no compute lock: %s is not this user's file; this machine's members compute side by side", path)
        return -1
    return fd


class NoLock(contextlib.nullcontext):
    """A member alone on its machine: nothing to take."""

    waiting = False

    def wait_s(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


def core_lock(me: str, machines: dict[str, str] | None) -> CoreLock | NoLock:
    """The lock for member `me`'s compute: a CoreLock when another ring member runs on the same
    machine (`machines`: ring member → machine id), else a NoLock."""
    if not machines or os.environ.get("KAFILA_CORE_LOCK", "1") == "0":
        return NoLock()
    mine = machines.get(me, me)
    if not any(m == mine for n, m in machines.items() if n != me):
        return NoLock()
    return CoreLock(mine)
