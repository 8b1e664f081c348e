"""The pipeline as a deployment entry point (infra/prefect.yaml: grpo-pipeline/local, /docker-gpu, /k8s-gpu).

A deployment's parameters must be JSON, so this flow takes what a user types on the command line instead of a
resolved config dict: ``config``, the path of a YAML config (relative to the working directory: the repo root
locally, /app in the images), and ``overrides``, a list of "key=value" strings, loaded exactly as `grpoflow run`
loads them (flows/cli_run.py). It then runs the pipeline body in this flow run, so one deployment run is one flow run
and one MLflow parent run (tagged with this flow run's id).

    prefect deployment run grpo-pipeline/local --param config=configs/default.yaml \\
        --param overrides='["grpo.max_steps=50"]'
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from grpoflow.flows.run_logs import show_grpoflow_info
from grpoflow.tasks.config import ConfigError, PipelineConfig, load_run_config
from grpoflow.tasks.pipeline.run_folder import run_folder_problem
from grpoflow.tasks.storage.store import open_store
from grpoflow.tasks.storage.workspace import join_location


def workspace_of(cfg: PipelineConfig) -> str:
    """The run's workspace, <run.output_dir>/<run.name>, as `grpoflow run` names it: a local folder made absolute
    (relative to the flow run's working directory: the checkout, or /app in the images), an s3:// URI kept as a
    URI (a Path would turn it into the local folder <cwd>/s3:/bucket/..., silently)."""
    return join_location(cfg.run.output_dir, cfg.run.name)


def refuse_other_folders(cfg: PipelineConfig, workspace: str) -> None:
    """A ConfigError when ``workspace`` is a folder of no grpoflow run (another tool's config.yaml, or files but no
    config.yaml: tasks/pipeline/run_folder.py), as `grpoflow run` refuses it: the stages would empty its folders.
    A grpoflow run there is resumed, as the pipeline flow does."""
    store = open_store(workspace, cfg.storage)
    if problem := run_folder_problem(store, store.read("config.yaml")):
        raise ConfigError(f"run.name {cfg.run.name!r}: {problem}. Pick another run.name or run.output_dir")


@flow(name="grpo-pipeline")
def grpo_pipeline(config: str | None = None, overrides: list[str] | None = None) -> dict:
    """Run the pipeline on CONFIG (default: the embedded offline config) plus key=value overrides.

    Named as the flow is (grpo-pipeline -> grpo_pipeline): `prefect deploy -n grpo-pipeline/local` finds a
    deployment by the function name after the entry point's colon."""
    from grpoflow.flows import pipeline  # torch and friends: not when `prefect deploy` loads this module

    show_grpoflow_info()
    cfg = load_run_config(config, overrides)
    workspace = workspace_of(cfg)
    refuse_other_folders(cfg, workspace)
    get_run_logger().info("config %s + %s: workspace %s", config or "(default)", list(overrides or []), workspace)
    # the body, not the flow object: this deployment run is the pipeline's flow run (no nested run of the same name)
    result = pipeline.grpo_pipeline.fn(config=cfg, workspace=workspace)
    if "eval" in result:
        e = result["eval"]
        get_run_logger().info("accuracy %.1f%% -> %.1f%%", 100 * e["accuracy_before"], 100 * e["accuracy_after"])
    return {k: result[k] for k in ("workspace", "mlflow_run_id") if k in result}
