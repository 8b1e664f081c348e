"""The MLflow model registry: every finished run registers its model; the best one carries an alias.

After export, the run's model becomes a new version of ``tracking.registered_model``: the merged weights as an
MLflow transformers model, or without a merged export the adapter on its base model (the transformers flavour
with a peft adapter); either a LoggedModel of the export run (tasks/tracking/model_registry.py), loadable with
``mlflow.pyfunc.load_model("models:/NAME@champion")``.
The version is tagged with the run's held-out accuracy after GRPO; it takes the alias ``tracking.champion_alias``

- when there is no champion yet;
- for a run that started from the champion (a continuous cycle: GRPO warm-started from it, so the eval stage scored
  champion and candidate on the same held-out rows), when the paired test of tasks/tracking/promotion.py says so:
  more rows gained than lost and an exact McNemar p < ``tracking.promotion_alpha``; the counts, both accuracies,
  the p-value, alpha and the decision are tagged (``promotion.*``) on the version and the parent run. Should the
  alias have moved to another version during the run, the new one is not promoted (it was not compared with it);
- for any other run (it did not start from the champion, so the two were never measured side by side), when its
  accuracy beats the champion's recorded ``accuracy_after`` tag (ties keep the current champion), and only when
  both were measured on the same held-out set (the ``eval_set`` tag: :func:`eval_set_id`); a figure from other
  rows, another eval.max_samples or another token budget is not comparable and keeps the champion.

The decision and its reason are tagged on the version and the parent run (``champion_decision``). The registry
lives in the tracking store (SQLite file or an ``mlflow server``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from grpoflow.tasks.tracking.model_registry import log_adapter_model, log_merged_model
from grpoflow.tasks.tracking.promotion import PairedComparison, paired_promotion

log = logging.getLogger(__name__)
ACCURACY_TAG = "accuracy_after"
EVAL_SET_TAG = "eval_set"


def eval_set_id(eval_split: str, max_samples: int | None, max_new_tokens: int, accuracy_reward: str) -> str:
    """16 hex digits naming what an accuracy was measured on: the held-out split's content (its Arrow files),
    eval.max_samples (the rows taken), the token budget and the reward that counts a row right."""
    import hashlib

    from grpoflow.tasks.tracking.dataset_inputs import split_digest

    parts = [split_digest(eval_split), str(max_samples), str(max_new_tokens), accuracy_reward]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Registration:
    name: str
    version: str
    promoted: bool
    reason: str


def champion_decision(new: float | None, champion: float | None) -> tuple[bool, str]:
    """(promote?, why) for a new version's accuracy against the champion's (None: unknown / no champion)."""
    if new is None:
        return False, "no held-out accuracy for this run (eval disabled): the champion is kept"
    if champion is None:
        return True, f"first version with an accuracy ({new:.1%}): becomes the champion"
    if new > champion:
        return True, f"accuracy {new:.1%} beats the champion's {champion:.1%}"
    return False, f"accuracy {new:.1%} does not beat the champion's {champion:.1%}"


@dataclass(frozen=True)
class Baseline:
    """The champion a run started from (its registry version) and the paired comparison against it."""

    version: str
    comparison: PairedComparison


def register_run_model(
    client: MlflowClient,
    name: str,
    alias: str,
    source: str,
    run_id: str,
    accuracy: float | None,
    parent_run_id: str | None = None,
    model_id: str | None = None,
    baseline: Baseline | None = None,
    eval_set: str | None = None,
) -> Registration:
    """Register ``source`` (an artifact URI of ``run_id``) as a new version of ``name``; move ``alias`` to it
    when the module docstring's rule says so (``baseline``: the champion version the run started from and the
    paired comparison with it; ``eval_set``: :func:`eval_set_id` of the accuracy). Tags the version (accuracy,
    eval set, decision, the comparison) and the parent run."""
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="GRPO fine-tuned models of grpoflow runs")
    tags = {ACCURACY_TAG: f"{accuracy:.6f}"} if accuracy is not None else {}
    tags |= {EVAL_SET_TAG: eval_set} if eval_set is not None and accuracy is not None else {}
    version = client.create_model_version(name, source, run_id=run_id, tags=tags, model_id=model_id).version
    try:
        current = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        current = None
    promoted, reason = _decide(accuracy, current, baseline, eval_set)
    if promoted:
        client.set_registered_model_alias(name, alias, version)
    decided = {"champion_decision": reason}
    if baseline is not None:  # the figures of the comparison, and what was done (the alias may have moved)
        decided |= baseline.comparison.tags() | {"promotion.champion_version": baseline.version}
        decided["promotion.decision"] = "promoted" if promoted else "kept the champion"
    for key, value in decided.items():
        client.set_model_version_tag(name, version, key, value)
    if parent_run_id is not None:
        client.set_tag(parent_run_id, "registered_model", f"{name}/{version}")
        for key, value in decided.items():
            client.set_tag(parent_run_id, key, value)
    log.info("registry: %s version %s; %s", name, version, reason)
    return Registration(name, str(version), promoted, reason)


def _decide(accuracy: float | None, current, baseline: Baseline | None, eval_set: str | None) -> tuple[bool, str]:
    """(promote?, why) for a new version against ``current`` (the alias holder's ModelVersion, None: no champion),
    by the module docstring's rule."""
    champion = float(current.tags[ACCURACY_TAG]) if current is not None and ACCURACY_TAG in current.tags else None
    if accuracy is None or current is None:
        return champion_decision(accuracy, champion)
    if baseline is not None and str(current.version) != baseline.version:
        return False, (
            f"the champion moved to version {current.version} during this run (it started from version "
            f"{baseline.version} and was compared with it): the champion is kept"
        )
    if baseline is not None:
        return baseline.comparison.promote, baseline.comparison.reason
    if eval_set is not None and current.tags.get(EVAL_SET_TAG, eval_set) != eval_set:
        return False, (
            f"accuracy {accuracy:.1%} was measured on another held-out set than the champion's (version "
            f"{current.version}: eval set {current.tags[EVAL_SET_TAG]}, this run's {eval_set}: other rows, "
            "eval.max_samples or token budget): not comparable, the champion is kept"
        )
    if champion is None:
        return True, f"the champion (version {current.version}) has no recorded accuracy"
    return champion_decision(accuracy, champion)


def paired_baseline(cfg, evaluation: dict | None, champion_version: str | None) -> Baseline | None:
    """The :class:`Baseline` of a run that started from registry version ``champion_version``, from its eval
    summary's per-row correctness (``correct_before``: the champion, ``correct_after``: this run's model); None
    for a run that did not start from the champion, or whose eval summary has no per-row data."""
    if champion_version is None or not evaluation or "correct_before" not in evaluation:
        return None
    alpha = cfg.tracking.promotion_alpha
    comparison = paired_promotion(evaluation["correct_before"], evaluation["correct_after"], alpha)
    return Baseline(str(champion_version), comparison)


def register_pipeline_model(
    client: MlflowClient,
    cfg,
    parent_run_id: str,
    export: dict | None,
    evaluation: dict | None,
    eval_path: str | None,
    champion_version: str | None = None,
) -> Registration | None:
    """The pipeline's last step: register the model the export stage wrote (``export``: its summary), with the
    eval stage's summary ``evaluation`` (its held-out ``accuracy_after``; None without an eval stage) and the first
    question of ``eval_path`` as the merged model's input example. ``champion_version``: the registry version the
    run's GRPO started from (the continuous cycle's champion): the alias then moves on the paired comparison.

    Nothing when registration is off, nothing was exported, or this export run is already registered
    (a resumed run whose export stage was skipped)."""
    t = cfg.tracking
    if not t.register_model or not export:
        return None
    folder = "merged" if "merged_path" in export else "adapter" if "adapter_path" in export else None
    if folder is None:
        return None
    export_run = export["mlflow_run_id"]
    if client.get_run(parent_run_id).data.tags.get("registered_export_run") == export_run:
        return None
    name = t.registered_model or registered_model_name(cfg.model.name)
    example = (first_question(eval_path) if eval_path else None) or "What is 2 + 3?"
    max_new = cfg.eval.max_new_tokens or cfg.grpo.max_completion_length
    if folder == "merged":
        logged = log_merged_model(client, export_run, export["merged_path"], name, example, max_new)
    else:  # the adapter on its base: MLflow's transformers flavour with a peft adapter (model_registry.py)
        base = export.get("base_model") or adapter_base(export["adapter_path"])
        revision = cfg.model.revision if base == cfg.model.name else None  # the hub base's commit it trained on
        logged = log_adapter_model(client, export_run, export["adapter_path"], base, name, example, max_new, revision)
    source, model_id = logged.source, logged.model_id
    accuracy = (evaluation or {}).get("accuracy_after")
    baseline = paired_baseline(cfg, evaluation, champion_version)
    eval_set = None
    if accuracy is not None and eval_path and Path(eval_path).is_dir():
        acc_reward = "code_tests" if "code_tests" in cfg.grpo.reward_funcs else "correctness"
        eval_set = eval_set_id(eval_path, cfg.eval.max_samples, max_new, acc_reward)
    reg = register_run_model(
        client, name, t.champion_alias, source, export_run, accuracy, parent_run_id, model_id, baseline, eval_set
    )
    client.set_tag(parent_run_id, "registered_export_run", export_run)
    return reg


def adapter_base(adapter_dir: str) -> str:
    """The base model an exported adapter applies to, as peft recorded it (adapter_config.json's
    ``base_model_name_or_path``): for an export summary written before the summary named it."""
    import json
    from pathlib import Path

    config = Path(adapter_dir) / "adapter_config.json"
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"registry: {config} names no base_model_name_or_path; the adapter cannot be registered")
    return base


def first_question(eval_path: str) -> str | None:
    """The first held-out question (the registered model's input example)."""
    import datasets

    try:
        ds = datasets.load_from_disk(eval_path)
    except (OSError, ValueError):
        return None
    return ds[0]["question"] if len(ds) else None


def registered_model_name(model_name: str) -> str:
    """grpoflow-<model>, the model id's last path part with characters the registry dislikes replaced."""
    base = model_name.rstrip("/").split("/")[-1]
    return "grpoflow-" + "".join(c if c.isalnum() or c in "-_." else "-" for c in base)
