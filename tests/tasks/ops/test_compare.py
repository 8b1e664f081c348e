"""grpoflow compare: two runs logged the way the pipeline logs them (real MLflow store, real CLI)."""

import json

from mlflow.tracking import MlflowClient

from grpoflow.flows.cli import main
from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import load_config
from grpoflow.tasks.ops.compare import config_differences, run_summary
from grpoflow.tasks.tracking.tracker import stage_run, start_pipeline_run, tracking_uri


def logged_run(out, name, overrides, rewards, accuracy):
    """A parent run with the resolved config, a grpo stage run with per-step reward/step_time, eval metrics."""
    cfg = load_config(None, [f"run.output_dir={out}", f"run.name={name}", *overrides])
    parent = start_pipeline_run(cfg)
    with stage_run(cfg, parent.run_id, PIPELINE["grpo"]) as grpo:
        for step, r in enumerate(rewards, 1):
            grpo.log_metrics({"reward": r, "step_time": 1.0 + step / 10}, step=step)
    parent.log_metrics({"accuracy_before": accuracy[0], "accuracy_after": accuracy[1]})
    parent.end(True)  # FINISHED, and what was logged sent (the logger sends in the background)
    ws = out / name
    ws.mkdir(parents=True, exist_ok=True)  # it holds the runs' tracking journal already
    (ws / "run.json").write_text(json.dumps({"mlflow_run_id": parent.run_id, "tracking_uri": tracking_uri(cfg)}))
    return cfg, parent.run_id, ws


def test_summary_and_cli_table(tmp_path, capsys):
    cfg, a_id, a_ws = logged_run(tmp_path, "a", [], [1.0, 1.0, 2.0, 3.0], (0.2, 0.5))
    _, b_id, _ = logged_run(tmp_path, "b", ["grpo.learning_rate=0.002"], [1.0, 2.0], (0.2, 0.3))
    client = MlflowClient(tracking_uri(cfg))
    a = run_summary(client, a_id, window=2)
    assert a["steps"] == 4 and a["reward_first"] == 1.0 and a["reward_last"] == 2.5
    assert abs(a["accuracy_gain_points"] - 30.0) < 1e-9 and a["step_time_median"] == 1.25
    assert a["grpo_seconds"] >= 0 and a["status"] == "FINISHED"
    diff = config_differences(a["params"], run_summary(client, b_id)["params"])
    assert diff["grpo.learning_rate"] == ("0.001", "0.002") and diff["run.name"] == ("a", "b")
    # a workspace folder and a bare run id, mixed
    assert main(["compare", str(a_ws), b_id, "--tracking-uri", tracking_uri(cfg), "--window", "2"]) == 0
    out = capsys.readouterr().out
    assert "+30.0 points" in out and "+10.0 points" in out
    assert "config grpo.learning_rate" in out and "0.002" in out
    assert "config run.name" not in out  # names differ by definition


def test_compare_errors_name_the_argument(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["compare", str(tmp_path), "x"]) == 2
    assert "no run.json" in capsys.readouterr().err
    assert main(["compare", "not-a-dir-run-id", "y"]) == 2
    assert "--tracking-uri" in capsys.readouterr().err
