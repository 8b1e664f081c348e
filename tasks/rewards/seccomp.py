"""A seccomp-BPF filter for the code sandbox, built here (no libseccomp): it denies, with EPERM, the syscalls a
confined program has no use for and an escape would need: ptrace, process_vm_readv/writev, mount and the new
mount API, pivot_root, chroot, unshare, setns, clone with a namespace flag, keyctl/add_key/request_key, bpf,
perf_event_open, userfaultfd, io_uring, module and kexec loading, open_by_handle_at, swapon/off, reboot, acct.
clone3 answers ENOSYS (its flags sit in memory a filter cannot read), so libc falls back to clone, whose flags
are checked. A syscall of another ABI (x32 on x86_64, or a foreign architecture) is refused likewise.

bwrap loads it with ``--seccomp FD`` (:func:`filter_bytes`, the ``struct sock_filter`` array) just before it
runs the launcher, so it covers the launcher and every process of the run."""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: nr @0, arch @4, instruction_pointer @8, args[6] @16 (u64 each; low half first)
_ARCH_NR, _NR, _ARG0_LO = 4, 0, 16
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000
_X32_BIT = 0x40000000
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

DENIED = (
    "ptrace process_vm_readv process_vm_writev mount umount2 pivot_root chroot unshare setns keyctl add_key "
    "request_key bpf perf_event_open userfaultfd io_uring_setup io_uring_enter io_uring_register init_module "
    "finit_module delete_module kexec_load kexec_file_load open_by_handle_at swapon swapoff reboot acct open_tree "
    "move_mount fsopen fsconfig fsmount fspick mount_setattr"
).split()

# (AUDIT_ARCH, syscall numbers) from the kernel's unistd tables: x86_64 (asm/unistd_64.h), aarch64 (generic)
_TABLES = {
    "x86_64": (
        0xC000003E,
        dict(
            ptrace=101,
            process_vm_readv=310,
            process_vm_writev=311,
            mount=165,
            umount2=166,
            pivot_root=155,
            chroot=161,
            unshare=272,
            setns=308,
            keyctl=250,
            add_key=248,
            request_key=249,
            bpf=321,
            perf_event_open=298,
            userfaultfd=323,
            io_uring_setup=425,
            io_uring_enter=426,
            io_uring_register=427,
            init_module=175,
            finit_module=313,
            delete_module=176,
            kexec_load=246,
            kexec_file_load=320,
            open_by_handle_at=304,
            swapon=167,
            swapoff=168,
            reboot=169,
            acct=163,
            open_tree=428,
            move_mount=429,
            fsopen=430,
            fsconfig=431,
            fsmount=432,
            fspick=433,
            mount_setattr=442,
            clone=56,
            clone3=435,
        ),
    ),  # fmt: skip
    "aarch64": (
        0xC00000B7,
        dict(
            ptrace=117,
            process_vm_readv=270,
            process_vm_writev=271,
            mount=40,
            umount2=39,
            pivot_root=41,
            chroot=51,
            unshare=97,
            setns=268,
            keyctl=219,
            add_key=217,
            request_key=218,
            bpf=280,
            perf_event_open=241,
            userfaultfd=282,
            io_uring_setup=425,
            io_uring_enter=426,
            io_uring_register=427,
            init_module=105,
            finit_module=273,
            delete_module=106,
            kexec_load=104,
            kexec_file_load=294,
            open_by_handle_at=265,
            swapon=224,
            swapoff=225,
            reboot=142,
            acct=89,
            open_tree=428,
            move_mount=429,
            fsopen=430,
            fsconfig=431,
            fsmount=432,
            fspick=433,
            mount_setattr=442,
            clone=220,
            clone3=435,
        ),
    ),  # fmt: skip
}


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_bytes(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture (``platform.machine()``), None where there is no table."""
    table = _TABLES.get(machine or platform.machine())
    if table is None:
        return None
    arch, nr = table
    deny = sorted({nr[name] for name in DENIED})
    errno_eperm = _ERRNO | errno.EPERM
    prog = [_ins(_LD_W_ABS, _ARCH_NR), _ins(_JEQ_K, arch, 1, 0), _ins(_RET_K, _KILL), _ins(_LD_W_ABS, _NR)]
    if arch == 0xC000003E:  # x32 syscalls share the arch value: refuse the whole ABI
        prog += [_ins(_JGE_K, _X32_BIT, 0, 1), _ins(_RET_K, errno_eperm)]
    prog += [_ins(_JEQ_K, nr["clone3"], 0, 1), _ins(_RET_K, _ERRNO | errno.ENOSYS)]
    # clone: flags are arg 0 on both tables' ABIs; any namespace flag is refused
    prog += [_ins(_JEQ_K, nr["clone"], 0, 3), _ins(_LD_W_ABS, _ARG0_LO), _ins(_JSET_K, _CLONE_NAMESPACES, 0, 1)]
    prog += [_ins(_RET_K, errno_eperm), _ins(_LD_W_ABS, _NR)]
    for i, n in enumerate(deny):  # each: equal -> jump to the shared EPERM return after the list
        prog.append(_ins(_JEQ_K, n, len(deny) - i, 0))
    prog += [_ins(_RET_K, _ALLOW), _ins(_RET_K, errno_eperm)]
    return b"".join(prog)
