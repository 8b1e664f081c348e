"""A memory, process and CPU bandwidth cap on a whole sandbox run (every process of it, the tmpfs pages it writes
included): a cgroup of its own under this process's cgroup, where this machine lets us make one.

- cgroup v2 (``/sys/fs/cgroup/cgroup.controllers`` lists memory and pids, and this process's cgroup is
  writable: as root, or in a delegated systemd scope, ``systemd-run --user --scope -p Delegate=yes``; see
  :func:`_v2_parent`): ``memory.max``, ``memory.swap.max = 0``, ``pids.max``, and ``cpu.max`` where the cpu
  controller can be enabled too; ``cgroup.kill`` ends the run.
- cgroup v1 (writable ``memory`` and ``pids`` hierarchies, as root in a container of a v1 or hybrid host):
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap accounting is on), ``pids.max``,
  and ``cpu.cfs_period_us``/``cpu.cfs_quota_us`` where the ``cpu`` hierarchy is writable too.
- neither: no cap beyond the per-process rlimits; :func:`detect` says which (and whether the CPU cap is in
  force: :attr:`Hierarchy.cpu`), and the sandbox logs it once.

The CPU cap is what keeps one run's busy processes from starving the runs beside it (a GRPO group's siblings)
into their wall-clock timeout: without it a run may keep max_processes CPUs busy for its whole timeout.

A run's processes join the cgroup from the start: the command is wrapped in ``/bin/sh -c`` that writes its own
pid into each ``cgroup.procs`` and ``exec``s bwrap (so the fork that makes bwrap's children is already inside)."""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000  # the CPU cap's period: a run gets cpu_quota_us of CPU time in each


def _own_path(controller: str | None) -> str | None:
    """This process's cgroup path in the v2 hierarchy (controller None) or the v1 ``controller`` hierarchy."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller and controller in names.split(",")):
            return path
    return None


def _try_make(parent: Path) -> bool:
    probe = parent / f"grpoflow-probe-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    probe.rmdir()
    return True


@dataclass(frozen=True)
class Hierarchy:
    """Where run cgroups are made: ``version`` 2 (one ``parents[0]``) or 1 (memory, pids[, cpu] parents);
    ``cpu``: whether runs get a CPU bandwidth cap (v2: the cpu controller enabled in the parent; v1: a writable
    cpu hierarchy, the third parent)."""

    version: int
    parents: tuple[Path, ...]
    cpu: bool = False


def _subtree(cg: Path) -> set[str]:
    return set((cg / "cgroup.subtree_control").read_text().split())


def _enable_cpu(cg: Path) -> bool:
    """Enable the cpu controller for ``cg``'s children where it can be (the kernel may refuse: a realtime
    process in the subtree, the controller not delegated); whether it is enabled."""
    try:
        (cg / "cgroup.subtree_control").write_text("+cpu")
    except OSError:
        pass
    return "cpu" in _subtree(cg)


def _v2_parent(own: Path) -> tuple[Path, bool] | None:
    """``own``/grpoflow-sandbox with memory and pids (and cpu, where it can be) enabled for its children, and
    whether cpu is; None when memory and pids cannot be.

    A v2 cgroup that holds processes cannot enable controllers for its children ("no internal processes"): when
    this process is the only one in its cgroup (a delegated scope started for the trainer), it first moves itself
    into a leaf ``grpoflow-trainer``; it never moves another process."""
    cpu_here = "cpu" in (own / "cgroup.controllers").read_text().split()
    enabled = _subtree(own)
    if not {"memory", "pids"} <= enabled or (cpu_here and "cpu" not in enabled):
        procs = (own / "cgroup.procs").read_text().split()
        if procs and procs != [str(os.getpid())]:
            if not {"memory", "pids"} <= enabled:
                return None
        else:  # cpu missing only where another process shares our cgroup: runs go without the CPU cap
            if procs:
                leaf = own / "grpoflow-trainer"
                leaf.mkdir(exist_ok=True)
                (leaf / "cgroup.procs").write_text(str(os.getpid()))
            (own / "cgroup.subtree_control").write_text("+memory +pids")
            if cpu_here:
                _enable_cpu(own)
    parent = own / "grpoflow-sandbox"
    parent.mkdir(exist_ok=True)
    (parent / "cgroup.subtree_control").write_text("+memory +pids")  # parent holds no process, only runs
    cpu = "cpu" in _subtree(own) and _enable_cpu(parent)
    return (parent, cpu) if _try_make(parent) else None


def _v1_parent(controller: str) -> Path | None:
    """This process's cgroup in the v1 ``controller`` hierarchy when we can make cgroups in it, else None."""
    own = _own_path(controller)
    base = ROOT / controller
    if own is None or not (base / "cgroup.procs").is_file():
        return None
    parent = base / own.lstrip("/")
    if not _try_make(parent):
        return None
    _remove_stale(parent)
    return parent


