"""The sandbox's launcher: runs inside the sandbox as ``python -I -S -c <this file's source> <args>`` (standard
library only; grpoflow is not importable there) and decides whether the tests passed, outside the program's
process.

Two processes, forked before any secret or test is read:

- the **program** (A): the fork's child drops to the run's uid (as root), sets the rlimits, closes every fd of
  the launcher, runs the program's source, then serves requests on a pipe: ``get`` a global, ``call`` a
  function or ``getattr`` of an object it handed out. It never sees the tests, the nonce or the verdict fd.
- the **judge** (B, the parent): non-dumpable and, as root, on a uid of its own, so the program cannot read its
  memory, fds or /proc entries; then it reads the nonce and the tests from the input fd, runs the tests with
  every name they do not define (and that is not a builtin, unless the question asks the program for it: its
  stubs) looked up in the program over the pipe, and
  writes the verdict with the nonce on the verdict fd.

Values cross the pipe as JSON of tagged plain data (None, bool, int, float, complex, str, bytes, list, tuple,
dict, set, frozenset); the judge decodes them into exact builtin types, so nothing the program made (an
``__eq__`` that always says True, a patched ``assert``) runs in the judge. Any other object crosses as a
handle the judge can only call or take attributes of (over the pipe again). A program that dies, exits,
answers out of protocol or sends a malformed value breaks the channel: the verdict is then not passed whatever
the tests do afterwards.

argv: input_fd verdict_fd program_path uid judge_uid cpu_s as_bytes nproc fsize [seccomp filter as hex, or -
[fd of the Landlock rules as JSON: rlimits mode]]
"""

import _json
import builtins
import os
import resource
import struct
import sys
import traceback  # now: after the uid drop the Python install may be unreadable (rlimits, /root)

MAX_MESSAGE = 16 << 20
MAX_DEPTH = 200
_STOPS = (StopIteration, StopAsyncIteration)  # the program's arrive as RuntimeError (PEP 479 does so in generators)
_LEN = struct.Struct(">I")


# ---------------------------------------------------------------------------- framing (both sides)
# JSON by the C codec directly: ``import json`` pulls in re and enum, milliseconds of every run's start


class _ScanContext:
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int
    parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__
    memo = {}


def _no_default(o):
    raise TypeError(f"{type(o).__name__} is not JSON")


_scan = _json.make_scanner(_ScanContext())
_encode = _json.make_encoder(None, _no_default, _json.encode_basestring_ascii, None, ":", ",", False, False, True)


def dumps(obj):
    return "".join(_encode(obj, 0))


