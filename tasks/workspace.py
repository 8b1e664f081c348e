"""The run workspace: one folder per pipeline run, one sub-folder per stage.

    <output_dir>/<run name>/
        config.yaml            the resolved config
        data/   sft/   grpo/   eval/   export/
            manifest.json      written last: a stage is complete iff its manifest exists

The manifest is written atomically (temp file + rename) after everything else of the stage,
so a killed stage leaves no manifest and is recomputed. S3 workspaces come with the operations
issue; stages only use the methods below, never raw paths outside their own folder.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

STAGES = ("data", "sft", "grpo", "eval", "export")
MANIFEST = "manifest.json"


class Workspace:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    def stage_dir(self, stage: str) -> Path:
        if stage not in STAGES and stage != "base_model":
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        path = self.root / stage
        path.mkdir(parents=True, exist_ok=True)
        return path

    def manifest_path(self, stage: str) -> Path:
        return self.root / stage / MANIFEST

    def write_manifest(self, stage: str, payload: dict[str, Any]) -> Path:
        """Publish a stage: write its manifest last, atomically."""
        path = self.manifest_path(stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"stage": stage, "finished_at": time.time(), **payload}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=2, sort_keys=True, default=str))
        os.replace(tmp, path)
        return path

    def read_manifest(self, stage: str) -> dict[str, Any] | None:
        path = self.manifest_path(stage)
        if not path.is_file():
            return None
        return json.loads(path.read_text())
