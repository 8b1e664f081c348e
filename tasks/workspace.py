"""The run workspace: one folder per pipeline run, one sub-folder per stage.

    <output_dir>/<run name>/
        config.yaml            the resolved config
        data/   sft/   grpo/   eval/   export/
            manifest.json      written last: a stage is complete iff its manifest exists

The manifest is written atomically (temp file + rename) after everything else of the stage,
so a killed stage leaves no manifest and is recomputed. Resuming (tasks/stage.py, tasks/resume.py):
the manifest also holds the stage's ``key`` and the ``summary`` it returned, and ``attempt.json``
(written when a stage starts) the key of its latest attempt, so that files an attempt with another key
left behind (GRPO checkpoints) are removed rather than resumed. S3 workspaces come with the operations
issue; stages only use the methods below, never raw paths outside their own folder.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

STAGES = ("data", "sft", "grpo", "eval", "export")
MANIFEST = "manifest.json"
ATTEMPT = "attempt.json"


def stages_from(stage: str) -> tuple[str, ...]:
    """``stage`` and every stage after it."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    return STAGES[STAGES.index(stage) :]


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

    def completed(self, stage: str, key: str) -> dict[str, Any] | None:
        """The stored summary when the stage is complete with this key, else None."""
        manifest = self.read_manifest(stage)
        if manifest is None or manifest.get("key") != key or "summary" not in manifest:
            return None
        return manifest["summary"]

    def seal_manifest(self, stage: str, key: str, summary: dict[str, Any]) -> Path:
        """Add the key and the returned summary to the manifest the stage wrote (atomically)."""
        manifest = self.read_manifest(stage) or {}  # its finished_at, when there is one, is kept
        return self.write_manifest(stage, {**manifest, "key": key, "summary": summary})

    def forget(self, stages: tuple[str, ...], attempts: bool = False) -> None:
        """Remove the manifests (and with ``attempts`` the attempt records) of these stages."""
        for stage in stages:
            self.manifest_path(stage).unlink(missing_ok=True)
            if attempts:
                (self.root / stage / ATTEMPT).unlink(missing_ok=True)

    def begin(self, stage: str, key: str) -> None:
        """Record an attempt of ``stage`` with ``key``; a folder last attempted with another key is emptied first."""
        folder = self.root / stage
        attempt = folder / ATTEMPT
        if folder.is_dir() and any(folder.iterdir()):
            last = json.loads(attempt.read_text()).get("key") if attempt.is_file() else None
            if last != key:
                shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = attempt.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "started_at": time.time()}))
        os.replace(tmp, attempt)
