"""What an MLflow run says about itself: its name, params, filter tags, description and result metrics.

Pure functions of the resolved config (and a stage's summary), so the MLflow UI can compare runs:

    params(stage)   the config sections the stage's spec names, under TRL's key names (tasks/config/trl_keys.py),
                    the spec's extra params, model, dataset, dataset_digest, seed and device; the parent run
                    keeps the whole config
    name(stage)     "<stage>" and the parts the spec adds (model, dataset, loss type, learning rate); the parent:
                    run.name when the user chose it, else "<model> · <dataset> · <date>"
    tags            stage, model, dataset, git_commit, config_hash, pipeline (the parent's name), the spec's tags
    description     the mlflow.note.content tag, set at the stage's end: the spec's template and result sentence

The stage-specific parts come from the stage's spec (tasks/pipeline/spec.py, declared beside each stage in
tasks/stages/): this module names no stage.
    results         a stage summary's numbers: floats become run metrics, counts become params; paths and
                    booleans stay in summary.json

A metric that cannot move at the current settings is not logged (:func:`constant_metrics`); a tag
``metric_omitted.<name>`` on the stage run says why.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any, Protocol

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.config.fingerprint import config_digest
from grpoflow.tasks.config.trl_keys import TRL_KEYS

SEP = " · "
DEFAULT_RUN_NAME = re.compile(r"run-\d{8}-\d{6}")
PIPELINE_DESCRIPTION = "grpoflow pipeline: {stages}."


class StageInfo(Protocol):
    """What these functions read of a stage (tasks/pipeline/spec.py StageSpec has it: this layer is below it)."""

    name: str
    description: str
    param_sections: tuple[str, ...]
    name_parts: Callable[[PipelineConfig], tuple[str, ...]]
    params: Callable[[PipelineConfig], dict[str, Any]]
    tags: Callable[[PipelineConfig], dict[str, Any]]
    result: Callable[[dict[str, Any]], str]


def _our_to_trl() -> dict[str, str]:
    """{our dotted key: TRL's name} for each trl key that maps onto a differently named key of ours."""
    out: dict[str, str] = {}
    for trl_name, rule in TRL_KEYS.items():
        m = re.match(r"`([a-z_]+)\.([a-z0-9_]+)`", rule.what)
        if rule.kind == "maps" and m and m.group(1) == "grpo" and m.group(2) != trl_name:
            if "deprecated" not in rule.what:
                out.setdefault(f"{m.group(1)}.{m.group(2)}", trl_name)
    return out


OUR_TO_TRL = _our_to_trl()


def short_model(name: str) -> str:
    """'Qwen/Qwen2.5-0.5B-Instruct' -> 'qwen2.5-0.5b-instruct'; 'tiny' -> 'tiny'."""
    return name.rstrip("/").split("/")[-1].lower()


def short_dataset(source: str) -> str:
    """'openai/gsm8k' -> 'gsm8k'; 's3://b/x/train.jsonl' -> 'train'; 'arithmetic' -> 'arithmetic'."""
    last = source.rstrip("/").split("/")[-1]
    return PurePosixPath(last).stem if "." in last else last.lower()


def fmt_lr(lr: float) -> str:
    """1e-06 -> '1e-6', 0.0005 -> '5e-4', 1.5e-05 -> '1.5e-5'."""
    mant, exp = f"{lr:.2e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def config_hash(cfg: PipelineConfig) -> str:
    """The config's digest (tasks/config/fingerprint.py: every field that can change a result), first 12 hex: the
    same digest the stage keys hash, so two runs with one config_hash computed the same."""
    return config_digest(cfg)[:12]


def parent_name(cfg: PipelineConfig, date: str) -> str:
    """run.name when the user chose one, else '<model> · <dataset> · <date>'."""
    if cfg.run.name and not DEFAULT_RUN_NAME.fullmatch(cfg.run.name):
        return cfg.run.name
    return SEP.join((short_model(cfg.model.name), short_dataset(cfg.data.source), date))


def stage_name(cfg: PipelineConfig, stage: StageInfo) -> str:
    """'<stage> · ' and what the stage's spec names its runs by (model, dataset, loss type, learning rate)."""
    return SEP.join((stage.name, *stage.name_parts(cfg)))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def stage_params(cfg: PipelineConfig, stage: StageInfo, device: str, dataset_digest: str | None) -> dict[str, Any]:
    """The settings that shaped ``stage``: its spec's param sections by TRL's names (the first section's keys bare,
    the others dotted), the spec's extra params, and model, dataset, its digest, seed and device."""
    d = cfg.to_dict()
    out: dict[str, Any] = {}
    sections = stage.param_sections
    for section in sections:
        value = d
        for part in section.split("."):
            value = value[part]
        for key, v in _flat(value).items():
            dotted = f"{section}.{key}"
            out[OUR_TO_TRL.get(dotted, key if section == sections[0] else dotted)] = v
    out.update(stage.params(cfg))
    out.update(
        {
            "model": cfg.model.name,
            "dataset": cfg.data.source,
            "dataset_digest": dataset_digest,
            "seed": cfg.run.seed,
            "device": device,
        }
    )
    return {k: v for k, v in out.items() if v is not None}


def filter_tags(cfg: PipelineConfig, stage: StageInfo | None, pipeline: str, commit: str | None) -> dict[str, str]:
    """Tags users filter by: tags.stage = 'grpo' and tags.loss_type = 'dapo' and tags.model = 'tiny' ...
    ``stage`` None: the parent run (stage 'pipeline', which carries the loss type too)."""
    name = stage.name if stage is not None else "pipeline"
    tags = {
        "stage": name,
        "grpoflow.stage": name,
        "model": cfg.model.name,
        "dataset": cfg.data.source,
        "config_hash": config_hash(cfg),
        "pipeline": pipeline,
        "git_commit": commit,
    }
    tags.update(stage.tags(cfg) if stage is not None else {"loss_type": cfg.grpo.loss_type})
    return {k: v for k, v in tags.items() if v is not None}


def _what(cfg: PipelineConfig, template: str, **extra: str) -> str:
    return template.format(
        model=cfg.model.name,
        dataset=cfg.data.source,
        loss_type=cfg.grpo.loss_type,
        lr=fmt_lr(cfg.grpo.learning_rate),
        **extra,
    )


def _took(result: str, s: dict[str, Any]) -> str:
    if s.get("seconds") is not None:
        result += f" Took {s['seconds']:.1f} s."
    return result.strip()


def describe(cfg: PipelineConfig, stage: StageInfo, summary: dict[str, Any] | None) -> str:
    """The stage run's description (markdown): what the stage did (its spec's template) and its key result."""
    s = summary or {}
    return f"{_what(cfg, stage.description)}\n\n{_took(stage.result(s) if s else '', s)}".strip()


def describe_pipeline(cfg: PipelineConfig, stages: tuple[str, ...], summary: dict[str, Any] | None) -> str:
    """The parent run's description: the stages it runs and, with an eval summary, the held-out accuracy."""
    s = summary or {}
    result = ""
    if s.get("accuracy_after") is not None:
        result = f"Held-out accuracy {s['accuracy_before']:.1%} -> {s['accuracy_after']:.1%}."
    what = _what(cfg, PIPELINE_DESCRIPTION, stages=" -> ".join(stages))
    return f"{what}\n\n{_took(result, s)}".strip()


def summary_results(summary: dict[str, Any]) -> tuple[dict[str, float], dict[str, int]]:
    """(metrics, params) of a stage summary: floats are results (run metrics: one value each, compared across
    runs as bars), ints are counts (params: rows, steps). Strings, paths, booleans and nested dicts are left out."""
    metrics, params = {}, {}
    for k, v in summary.items():
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, float):
            metrics[k] = v
        elif isinstance(v, int):
            params[f"result.{k}"] = v
    return metrics, params


