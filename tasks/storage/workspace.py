"""The run workspace: one folder per pipeline run, one sub-folder per stage, on local disk or on S3.

    <output_dir>/<run name>/
        config.yaml            the resolved config
        run.json               the MLflow parent run (tasks/pipeline/resume.py)
        base_model/  data/   sft/   grpo/   eval/   export/
            attempt.json       the key of the stage's latest attempt
            manifest.json      written last: a stage is complete iff its manifest exists

The stage shell (tasks/pipeline/shell.py) writes the manifest once, atomically (temp file + rename), after
everything else of the stage (:meth:`Workspace.publish`), so a killed stage leaves no manifest and is recomputed.
Resuming (tasks/pipeline/resume.py): the manifest holds the stage's ``key`` and the ``summary`` it returned, and
``attempt.json``
(written when a stage starts) the key of its latest attempt, so that files an attempt with another key
left behind (GRPO checkpoints) are removed rather than resumed. Stages only use the methods below, never
raw paths outside their own folder.

S3 (``run.output_dir: s3://bucket/prefix``): the workspace is s3://bucket/prefix/<run name>, the source of
truth, and stages still read and write plain files in its local mirror <storage.cache_dir>/<bucket>/<prefix>/
<run name> (tasks/storage/s3.py). Publishing a stage uploads its folder (what differs), then its manifest, so on S3
too a stage is complete or absent. Manifests, attempt records, config.yaml and run.json are read from and
written to S3; before a stage runs, the complete upstream stages are pulled into the mirror when the local
copy is not theirs (its manifest differs), and its own folder is pulled (a killed GRPO's checkpoints, which
``push`` uploads as they are saved). So the mirror is a cache: delete it, or resume on another machine,
and the run continues from S3. Summaries hold mirror paths; the manifest records the root they were written
under and :meth:`Workspace.completed` re-roots them, so they stay valid under another cache_dir (or a local
workspace that was moved).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage import s3

MANIFEST = "manifest.json"
ATTEMPT = "attempt.json"
MARKERS = ("trainer_state.json",)  # a GRPO checkpoint is complete when it holds this: uploaded last, deleted first


DEFAULT_CACHE_DIR = StorageConfig().cache_dir


def local_dir(location: str | Path, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """A local folder, resolved; or the local mirror of an s3:// location under ``cache_dir``."""
    if s3.is_s3_uri(str(location)):
        return s3.local_path(str(location), cache_dir)
    return Path(location).resolve()


def join_location(location: str | Path, name: str) -> str:
    """<location>/<name> for a folder or an s3:// prefix."""
    return s3.join_uri(str(location), name) if s3.is_s3_uri(str(location)) else str(Path(location).resolve() / name)


