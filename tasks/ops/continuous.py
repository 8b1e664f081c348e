"""The pieces of one continuous fine-tuning cycle, as plain functions (flows/continuous.py wires them):

    new files of the source -> one training file -> the champion model from the registry -> a cycle config

The cycle itself is the pipeline flow on that config: data prep on the new files, GRPO warm-started from the
champion (no SFT), evaluation on the config's fixed held-out file (``data.eval_source``), export, and
registration, where the champion alias moves only when the new model beats the champion on the same held-out rows
by more than their noise (a paired McNemar test: tasks/tracking/promotion.py, tasks/tracking/registry.py).
mlflow, datasets and torch are imported where used: the continuous flow imports this module first thing, and a run
that finds no new data should not wait for them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from grpoflow.tasks.config import ConfigError, PipelineConfig, StorageConfig
from grpoflow.tasks.ops.datasource import DataFile, DataFileChanged, fetch, sha256_file

log = logging.getLogger(__name__)


def check_continuous_config(cfg: PipelineConfig) -> None:
    """The cycle compares models on one fixed held-out set and needs a held-out accuracy to decide."""
    if not cfg.data.eval_source:
        raise ConfigError(
            "data.eval_source: the continuous flow needs a fixed held-out file (e.g. data.eval_source=heldout.jsonl); "
            "without it the held-out rows would come from each batch of new data and cycles could not be compared"
        )
    if not cfg.eval.enabled:
        raise ConfigError("eval.enabled: must be true for the continuous flow (promotion needs a held-out accuracy)")
    if not cfg.tracking.register_model:
        raise ConfigError("tracking.register_model: must be true for the continuous flow (it promotes in the registry)")


def check_file(f: DataFile, path: Path, cfg: PipelineConfig) -> str | None:
    """Why landed file ``f`` (its bytes at ``path``) cannot train, named by its own URI and line (as an editor
    shows it), with the rules of the data stage (data.question_field/answer_field, data.format,
    data.on_invalid_row); None when it can. Checked one by one, so one bad file does not fail the others."""
    from grpoflow.tasks.dataio.rows import columns, detect_format, map_rows
    from grpoflow.tasks.dataio.sources import load_source, row_locator

    d = cfg.data
    try:
        q, a = columns(load_source(str(path)), d.question_field, d.answer_field, f.uri)
        fmt = d.format if d.format != "auto" else detect_format(a)
        examples, skipped = map_rows(q, a, fmt, d, f.uri, row_locator(str(path)))
    except (ValueError, OSError) as e:
        text = str(e)
        return text if f.uri in text or f.name in text else f"{f.uri}: {text}"
    if not examples:
        return f"{f.uri}: no usable row ({len(skipped)} invalid; the first: {skipped[0][1] if skipped else 'none'})"
    return None


class Gathered(NamedTuple):
    """What :func:`gather` made of the listed files."""

    path: Path  # the JSON-lines file of every row that trains
    rows: int
    bad: list[tuple[DataFile, str]]  # left out, with why (quarantined by the cycle)
    changed: list[DataFile]  # changed since listed: neither trained nor recorded; the next cycle lists them
    files: list[DataFile]  # the files whose rows it holds, each with its snapshot's sha256 (what the ledger records)
    same: list[tuple[DataFile, dict]]  # a new key, the bytes of a file already recorded (its entry): not trained


def gather(
    files: list[DataFile],
    dest: Path,
    storage: StorageConfig | None = None,
    check: Callable[[DataFile, Path], str | None] | None = None,
    seen: dict[tuple[str, int, str], dict] | None = None,
) -> Gathered:
    """Every row of ``files`` (any format the data stage reads; S3 ones fetched with ``storage``) in one JSON-lines
    file (:class:`Gathered`). ``check(file, local path)`` (:func:`check_file`) says why a file cannot train; such a
    file, or one that does not load, is left out rather than failing the others. Each file is read from one
    snapshot of the listed bytes (:func:`fetch`), whose sha256 it then carries; one that changed since it was
    listed is left out too, neither trained nor to be recorded: the next cycle lists its new version. A file whose
    name, size and sha256 are in ``seen`` (the ledger's :meth:`~Ledger.contents`: an S3 object uploaded again,
    with another ETag) is left out as ``same``, with the entry it repeats."""
    from grpoflow.tasks.dataio.sources import load_source

    download_dir = dest.parent / "downloads"
    rows = 0
    bad: list[tuple[DataFile, str]] = []
    changed: list[DataFile] = []
    kept: list[DataFile] = []
    same: list[tuple[DataFile, dict]] = []
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w") as out:
        for f in files:
            try:
                path = fetch(f, download_dir, storage)
            except DataFileChanged as e:
                log.warning("%s: left for the next cycle", e)
                changed.append(f)
                continue
            f = dataclasses.replace(f, sha256=f.sha256 or sha256_file(path))
            if f.content in (seen or {}):
                same.append((f, seen[f.content]))
                continue
            problem = check(f, path) if check is not None else None
            if problem is None:
                try:
                    ds = load_source(str(path))
                except (ValueError, FileNotFoundError) as e:
                    problem = f"new data file {f.uri}: {e}"
            if problem is not None:
                bad.append((f, problem))
                continue
            for row in ds:
                out.write(json.dumps(row, default=str) + "\n")
                rows += 1
            kept.append(f)
    return Gathered(dest, rows, bad, changed, kept, same)


def champion_model(cfg: PipelineConfig, dest: Path) -> tuple[str, dict] | None:
    """Download the model the alias ``tracking.champion_alias`` points at into ``dest``; (local folder, info),
    or None when there is no champion yet. A LoRA adapter is merged onto its base first, so the result is always
    a plain model folder GRPO can start from (with a fresh adapter when LoRA is on)."""
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from grpoflow.tasks.tracking.registry import ACCURACY_TAG, registered_model_name
    from grpoflow.tasks.tracking.tracker import tracking_uri

    uri = tracking_uri(cfg)
    name = cfg.tracking.registered_model or registered_model_name(cfg.model.name)
    alias = cfg.tracking.champion_alias
    client = MlflowClient(uri, registry_uri=uri)
    try:
        version = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    # the version's own artifact location (a models:/ URI would resolve against the default registry, not ``uri``)
    source = client.get_model_version_download_uri(name, version.version)
    local = Path(download_artifacts(artifact_uri=source, dst_path=str(dest), tracking_uri=uri))
    if (local / "MLmodel").is_file() and (local / "peft").is_dir():  # an adapter-only export: base + peft/ adapter
        local = _merge_mlflow_adapter(local, dest / "merged", cfg)
    elif (local / "MLmodel").is_file():  # an MLflow transformers model: the HF folder (weights, tokenizer) in model/
        local = local / "model"
    if (local / "adapter_config.json").is_file():
        local = _merge_adapter(local, dest / "merged", cfg)
    if not (local / "config.json").is_file():
        raise ValueError(f"champion {name}/{version.version} ({version.source}): no model config.json in {local}")
    info = {
        "name": name,
        "version": str(version.version),
        "accuracy": float(version.tags[ACCURACY_TAG]) if ACCURACY_TAG in version.tags else None,
        "source": version.source,
    }
    return str(local), info


def _merge_mlflow_adapter(saved: Path, out: Path, cfg: PipelineConfig) -> Path:
    """An adapter-only MLflow model (tasks/tracking/model_registry.py log_adapter_model: its base under model/, or
    a hub repo at a commit, and the adapter under peft/) loaded as MLflow loads it, base with the adapter applied,
    and merged into a plain model folder. Its model/ folder alone is the base without the adapter."""
    import mlflow.transformers

    parts = mlflow.transformers.load_model(str(saved), return_type="components")
    return _save_merged(parts["model"], parts["tokenizer"], out, cfg)


def _merge_adapter(adapter_dir: Path, out: Path, cfg: PipelineConfig) -> Path:
    from grpoflow.tasks.model.loading import load_tokenizer, load_with_adapter

    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or (base.startswith(("/", ".")) and not Path(base).exists()):
        raise ValueError(f"champion adapter {adapter_dir}: its base model {base!r} is not available here")
    model = load_with_adapter(base, str(adapter_dir), cfg.model, quantize=False)
    return _save_merged(model, load_tokenizer(str(adapter_dir), cfg.model), out, cfg)


def _save_merged(model, tokenizer, out: Path, cfg: PipelineConfig) -> Path:
    """The champion's adapter folded into its base, saved as a plain model folder at ``out`` in model.dtype (auto:
    the loaded model's)."""
    from grpoflow.tasks.model.save import save_merged

    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else str(model.dtype).removeprefix("torch.")
    save_merged(model, tokenizer, out, dtype, is_adapter=True)
    return out


