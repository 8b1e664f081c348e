"""Continuous background fine-tuning: one cycle per run (infra/prefect.yaml: grpo-continuous/local, started by an
interval schedule and by the ``grpoflow.data.landed`` event).

    list the source -> files not in the ledger? -> none: done, nothing consumed
                                               -> check each (a bad one is quarantined: named by file
                                                  and line in the ledger and the log; the others train)
                                               -> gather them into one training file
                                               -> download the champion (registry alias), if any
                                               -> the pipeline: data -> GRPO from the champion -> eval -> export
                                                  -> register (the alias moves only when the new model beats the
                                                     champion on the same held-out rows by more than their noise:
                                                     a paired McNemar test, tasks/tracking/promotion.py)
                                               -> add the files to the ledger

The parameters are checked first (flows/parameters.py): a missing source folder fails in one line naming the
deployment and the parameter. The files are recorded in the ledger (``<state>/ledger.json``) only after the
pipeline finished, so a failed cycle consumes nothing. Before the pipeline starts the ledger names the cycle as
pending (its files and champion version); a cycle killed or failed stays pending and the next run continues it
(the same workspace: finished stages skipped, GRPO from its newest checkpoint) on exactly its files while they are
unchanged and the champion is the same, else trains them anew in a new cycle; when the champion moved because
the pending cycle's own model was promoted (killed between registration and the ledger), its files are recorded
as trained, not trained again (:func:`_promoted_by`). Recording the files ends the pending
cycle in the same write; ``grpoflow continuous-skip`` ends one that fails on every run, quarantining its files.
The state (ledger and cycle workspaces) may live on S3 (tasks/ops/datasource.py: state_location), so a worker pod
that restarts does not retrain on everything.
Run one cycle at a time (the deployment's concurrency limit is 1): besides, a cycle holds the state folder's lock
(tasks/storage/lock.py) from listing the files to writing the ledger, so a second cycle fails at once naming the
first rather than training on the same files.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from grpoflow.flows.parameters import continuous_config, quiet_parameter_errors
from grpoflow.flows.run_logs import show_grpoflow_info
from grpoflow.tasks.config import PipelineConfig, StorageConfig
from grpoflow.tasks.ops.datasource import DataFile, Ledger, list_source, state_location
from grpoflow.tasks.storage.lock import workspace_lock
from grpoflow.tasks.storage.s3 import is_s3_uri, local_path
from grpoflow.tasks.storage.store import join_location, open_store

# grpoflow.flows.pipeline (torch, transformers) and grpoflow.tasks.ops.continuous (mlflow) are imported where used:
# `prefect deploy` imports this module, and a cycle with no new data should start in seconds

LEDGER = "ledger.json"


# no Prefect cache: the ledger says which files are new, the registry which model is champion; a cached
# answer would be stale
@task(name="new-data-files", cache_policy=NO_CACHE)
def new_files_task(source: str, ledger_path: str, storage: StorageConfig | None = None) -> list[dict]:
    files = Ledger(ledger_path, storage).new_files(list_source(source, storage))  # storage: an s3:// endpoint
    return [f.__dict__ for f in files]


@task(name="champion", cache_policy=NO_CACHE)
def champion_task(cfg: PipelineConfig, dest: str) -> tuple[str, dict] | None:
    from grpoflow.tasks.ops.continuous import champion_model

    return champion_model(cfg, Path(dest))


@flow(name="grpo-continuous")
def grpo_continuous(
    config: str | None = None,
    overrides: list[str] | None = None,
    source: str | None = None,
    state_dir: str | None = None,
) -> dict:
    """One cycle: train on the files of ``source`` (a folder or s3://bucket/prefix) not consumed yet.

    ``config``/``overrides`` as for grpo-pipeline (the config must name a fixed held-out file,
    ``data.eval_source``); ``state_dir`` (a folder or s3:// URI) holds the ledger and one workspace per cycle
    (default <run.output_dir>/continuous, or <source>/_grpoflow-continuous for an s3:// source when
    run.output_dir is local)."""
    show_grpoflow_info()
    logger = get_run_logger()
    quiet_parameter_errors()  # a parameter problem: one line naming the deployment and parameter, no traceback
    cfg = continuous_config(config, overrides, source, state_dir)
    state = state_location(source, state_dir, cfg.run.output_dir)
    with workspace_lock(open_store(state, cfg.storage), "grpo-continuous cycle"):  # one cycle owns the ledger
        return _cycle(cfg, source, state, logger)


def _cycle(cfg: PipelineConfig, source: str, state: str, logger) -> dict:
    """One cycle, holding the state folder: new files -> pipeline -> ledger (the module docstring)."""
    ledger = Ledger(join_location(state, LEDGER), cfg.storage)
    listed = [DataFile(**f) for f in new_files_task(source, ledger.location, cfg.storage)]
    if not listed:
        logger.info("no new data files in %s (ledger %s): nothing to do", source, ledger.location)
        return {"consumed": [], "decision": None}
    pending = ledger.pending()
    if pending is not None:
        by_key = {f.key: f for f in listed}
        if all(k in by_key for k in pending["files"]):  # every file it trained is still there, unchanged
            later = len(listed) - len(pending["files"])
            waiting = f"; {later} file{'s' if later > 1 else ''} landed since wait for the next cycle" if later else ""
            logger.info(
                "continuing cycle %s, which did not finish (killed or failed): its %d files%s (one that fails on "
                "every run: grpoflow continuous-skip %s --reason ... sets it aside)",
                pending["cycle"], len(pending["files"]), waiting, source,
            )  # fmt: skip
            return _train(cfg, source, state, ledger, [by_key[k] for k in pending["files"]], pending, logger)
        logger.warning(
            "cycle %s did not finish and some of its files changed or are gone since: its files train anew",
            pending["cycle"],
        )
    return _train(cfg, source, state, ledger, listed, None, logger)


def _train(cfg: PipelineConfig, source: str, state: str, ledger: Ledger, new: list[DataFile], pending, logger) -> dict:
    """Train ``new`` in a new cycle, or in the ``pending`` one (the ledger's, :meth:`Ledger.pending`): its
    workspace again, so its finished stages are skipped and GRPO continues from its newest checkpoint."""
    from grpoflow.flows.pipeline import grpo_pipeline
    from grpoflow.tasks.ops.continuous import check_file, cycle_config, gather

    listed = new
    name = pending["cycle"] if pending is not None else time.strftime("cycle-%Y%m%d-%H%M%S")
    ws = join_location(state, "cycles", name)
    # the new rows and the champion are this worker's local inputs of the cycle (beside an S3 workspace's cache)
    incoming = (local_path(ws, cfg.storage.cache_dir) if is_s3_uri(ws) else Path(ws)) / "incoming"
    check = functools.partial(check_file, cfg=cfg)
    got = gather(new, incoming / "train.jsonl", cfg.storage, check=check, seen=ledger.contents())
    bad, changed = got.bad, got.changed
    for f in changed:  # rewritten since listed: neither trained nor recorded; the next cycle lists the new version
        logger.warning("%s changed since it was listed: left for the next cycle", f.name)
    for f, seen in got.same:  # uploaded again (a new ETag), the same bytes: recorded as the earlier one was
        logger.info(
            "%s: the same bytes as %s, %s in cycle %s (uploaded again: a new ETag): not trained again",
            f.name, seen["name"], "quarantined" if seen.get("quarantined") else "trained", seen.get("cycle"),
        )  # fmt: skip
    if got.same:
        ledger.same_content(got.same, cycle=name)
    for f, error in bad:  # one line each, naming the landed file and line; the good files train
        logger.error("quarantined %s: %s (fix it and land it again under its name)", f.name, error)
    if bad:
        ledger.quarantine(bad, cycle=name)
    new = got.files
    quarantined = [{"name": f.name, "uri": f.uri, "error": e} for f, e in bad]
    if not new:
        logger.info(
            "no new data file can train (%d quarantined, %d changed, %d already seen): nothing to do",
            len(bad), len(changed), len(got.same),
        )  # fmt: skip
        return {"consumed": [], "quarantined": quarantined, "decision": None}
    logger.info("%d new data files (%d rows) in %s: %s", len(new), got.rows, source, [f.name for f in new])
    champion = champion_task(cfg, str(incoming / "champion"))
    version = champion[1]["version"] if champion is not None else None
    same_files = pending is not None and [f.key for f in new] == pending["files"]
    if same_files and version != pending["champion"] and (run_id := _promoted_by(cfg, ws, champion)):
        # killed after its model was promoted, before the ledger said so: recorded now, not trained a second time
        ledger.record(new, cycle=name, mlflow_run_id=run_id)
        decision = f"promoted before the cycle was stopped: {champion[1]['name']} version {version}"
        logger.info("cycle %s: %s; ledger %s: recorded %d files", name, decision, ledger.location, len(new))
        return {"cycle": name, "consumed": [f.name for f in new], "quarantined": quarantined, "decision": decision,
                "mlflow_run_id": run_id}  # fmt: skip
    if pending is not None and (version != pending["champion"] or not same_files):
        # its GRPO would continue from checkpoints of another start: the files train from the start, in a new cycle
        logger.warning(
            "cycle %s cannot continue (it started from champion version %s, the registry's is now %s; it trained %d "
            "files, %d of them can train now): they train in a new cycle",
            name, pending["champion"], version, len(pending["files"]), len(new),
        )  # fmt: skip
        return _train(cfg, source, state, ledger, listed, None, logger)
    if champion is None:
        logger.info("no champion in the registry yet: starting from %s (SFT: %s)", cfg.model.name, cfg.sft.enabled)
    else:
        logger.info("warm start from champion %s version %s", champion[1]["name"], champion[1]["version"])
    cycle = cycle_config(cfg, name, got.path, warm_start=champion[0] if champion is not None else None)
    ledger.begin(name, new, version)  # a cycle killed from here on is continued by the next one (_cycle)
    result = grpo_pipeline(config=cycle, workspace=ws, init_version=version)
    reg = result.get("registry")
    if reg is None:
        decision = "not registered (no exported model)"
    else:
        decision = f"{'promoted' if reg['promoted'] else 'kept the champion'}: {reg['name']} version {reg['version']}"
        decision += f"; {reg['reason']}"
    if "eval" in result:  # the starting model (the champion, when warm-started) on the same held-out rows
        e = result["eval"]
        decision += f" (held-out: start {e['accuracy_before']:.1%}, new {e['accuracy_after']:.1%})"
    logger.info("decision: %s", decision)
    # the ledger first: the files trained (the model may be promoted already), whatever tagging the run does next;
    # one write records them and ends the pending cycle
    ledger.record(new, cycle=name, mlflow_run_id=result["mlflow_run_id"])
    logger.info("ledger %s: recorded %d files", ledger.location, len(new))
    _tag_run(cycle, result, new, champion, decision, quarantined)
    out = {"cycle": name, "consumed": [f.name for f in new], "quarantined": quarantined, "decision": decision}
    return {**out, "mlflow_run_id": result["mlflow_run_id"]}


def _promoted_by(cfg: PipelineConfig, ws: str, champion: tuple[str, dict] | None) -> str | None:
    """The MLflow parent run of the cycle workspace ``ws`` when the registry's champion is the version that run
    registered (its ``registered_model`` tag), else None."""
    import json

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from grpoflow.tasks.pipeline.run_folder import RUN_FILE
    from grpoflow.tasks.tracking.tracker import tracking_uri

    run_id = json.loads(open_store(ws, cfg.storage).read(RUN_FILE) or b"{}").get("mlflow_run_id")
    if champion is None or not run_id:
        return None
    try:
        tags = MlflowClient(tracking_uri(cfg)).get_run(run_id).data.tags
    except MlflowException:
        return None
    return run_id if tags.get("registered_model") == f"{champion[1]['name']}/{champion[1]['version']}" else None


def _tag_run(cfg, result: dict, files, champion, decision: str, quarantined: list[dict]) -> None:
    """What the cycle consumed, where it started and what it decided, on its MLflow parent run."""
    import json

    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri)
    rid = result["mlflow_run_id"]
    start = f"models:/{champion[1]['name']}/{champion[1]['version']}" if champion else cfg.model.name
    for key, value in {
        "grpoflow.continuous": "true",
        "continuous.warm_start": start,
        "continuous.files": ", ".join(f.name for f in files)[:5000],
        "continuous.decision": decision[:5000],
        "continuous.quarantined": ", ".join(q["name"] for q in quarantined)[:5000],
    }.items():
        client.set_tag(rid, key, value)
    client.log_text(rid, json.dumps([f.__dict__ for f in files], indent=2), "consumed_files.json")
    if quarantined:
        client.log_text(rid, json.dumps(quarantined, indent=2), "quarantined_files.json")
