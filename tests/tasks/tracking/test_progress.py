"""Progress without a terminal (a log file, a pod, a Prefect worker): log lines, not a silent rich bar."""

from __future__ import annotations

import logging

import pytest

from grpoflow.tasks.tracking.progress import progress_bar, progress_line


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("GRPOFLOW_PROGRESS", "1")  # the suite turns progress off (conftest)


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "grpoflow.progress"]


def test_every_step_is_a_line_when_the_interval_is_zero(on, monkeypatch, caplog):
    monkeypatch.setenv("GRPOFLOW_PROGRESS_EVERY_S", "0")
    with caplog.at_level(logging.INFO, "grpoflow.progress"), progress_bar("grpo", 3) as advance:
        for k in range(3):
            advance(reward=0.5 * k, loss=0.01)
    got = lines(caplog)
    assert [g.split()[1] for g in got] == ["1/3", "2/3", "3/3"]
    assert got[1].startswith("grpo 2/3 (67%)") and "left" in got[1] and "reward=0.5" in got[1]
    assert "left" not in got[2]  # nothing is left at the end


def test_a_long_interval_logs_the_first_and_the_last_step_only(on, monkeypatch, caplog):
    monkeypatch.setenv("GRPOFLOW_PROGRESS_EVERY_S", "1000")
    with caplog.at_level(logging.INFO, "grpoflow.progress"), progress_bar("eval", 10) as advance:
        for _ in range(5):
            advance(2)
    assert [g.split()[1] for g in lines(caplog)] == ["2/10", "10/10"]


def test_a_resumed_run_counts_from_its_start_and_paces_by_this_process_only(on, monkeypatch, caplog):
    monkeypatch.setenv("GRPOFLOW_PROGRESS_EVERY_S", "0")
    with caplog.at_level(logging.INFO, "grpoflow.progress"), progress_bar("grpo", 20, start=15) as advance:
        advance()
    assert lines(caplog)[0].startswith("grpo 16/20 (80%)")
    # 1 unit done here in 10 s: 4 left take ~40 s (not 16 units in 10 s)
    assert progress_line("grpo", 16, 20, 10.0, 1, {}) == "grpo 16/20 (80%)  0:10 elapsed, ~0:40 left"


def test_off_means_silent(monkeypatch, caplog):
    monkeypatch.setenv("GRPOFLOW_PROGRESS", "0")
    monkeypatch.setenv("GRPOFLOW_PROGRESS_EVERY_S", "0")
    with caplog.at_level(logging.INFO, "grpoflow.progress"), progress_bar("grpo", 2) as advance:
        advance()
        advance()
    assert lines(caplog) == []