def _v1_cpu_ceiling_us(parent: Path) -> int:
    """The tightest CPU quota of ``parent`` and its ancestors in the v1 cpu hierarchy, per CPU_PERIOD_US
    (a container's ``--cpus``): v1 refuses a child quota over it (EINVAL), so a run's cap is clamped to it."""
    ceiling = 1 << 62
    for d in (parent, *parent.parents):
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            break  # above the hierarchy's root
        if quota > 0:
            ceiling = min(ceiling, quota * CPU_PERIOD_US // period)
    return ceiling


@cache
def detect() -> Hierarchy | None:
    """The writable hierarchy with memory and pids control (and cpu where it has it), None when there is none."""
    v2 = _own_path(None)
    controllers = ROOT / "cgroup.controllers"
    if v2 is not None and controllers.is_file() and {"memory", "pids"} <= set(controllers.read_text().split()):
        try:
            found = _v2_parent(ROOT / v2.lstrip("/"))
            if found is not None:
                _remove_stale(found[0])
                return Hierarchy(2, (found[0],), cpu=found[1])
        except OSError:
            pass
    memory, pids = _v1_parent("memory"), _v1_parent("pids")
    if memory is None or pids is None:
        return None
    cpu = _v1_parent("cpu")
    return Hierarchy(1, (memory, pids) if cpu is None else (memory, pids, cpu), cpu=cpu is not None)


class RunCgroup:
    """One run's cgroup(s) with the caps: joined by the wrapped command (:meth:`wrap`), emptied by :meth:`empty`,
    removed by :meth:`close`. :func:`acquire` and :func:`release` reuse them across runs: making and removing a
    memory cgroup costs several milliseconds a run. ``cpu_quota_us`` of CPU time per CPU_PERIOD_US for all the
    run's processes together, where ``hierarchy.cpu``."""

    def __init__(self, hierarchy: Hierarchy, memory_bytes: int, max_pids: int, cpu_quota_us: int) -> None:
        self.hierarchy = hierarchy
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.dirs = tuple(p / name for p in hierarchy.parents)
        self.pids_dir = self.dirs[0] if hierarchy.version == 2 else self.dirs[1]
        self._oom_base = 0
        for d in self.dirs:
            d.mkdir()
        try:
            if hierarchy.version == 2:
                (d,) = self.dirs
                self._write(d / "memory.max", memory_bytes)
                self._write(d / "memory.swap.max", 0, missing_ok=True)
                self._write(d / "pids.max", max_pids)
                if hierarchy.cpu:
                    (d / "cpu.max").write_text(f"{cpu_quota_us} {CPU_PERIOD_US}")
            else:
                mem, pids = self.dirs[:2]
                self._write(mem / "memory.limit_in_bytes", memory_bytes)
                self._write(mem / "memory.memsw.limit_in_bytes", memory_bytes, missing_ok=True)
                self._write(pids / "pids.max", max_pids)
                if hierarchy.cpu:  # the period first: a quota is checked against the period in force
                    self._write(self.dirs[2] / "cpu.cfs_period_us", CPU_PERIOD_US)
                    quota = min(cpu_quota_us, _v1_cpu_ceiling_us(hierarchy.parents[2]))
                    self._write(self.dirs[2] / "cpu.cfs_quota_us", quota)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _write(path: Path, value: int, missing_ok: bool = False) -> None:
        try:
            path.write_text(str(value))
        except FileNotFoundError:
            if not missing_ok:
                raise

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run by a shell that first moves itself into the run's cgroup(s); exit 97 if it cannot."""
        script = 'for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 97; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *(str(d / "cgroup.procs") for d in self.dirs), "--", *cmd]

    def _ooms(self) -> int:
        try:
            if self.hierarchy.version == 2:
                events = dict(line.split() for line in (self.dirs[0] / "memory.events").read_text().splitlines())
                return int(events.get("oom_kill", 0)) + int(events.get("max", 0))
            return int((self.dirs[0] / "memory.failcnt").read_text())
        except (OSError, ValueError):
            return 0

    def pids_charged(self) -> int:
        """pids.current: tasks still charged to the cgroup (zombies included)."""
        try:
            return int((self.pids_dir / "pids.current").read_text())
        except (OSError, ValueError):
            return 1

    def oom_killed(self) -> bool:
        """Whether the memory cap was hit in this run (a process OOM-killed, or an allocation at the cap)."""
        return self._ooms() > self._oom_base

    def empty(self, wait_s: float = 10.0) -> bool:
        """Kill every process in the cgroup(s) and wait until none is left; False if some outlived ``wait_s``.
        A run's processes cannot leave: the cgroup files are root's (and not mounted in bwrap)."""
        deadline = time.monotonic() + wait_s
        for d in self.dirs:
            kill = d / "cgroup.kill"
            while True:
                try:
                    pids = (d / "cgroup.procs").read_text().split()
                except FileNotFoundError:
                    break
                if not pids:
                    break
                if time.monotonic() > deadline:
                    return False
                if self.hierarchy.version == 2 and kill.exists():
                    kill.write_text("1")
                else:
                    for pid in pids:
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                time.sleep(0.0005)
        return True

    def close(self, wait_s: float = 10.0) -> None:
        """Empty the cgroup(s) and remove them."""
        self.empty(wait_s)
        deadline = time.monotonic() + wait_s
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.0005)