def reroot(value: Any, old: str, new: str) -> Any:
    """``value`` with every string path under ``old`` moved under ``new`` (dicts and lists walked)."""
    if isinstance(value, str) and (value == old or value.startswith(old + "/")):
        return new + value[len(old) :]
    if isinstance(value, dict):
        return {k: reroot(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [reroot(v, old, new) for v in value]
    return value


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Workspace:
    def __init__(self, root: str | Path, storage: StorageConfig | None = None):
        """A local folder, or an s3://bucket/prefix URI reached with the ``storage`` settings (endpoint, retries)
        and mirrored under storage.cache_dir."""
        self.uri = s3.join_uri(str(root)) if s3.is_s3_uri(str(root)) else None
        self.s3 = s3.S3Store(storage)
        if self.uri is not None:
            s3.split_s3_uri(self.uri)  # a clear error for a malformed URI
        self.root = local_dir(self.uri or root, self.s3.settings.cache_dir)
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Workspace({self.location!r})"

    @property
    def location(self) -> str:
        """What names the workspace: its s3:// URI, or its local folder."""
        return self.uri or str(self.root)

    def _remote(self, *parts: str) -> str:
        return s3.join_uri(self.uri, *parts)

    def stage_dir(self, stage: str) -> Path:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", stage):  # a stage's folder name (tasks/pipeline/spec.py)
            raise ValueError(f"stage {stage!r}: not a stage folder name")
        path = self.root / stage
        path.mkdir(parents=True, exist_ok=True)
        return path

    def manifest_path(self, stage: str) -> Path:
        return self.root / stage / MANIFEST

    # ------------------------------------------------------------------ publishing a stage
    def publish(self, stage: str, key: str, summary: dict[str, Any], record: dict[str, Any] | None = None) -> Path:
        """Publish a finished stage, once (the stage shell, tasks/pipeline/shell.py, calls it): on S3 upload its
        files first (and the base model's, for sft/grpo), then write its manifest (the key and the summary) last,
        atomically. ``record``: more of the manifest's body (the stage's fingerprint)."""
        if self.uri is not None:
            self.push(stage)
            if stage in ("sft", "grpo") and (self.root / "base_model").is_dir():
                self.push("base_model")
        return self._write_manifest(stage, {**(record or {}), "key": key, "summary": summary})

    def _write_manifest(self, stage: str, payload: dict[str, Any]) -> Path:
        body = {"stage": stage, "finished_at": time.time(), **payload, "root": str(self.root)}
        path = self.manifest_path(stage)
        _write_atomic(path, json.dumps(body, indent=2, sort_keys=True, default=str))
        if self.uri is not None:
            self.s3.put_bytes(path.read_bytes(), self._remote(stage, MANIFEST))
        return path

    def push(self, stage: str, sub: str = "") -> None:
        """Upload <stage>/<sub> to S3 now, making the remote copy match (a no-op for a local workspace).
        GRPO calls it after each checkpoint, so a killed stage resumes from S3."""
        if self.uri is None:
            return
        self.s3.upload_dir(
            self.root / stage / sub, self._remote(stage, sub), delete=True, markers=MARKERS, exclude=(MANIFEST,)
        )

    def push_added(self, stage: str, sub: str = "") -> None:
        """Upload <stage>/<sub> to S3 without deleting anything there (a no-op for a local workspace): a TrainJob's
        other nodes add their own checkpoint shards to the folder node 0 publishes."""
        if self.uri is None:
            return
        self.s3.upload_dir(self.root / stage / sub, self._remote(stage, sub), markers=MARKERS, exclude=(MANIFEST,))

    def push_merged(self, stage: str, sub: str = "") -> None:
        """:meth:`push` for a folder other nodes add to (a TrainJob's node 0): the same, except that the files in a
        checkpoint folder this mirror holds are kept on S3 though absent here (the other nodes' shards); a
        checkpoint folder gone here is removed on S3 with every node's files."""
        if self.uri is None:
            return
        prefix = self._remote(stage, sub) + "/"
        local = self.root / stage / sub
        others = []
        for obj in self.s3.list_objects(prefix):
            name = obj["uri"][len(prefix) :]
            parts = name.split("/")
            ckpt = next((i for i, p in enumerate(parts[:-1]) if re.fullmatch(r"checkpoint-\d+", p)), None)
            if ckpt is not None and (local / "/".join(parts[: ckpt + 1])).is_dir() and not (local / name).exists():
                others.append(name)
        self.s3.upload_dir(local, prefix, delete=True, markers=MARKERS, exclude=(MANIFEST, *others))

    def push_checkpoint(self, stage: str, sub: str, name: str, keep: int = 2, merged: bool = False) -> None:
        """Upload checkpoint folder <stage>/<sub>/<name> to S3, its marker last, then remove the checkpoint folders
        on S3 below it but the newest ``keep`` complete ones (each marker first), as the trainer prunes locally.
        ``merged``: files on S3 in that folder but absent here are kept (a TrainJob's other nodes' shards).
        A no-op for a local workspace; uploads of several checkpoints must run in their order."""
        if self.uri is None:
            return
        prefix = self._remote(stage, sub) + "/"
        self.s3.upload_dir(self.root / stage / sub / name, prefix + name, delete=not merged, markers=MARKERS)
        folders: dict[int, list[str]] = {}
        complete = set()
        for obj in self.s3.list_objects(prefix):
            found = re.fullmatch(r"checkpoint-(\d+)/(.+)", obj["uri"][len(prefix) :])
            if found:
                folders.setdefault(int(found[1]), []).append(obj["uri"])
                if found[2] in MARKERS:
                    complete.add(int(found[1]))
        step = int(name.rsplit("-", 1)[1])
        kept = set(sorted(n for n in complete if n <= step)[-keep:])
        stale = [uri for n, uris in folders.items() if n < step and n not in kept for uri in uris]
        stale.sort(key=lambda u: u.rsplit("/", 1)[-1] not in MARKERS)  # markers first
        if stale:
            self.s3.delete_objects(stale)

    def pull(self, stage: str, sub: str = "") -> None:
        """Download <stage>/<sub> from S3 now, making the local copy match (a no-op for a local workspace): the
        files another machine pushed (a TrainJob's node 0)."""
        if self.uri is None:
            return
        self.s3.download_dir(
            self._remote(stage, sub), self.root / stage / sub, delete=True, markers=MARKERS, exclude=(MANIFEST,)
        )

    def read_manifest(self, stage: str) -> dict[str, Any] | None:
        if self.uri is not None:
            return self.s3.get_json(self._remote(stage, MANIFEST), None)
        path = self.manifest_path(stage)
        if not path.is_file():
            return None
        return json.loads(path.read_text())

    def completed(self, stage: str, key: str) -> dict[str, Any] | None:
        """The stored summary when the stage is complete with this key, else None; its paths re-rooted to this
        workspace's root when it was written under another (another cache_dir, a moved folder)."""
        manifest = self.read_manifest(stage)
        if manifest is None or manifest.get("key") != key or "summary" not in manifest:
            return None
        old = manifest.get("root")
        return reroot(manifest["summary"], old, str(self.root)) if old else manifest["summary"]

    def forget(self, stages: tuple[str, ...], attempts: bool = False) -> None:
        """Remove the manifests (and with ``attempts`` the attempt records) of these stages."""
        names = (MANIFEST, ATTEMPT) if attempts else (MANIFEST,)
        for stage in stages:
            for name in names:
                (self.root / stage / name).unlink(missing_ok=True)
        if self.uri is not None:
            self.s3.delete_objects([self._remote(stage, name) for stage in stages for name in names])

    # ------------------------------------------------------------------ running a stage
    def begin(self, stage: str, key: str) -> None:
        """Record an attempt of ``stage`` with ``key``; a folder last attempted with another key is emptied first.
        On S3 the remote folder decides, and what it holds of a same-key attempt is pulled into the mirror."""
        folder = self.root / stage
        attempt = folder / ATTEMPT
        local_key = json.loads(attempt.read_text()).get("key") if attempt.is_file() else None
        remote_files = []
        if self.uri is not None:
            remote_files = self.s3.list_objects(self._remote(stage) + "/")
            last = self.s3.get_json(self._remote(stage, ATTEMPT), None)
            if remote_files and (last or {}).get("key") != key:
                self.s3.delete_prefix(self._remote(stage) + "/", markers=MARKERS)
                remote_files = []
        if folder.is_dir() and any(folder.iterdir()) and local_key != key:
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if remote_files:
            self.s3.download_dir(self._remote(stage), folder, delete=True, markers=MARKERS, exclude=(MANIFEST,))
        body = json.dumps({"key": key, "started_at": time.time()})
        _write_atomic(attempt, body)
        if self.uri is not None:
            self.s3.put_bytes(body.encode(), self._remote(stage, ATTEMPT))

    def fetch(self, stages: tuple[str, ...]) -> None:
        """Pull these stages into the local mirror when the local copy is not the published one (S3 only).

        A complete stage is pulled unless the local manifest equals the remote one (it is written last, after
        the download, so it marks a complete copy); a stage without a manifest (base_model) is synced file by
        file (size and ETag)."""
        if self.uri is None:
            return
        for stage in stages:
            if stage == "base_model":
                self.s3.download_dir(self._remote(stage), self.root / stage, markers=MARKERS)
                continue
            remote = self.read_manifest(stage)
            if remote is None:
                continue
            local = self.manifest_path(stage)
            if local.is_file() and json.loads(local.read_text()) == remote:
                continue
            local.unlink(missing_ok=True)
            self.s3.download_dir(
                self._remote(stage), self.root / stage, delete=True, markers=MARKERS, exclude=(MANIFEST,)
            )
            _write_atomic(local, json.dumps(remote, indent=2, sort_keys=True, default=str))

    # ------------------------------------------------------------------ run-level files
    def write_text(self, name: str, text: str) -> None:
        """A file at the workspace root (config.yaml, run.json), written atomically; on S3 uploaded too."""
        _write_atomic(self.root / name, text)
        if self.uri is not None:
            self.s3.put_bytes(text.encode(), self._remote(name))

    def read_text(self, name: str) -> str | None:
        """A file at the workspace root, None when absent (on S3: read from S3)."""
        if self.uri is not None:
            try:
                return self.s3.get_bytes(self._remote(name)).decode()
            except s3.S3NoSuchBucketError:
                raise
            except s3.S3NotFoundError:
                return None
        path = self.root / name
        return path.read_text() if path.is_file() else None
