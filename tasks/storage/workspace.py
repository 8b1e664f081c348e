"""The run workspace: one folder per pipeline run, one sub-folder per stage, in one store (a local folder or S3).

    <output_dir>/<run name>/
        config.yaml            the resolved config
        run.json               the MLflow parent run (tasks/pipeline/resume.py)
        base_model/  data/   sft/   grpo/   eval/   export/
            attempt.json       the key of the stage's latest attempt
            manifest.json      written last: a stage is complete iff its manifest exists

The workspace is written once against :class:`~grpoflow.tasks.storage.store.Store` (``self.store``), which keeps
the local-versus-S3 difference to itself: stages work on plain files under ``root`` (= store.local_root: the
folder itself, or the S3 mirror <storage.cache_dir>/<bucket>/<prefix>/<run name>), and every bookkeeping file
(manifest.json, attempt.json, config.yaml, run.json) is written through the store, atomically (whole or absent,
on S3 the mirror's copy in step). What the store guarantees and what its sync compares (size and content
digest, markers last up and first down) is in tasks/storage/store.py.

The stage shell (tasks/pipeline/shell.py) publishes a stage once, after everything else of it
(:meth:`Workspace.publish`): its folder is synced up, then the manifest written last, so a killed stage leaves no
manifest and is recomputed, on S3 as locally. Resuming (tasks/pipeline/resume.py): the manifest holds the
stage's ``key`` and the ``summary`` it returned, and ``attempt.json`` (written when a stage starts) the key of its
latest attempt, so that files an attempt with another key left behind (GRPO checkpoints) are removed rather than
resumed. Stages only use the methods below, never raw paths outside their own folder.

On S3 the store is the source of truth: manifests, attempt records, config.yaml and run.json are read from it;
before a stage runs, the complete upstream stages are synced into the mirror when the local copy is not theirs
(its manifest differs), and its own folder is synced down (a killed GRPO's checkpoints, which ``push`` uploads
as they are saved). So the mirror is a cache: delete it, or resume on another machine, and the run continues
from S3. For a local store the same calls find the local copy already current and move nothing. Summaries hold
local paths; the manifest records the root they were written under and :meth:`Workspace.completed` re-roots
them, so they stay valid under another cache_dir (or a local workspace that was moved).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage.store import S3Store, Store, open_store, write_atomic
from grpoflow.tasks.storage.store import join_location as join_location  # re-exported: callers name it here

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ATTEMPT = "attempt.json"
MARKERS = ("trainer_state.json",)  # a GRPO checkpoint is complete when it holds this: uploaded last, deleted first


DEFAULT_CACHE_DIR = StorageConfig().cache_dir


def local_dir(location: str | Path, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """A local folder, resolved; or the local mirror of an s3:// location under ``cache_dir``."""
    return open_store(location, StorageConfig(cache_dir=str(cache_dir))).local_root


