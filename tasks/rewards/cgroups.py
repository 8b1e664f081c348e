"""A memory and process cap on a whole sandbox run (every process of it, the tmpfs pages it writes included): a
cgroup of its own under this process's cgroup, where this machine lets us make one.

- cgroup v2 (``/sys/fs/cgroup/cgroup.controllers`` lists memory and pids, and this process's cgroup is
  writable, as root or in a delegated systemd scope): ``memory.max``, ``memory.swap.max = 0``, ``pids.max``;
  ``cgroup.kill`` ends the run.
- cgroup v1 (writable ``memory`` and ``pids`` hierarchies, as root in a container of a v1 or hybrid host):
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap accounting is on), ``pids.max``.
- neither: no cap beyond the per-process rlimits; :func:`detect` says which, and the sandbox logs it once.

A run's processes join the cgroup from the start: the command is wrapped in ``/bin/sh -c`` that writes its own
pid into each ``cgroup.procs`` and ``exec``s bwrap (so the fork that makes bwrap's children is already inside)."""

from __future__ import annotations

import os
import secrets
import signal
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


@cache
def detect() -> Hierarchy | None:
    """The writable hierarchy with memory and pids control, None when there is none."""
    v2 = _own_path(None)
    controllers = ROOT / "cgroup.controllers"
    if v2 is not None and controllers.is_file() and {"memory", "pids"} <= set(controllers.read_text().split()):
        parent = ROOT / v2.lstrip("/") / "grpoflow-sandbox"
        try:
            parent.mkdir(exist_ok=True)
            # a v2 cgroup with processes cannot enable controllers for children: ours hold none, only runs
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
            if _try_make(parent):
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
    return Hierarchy(1, tuple(parents))


class RunCgroup:
    """One run's cgroup(s): made with the caps, joined by the wrapped command, emptied and removed by
    :meth:`close`."""

    def __init__(self, hierarchy: Hierarchy, memory_bytes: int, max_pids: int) -> None:
        self.hierarchy = hierarchy
        name = f"grpoflow-run-{secrets.token_hex(6)}"
        self.dirs = tuple(p / name for p in hierarchy.parents)
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

    def oom_killed(self) -> bool:
        """Whether the memory cap was hit (a process OOM-killed, or an allocation refused at the cap)."""
        try:
            if self.hierarchy.version == 2:
                events = dict(line.split() for line in (self.dirs[0] / "memory.events").read_text().splitlines())
                return int(events.get("oom_kill", 0)) > 0 or int(events.get("max", 0)) > 0
            return int((self.dirs[0] / "memory.failcnt").read_text()) > 0
        except (OSError, ValueError):
            return False

    def close(self, wait_s: float = 10.0) -> None:
        """Kill whatever is left in the cgroup(s) and remove them (retrying while the kernel reaps)."""
        deadline = time.monotonic() + wait_s
        for d in self.dirs:
            while d.exists():
                try:
                    if self.hierarchy.version == 2 and (d / "cgroup.kill").exists():
                        (d / "cgroup.kill").write_text("1")
                    else:
                        for pid in (d / "cgroup.procs").read_text().split():
                            try:
                                os.kill(int(pid), signal.SIGKILL)
                            except (ProcessLookupError, PermissionError):
                                pass
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
