"""What more than one stage needs and that belongs to no library layer: which model a run starts from."""

from __future__ import annotations

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.dataio.splits import corpus_text, load_split
from grpoflow.tasks.model.tiny import ensure_base_model
from grpoflow.tasks.storage.workspace import Workspace


def base_model_path(cfg: PipelineConfig, ws: Workspace) -> str:
    """The configured base model; for ``tiny`` it is built (once) from the training text."""
    texts = corpus_text(load_split(ws, "train")) if cfg.model.name == "tiny" else None
    return ensure_base_model(cfg.model, texts, ws.stage_dir("base_model"), cfg.run.seed)
