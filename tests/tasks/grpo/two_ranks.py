"""Running a cases module on two gloo processes under torchrun, as the distributed tests do."""

import os
import subprocess
import sys

from tests.paths import REPO


def run_two_ranks(module: str, *args: str) -> None:
    """``python -m torch.distributed.run --nproc_per_node=2 -m <module> <args>`` from the repository, one torch
    thread per process; fails with the tail of its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", module, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPOFLOW_PROGRESS": "0"}
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-8000:]
