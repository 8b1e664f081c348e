"""A memory and process cap on a whole sandbox run (every process of it, the tmpfs pages it writes included): a
cgroup of its own under this process's cgroup, where this machine lets us make one.

- cgroup v2 (``/sys/fs/cgroup/cgroup.controllers`` lists memory and pids, and this process's cgroup is
  writable: as root, or in a delegated systemd scope, ``systemd-run --user --scope -p Delegate=yes``; see
  :func:`_v2_parent`): ``memory.max``, ``memory.swap.max = 0``, ``pids.max``; ``cgroup.kill`` ends the run.
- cgroup v1 (writable ``memory`` and ``pids`` hierarchies, as root in a container of a v1 or hybrid host):
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap accounting is on), ``pids.max``.
- neither: no cap beyond the per-process rlimits; :func:`detect` says which, and the sandbox logs it once.

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
    """Where run cgroups are made: ``version`` 2 (one ``parents[0]``) or 1 (memory, pids parents)."""

    version: int
    parents: tuple[Path, ...]


def _v2_parent(own: Path) -> Path | None:
    """``own``/grpoflow-sandbox with memory and pids enabled for its children, or None.

    A v2 cgroup that holds processes cannot enable controllers for its children ("no internal processes"): when
    this process is the only one in its cgroup (a delegated scope started for the trainer), it first moves itself
    into a leaf ``grpoflow-trainer``; it never moves another process."""
    wanted = {"memory", "pids"}
    if not wanted <= set((own / "cgroup.subtree_control").read_text().split()):
        procs = (own / "cgroup.procs").read_text().split()
        if procs and procs != [str(os.getpid())]:
            return None
        if procs:
            leaf = own / "grpoflow-trainer"
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
        (own / "cgroup.subtree_control").write_text("+memory +pids")
    parent = own / "grpoflow-sandbox"
    parent.mkdir(exist_ok=True)
    (parent / "cgroup.subtree_control").write_text("+memory +pids")  # parent holds no process, only runs
    return parent if _try_make(parent) else None


@cache
def detect() -> Hierarchy | None:
    """The writable hierarchy with memory and pids control, None when there is none."""
    v2 = _own_path(None)
    controllers = ROOT / "cgroup.controllers"
    if v2 is not None and controllers.is_file() and {"memory", "pids"} <= set(controllers.read_text().split()):
        try:
            parent = _v2_parent(ROOT / v2.lstrip("/"))
            if parent is not None:
                _remove_stale(parent)
                return Hierarchy(2, (parent,))
        except OSError:
            pass
    parents = []
    for controller in ("memory", "pids"):
        own = _own_path(controller)
        base = ROOT / controller
        if own is None or not (base / "cgroup.procs").is_file():
            return None
        parent = base / own.lstrip("/")
        if not _try_make(parent):
            return None
        parents.append(parent)
        _remove_stale(parent)
    return Hierarchy(1, tuple(parents))


class RunCgroup:
    """One run's cgroup(s) with the caps: joined by the wrapped command (:meth:`wrap`), emptied by :meth:`empty`,
    removed by :meth:`close`. :func:`acquire` and :func:`release` reuse them across runs: making and removing a
    memory cgroup costs several milliseconds a run."""

    def __init__(self, hierarchy: Hierarchy, memory_bytes: int, max_pids: int) -> None:
        self.hierarchy = hierarchy
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.dirs = tuple(p / name for p in hierarchy.parents)
        self._oom_base = 0
        for d in self.dirs:
            d.mkdir()
        try:
            if hierarchy.version == 2:
                (d,) = self.dirs
                self._write(d / "memory.max", memory_bytes)
                self._write(d / "memory.swap.max", 0, missing_ok=True)
                self._write(d / "pids.max", max_pids)
            else:
                mem, pids = self.dirs
                self._write(mem / "memory.limit_in_bytes", memory_bytes)
                self._write(mem / "memory.memsw.limit_in_bytes", memory_bytes, missing_ok=True)
                self._write(pids / "pids.max", max_pids)
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
            return int((self.dirs[-1] / "pids.current").read_text())
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
_pool: dict[tuple[Hierarchy, int, int], list[RunCgroup]] = {}
_pool_lock = threading.Lock()


MAX_LEFTOVER_PIDS = 64


def acquire(hierarchy: Hierarchy, memory_bytes: int, max_pids: int) -> RunCgroup:
    """An empty cgroup with these caps: an idle one from the pool, else a new one."""
    with _pool_lock:
        idle = _pool.get((hierarchy, memory_bytes, max_pids))
        group = idle.pop() if idle else None
    if group is None:
        group = RunCgroup(hierarchy, memory_bytes, max_pids)
    elif leftover := group.pids_charged():
        # pids.current can keep a charge after its last task is gone (seen on cgroup v1): the run still gets its
        # max_pids on top of it
        (group.dirs[-1] / "pids.max").write_text(str(max_pids + leftover))
    group._oom_base = group._ooms()
    return group


def release(group: RunCgroup, memory_bytes: int, max_pids: int) -> None:
    """Back to the pool once empty (removed if a process outlived the wait, or over MAX_LEFTOVER_PIDS pids are
    still charged with no task left)."""
    if not group.empty() or group.pids_charged() > MAX_LEFTOVER_PIDS:
        group.close()
        return
    with _pool_lock:
        _pool.setdefault((group.hierarchy, memory_bytes, max_pids), []).append(group)


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