PREFIX = "grpoflow-run-"
_pool: dict[tuple[Hierarchy, int, int, int], list[RunCgroup]] = {}
_pool_lock = threading.Lock()


MAX_LEFTOVER_PIDS = 64


def acquire(hierarchy: Hierarchy, memory_bytes: int, max_pids: int, cpu_quota_us: int) -> RunCgroup:
    """An empty cgroup with these caps: an idle one from the pool, else a new one."""
    with _pool_lock:
        idle = _pool.get((hierarchy, memory_bytes, max_pids, cpu_quota_us))
        group = idle.pop() if idle else None
    if group is None:
        group = RunCgroup(hierarchy, memory_bytes, max_pids, cpu_quota_us)
    elif leftover := group.pids_charged():
        # pids.current can keep a charge after its last task is gone (seen on cgroup v1): the run still gets its
        # max_pids on top of it
        (group.pids_dir / "pids.max").write_text(str(max_pids + leftover))
    group._oom_base = group._ooms()
    return group


def release(group: RunCgroup, memory_bytes: int, max_pids: int, cpu_quota_us: int) -> None:
    """Back to the pool once empty (removed if a process outlived the wait, or over MAX_LEFTOVER_PIDS pids are
    still charged with no task left)."""
    if not group.empty() or group.pids_charged() > MAX_LEFTOVER_PIDS:
        group.close()
        return
    with _pool_lock:
        _pool.setdefault((group.hierarchy, memory_bytes, max_pids, cpu_quota_us), []).append(group)


@atexit.register
def close_all() -> None:
    """Remove the pooled cgroups (at exit; a killed trainer's are removed by the next :func:`detect`)."""
    with _pool_lock:
        groups = [g for idle in _pool.values() for g in idle]
        _pool.clear()
    for g in groups:
        g.close(wait_s=1.0)


def _remove_stale(parent: Path) -> None:
    """Empty run cgroups left by a process that is gone (a trainer killed before its atexit)."""
    for d in parent.glob(f"{PREFIX}*"):
        pid = d.name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                d.rmdir()
            except OSError:
                pass
