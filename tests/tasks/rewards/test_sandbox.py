"""Tests for tasks/rewards/sandbox.py: a program cannot reach the trainer, its secrets, files or the network;
fork bombs and children that leave the session leave no process behind; rlimits mode contains the bombs."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpoflow.tasks.config import CodeRewardConfig
from grpoflow.tasks.rewards import cgroups, sandbox
from grpoflow.tasks.rewards.code import CodeTests

# allow_unsafe: the containment tests also run where bwrap cannot isolate (each says what it needs). FAST has
# room for a busy machine where a result must be a pass; SHORT ends the programs that only a timeout ends.
FAST = CodeRewardConfig(
    timeout_s=20, cpu_s=1, memory_mb=256, max_processes=8, max_output_bytes=4096, workers=2, allow_unsafe=True
)
SHORT = FAST.model_copy(update={"timeout_s": 1.5})
LIMITS, SHORT_LIMITS = CodeTests(FAST).limits, CodeTests(SHORT).limits
SECRET = "GRPOFLOW_TEST_SECRET"


# (program, statuses it may end in); every one must score 0 and leave the test process and its files alone
HOSTILE = {
    "infinite_loop": ("while True:\n    pass", {"cpu_limit", "timeout"}),
    "sleep_forever": ("import time\ntime.sleep(1000)", {"timeout"}),
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        {"timeout", "cpu_limit", "killed"},
    ),
    "memory_bomb": ("x = []\nwhile True:\n    x.append(bytearray(10**7))", {"memory"}),
    "huge_output": ("while True:\n    print('x' * 1000)", {"output_limit"}),
    "exit_early": ("import os\nos._exit(0)", {"failed"}),
    "sys_exit_zero": ("import sys\nsys.exit(0)", {"failed"}),
    # a program that looks like a sandbox failure still scores 0, not None (not scored)
    "fake_sandbox_error": ("import os, sys\nsys.stderr.write('bwrap: cannot start\\n')\nos._exit(5)", {"failed"}),
}


def _processes_of(uid: int) -> list[int]:
    """Live processes of ``uid`` (zombies are dead: killed, waiting for init to reap them)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(entry))
    return pids


