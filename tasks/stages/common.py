"""What more than one stage needs and that belongs to no library layer: which model a run starts from, the tiny
base model's spec (a folder sft and grpo write, keyed by its own spec), and the model params of the training
stages' MLflow runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.dataio.splits import corpus_text, load_split
from grpoflow.tasks.model.tiny import ensure_base_model
from grpoflow.tasks.pipeline.spec import StageSpec
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.run_meta import short_dataset, short_model

DATA = "data"  # the stage that prepares the splits (tasks/stages/data.py): the others read them from its folder


def prepared(ws: Workspace) -> Path:
    """The folder holding the prepared splits (<workspace>/data): what sft, grpo, eval and export read."""
    return ws.root / DATA


# the tiny model built from the training text: keyed by what builds it, not by sft or grpo settings
BASE_MODEL = StageSpec(
    name="base_model",
    keys=("run.seed", "model.name", "model.revision", "model.tiny"),
    upstream=lambda cfg: (DATA,),
)


def base_model_path(cfg: PipelineConfig, ws: Workspace) -> str:
    """The configured base model; for ``tiny`` it is built (once) from the training text."""
    texts = corpus_text(load_split(prepared(ws), "train")) if cfg.model.name == "tiny" else None
    return ensure_base_model(cfg.model, texts, ws.stage_dir(BASE_MODEL.name), cfg.run.seed)


def model_params(cfg: PipelineConfig) -> dict[str, Any]:
    """model.* (LoRA, dtype, tiny shape) as params of a training stage's run; not name (a param of its own),
    cache_dir, or warm_start when unset (the runs before it existed logged no such param)."""
    out: dict[str, Any] = {}

    def flat(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                flat(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    skip = ("name", "cache_dir", *(("warm_start",) if cfg.model.warm_start is None else ()))
    flat({k: v for k, v in cfg.model.model_dump(mode="json").items() if k not in skip}, "model.")
    return out


def model_and_dataset(cfg: PipelineConfig) -> tuple[str, ...]:
    """The run-name parts most stages share: the model's and the dataset's short names."""
    return (short_model(cfg.model.name), short_dataset(cfg.data.source))
