"""The CPUs a process may use (engine/cpus.py): cgroup v2's and v1's quota against the affinity mask, from fake
cgroup files."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from engine import cpus


def _v2(root, cpu_max: str, path: str = "/", own: str | None = None):
    """A cgroup v2 tree whose root holds `cpu_max`, and the process's own cgroup `path` (its cpu.max `own`)."""
    (root / "cpu.max").write_text(cpu_max + "\n")
    folder = root / path.strip("/")
    folder.mkdir(parents=True, exist_ok=True)
    if own is not None:
        (folder / "cpu.max").write_text(own + "\n")
    proc = root / "proc-cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


@pytest.mark.parametrize(
    "cpu_max, own, affinity, want",
    [
        ("max 100000", None, 64, 64),  # no quota: the mask
        ("200000 100000", None, 64, 2),  # a 2-vCPU container on a 64-core host
        ("150000 100000", None, 64, 2),  # 1.5 CPUs: rounded up
        ("50000 100000", None, 64, 1),  # half a CPU: at least one
        ("800000 100000", None, 4, 4),  # a quota above the mask: the mask
        ("max 100000", "300000 100000", 64, 3),  # the quota on the process's own cgroup
        ("200000 100000", "800000 100000", 64, 2),  # the tightest of the cgroup and those above it
    ],
)
def test_cgroup_v2_quota_against_the_affinity_mask(monkeypatch, tmp_path, cpu_max, own, affinity, want):
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    root, proc = _v2(tmp_path, cpu_max, "/user.slice/app.scope", own)
    assert cpus.usable_cpus(root, proc) == want


@pytest.mark.parametrize(
    "quota, period, want",
    [("-1", "100000", 16), ("400000", "100000", 4), ("250000", "100000", 3), ("1000", "100000", 1)],
)
def test_cgroup_v1_quota_against_the_affinity_mask(monkeypatch, tmp_path, quota, period, want):
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(16)))
    folder = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text(quota + "\n")
    (folder / "cpu.cfs_period_us").write_text(period + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cpus.usable_cpus(tmp_path, proc) == want


def test_no_cgroup_files_leave_the_affinity_mask(monkeypatch, tmp_path):
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert cpus.usable_cpus(tmp_path / "none", tmp_path / "none" / "cgroup") == 3


def test_fit_threads_sets_omp_and_narrows_the_mask_to_the_quota(monkeypatch, tmp_path):
    environ, narrowed = {}, []
    monkeypatch.setattr(cpus.os, "environ", environ)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(cpus.os, "sched_setaffinity", lambda pid, mask: narrowed.append(list(mask)))
    root, proc = _v2(tmp_path, "200000 100000")
    assert cpus.fit_threads(root, proc) == 2
    assert environ == {"OMP_NUM_THREADS": "2"} and narrowed == [[0, 1]]

    environ["OMP_NUM_THREADS"] = "1"  # the user's own choice stays
    narrowed.clear()
    (root / "cpu.max").write_text("max 100000\n")
    assert cpus.fit_threads(root, proc) == 8
    assert environ == {"OMP_NUM_THREADS": "1"} and narrowed == []  # no quota: the mask as it is


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_work_nobody_waits_for_runs_at_the_lowest_priority_and_its_threads_inherit_it():
    """The warm-up's programs after Ready compile on threads of nice 19, and so do the threads they start (XLA's
    compile threads): a request drawing meanwhile keeps the cores. The caller's priority is left as it was."""
    mine, seen = _niceness(), {}

    def idle():
        cpus.run_when_idle()
        seen["idle"] = _niceness()
        child = threading.Thread(target=lambda: seen.setdefault("its child", _niceness()))
        child.start()
        child.join()

    thread = threading.Thread(target=idle)
    thread.start()
    thread.join()
    assert seen == {"idle": cpus.IDLE_NICENESS, "its child": cpus.IDLE_NICENESS}
    assert _niceness() == mine


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_programs_asked_for_compile_at_the_process_s_priority_and_background_ones_at_the_lowest():
    from engine.serving.programs import Programs

    programs = Programs(graphdef=None, params=None, batch=None, replicated=None, example=None)
    priorities = {}
    programs._add = lambda plan, width: priorities.setdefault(plan, _niceness())  # in place of the compile
    try:
        programs.request("a plan a request waits for", 1).result()
        programs.request("the warm-up's after Ready", 1, background=True).result()
    finally:
        programs.shutdown()
    assert priorities == {"a plan a request waits for": _niceness(), "the warm-up's after Ready": cpus.IDLE_NICENESS}