def test_program_cannot_kill_the_trainer_or_read_its_secrets(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    if sandbox.isolation() != "bwrap" and os.geteuid() != 0:
        pytest.skip("rlimits only, not root: the program has the trainer's uid and could signal it")
    monkeypatch.setenv(SECRET, "hunter2")
    outside = tmp_path / "pwned.txt"
    kill = f"import os, signal\ntry:\n    os.kill({os.getpid()}, signal.SIGKILL)\nexcept OSError as e:\n    print(e)"
    r = sandbox.run_python(kill + "\nprint('after kill')", LIMITS)
    assert r.passed and "after kill" in r.stdout  # the kill failed and the test process is still here
    r = sandbox.run_python(
        "import os\nprint(sorted(os.environ))\n"
        "for p in ('/proc/1/environ', f'/proc/{os.getppid()}/environ'):\n"
        "    try:\n        print(open(p).read())\n    except OSError as e:\n        print(type(e).__name__)",
        LIMITS,
    )
    assert r.passed and SECRET not in r.stdout and "hunter2" not in r.stdout
    r = sandbox.run_python(f"open({str(outside)!r}, 'w').write('x')", LIMITS)
    assert r.status == "failed" and not outside.exists()
    r = sandbox.run_python("open('inside.txt', 'w').write('x')\nprint(open('inside.txt').read())", LIMITS)
    assert r.passed and r.stdout.strip() == "x"
    assert not os.path.exists(r.workdir)  # the private folder is removed


def test_no_network_in_the_sandbox() -> None:
    if sandbox.isolation() != "bwrap":
        pytest.skip("bwrap cannot create namespaces here: the sandbox has no network isolation")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        r = sandbox.run_python(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')",
            LIMITS,
        )
    finally:
        server.close()
    assert r.status == "failed" and "connected" not in r.stdout and "ConnectionRefused" in r.stderr


@pytest.mark.parametrize("mode", ["bwrap", "rlimits"])
def test_a_fork_bomb_leaves_no_process(mode: str) -> None:
    if mode == "bwrap" and sandbox.isolation() != "bwrap":
        pytest.skip("bwrap cannot create namespaces here")
    spawn = "import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n        time.sleep(60)\n"
    r = sandbox.run_python(spawn + "time.sleep(60)", SHORT_LIMITS, mode=mode)
    assert r.status == "timeout"
    if os.geteuid() == 0:  # each run has its own uid: nothing of it is left
        assert r.uid != 0 and _processes_of(r.uid) == []


def test_a_child_that_leaves_the_session_is_killed_too_as_root() -> None:
    """rlimits mode has no pid namespace: a setsid() child escapes the process group, but not the run's uid."""
    if os.geteuid() != 0:
        pytest.skip("not root: runs keep the caller's uid")
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
    r = sandbox.run_python(escape, SHORT_LIMITS, mode="rlimits")
    assert r.status == "passed"  # the parent returned at once; its child was still sleeping
    assert r.uid != 0 and _processes_of(r.uid) == []


def test_rlimits_mode_contains_the_bombs() -> None:
    for program in (HOSTILE["memory_bomb"][0], HOSTILE["huge_output"][0], HOSTILE["infinite_loop"][0]):
        r = sandbox.run_python(program, SHORT_LIMITS, mode="rlimits")
        assert r.status in {"memory", "output_limit", "cpu_limit", "timeout"}, r
        assert not os.path.exists(r.workdir)


def test_two_runs_at_once_never_share_a_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    """As root each run's uids are drawn at random; a uid another live run holds is drawn again: run A's end kills
    every process of its uids, which were also run B's, and B's right answer was scored killed."""
    if os.geteuid() != 0 or sandbox.run_uid() == sandbox.NOBODY:
        pytest.skip("not root, or no uid range of our own: runs keep one uid")
    sandbox.isolation()  # its probe run draws before the patch
    base = sandbox.RUN_UIDS[0] + 4242
    draws = iter([base, base + 1, base, base + 1, base + 2, base + 3])  # the second run draws the first's pair
    monkeypatch.setattr(sandbox, "run_uid", lambda: next(draws))
    slow = "import time\ndef f(x):\n    time.sleep(3)\n    return x + 1\n"
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(sandbox.run_python, "import time\ntime.sleep(0.5)", LIMITS)
        time.sleep(0.2)  # the first has drawn its uids
        second = pool.submit(sandbox.run_python, slow, LIMITS, tests="assert f(1) == 2")
        assert first.result().passed
        r = second.result()
    assert r.passed and r.uid == base + 2, r


# 4 children busy until WALL_S after the start, then the CPU time they used and the wall time, as the program saw
BUSY = (
    "import os, resource, time\nstart = time.monotonic()\npids = []\n"
    "for _ in range(4):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        while time.monotonic() < start + 1.5:\n            pass\n"
    "        os._exit(0)\n"
    "    pids.append(pid)\n"
    "for p in pids:\n    os.waitpid(p, 0)\n"
    "used = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "print(used.ru_utime + used.ru_stime, time.monotonic() - start)\n"
)


@pytest.mark.parametrize("mode", ["bwrap", "rlimits"])
def test_a_run_gets_at_most_its_cpus(mode: str) -> None:
    """Busy processes of one run share its CPU cap (here half a CPU), so they cannot starve the runs beside it
    into a timeout; uncapped, 4 of them use up to 4 CPUs (as many as the host has). CPU time used, not wall
    time: robust on a loaded machine (the margin covers the 100 ms bandwidth periods and the program's start)."""
    if mode == "bwrap" and sandbox.isolation() != "bwrap":
        pytest.skip("bwrap cannot create namespaces here")
    hierarchy = cgroups.detect()
    if hierarchy is None or not hierarchy.cpu:
        pytest.skip("no writable cgroup cpu controller here: no per-run CPU cap")
    cfg = FAST.model_copy(update={"cpu_s": 5, "cpus": 0.5})
    r = sandbox.run_python(BUSY, CodeTests(cfg).limits, mode=mode)
    assert r.passed, r
    used_s, wall_s = map(float, r.stdout.split())
    assert used_s < 1.6 * cfg.cpus * wall_s, (used_s, wall_s)


LANDLOCK_PROBE = """
import json, os, socket, sys
from grpoflow.tasks.rewards.verdict_launcher import landlock
import ctypes
rules, secret, work, port = json.loads(sys.argv[1])
abi = landlock(rules, ctypes.CDLL(None, use_errno=True))
out = {"abi": abi}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = type(e).__name__
attempt("read_secret", lambda: open(secret).read())
attempt("write_work", lambda: open(os.path.join(work, "x"), "w").write("x"))
attempt("write_beside", lambda: open(os.path.join(os.path.dirname(secret), "y"), "w").write("y"))
attempt("read_stdlib", lambda: open(os.__file__).read())
attempt("import_stdlib", lambda: __import__("fractions"))
attempt("connect", lambda: socket.create_connection(("127.0.0.1", port), timeout=2))
print(json.dumps(out))
"""


def test_landlock_confines_a_process_to_the_standard_library_and_its_work_folder(tmp_path) -> None:
    """The rules rlimits mode gives a program (:func:`sandbox.readable_roots` plus a writable work folder),
    applied by the launcher's :func:`landlock` in a process of this uid (no uid drop, as without root): files of
    the same uid beside the work folder can be neither read nor written; the standard library reads and imports;
    TCP connect is denied (Landlock ABI 4+)."""
    import json
    import subprocess
    import sys

    abi = sandbox.landlock_abi()
    if abi < 1:
        pytest.skip("no Landlock in this kernel")
    secret, work = tmp_path / "answers.jsonl", tmp_path / "work"
    secret.write_text("the canonical solution\n")
    work.mkdir()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    rules = [*sandbox.readable_roots(), [str(work), True]]
    try:
        arg = json.dumps([rules, str(secret), str(work), server.getsockname()[1]])
        r = subprocess.run([sys.executable, "-c", LANDLOCK_PROBE, arg], capture_output=True, text=True, timeout=60)
    finally:
        server.close()
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["abi"] == abi
    assert got["read_secret"] == got["write_beside"] == "PermissionError", got
    assert got["write_work"] == got["read_stdlib"] == got["import_stdlib"] == "ok", got
    assert got["connect"] == ("PermissionError" if abi >= 4 else "ok"), got
    assert (work / "x").read_text() == "x" and not (tmp_path / "y").exists()