def loads(text):
    """One JSON value, the whole of ``text``; ValueError otherwise."""
    try:
        obj, end = _scan(text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("trailing data after JSON")
    return obj


def send(fd, obj):
    data = dumps(obj).encode()
    data = _LEN.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def _read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("the program closed the channel")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def receive(fd):
    (n,) = _LEN.unpack(_read_exact(fd, 4))
    if n > MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes over the {MAX_MESSAGE} cap")
    return loads(_read_exact(fd, n).decode())


# ---------------------------------------------------------------------------- the program's side (A)
def encode(value, handles, depth=0):
    """Plain data as tagged JSON; anything else as a handle (an index into ``handles``)."""
    if depth > MAX_DEPTH:
        raise RecursionError("value nested too deep to send")
    t = type(value)
    if value is None or t is bool or t is float or t is str:
        return value
    if t is int:
        return value if -(1 << 62) < value < (1 << 62) else {"x": format(value, "x")}
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[t]
        return {tag: [encode(v, handles, depth + 1) for v in value]}
    if t is dict:
        return {"d": [[encode(k, handles, depth + 1), encode(v, handles, depth + 1)] for k, v in value.items()]}
    if t is bytes:
        return {"b": value.hex()}
    if t is complex:
        return {"c": [value.real, value.imag]}
    handles.append(value)
    return {"h": len(handles) - 1}


def decode_for_program(value, handles):
    """The judge's arguments, in the program (handles resolve to the program's own objects)."""
    if isinstance(value, dict):
        (tag, v), *_ = value.items()
        if tag == "h":
            return handles[v]
        if tag == "x":
            return int(v, 16)
        if tag == "b":
            return bytes.fromhex(v)
        if tag == "c":
            return complex(*v)
        if tag == "d":
            return {decode_for_program(k, handles): decode_for_program(x, handles) for k, x in v}
        items = [decode_for_program(x, handles) for x in v]
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
    return value


def serve(source, req, resp):
    """Run the program, report how its top level ended, then answer the judge until it closes the pipe."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    handles = []
    try:
        exec(compile(source, "program.py", "exec"), namespace)
        loaded = None
    except MemoryError:  # free what it holds first: reporting needs memory too
        namespace.clear()
        loaded = "MemoryError"
    except BaseException as e:  # SystemExit too: the program did not run to its end
        traceback.print_exc()
        loaded = type(e).__name__
    sys.stdout.flush()
    sys.stderr.flush()
    send(resp, ["loaded", loaded])
    while True:
        try:
            op, *args = receive(req)
        except EOFError:
            break
        try:
            if op == "get":
                reply = ["ok", encode(namespace[args[0]], handles)] if args[0] in namespace else ["missing"]
            elif op == "getattr":
                reply = ["ok", encode(getattr(handles[args[0]], args[1]), handles)]
            else:  # call
                fn, a, kw = handles[args[0]], decode_for_program(args[1], handles), decode_for_program(args[2], handles)
                reply = ["ok", encode(fn(*a, **kw), handles)]
        except BaseException as e:
            reply = ["err", type(e).__name__, str(e)[:2000]]
        sys.stdout.flush()
        sys.stderr.flush()
        send(resp, reply)
    sys.stdout.flush()
    sys.stderr.flush()


def load_seccomp(bpf, libc):
    """Install the seccomp filter ``bpf`` (struct sock_filter array) on this process and its future children:
    rlimits mode, where bwrap does not (``--seccomp``). NO_NEW_PRIVS first, as the kernel requires unprivileged."""
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(bpf) // 8, bpf)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # NO_NEW_PRIVS, SECCOMP
        raise OSError(ctypes.get_errno(), "seccomp filter not installed")


# Landlock (Linux 5.13+): the calls and bits of linux/landlock.h; one syscall number on every architecture
_LL_CREATE, _LL_ADD, _LL_RESTRICT = 444, 445, 446
_LL_READ = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR
_LL_FILE = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # the rights a rule on a file may hold: EXECUTE, WRITE, READ, TRUNCATE,
# IOCTL_DEV


def landlock(rules, libc):
    """Confine this process and its children to ``rules`` ([path, writable] pairs: read and execute beneath each
    path, or every file-system right beneath a writable one), deny TCP bind and connect (ABI 4+) and signals or
    abstract sockets out of the domain (ABI 6+). Rlimits mode, where no bwrap namespace hides the host's files:
    the data and checkpoints a program could read its tests or answers from. Returns the ABI, 0 where the kernel
    has no Landlock (the program then keeps the uid's file system: docs/rewards.md)."""
    import ctypes

    abi = libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = ctypes.create_string_buffer(struct.pack("<QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:size])
    ruleset = libc.syscall(_LL_CREATE, attr, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    for path, writable in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:  # not there, or not reachable by this uid: nothing to grant
            continue
        access = (fs if writable else _LL_READ) & (fs if os.path.isdir(f"/proc/self/fd/{fd}") else _LL_FILE)
        rule = ctypes.create_string_buffer(struct.pack("<Qi", access, fd))  # struct landlock_path_beneath_attr
        done = libc.syscall(_LL_ADD, ruleset, ctypes.c_uint32(1), rule, ctypes.c_uint32(0))  # PATH_BENEATH
        os.close(fd)
        if done != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path} failed")
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(_LL_RESTRICT, ruleset, ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(ruleset)
    return abi


def program_child(req, resp, path, uid, cpu, mem, nproc, fsize, bpf=None, libc=None, rules=None):
    """The fork's child: confine itself, then :func:`serve`. Exit 5: it could not (a sandbox error)."""
    try:
        low, high = sorted((req, resp))
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, 1 << 20)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if os.getuid() == 0:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        for res, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_FSIZE, fsize)):
            resource.setrlimit(res, (v, v))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu s, SIGKILL a second later
        if rules is not None:
            landlock(rules, libc)
        if bpf:
            load_seccomp(bpf, libc)
        with open(path) as f:
            source = f.read()
    except BaseException as e:
        os.write(2, f"sandbox launcher: {type(e).__name__}: {e}\n".encode())
        os._exit(5)
    try:
        serve(source, req, resp)
    except MemoryError:
        os._exit(3)
    except BaseException:
        os._exit(1)
    os._exit(0)


# ---------------------------------------------------------------------------- the judge's side (B)
class ChannelBroken(BaseException):
    """The program died or left the protocol: not an Exception, so a test's ``except Exception`` cannot hide it
    (and the judge fails the run anyway)."""


def decode(value, depth=0):
    """Untrusted tagged JSON to exact builtin types (Remote for handles); ValueError on anything else."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deep")
    t = type(value)
    if value is None or t in (bool, int, float, str):
        return value
    if t is not dict or len(value) != 1:
        raise ValueError(f"malformed value of type {t.__name__}")
    (tag, v), *_ = value.items()
    if tag == "h" and type(v) is int:
        return Remote(v)
    if tag == "x" and type(v) is str:
        return int(v, 16)
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2 and all(type(x) in (int, float) for x in v):
        return complex(v[0], v[1])
    if tag == "d" and type(v) is list:
        out = {}
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed dict item")
            out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
        return out
    kinds = {"l": list, "t": tuple, "s": set, "f": frozenset}
    if tag in kinds and type(v) is list:
        return kinds[tag](decode(x, depth + 1) for x in v)
    raise ValueError(f"malformed value tag {tag!r}")


def encode_for_program(value, depth=0):
    """The judge's arguments to a program call: plain data and handles only."""
    if depth > MAX_DEPTH:
        raise ValueError("argument nested too deep")
    t = type(value)
    if t is Remote:
        return {"h": value._id}
    if t is int and not -(1 << 62) < value < (1 << 62):
        return {"x": format(value, "x")}
    if value is None or t in (bool, int, float, str):
        return value
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[t]
        return {tag: [encode_for_program(v, depth + 1) for v in value]}
    if t is dict:
        return {"d": [[encode_for_program(k, depth + 1), encode_for_program(v, depth + 1)] for k, v in value.items()]}
    if t is bytes:
        return {"b": value.hex()}
    if t is complex:
        return {"c": [value.real, value.imag]}
    raise TypeError(f"a {t.__name__} cannot be passed to the program (plain data only)")


class Channel:
    def __init__(self, req, resp):
        self.req, self.resp = req, resp
        self.broken = None
        self.remote_errors = []

    def ask(self, *request):
        """Send a request, return (found, value); a program's exception is raised here as the builtin exception
        of that name (else RuntimeError: also StopIteration, which would end a test's map() or filter() as if
        every case had been checked); anything out of protocol breaks the channel."""
        if self.broken:
            raise ChannelBroken(self.broken)
        try:
            send(self.req, list(request))
            reply = receive(self.resp)
            if type(reply) is list and len(reply) == 2 and reply[0] == "ok":
                return True, decode(reply[1])
            if reply == ["missing"]:
                return False, None
            if not (type(reply) is list and len(reply) == 3 and reply[0] == "err"):
                raise ValueError("reply out of protocol")
            name, message = reply[1], reply[2]
            if type(name) is not str or type(message) is not str:
                raise ValueError("reply out of protocol")
        except Exception as e:  # EOF, OSError, a malformed reply (ValueError, TypeError, RecursionError, ...)
            self.broken = f"{type(e).__name__}: {e}"
            raise ChannelBroken(self.broken) from None
        self.remote_errors.append(name)
        cls = getattr(builtins, name, None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)) or issubclass(cls, _STOPS):
            raise RuntimeError(f"{name}: {message}")
        raise cls(message)


CHANNEL = None


class Remote:
    """An object of the program's, seen by the tests: it can be called and its attributes taken, over the pipe;
    it has no other behaviour (compared, it is only equal to itself)."""

    __slots__ = ("_id",)

    def __init__(self, handle):
        self._id = handle

    def __call__(self, *args, **kwargs):
        a = encode_for_program(list(args))
        kw = {"d": [[k, encode_for_program(v)] for k, v in kwargs.items()]}
        return CHANNEL.ask("call", self._id, a, kw)[1]

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return CHANNEL.ask("getattr", self._id, name)[1]

    def __repr__(self):
        return f"<program object {self._id}>"


class ProgramGlobals(dict):
    """The tests' globals: a name the tests did not define and that is no builtin is looked up in the program. A
    name the program is asked to define (``asked``: the question's stubs) is the program's even where a builtin
    has it: tests of a ``def sum(xs)`` question test the program's ``sum``, not Python's; a program that does not
    define it fails them (NameError), it does not pass them with the builtin."""

    def __init__(self, asked=(), **names):
        super().__init__(**names)
        self.asked = frozenset(asked)

    def __missing__(self, name):
        if hasattr(builtins, name) and name not in self.asked:
            raise KeyError(name)
        found, value = CHANNEL.ask("get", name)
        if not found:
            if name in self.asked:
                raise NameError(f"the program does not define {name!r}")
            raise KeyError(name)
        self[name] = value
        return value


def _child_status(pid):
    """How the program's process ended (waits for it)."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"signal": sig}
    return {"exit": os.WEXITSTATUS(status)}


def not_dumpable():
    """PR_SET_DUMPABLE 0: a process of the same uid without CAP_SYS_PTRACE cannot open /proc/<judge>/{mem,fd,
    environ} nor ptrace it. Set before the fork (so no window where the program runs beside a dumpable judge)
    and again after a uid change (which resets it). As root it is not needed (the program runs on another uid
    than the judge's, which is all ptrace and /proc check then) and not done: ctypes costs milliseconds a run."""
    if os.getuid() == 0:
        return
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def judge(pid, req, resp, input_fd, verdict_fd, judge_uid, mem):
    global CHANNEL
    os.write(verdict_fd, b"started\n")
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))  # what the program sends it is bounded too
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(judge_uid)
        os.setuid(judge_uid)  # the program has another uid: it cannot ptrace, signal or open /proc/<judge>/*
    with os.fdopen(input_fd, "rb") as f:
        nonce = f.readline().decode().strip()
        has_tests = f.readline().strip() == b"1"
        asked = f.readline().decode().split()
        tests = f.read().decode()
    CHANNEL = Channel(req, resp)
    status, detail = "failed", ""
    try:
        reply = receive(resp)
        if type(reply) is not list or len(reply) != 2 or reply[0] != "loaded":
            raise ValueError("load report out of protocol")
        if reply[1] is not None:
            status = "memory" if reply[1] == "MemoryError" else "failed"
            detail = f"the program raised {str(reply[1])[:100]}"
        elif not has_tests:
            status = "passed"
        else:
            exec(compile(tests, "tests.py", "exec"), ProgramGlobals(asked, __name__="__main__", __builtins__=builtins))
            if CHANNEL.broken:
                raise ChannelBroken(CHANNEL.broken)
            status = "passed"
    except ChannelBroken as e:
        detail = f"channel broken: {e}"
    except (EOFError, ValueError) as e:
        CHANNEL.broken = CHANNEL.broken or f"{type(e).__name__}: {e}"
        detail = f"channel broken: {CHANNEL.broken}"
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        status = "memory" if "MemoryError" in CHANNEL.remote_errors else "failed"
        detail = "the tests failed"
    if CHANNEL.broken and status == "passed":
        status = "failed"
    os.close(req)
    if CHANNEL.broken:  # the program ended early: how (a signal names a limit)
        child = _child_status(pid)
        sig = child.get("signal")
        if sig == 24:  # SIGXCPU
            status = "cpu_limit"
        elif sig:
            status = "killed"
        elif child["exit"] == 3:  # the program's side ran out of memory while answering
            status = "memory"
    else:
        child = {}
    send_verdict(verdict_fd, {"nonce": nonce, "status": status, "detail": detail, "child": child})


def send_verdict(fd, verdict):
    os.write(fd, (dumps(verdict) + "\n").encode())
    os.close(fd)


def main():
    input_fd, verdict_fd = int(sys.argv[1]), int(sys.argv[2])
    path = sys.argv[3]
    uid, judge_uid, cpu, mem, nproc, fsize = map(int, sys.argv[4:10])
    bpf = bytes.fromhex(sys.argv[10]) if len(sys.argv) > 10 and sys.argv[10] != "-" else None
    rules = None
    if len(sys.argv) > 11:  # a memory file's fd: read here, closed with the rest in the program's process
        with os.fdopen(int(sys.argv[11]), "rb") as f:
            rules = loads(f.read().decode())
    libc = None
    if bpf or rules is not None:  # ctypes loaded before any uid drop (the Python install may not be readable after)
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    not_dumpable()
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        program_child(req_r, resp_w, path, uid, cpu, mem, nproc, fsize, bpf, libc, rules)
    os.close(req_r)
    os.close(resp_w)
    os.close(0)
    judge(pid, req_w, resp_r, input_fd, verdict_fd, judge_uid, mem)
    os._exit(0)


if __name__ == "__main__":
    main()