def constant_metrics(cfg: PipelineConfig) -> dict[str, str]:
    """{metric name prefix: why it cannot move} for the grpo stage at these settings.

    Clip ratios: with old_logp = sg(logp) (tasks/grpo/trainer.py: when gradient_accumulation_steps is a multiple
    of steps_per_generation * num_iterations, the whole round falls inside one optimizer window, so the weights
    cannot move between sampling and the loss pass, and the sampler correction then reuses the loss pass's own
    log-probs), w = exp(logp - old_logp) = 1 exactly (token and sequence level), so
    low = w < 1 - epsilon and high = w > 1 + epsilon_high are never true (epsilon > 0, epsilon_high > 0).
    KL: not computed at beta = 0."""
    g = cfg.grpo
    b = g.batching(cfg.distributed.world_size)
    out = {}
    if b.gradient_accumulation_steps % b.micro_steps_per_round == 0:
        out["clip_ratio/"] = (
            f"0 by construction: gradient_accumulation_steps ({b.gradient_accumulation_steps}) is a multiple of "
            f"steps_per_generation * num_iterations ({b.steps_per_generation} * {b.num_iterations}), so the "
            "policy cannot move within a round: the importance ratio is exactly 1 and never leaves "
            "[1 - epsilon, 1 + epsilon_high]"
        )
    if g.beta == 0:
        out["kl"] = "not computed: beta = 0 (no KL penalty, no reference model)"
    return out


def omitted(name: str, constant: dict[str, str]) -> bool:
    """Whether metric ``name`` is one of ``constant``'s (a key ending in '/' is a prefix, else the exact name)."""
    return any(name.startswith(p) if p.endswith("/") else name == p for p in constant)
