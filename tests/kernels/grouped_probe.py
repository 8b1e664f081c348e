"""A Triton kernel that records where kernels/triton_logprobs.py's grouped launch order sends each program.

Its own module because Triton resolves the names a kernel calls from the kernel's module globals: a kernel
defined inside a test function cannot see a ``_grouped`` imported there. Imported only by tests that run under
TRITON_INTERPRET=1 (triton reads the variable when this module defines the kernel)."""

import triton
import triton.language as tl

from grpoflow.kernels.triton_logprobs import _grouped


@triton.jit
def where_each_program_goes(OUT, num_n, num_v, GROUP_N: tl.constexpr):
    """OUT[pid] = (row block, vocabulary index) that program ``pid`` takes."""
    pid = tl.program_id(0)
    pid_n, pid_v = _grouped(pid, num_n, num_v, GROUP_N)
    tl.store(OUT + 2 * pid, pid_n)
    tl.store(OUT + 2 * pid + 1, pid_v)
