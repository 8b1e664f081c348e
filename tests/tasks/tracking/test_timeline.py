"""Time outside the training loops (tasks/tracking/timeline.py): spans between marks, stage overheads, shares."""

import os
import subprocess
import sys
import time

import pytest

from grpoflow.tasks.tracking import timeline


def test_spans_stages_and_outside_share():
    m = {
        "config_loaded": 101.0,
        "imports_done": 104.0,
        "prefect_server_up": 110.0,
        "flow_start": 111.0,
        "parent_run_open": 111.5,
        "stage_start/data": 112.0,
        "stage_end/data": 113.0,
        "stage_start/sft": 113.0,
        "sft/loop_start": 115.0,
        "stage_end/sft": 135.0,
        "stage_start/grpo": 135.0,
        "grpo/generator_start": 136.0,
        "grpo/generator_up": 146.0,
        "stage_end/grpo": 190.0,
    }
    out = timeline.timeline_metrics(m, start=100.0, end=200.0, loops={"sft": 18.0, "grpo": 40.0})
    assert out["startup/config_s"] == 1.0 and out["startup/imports_s"] == 3.0
    assert out["startup/prefect_server_s"] == 6.0 and out["startup/flow_start_s"] == 1.0
    assert out["startup/parent_run_s"] == 0.5 and out["startup/to_first_sft_loop_s"] == 15.0
    assert out["startup/generator_s"] == 10.0
    assert "startup/to_first_grpo_loop_s" not in out  # no mark: no span (e.g. GRPO ran under torchrun)
    assert out["stage/data_s"] == 1.0 and "stage_overhead/data_s" not in out
    assert out["stage/sft_s"] == 22.0 and out["stage_overhead/sft_s"] == 4.0
    assert out["stage_overhead/grpo_s"] == 15.0
    assert out["run/wall_s"] == 100.0 and out["run/loop_s"] == 58.0
    assert out["run/outside_loop_share"] == pytest.approx(0.42)


def test_marks_keep_the_first_time_and_process_start_is_in_the_past():
    timeline.reset()
    timeline.mark("x")
    first = timeline.marks()["x"]
    time.sleep(0.01)
    timeline.mark("x")
    assert timeline.marks()["x"] == first
    start = timeline.process_start_time()
    assert start <= first <= time.time()
    assert time.time() - start < 24 * 3600 or os.getppid() == 1  # this process's start, not the machine's boot
    timeline.reset()


def test_a_process_execd_into_an_older_one_is_timed_from_its_import():
    """`bash -c 'pip install ... && grpoflow run'`: bash may exec the last command into its own process, whose
    starttime is before pip; the run's start-up must not count the installation."""
    probe = (
        "import time; from grpoflow.tasks.tracking import timeline; print(time.time() - timeline.process_start_time())"
    )
    gap = timeline.EXEC_GAP_S + 2
    out = subprocess.run(
        ["bash", "-c", f'sleep {gap}; exec "{sys.executable}" -c "{probe}"'], capture_output=True, text=True, check=True
    )
    assert float(out.stdout) < timeline.EXEC_GAP_S, out.stdout  # not the shell's start, `gap` s before
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert 0 <= float(plain.stdout) < timeline.EXEC_GAP_S  # a plain process: its own start
