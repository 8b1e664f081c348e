"""Tests for tasks/rewards/cgroups.py's CPU cap: each run's cgroup gets cpu.max (v2) or cpu.cfs_quota_us (v1)
from Limits.cpus, clamped under a v1 ancestor's quota; the sandbox's log of caps says whether it is in force.
The files are checked in a stand-in hierarchy under tmp_path, and in this machine's where one is writable."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpoflow.tasks.rewards import cgroups, sandbox

CAPS = sandbox.cgroup_caps(sandbox.Limits(cpus=1.5))


def _fake(tmp_path: Path, version: int, cpu: bool = True) -> cgroups.Hierarchy:
    names = ("sandbox",) if version == 2 else ("memory", "pids", "cpu") if cpu else ("memory", "pids")
    parents = tuple(tmp_path / n for n in names)
    for p in parents:
        p.mkdir(parents=True)
    return cgroups.Hierarchy(version, parents, cpu=cpu)


def test_cpus_is_the_quota_per_period() -> None:
    assert CAPS[2] == 150_000 and cgroups.CPU_PERIOD_US == 100_000
    assert sandbox.cgroup_caps(sandbox.Limits(cpus=0.001))[2] == 1000  # the kernel's least quota


def test_v2_run_cgroup_gets_cpu_max(tmp_path: Path) -> None:
    group = cgroups.RunCgroup(_fake(tmp_path, 2), *CAPS)
    assert (group.dirs[0] / "cpu.max").read_text() == "150000 100000"
    assert (group.dirs[0] / "pids.max").read_text() == str(CAPS[1])


def test_v1_run_cgroup_gets_the_cfs_quota(tmp_path: Path) -> None:
    group = cgroups.RunCgroup(_fake(tmp_path, 1), *CAPS)
    mem, pids, cpu = group.dirs
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "150000"
    assert (pids / "pids.max").read_text() == str(CAPS[1]) and group.pids_dir == pids


def test_v1_quota_is_clamped_under_an_ancestors(tmp_path: Path) -> None:
    """v1 refuses (EINVAL) a child quota over an ancestor's (a container's --cpus): the run gets the ancestor's."""
    h = _fake(tmp_path, 1)
    (h.parents[2] / "cpu.cfs_quota_us").write_text("25000")  # half a CPU, on a 50 ms period
    (h.parents[2] / "cpu.cfs_period_us").write_text("50000")
    group = cgroups.RunCgroup(h, *CAPS)
    assert (group.dirs[2] / "cpu.cfs_quota_us").read_text() == "50000"


def test_no_cpu_controller_no_cpu_files(tmp_path: Path) -> None:
    for version in (1, 2):
        group = cgroups.RunCgroup(_fake(tmp_path / str(version), version, cpu=False), *CAPS)
        assert not [f for d in group.dirs for f in d.iterdir() if f.name.startswith("cpu.")]


def test_caps_log_says_whether_the_cpu_cap_is_in_force(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cgroups, "detect", lambda: _fake(tmp_path / "on", 1))
    assert sandbox.caps("bwrap")["cpu"].startswith("on: cgroup v1 cpu.cfs_quota_us per run")
    monkeypatch.setattr(cgroups, "detect", lambda: _fake(tmp_path / "off", 2, cpu=False))
    assert sandbox.caps("rlimits")["cpu"].startswith("off")


def test_this_machines_run_cgroup_gets_the_configured_cap() -> None:
    hierarchy = cgroups.detect()
    if hierarchy is None or not hierarchy.cpu:
        pytest.skip("no writable cgroup cpu controller here: no per-run CPU cap")
    caps = sandbox.cgroup_caps(sandbox.Limits(cpus=0.75))
    group = cgroups.acquire(hierarchy, *caps)
    try:
        if hierarchy.version == 2:
            assert (group.dirs[0] / "cpu.max").read_text().split() == ["75000", "100000"]
        else:
            assert (group.dirs[2] / "cpu.cfs_period_us").read_text().strip() == "100000"
            assert int((group.dirs[2] / "cpu.cfs_quota_us").read_text()) == min(
                75000, cgroups._v1_cpu_ceiling_us(hierarchy.parents[2])
            )
    finally:
        cgroups.release(group, *caps)
