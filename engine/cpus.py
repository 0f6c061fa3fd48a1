"""How many CPUs this process may use: the smaller of its cgroup's CPU quota and its affinity mask.

A container's quota is not its affinity: a Space or CPU job with 2 vCPUs on a 64-core host (AMD EPYC 7R13) sees
64 CPUs in `os.cpu_count()` and in its affinity mask, and a thread pool sized from either runs 64 threads in 2
CPUs' time, stalled by the scheduler's throttling at every period. The quota is cgroup v2's `cpu.max` ("max 100000"
or "200000 100000": quota and period in microseconds) or cgroup v1's `cpu.cfs_quota_us` (-1: none) over
`cpu.cfs_period_us`, in the process's own cgroup or any above it; the tightest one holds.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
V1_CPU_DIRS = ("cpu,cpuacct", "cpu", "cpuacct,cpu")  # where cgroup v1 mounts its cpu controller


def _ancestors(base: Path, relative: str) -> list[Path]:
    """base/relative and each folder above it up to base (a container's cgroup namespace shows its own root as
    base, whatever /proc/self/cgroup names)."""
    parts = [p for p in relative.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroups in CPUs (1.5 for "150000 100000"); None where there is none."""
    v2_path, v1_path = "/", "/"
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    quotas = []
    for folder in _ancestors(cgroup_root, v2_path):
        fields = (_read(folder / "cpu.max") or "").split()
        if len(fields) == 2 and fields[0] != "max" and float(fields[1]) > 0:
            quotas.append(float(fields[0]) / float(fields[1]))
    for name in V1_CPU_DIRS:
        for folder in _ancestors(cgroup_root / name, v1_path):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            if quota and period and float(quota) > 0 and float(period) > 0:
                quotas.append(float(quota) / float(period))
    return min(quotas) if quotas else None


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The CPUs this process may keep busy: its cgroup quota rounded up (at least 1), or its affinity mask's size,
    whichever is smaller. Size thread pools from this, not `os.cpu_count()`."""
    affinity = len(os.sched_getaffinity(0))
    quota = cgroup_quota(cgroup_root, proc_cgroup)
    return affinity if quota is None else max(1, min(affinity, math.ceil(quota)))


def fit_threads(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """Sizes this process's thread pools to `usable_cpus()`, before JAX and oneDNN start them; returns that count.
    oneDNN's OpenMP threads: OMP_NUM_THREADS, where not set already. XLA's CPU pool is as large as the affinity
    mask (it takes no count of threads), so a mask larger than the quota is narrowed to its first CPUs."""
    count = usable_cpus(cgroup_root, proc_cgroup)
    os.environ.setdefault("OMP_NUM_THREADS", str(count))
    mask = sorted(os.sched_getaffinity(0))
    if count < len(mask):
        os.sched_setaffinity(0, mask[:count])
    return count


IDLE_NICENESS = 19  # Linux's lowest priority: such a thread runs on what the others leave


def run_when_idle() -> None:
    """Lowers the calling thread to the lowest priority (nice 19), and the threads it starts after, which inherit
    it: work nobody is waiting for (the warm-up's programs after Ready) then takes what a request drawing meanwhile
    leaves of the cores, instead of half of them. Where the system refuses, nothing changes."""
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IDLE_NICENESS)
    except (OSError, AttributeError):  # not Linux, or not allowed: the thread keeps its priority
        pass
