"""`--throttle NAME=FRACTION`: run one process under a cgroup (v1) CPU quota, a slower device.

FRACTION is the share of one CPU's time the process may use (0.25: a quarter of a core, as
bench/probe_throttle.py). The period is short (10 ms) so that the slowdown is smooth: with the
usual 100 ms period a 25 ms measurement or a 5 ms stage can run at full speed inside one
period's quota, and a device would look fast to the probe and then stall. The cgroup is created
under /sys/fs/cgroup/cpu with a unique name, the child joins it before it execs (so even its
first probe runs slowed), and the cgroup is removed when the throttled process has exited.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

from backends.errors import BadInput, Refused

CGROUP_CPU_ROOT = "/sys/fs/cgroup/cpu"
CFS_PERIOD_US = 10_000
MIN_FRACTION = 0.01


def parse_throttle(text: str) -> tuple[str, float]:
    """`m2=0.25` → ("m2", 0.25)."""
    name, sep, value = text.partition("=")
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not sep or not name or not MIN_FRACTION <= fraction <= 1.0:
        raise BadInput(f"bad --throttle {text!r}: use NAME=FRACTION with FRACTION in {MIN_FRACTION}..1, e.g. m2=0.25")
    return name, fraction


@dataclass
class CpuQuota:
    path: str
    fraction: float

    @classmethod
    def create(cls, label: str, fraction: float, root: str = CGROUP_CPU_ROOT) -> CpuQuota:
        if not os.path.isdir(root) or not os.path.exists(os.path.join(root, "cpu.cfs_quota_us")):
            raise Refused(f"--throttle needs the cgroup v1 cpu controller at {root}, which this machine lacks")
        path = os.path.join(root, f"kafila-{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(path)
            quota_us = max(1000, int(fraction * CFS_PERIOD_US))  # the kernel's minimum is 1 ms
            with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                f.write(str(CFS_PERIOD_US))
            with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(quota_us))
        except OSError as exc:
            _rmdir(path)
            raise Refused(f"cannot create a CPU quota cgroup at {path}: {exc.strerror} (run as root)") from None
        return cls(path, fraction)

    def preexec(self):
        """For subprocess.Popen(preexec_fn=...): the child joins the cgroup before exec."""
        procs = os.path.join(self.path, "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return join

    def add(self, pid: int) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def remove(self, timeout_s: float = 5.0) -> None:
        """Remove the cgroup (its processes must have exited; waits a little for the kernel)."""
        deadline = time.monotonic() + timeout_s
        while os.path.isdir(self.path):
            if _rmdir(self.path) or time.monotonic() > deadline:
                return
            time.sleep(0.05)


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
