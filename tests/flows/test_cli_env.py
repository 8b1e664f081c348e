"""The CLI's OpenMP wait policy: passive when other processes keep a core busy, never over the user's choice."""

import subprocess
import sys

from grpoflow.flows import cli


def test_busy_cores_sees_a_busy_process():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert cli.busy_cores(0.5) >= 0.7
    finally:
        hog.kill()
        hog.wait()


def test_wait_policy_follows_the_load_and_keeps_a_set_value(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(cli, "busy_cores", lambda seconds=0.5: 0.1)
    cli._openmp_wait_policy()
    assert "OMP_WAIT_POLICY" not in cli.os.environ
    monkeypatch.setattr(cli, "busy_cores", lambda seconds=0.5: 1.2)
    cli._openmp_wait_policy()
    assert cli.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli._openmp_wait_policy()
    assert cli.os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
