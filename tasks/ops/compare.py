"""Two pipeline runs side by side, from MLflow: ``grpoflow compare RUN_A RUN_B``.

A run is named by its workspace folder or s3:// URI (its ``run.json`` holds the parent run id and tracking URI) or by
an MLflow run id (with ``--tracking-uri`` or $MLFLOW_TRACKING_URI). For each run:

    accuracy before/after GRPO and the gain    parent run metrics (written by the eval stage)
    reward first/last                          mean of the GRPO stage's ``reward`` over its first/last
                                               ``window`` logged steps
    steps, step time                           number of logged GRPO steps, median ``step_time``
    stage seconds                              end - start of each nested stage run (its latest attempt)

and every config param (the flattened config the parent run logged) whose values differ.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from grpoflow.tasks.config.secrets import real_uri
from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage.s3 import is_s3_uri
from grpoflow.tasks.storage.store import open_store
from grpoflow.tasks.tracking.tracker import PARENT_TAG


def resolve_run(ref: str, tracking_uri: str | None, storage: StorageConfig | None = None) -> tuple[str, str]:
    """(tracking uri, parent run id) of a workspace (a folder or an s3:// URI, read with ``storage``) or an MLflow
    run id."""
    path = Path(ref)
    if is_s3_uri(ref) or path.is_dir():  # a workspace: its run.json, read through its store
        text = open_store(ref, storage).read("run.json")
        if text is None:
            raise ValueError(f"{ref}: no run.json; not a run workspace (<output_dir>/<run name>)")
        data = json.loads(text)
        uri = real_uri(data["tracking_uri"], tracking_uri, who="grpoflow compare", also=" or --tracking-uri")
        return uri, data["mlflow_run_id"]
    if ref.startswith((".", "~")) or "/" in ref or "\\" in ref:  # a path, never a run id: it does not exist
        raise ValueError(f"{ref}: no such run workspace folder (looked at {path.expanduser().absolute()})")
    if tracking_uri is None:
        raise ValueError(f"{ref}: not a folder; an MLflow run id needs --tracking-uri or $MLFLOW_TRACKING_URI")
    return tracking_uri, ref


def _history(client: MlflowClient, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def run_summary(client: MlflowClient, run_id: str, window: int = 20) -> dict[str, Any]:
    """The comparable numbers of one pipeline run (see the module docstring)."""
    parent = client.get_run(run_id)
    out: dict[str, Any] = {"run": parent.info.run_name, "run_id": run_id, "status": parent.info.status}
    m = parent.data.metrics
    if "accuracy_before" in m and "accuracy_after" in m:
        out.update(
            accuracy_before=m["accuracy_before"],
            accuracy_after=m["accuracy_after"],
            accuracy_gain_points=100 * (m["accuracy_after"] - m["accuracy_before"]),
        )
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.{PARENT_TAG} = '{run_id}'", order_by=["attributes.start_time ASC"]
    )
    stages = {c.data.tags.get("grpoflow.stage"): c for c in children}  # a resumed run: the latest attempt wins
    for name, child in stages.items():
        if child.info.end_time and child.info.start_time:
            out[f"{name}_seconds"] = (child.info.end_time - child.info.start_time) / 1000
    grpo = stages.get("grpo")
    if grpo is not None:
        reward = _history(client, grpo.info.run_id, "reward")
        step_time = _history(client, grpo.info.run_id, "step_time")
        if reward:
            out.update(
                steps=len(reward),
                reward_first=statistics.fmean(reward[:window]),
                reward_last=statistics.fmean(reward[-window:]),
            )
        if step_time:
            out["step_time_median"] = statistics.median(step_time)
    out["params"] = dict(parent.data.params)
    return out


def config_differences(a: dict[str, str], b: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """Params whose values differ (a key missing on one side shows as None), sorted by key."""
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


ROWS = (
    ("accuracy before GRPO", "accuracy_before", "{:.1%}"),
    ("accuracy after GRPO", "accuracy_after", "{:.1%}"),
    ("accuracy gain", "accuracy_gain_points", "{:+.1f} points"),
    ("reward, first steps", "reward_first", "{:.3f}"),
    ("reward, last steps", "reward_last", "{:.3f}"),
    ("GRPO steps", "steps", "{:d}"),
    ("GRPO step time (median s)", "step_time_median", "{:.2f}"),
    ("SFT stage s", "sft_seconds", "{:.0f}"),
    ("GRPO stage s", "grpo_seconds", "{:.0f}"),
    ("status", "status", "{}"),
)


def table_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(label, value of a, value of b) for the metric rows, then one row per differing config param."""

    def fmt(summary: dict[str, Any], key: str, spec: str) -> str:
        return spec.format(summary[key]) if key in summary else "-"

    rows = [(label, fmt(a, key, spec), fmt(b, key, spec)) for label, key, spec in ROWS]
    for key, (va, vb) in config_differences(a["params"], b["params"]).items():
        if key not in ("run.name", "run.output_dir"):
            rows.append((f"config {key}", "-" if va is None else va, "-" if vb is None else vb))
    return rows
