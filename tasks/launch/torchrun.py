"""Running a stage's work on several processes: torchrun as a subprocess of the stage, watched to the end.

    python -m torch.distributed.run --standalone --nproc_per_node=N -m <module> <args>      (torchrun)

:func:`torchrun_command` builds the command from the ``distributed`` section (one node: --standalone; several:
--nnodes, --node_rank and a c10d rendezvous endpoint or a static master address; settings left unset are read
by torchrun from its PET_* environment, as Kubeflow Trainer sets it). :func:`run_torchrun` starts it in its own
process group and session, streams its output into this process's log, and on any exception here (a cancelled
task, Ctrl-C) terminates the whole group (SIGTERM, then SIGKILL after a grace period).

A worker that fails writes ``rank<r>.error.json`` (:func:`write_rank_error`) in the launch folder before it
exits. A non-zero exit raises the error of the rank that failed first: ValueError for what the user's input
caused (a bad reward function, ...), so the stage fails with it as it would on one process; RuntimeError with the
rank's traceback for a bug; ChildProcessError (an OSError: an environment failure) when no rank reported one (a
rank killed by a signal, a collective that timed out), naming torchrun's root cause (rank, exit code, signal). A
rank whose collective failed because another rank died or hung, or that torchrun stopped with SIGTERM after
another rank failed (:func:`lost_peer`), is never taken for the cause.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from grpoflow.tasks.config import DistributedConfig

log = logging.getLogger(__name__)

FIELDS = ("rank", "exitcode", "traceback")  # of torchrun's failure record
# what a rank raises when another rank went away or hung: a consequence, never the cause of a failed launch
PEER_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
PEER_MESSAGES = ("Connection reset by peer", "Connection closed by peer", "gloo/transport", "Timed out", "timed out")


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank died or hung (gloo reports it as a plain
    RuntimeError naming its transport; NCCL and the c10d store as torch.distributed.DistError), or this rank
    exiting 143 on the SIGTERM torchrun sends the group once a rank failed (tasks/storage/uploads.py
    drain_on_sigterm): a rank killed by SIGKILL may be noticed by torchrun before its peers' collectives fail."""
    if isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM:
        return True
    if type(exc).__name__ in PEER_ERRORS:
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in PEER_MESSAGES)


class RankTraceback(Exception):
    """The traceback a failed rank recorded, chained to the error the launch raises."""


def torchrun_command(d: DistributedConfig, module: str, args: list[str], python: str = sys.executable) -> list[str]:
    """The torchrun command line that runs ``python -m module *args`` on every process of ``d`` (``python``: this
    interpreter; a TrainJob's pods run it with the image's)."""
    cmd = [python, "-m", "torch.distributed.run"]
    if d.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd.append(f"--nnodes={d.nnodes}")
        if d.node_rank is not None:
            cmd.append(f"--node_rank={d.node_rank}")
        if d.rdzv_endpoint is not None:
            cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={d.rdzv_endpoint}"]
        if d.master_addr is not None:
            cmd.append(f"--master_addr={d.master_addr}")
        if d.master_port is not None:
            cmd.append(f"--master_port={d.master_port}")
    cmd += [f"--nproc_per_node={d.nproc_per_node}", "-m", module, *args]
    return cmd


def write_rank_error(folder: Path, rank: int, exc: BaseException, user_errors: tuple[type[BaseException], ...]) -> Path:
    """Record why this rank failed (read by :func:`run_torchrun` in the launching process)."""
    path = Path(folder) / f"rank{rank}.error.json"
    body = {
        "rank": rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": str(exc),
        "user_error": isinstance(exc, user_errors),
        "lost_peer": lost_peer(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)
    return path


def rank_errors(folder: Path) -> list[dict]:
    """The error records the ranks wrote, the first failure first (by time; the lost-peer errors last)."""
    found = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank*.error.json"))]
    return sorted(found, key=lambda e: (e["lost_peer"], e["time"]))


def failure(rc: int, errors: list[dict], tail: list[str], world: int) -> Exception:
    """The exception a failed launch raises (see the module docstring)."""
    if errors and not errors[0]["lost_peer"]:
        e = errors[0]
        where = f"rank {e['rank']} of {world}"
        if e["user_error"]:
            exc: Exception = ValueError(f"{where}: {e['message']}")
            exc.__cause__ = RankTraceback(e["traceback"])  # kept in the stage's error log
            return exc
        return RuntimeError(f"{where}: {e['type']}: {e['message']}\n{e['traceback']}")
    reported = "; ".join(f"rank {e['rank']}: {e['type']}: {e['message']}" for e in errors)
    exc = ChildProcessError(
        f"torchrun exited with code {rc} and no rank reported a cause of its own (a rank killed by a signal or out "
        f"of memory, or a collective past distributed.timeout_s): {root_cause(tail)}"
        + (f"; then {reported}" if reported else "")
    )
    exc.__cause__ = RankTraceback("".join(tail))  # torchrun's last lines, kept in the stage's error log
    return exc


def root_cause(lines: list[str]) -> str:
    """torchrun's "Root Cause" record in one line (rank, exit code, signal), else its last non-empty line."""
    block = [ln.strip() for ln in lines[next((i for i, ln in enumerate(lines) if "Root Cause" in ln), len(lines)) :]]
    fields = dict(ln.split(":", 1) for ln in block if ":" in ln and ln.split(":", 1)[0].strip() in FIELDS)
    if fields:
        return ", ".join(f"{k.strip()} {v.strip()}" for k, v in fields.items())
    rest = [ln.strip() for ln in lines if ln.strip()]
    return rest[-1] if rest else "no output"


def terminate_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the process group of ``proc`` (torchrun and its workers), SIGKILL if still alive after grace_s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For ``preexec_fn`` (between fork and exec): the child gets SIGTERM when the process that started it dies,
    even by kill -9 (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing), so no process of ours outlives its parent."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def run_torchrun(
    cmd: list[str], errors_dir: Path, world: int, env: dict[str, str] | None = None, keep_fds: Sequence[int] = ()
) -> None:
    """Run ``cmd`` (a torchrun command) in its own process group, its output streamed into this log; raise the
    first failing rank's error on a non-zero exit; terminate the group if this thread is interrupted. ``keep_fds``
    (the workspace's lock) stay open in torchrun, which outlives its workers: the lock holds until they are gone."""
    log.info("launching: %s", " ".join(cmd))
    tail: deque[str] = deque(maxlen=200)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,  # its own process group: cancelling kills torchrun and every worker together
        preexec_fn=die_with_parent,  # and a kill -9 of this process stops torchrun, which stops its workers
        env={**os.environ, **(env or {})},
        pass_fds=tuple(keep_fds),
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            log.info("%s", line.rstrip())
        rc = proc.wait()
    except BaseException:
        terminate_group(proc)
        raise
    if rc != 0:
        raise failure(rc, rank_errors(errors_dir), list(tail), world)
