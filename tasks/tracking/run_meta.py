"""What an MLflow run says about itself: its name, params, filter tags, description and result metrics.

Pure functions of the resolved config (and a stage's summary), so the MLflow UI can compare runs:

    params(stage)   the stage's own config section, under TRL's key names (tasks/config/trl_keys.py), plus
                    model, dataset, dataset_digest, seed and device; grpo adds generation.* and the resolved
                    batching, sft/grpo add model.* (LoRA); the parent run keeps the whole config
    name(stage)     "<stage> · <model> · <dataset>" and what tells runs of a stage apart
                    (grpo: "· <loss_type> · lr <lr>", sft: "· lr <lr>"); the parent: run.name when the user
                    chose it, else "<model> · <dataset> · <date>"
    tags            stage, model, dataset, loss_type (grpo), git_commit, config_hash, pipeline (the parent's name)
    description     the mlflow.note.content tag, set at the stage's end: what it did and its key result
    results         a stage summary's numbers: floats become run metrics, counts become params; paths and
                    booleans stay in summary.json

A metric that cannot move at the current settings is not logged (:func:`constant_metrics`); a tag
``metric_omitted.<name>`` on the stage run says why.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import PurePosixPath
from typing import Any

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.config.trl_keys import TRL_KEYS

SEP = " · "
STAGE_SECTIONS = {"data": ("data",), "sft": ("sft",), "grpo": ("grpo", "generation"), "eval": ("eval",)}
STAGE_SECTIONS["export"] = ("export",)
DEFAULT_RUN_NAME = re.compile(r"run-\d{8}-\d{6}")
DESCRIPTIONS = {
    "pipeline": "grpoflow pipeline: data -> SFT -> GRPO -> eval -> export.",
    "data": "Prepared the train and eval splits from {dataset}.",
    "sft": "Supervised fine-tuning of {model} on the reference answers of {dataset}.",
    "grpo": "GRPO training of {model} on {dataset} ({loss_type} loss, learning rate {lr}).",
    "eval": "Held-out evaluation of the model before and after GRPO on {dataset}.",
    "export": "Exported the trained model (adapter, merged weights, GGUF).",
}


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


def config_hash(resolved: dict[str, Any]) -> str:
    """sha256 of the resolved config (``cfg.to_dict()``, hashed one way) without run.name/run.output_dir (where it
    ran, not what), first 12 hex."""
    body = {**resolved, "run": {k: v for k, v in resolved["run"].items() if k not in ("name", "output_dir")}}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:12]


def parent_name(cfg: PipelineConfig, date: str) -> str:
    """run.name when the user chose one, else '<model> · <dataset> · <date>'."""
    if cfg.run.name and not DEFAULT_RUN_NAME.fullmatch(cfg.run.name):
        return cfg.run.name
    return SEP.join((short_model(cfg.model.name), short_dataset(cfg.data.source), date))


def stage_name(cfg: PipelineConfig, stage: str) -> str:
    parts = [stage]
    if stage != "data":
        parts.append(short_model(cfg.model.name))
    if stage != "export":
        parts.append(short_dataset(cfg.data.source))
    if stage == "grpo":
        parts += [cfg.grpo.loss_type, f"lr {fmt_lr(cfg.grpo.learning_rate)}"]
    elif stage == "sft":
        parts.append(f"lr {fmt_lr(cfg.sft.learning_rate)}")
    return SEP.join(parts)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def stage_params(cfg: PipelineConfig, stage: str, device: str, dataset_digest: str | None) -> dict[str, Any]:
    """The settings that shaped ``stage``: its section's keys by TRL's names (the grpo section's bare, others'
    bare too: each stage run has one section), generation.* for grpo, model.* for the training stages."""
    d = cfg.to_dict()
    out: dict[str, Any] = {}
    for section in STAGE_SECTIONS[stage]:
        for key, value in _flat(d[section]).items():
            dotted = f"{section}.{key}"
            name = OUR_TO_TRL.get(dotted, key if section == STAGE_SECTIONS[stage][0] else dotted)
            out[name] = value
    if stage == "grpo":
        out.update(cfg.grpo.batching(cfg.distributed.world_size).model_dump())  # the resolved round layout
    if stage in ("sft", "grpo"):
        out.update({f"model.{k}": v for k, v in _flat(d["model"]).items() if k not in ("name", "cache_dir")})
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


def filter_tags(cfg: PipelineConfig, stage: str, pipeline: str, commit: str | None) -> dict[str, str]:
    """Tags users filter by: tags.stage = 'grpo' and tags.loss_type = 'dapo' and tags.model = 'tiny' ..."""
    tags = {
        "stage": stage,
        "grpoflow.stage": stage,
        "model": cfg.model.name,
        "dataset": cfg.data.source,
        "config_hash": config_hash(cfg.to_dict()),
        "pipeline": pipeline,
        "git_commit": commit,
    }
    if stage in ("grpo", "pipeline"):
        tags["loss_type"] = cfg.grpo.loss_type
    return {k: v for k, v in tags.items() if v is not None}


def describe(cfg: PipelineConfig, stage: str, summary: dict[str, Any] | None) -> str:
    """The run's description (markdown): what the stage did and its key result."""
    what = DESCRIPTIONS[stage].format(
        model=cfg.model.name,
        dataset=cfg.data.source,
        loss_type=cfg.grpo.loss_type,
        lr=fmt_lr(cfg.grpo.learning_rate),
    )
    s = summary or {}
    result = ""
    if stage == "data" and "train_rows" in s:
        result = f"{s['train_rows']} train rows, {s['eval_rows']} eval rows ({s.get('skipped_rows', 0)} skipped)."
    elif stage == "sft" and s.get("final_loss") is not None:
        result = f"{s['steps']} steps, final loss {s['final_loss']:.4f}."
    elif stage == "grpo" and s.get("final_reward") is not None:
        first = s.get("first_reward")
        start = f"{first:.3f} -> " if first is not None else ""
        result = f"{s['steps']} steps, mean reward {start}{s['final_reward']:.3f}."
    elif stage == "eval" and "accuracy_after" in s:
        result = (
            f"Accuracy {s['accuracy_before']:.1%} before GRPO -> {s['accuracy_after']:.1%} after "
            f"({s['rows']} held-out rows)."
        )
    elif stage == "export":
        kept = [k.removesuffix("_path") for k in ("adapter_path", "merged_path") if k in s] + [
            f"gguf {t}" for t in s.get("gguf", {})
        ]
        if kept:
            result = "Wrote " + ", ".join(kept) + "."
            if s.get("verify_max_logprob_gap") is not None:
                result += (
                    f" Merged vs trained: log-prob gap {s['verify_max_logprob_gap']:.2g} (tolerance "
                    f"{s['verify_tolerance']:.2g}) on {s['verify_prompts']} prompts, greedy agreement "
                    f"{s['verify_greedy_agreement']:.0%}."
                )
    elif stage == "pipeline" and s.get("accuracy_after") is not None:
        result = f"Held-out accuracy {s['accuracy_before']:.1%} -> {s['accuracy_after']:.1%}."
    if s.get("seconds") is not None:
        result += f" Took {s['seconds']:.1f} s."
    return f"{what}\n\n{result.strip()}".strip()


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