def reroot(value: Any, old: str, new: str) -> Any:
    """``value`` with every string path under ``old`` moved under ``new`` (dicts and lists walked)."""
    if isinstance(value, str) and (value == old or value.startswith(old + "/")):
        return new + value[len(old) :]
    if isinstance(value, dict):
        return {k: reroot(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [reroot(v, old, new) for v in value]
    return value


def _name(*parts: str) -> str:
    """'grpo', 'checkpoints', '' -> 'grpo/checkpoints': a name relative to the workspace."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def _dumps(value: Any) -> bytes:
    return json.dumps(value, indent=2, sort_keys=True, default=str).encode()


def _not_lower(old: dict[str, Any] | None, new: dict[str, Any] | None) -> bool:
    """Whether every value of ``new`` is at least its value in ``old`` (both {path: number})."""
    old, new = old or {}, new or {}
    try:
        return set(old) == set(new) and all(new[k] >= old[k] for k in new)
    except TypeError:
        return False


def _continuable(last: dict[str, Any], continues: str | None, extents: dict[str, Any] | None) -> bool:
    """Whether attempt record ``last`` may be trained on by an attempt with ``continues`` key and ``extents``."""
    return bool(continues) and last.get("continues") == continues and _not_lower(last.get("extents"), extents)


_CHECKPOINT = re.compile(r"checkpoint-(\d+)/(.+)")
_IN_CHECKPOINT = re.compile(r"(?:(.*)/)?checkpoint-(\d+)/(.+)")  # <parent>/checkpoint-N/<file>, at any depth


class CorruptManifest(ValueError):
    """A stage's manifest.json that is not JSON (truncated, emptied by a crash): names the file."""


def unpublished_checkpoints(local: Path, stored: list[str]) -> list[str]:
    """The complete checkpoint folders under ``local`` (checkpoint-N holding its marker), as names relative to it,
    that are newer than every complete checkpoint the store holds in the same parent folder (``stored``: the
    store's names relative to the same folder). Saved here and not yet uploaded (a stage killed with uploads
    queued): a pull must keep them, the upload queue sends them. Older ones absent from the store were pruned
    there after newer ones went up, so a pull may remove them."""
    newest: dict[str, int] = {}
    for name in stored:
        found = _IN_CHECKPOINT.fullmatch(name)
        if found and found[3] in MARKERS:
            newest[found[1] or ""] = max(newest.get(found[1] or "", -1), int(found[2]))
    out = []
    for marker in local.rglob("checkpoint-*/" + MARKERS[0]) if local.is_dir() else ():
        found = _IN_CHECKPOINT.fullmatch(marker.relative_to(local).as_posix())
        if found and int(found[2]) > newest.get(found[1] or "", -1):
            out.append(marker.parent.relative_to(local).as_posix())
    return sorted(out, key=lambda n: int(n.rsplit("-", 1)[1]))


def _files_in(local: Path, folders: list[str]) -> list[str]:
    return [p.relative_to(local).as_posix() for f in folders for p in (local / f).rglob("*") if p.is_file()]


class Workspace:
    def __init__(self, root: str | Path, storage: StorageConfig | None = None):
        """A local folder, or an s3://bucket/prefix URI reached with the ``storage`` settings (endpoint, retries)
        and mirrored under storage.cache_dir: :func:`~grpoflow.tasks.storage.store.open_store` decides."""
        self.store: Store = open_store(root, storage)
        if isinstance(self.store, S3Store):
            self.store.claim()  # another endpoint's mirror is refused before anything in it is touched
        self.root = self.store.local_root
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"Workspace({self.location!r})"

    @property
    def location(self) -> str:
        """What names the workspace: its s3:// URI, or its local folder."""
        return self.store.location

    def stage_dir(self, stage: str) -> Path:
        """<root>/<stage>, created: where the stage works on plain files."""
        if not re.fullmatch(r"[a-z][a-z0-9_]*", stage):  # a stage's folder name (tasks/pipeline/spec.py)
            raise ValueError(f"stage {stage!r}: not a stage folder name")
        path = self.root / stage
        path.mkdir(parents=True, exist_ok=True)
        return path

    def manifest_path(self, stage: str) -> Path:
        return self.root / stage / MANIFEST

    # ------------------------------------------------------------------ publishing a stage
    def publish(
        self,
        stage: str,
        key: str,
        summary: dict[str, Any],
        also: tuple[str, ...] = (),
        record: dict[str, Any] | None = None,
    ) -> Path:
        """Publish a finished stage, once (the stage shell, tasks/pipeline/shell.py, calls it): sync its folder up
        first (and each folder of ``also`` that exists, e.g. the base model a stage built), then write its
        manifest (the key, the summary and the fields of ``record``) last, atomically."""
        self.push(stage)
        for other in also:
            if (self.root / other).is_dir():
                self.push(other)
        return self._write_manifest(stage, {**(record or {}), "key": key, "summary": summary})

    def _write_manifest(self, stage: str, payload: dict[str, Any]) -> Path:
        body = {"stage": stage, "finished_at": time.time(), **payload, "root": str(self.root)}
        self.store.write(_name(stage, MANIFEST), _dumps(body))
        return self.manifest_path(stage)

    def push(self, stage: str, sub: str = "") -> None:
        """Make the store's <stage>/<sub> match the local folder now (nothing moves for a local workspace). GRPO
        calls it after each checkpoint, so a killed stage resumes from S3."""
        self.store.sync_up(_name(stage, sub), delete=True, markers=MARKERS, exclude=(MANIFEST,))

    def push_added(self, stage: str, sub: str = "") -> None:
        """Sync <stage>/<sub> up without deleting anything in the store: a TrainJob's other nodes add their own
        checkpoint shards to the folder node 0 publishes."""
        self.store.sync_up(_name(stage, sub), markers=MARKERS, exclude=(MANIFEST,))

    def push_merged(self, stage: str, sub: str = "") -> None:
        """:meth:`push` for a folder other nodes add to (a TrainJob's node 0): the same, except that the files in a
        checkpoint folder this mirror holds are kept in the store though absent here (the other nodes' shards); a
        checkpoint folder gone here is removed from the store with every node's files."""
        folder = _name(stage, sub)
        local = self.root / folder
        others = []
        for entry in self.store.list(folder + "/"):
            name = entry.name[len(folder) + 1 :]
            parts = name.split("/")
            ckpt = next((i for i, p in enumerate(parts[:-1]) if re.fullmatch(r"checkpoint-\d+", p)), None)
            if ckpt is not None and (local / "/".join(parts[: ckpt + 1])).is_dir() and not (local / name).exists():
                others.append(name)
        self.store.sync_up(folder, delete=True, markers=MARKERS, exclude=(MANIFEST, *others))

    def checkpoint_jobs(
        self, stage: str, sub: str, name: str, merged: bool = False, keep: int = 2
    ) -> tuple[Callable[[], None], Callable[[], None]]:
        """The two jobs of checkpoint <stage>/<sub>/<name>'s upload, for ``UploadQueue.submit(name, job, then)``:
        :meth:`publish_checkpoint` (on S3 once it returns), then :meth:`prune_checkpoints`. Uploads of several
        checkpoints must run in their order (one queue)."""
        return (
            functools.partial(self.publish_checkpoint, stage, sub, name, merged),
            functools.partial(self.prune_checkpoints, stage, sub, name, keep),
        )

    def publish_checkpoint(self, stage: str, sub: str, name: str, merged: bool = False) -> None:
        """Sync checkpoint folder <stage>/<sub>/<name> up, its marker last: once this returns, the checkpoint is
        complete in the store (a resume can load it). ``merged``: files in the store in that folder but absent
        here are kept (a TrainJob's other nodes' shards)."""
        self.store.sync_up(_name(_name(stage, sub), name), delete=not merged, markers=MARKERS)

    def prune_checkpoints(self, stage: str, sub: str, name: str, keep: int = 2) -> None:
        """Remove the checkpoint folders of <stage>/<sub> older than ``name`` but the newest ``keep`` complete ones
        (each marker first, so a folder half removed is never taken for complete), as the trainer prunes locally
        (for a local workspace these are the trainer's own folders: a file it removed meanwhile is fine)."""
        folder = _name(stage, sub)
        files: dict[int, list[str]] = {}
        complete = set()
        for entry in self.store.list(folder + "/"):
            found = _CHECKPOINT.fullmatch(entry.name[len(folder) + 1 :])
            if found:
                files.setdefault(int(found[1]), []).append(entry.name)
                if found[2] in MARKERS:
                    complete.add(int(found[1]))
        step = int(name.rsplit("-", 1)[1])
        kept = set(sorted(n for n in complete if n <= step)[-keep:])
        stale = [f for n, names in files.items() if n < step and n not in kept for f in names]
        stale.sort(key=lambda f: f.rsplit("/", 1)[-1] not in MARKERS)  # markers first
        if stale:
            self.store.delete(stale)

    def pull(self, stage: str, sub: str = "") -> None:
        """Make the local <stage>/<sub> match the store now (nothing moves for a local workspace): the files
        another machine pushed (a TrainJob's node 0). Local complete checkpoints newer than the store's are kept
        (:func:`unpublished_checkpoints`)."""
        folder = _name(stage, sub)
        self._pull_keeping_unpublished(folder, [e.name[len(folder) + 1 :] for e in self.store.list(folder + "/")])

    def _pull_keeping_unpublished(self, folder: str, stored: list[str]) -> None:
        """sync_down(``folder``, delete) except the files of the local complete checkpoints the store lacks
        (``stored``: the store's names relative to ``folder``): neither deleted nor overwritten, each named in a
        log line."""
        local = self.root / folder
        keep = unpublished_checkpoints(local, stored)
        if keep:
            log.warning(
                "%s: keeping local checkpoint(s) %s, complete here and newer than any on %s (not uploaded yet); "
                "the pull leaves them and the GRPO stage uploads them",
                local,
                ", ".join(keep),
                self.store.location,
            )
        exclude = (MANIFEST, *_files_in(local, keep))
        self.store.sync_down(folder, delete=True, markers=MARKERS, exclude=exclude)

    def unpublished(self, stage: str, sub: str = "") -> list[str]:
        """Names (checkpoint-N) of the complete checkpoints in the local <stage>/<sub> newer than any complete one
        the store holds there: still to upload. Always empty for a local workspace (the store is the folder)."""
        folder = _name(stage, sub)
        stored = [e.name[len(folder) + 1 :] for e in self.store.list(folder + "/")]
        return [n.rsplit("/", 1)[-1] for n in unpublished_checkpoints(self.root / folder, stored) if "/" not in n]

    def read_manifest(self, stage: str) -> dict[str, Any] | None:
        """The stage's manifest as the store holds it (on S3: read from S3), None when absent."""
        data = self.store.read(_name(stage, MANIFEST))
        if data is None:
            return None
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = join_location(self.location, _name(stage, MANIFEST))
            raise CorruptManifest(f"{where}: not valid JSON ({len(data)} bytes; truncated or corrupt): {e}") from None

    def completed(self, stage: str, key: str) -> dict[str, Any] | None:
        """The stored summary when the stage is complete with this key, else None; its paths re-rooted to this
        workspace's root when it was written under another (another cache_dir, a moved folder)."""
        try:
            manifest = self.read_manifest(stage)
        except CorruptManifest as e:
            log.warning("%s; the stage %s counts as not complete and reruns", e, stage)
            return None
        if manifest is None or manifest.get("key") != key or "summary" not in manifest:
            return None
        old = manifest.get("root")
        return reroot(manifest["summary"], old, str(self.root)) if old else manifest["summary"]

    def rekey(
        self, stage: str, keys: tuple[str, str], continues: tuple[str | None, str | None], record: dict[str, Any]
    ) -> bool:
        """Give the stage's manifest and attempt record that hold key ``keys[0]`` (or continue key
        ``continues[0]``) the new one instead, the manifest with the fields of ``record`` (its fingerprint) too:
        the same stage under a key computed another way (tasks/pipeline/legacy.py). Whether anything changed."""
        try:
            manifest = self.read_manifest(stage)
        except CorruptManifest:
            manifest = None  # completed() reports it; the stage reruns
        changed = False
        if manifest is not None and manifest.get("key") == keys[0]:
            self._rewrite(_name(stage, MANIFEST), manifest, {**manifest, **record, "key": keys[1]})
            changed = True
        last = self.last_attempt(stage)
        renamed = {"key": keys[1]} if last.get("key") == keys[0] else {}
        if continues[0] and last.get("continues") == continues[0]:
            renamed["continues"] = continues[1]
        if renamed:
            self._rewrite(_name(stage, ATTEMPT), last, {**last, **renamed})
            changed = True
        return changed

    def _rewrite(self, name: str, old: dict[str, Any], new: dict[str, Any]) -> None:
        """Replace record ``name`` (``old``) with ``new`` through the store. The local mirror's copy stays only
        when it held ``old``: a mirror's manifest or attempt record says its files are that attempt's (fetch
        and begin trust it), which they are not when the mirror held another copy, or none."""
        local = self.root / name
        try:
            kept = json.loads(local.read_text()) == old
        except (OSError, ValueError):
            kept = False
        self.store.write(name, _dumps(new))
        if not kept:
            local.unlink(missing_ok=True)

    def forget(self, stages: tuple[str, ...], attempts: bool = False) -> None:
        """Remove the manifests (and with ``attempts`` the attempt records) of these stages."""
        names = (MANIFEST, ATTEMPT) if attempts else (MANIFEST,)
        self.store.delete([_name(stage, name) for stage in stages for name in names])

    # ------------------------------------------------------------------ running a stage
    def begin(
        self, stage: str, key: str, continues: str | None = None, extents: dict[str, Any] | None = None
    ) -> str | None:
        """Record an attempt of ``stage`` with ``key``; a folder last attempted with another key is emptied first,
        unless the last attempt had the same ``continues`` key (tasks/pipeline/fingerprint.py continue_key) and
        every value of ``extents`` is at least the one it recorded (grpo.max_steps raised: its checkpoints are
        trained on). The store decides (on S3 the remote folder), and what it holds of a kept attempt is pulled
        into the local folder; a local copy of another attempt is removed. Returns what became of the folder's
        earlier files: None (nothing there, or the same key), "continued" or "removed"."""
        folder = self.root / stage
        stored = self.store.list(stage + "/")
        local = folder / ATTEMPT
        last = self.last_attempt(stage)  # one read of the record (on S3 a request) for both questions
        same = last.get("key") == key
        extends = _continuable(last, continues, extents)
        outcome = None if same else "continued" if extends else None
        if stored and not same and not extends:
            self.store.delete_folder(stage, markers=MARKERS)
            stored, outcome = [], "removed"
        local_key = json.loads(local.read_text()).get("key") if local.is_file() else None
        if folder.is_dir() and any(folder.iterdir()) and local_key != key and not extends:
            shutil.rmtree(folder)
            outcome = "removed"
        folder.mkdir(parents=True, exist_ok=True)
        if stored:
            self._pull_keeping_unpublished(stage, [e.name[len(stage) + 1 :] for e in stored])
        record = {"key": key, "continues": continues, "extents": extents or {}, "started_at": time.time()}
        self.store.write(_name(stage, ATTEMPT), json.dumps(record).encode())
        return outcome

    def last_attempt(self, stage: str) -> dict[str, Any]:
        """The attempt record of ``stage`` (the store's, else the local folder's); {} when there is none."""
        raw = self.store.read(_name(stage, ATTEMPT))
        local = self.root / stage / ATTEMPT
        try:
            return json.loads(raw) if raw else json.loads(local.read_text()) if local.is_file() else {}
        except ValueError:  # a torn record: as if there were none (the folder is emptied)
            return {}

    def continues(self, stage: str, continues: str | None, extents: dict[str, Any] | None) -> bool:
        """Whether an attempt with ``continues`` key and ``extents`` trains on from the last attempt's files
        (:meth:`begin`)."""
        return _continuable(self.last_attempt(stage), continues, extents)

    def fetch(self, stages: tuple[str, ...], loose: tuple[str, ...] = ()) -> None:
        """Bring these stages into the local folder when the local copy is not the one the store holds (for a
        local workspace it always is).

        A complete stage is synced down unless the local manifest equals the stored one (it is written last,
        after the download, so it marks a complete copy); a folder of ``loose`` (one without a manifest, like
        the base model) is synced file by file (size and digest)."""
        for stage in stages:
            stored = self.read_manifest(stage)
            if stored is None:
                continue
            local = self.manifest_path(stage)
            if local.is_file() and json.loads(local.read_text()) == stored:
                continue
            local.unlink(missing_ok=True)
            self.store.sync_down(stage, delete=True, markers=MARKERS, exclude=(MANIFEST,))
            write_atomic(local, _dumps(stored))
        for folder in loose:
            self.store.sync_down(folder, markers=MARKERS)

    # ------------------------------------------------------------------ run-level files
    def write_text(self, name: str, text: str) -> None:
        """A file at the workspace root (config.yaml, run.json), written atomically through the store."""
        self.store.write(name, text.encode())

    def read_text(self, name: str) -> str | None:
        """A file at the workspace root as the store holds it (on S3: read from S3), None when absent."""
        data = self.store.read(name)
        return None if data is None else data.decode()
