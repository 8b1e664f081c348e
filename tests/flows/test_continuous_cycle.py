"""One continuous cycle's bookkeeping, with the pipeline and MLflow replaced: what the ledger holds when a step
after training fails."""

import json
import logging
import sys

import pytest

from grpoflow.tasks.config import load_config
from grpoflow.tasks.ops.datasource import Ledger, list_source
from tests.paths import MICRO


def test_a_failure_tagging_the_mlflow_run_after_training_still_records_the_files(tmp_path, monkeypatch):
    """The pipeline finished (the model may be promoted already): an MLflow error while tagging its run must not
    leave the files out of the ledger, or the next cycle trains on them a second time."""
    import grpoflow.flows.continuous as continuous
    import grpoflow.tasks.ops.continuous as ops

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"question": "What is 1 + 2?", "answer": "3"}) + "\n")
    cfg = load_config(MICRO, [f"run.output_dir={tmp_path}", "data.eval_source=heldout.jsonl"])
    pipeline = type(sys)("grpoflow.flows.pipeline")  # the real one imports torch; a cycle needs only this name
    pipeline.grpo_pipeline = lambda **kw: {"mlflow_run_id": "run-1", "registry": None}
    monkeypatch.setitem(sys.modules, "grpoflow.flows.pipeline", pipeline)
    monkeypatch.setattr(continuous, "new_files_task", lambda s, p, st: [f.__dict__ for f in list_source(s)])
    monkeypatch.setattr(continuous, "champion_task", lambda cfg, dest: None)
    monkeypatch.setattr(ops, "cycle_config", lambda cfg, name, data_file, warm_start: cfg)

    def tag_run(*args):
        raise ConnectionError("MLflow server unreachable")

    monkeypatch.setattr(continuous, "_tag_run", tag_run)
    state = tmp_path / "state"
    with pytest.raises(ConnectionError):
        continuous._cycle(cfg, str(src), str(state), logging.getLogger("test"))
    assert [e["name"] for e in Ledger(state / "ledger.json").entries()] == ["a.jsonl"]