def _pinned_default(cfg: PipelineConfig, tracking_uri) -> str | None:
    return None if os.environ.get("MLFLOW_TRACKING_URI") else tracking_uri(cfg)


def cycle_config(cfg: PipelineConfig, name: str, data_file: Path, warm_start: str | None) -> PipelineConfig:
    """The pipeline config of one cycle: the new rows as the source, the tracking store pinned (its default lies
    under run.output_dir), and, when GRPO warm-starts from the champion (``warm_start``: its local folder), that
    folder as model.warm_start and no SFT. So the cycle's config.yaml says where it started: its keys hold the
    champion's files, and `grpoflow resume` of the cycle's workspace starts from the champion again."""
    from grpoflow.tasks.tracking.tracker import tracking_uri

    update = {
        "run": cfg.run.model_copy(update={"name": name}),
        "data": cfg.data.model_copy(update={"source": str(data_file), "split": "train"}),
        # the default store's path pinned; $MLFLOW_TRACKING_URI is not copied in (it may hold credentials, which
        # the config refuses and must not write to config.yaml), every cycle reads it from the environment
        "tracking": cfg.tracking.model_copy(update={"uri": cfg.tracking.uri or _pinned_default(cfg, tracking_uri)}),
    }
    cycle = cfg.model_copy(update=update)
    return cycle.warm_started(warm_start) if warm_start is not None else cycle
