"""The commands that run the pipeline: ``grpoflow run``, ``grpoflow resume`` and ``grpoflow validate``.

The config is loaded and checked before anything heavy is imported (:func:`_load`), the reachable services next
(:func:`preflight`); then the flow runs in-process against a Prefect server started for it (flows/embedded_server.py),
holding the run's workspace, and the run's summary is printed (flows/cli_summary.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

from grpoflow.flows.cli_env import _setup_env
from grpoflow.flows.cli_summary import print_summary
from grpoflow.flows.embedded_server import serving, start_server
from grpoflow.tasks.config import (
    ConfigError,
    PipelineConfig,
    apply_overrides,
    config_from_dict,
    load_config,
    load_run_config,
)
from grpoflow.tasks.config.trl_keys import TRLKeyWarning
from grpoflow.tasks.pipeline.errors import StageError
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.store import open_store, write_atomic
from grpoflow.tasks.storage.workspace import join_location
from grpoflow.tasks.tracking import timeline


def _load(args) -> PipelineConfig:
    with warnings.catch_warnings(record=True) as caught:  # trl: keys with no meaning here, one line each
        warnings.simplefilter("always", TRLKeyWarning)
        cfg = load_run_config(args.config, args.overrides, name=args.command == "run", trl_config=args.trl_config)
    for w in caught:
        if issubclass(w.category, TRLKeyWarning):
            print(f"grpoflow: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    from grpoflow.tasks.model.sources import model_folder_problem, model_problem

    if problem := model_problem(cfg.model.name):  # a bad GGUF or folder: now, not after data prep
        raise ConfigError(f"model.name: {problem}")
    if cfg.model.warm_start is not None and (problem := model_folder_problem(cfg.model.warm_start)):
        raise ConfigError(f"model.warm_start: {problem}")
    from grpoflow.tasks.model.sources import cached_model

    folder = cached_model(cfg.model.name, cfg.model.cache_dir)
    if cfg.model.name != "tiny" and folder and Path(folder).expanduser().is_dir():  # a local folder: its template
        from grpoflow.tasks.model.template import chat_template_problem

        if problem := chat_template_problem(folder, cfg.model, cfg.data.system_prompt):
            raise ConfigError(problem)
    from grpoflow.tasks.model.context import context_problem, known_context

    if (known := known_context(cfg)) and (problem := context_problem(cfg, *known)):  # lengths past the context
        raise ConfigError(problem)
    from grpoflow.tasks.model.targets import lora_target_problem

    if problem := lora_target_problem(cfg):  # names that match no module: now, not in GRPO after SFT
        raise ConfigError(problem)
    x = cfg.export
    if x.enabled and x.merged and "q4_k_m" in x.gguf:  # said now: the export stage skips it at the run's end
        from grpoflow.tasks.model.gguf import llama_cpp_module, llama_quantize_binary

        if llama_cpp_module() is None and llama_quantize_binary() is None:
            print(
                "grpoflow: warning: export.gguf q4_k_m needs llama.cpp (pip install 'grpoflow[llamacpp]', or "
                "llama-quantize on PATH), neither found: the export will skip it",
                file=sys.stderr,
            )
    from grpoflow.tasks.dataio.sources import file_problem

    d = cfg.data
    for key, source in (("data.source", d.source), ("data.eval_source", d.eval_source)):
        if source and (problem := file_problem(source, d.question_field, d.answer_field)):
            raise ConfigError(f"{key}: {problem}")
    from grpoflow.tasks.pipeline.preflight import output_dir_problem

    if problem := output_dir_problem(cfg.run.output_dir):
        raise ConfigError(problem)
    from grpoflow.tasks.pipeline.fingerprint import missing_reward_file

    if problem := missing_reward_file(cfg):  # keyed by content: one that is gone cannot be, nor read by the reward
        raise ConfigError(problem)
    from grpoflow.tasks.rewards import resolve_reward_funcs

    try:  # imported and their signatures checked now, not in the GRPO stage after data prep and SFT
        resolve_reward_funcs(cfg.grpo.reward_funcs, cfg.grpo.code_reward)
    except ValueError as e:
        raise ConfigError(f"grpo.reward_funcs: {e}") from None
    return cfg


def cmd_run(args) -> int:
    """Run the pipeline in <output_dir>/<run.name>, holding the workspace; a run.name that names an existing run
    is resumed when its finished stages keep their keys, else refused (``--force``: replaced, each named)."""
    timeline.start_run()
    cfg = _load(args)
    return _run_pipeline(cfg, check=lambda store, c: refuse_replacing(c, store, args.force), command="grpoflow run")


def refuse_replacing(cfg: PipelineConfig, store, force: bool) -> None:
    """`grpoflow run` onto an existing run whose finished stages this config would rerun: a ConfigError naming
    them and pointing at `grpoflow resume`; with ``force`` each is named as it is replaced. A folder that is no
    grpoflow run (files but no config.yaml, or another tool's config.yaml: tasks/pipeline/run_folder.py) is
    refused whatever ``force`` says: the stages would empty its folders."""
    from grpoflow.tasks.pipeline.run_folder import run_folder_problem

    config = store.read("config.yaml")
    if problem := run_folder_problem(store, config):
        raise ConfigError(f"run.name {cfg.run.name!r}: {problem}. Pick another run.name or run.output_dir")
    if config is None:  # no run here yet
        return
    from grpoflow.flows.stages import PIPELINE
    from grpoflow.tasks.pipeline.resume import explain, replaced
    from grpoflow.tasks.storage.workspace import Workspace

    ws = Workspace(store.location, cfg.storage)
    reruns = explain(PIPELINE, cfg, ws)
    lost = replaced(PIPELINE, cfg, ws, reruns)
    if not lost:
        return
    lines = [f"  {stage}: {lost[stage]}; {'; '.join(reruns[stage])}" for stage in lost]
    if force:
        for line in lines:
            print(f"run --force:{line[1:]}")
        return
    raise ConfigError(
        f"run.name {cfg.run.name!r}: a run with another config exists at {store.location}; this config would rerun "
        "its finished stages:\n" + "\n".join(lines) + f"\nTo change that run's config use `grpoflow resume "
        f"{store.location} key=value ...` (it says what reruns); to keep it, pick another run.name; to replace "
        "them, add --force"
    )


def cmd_resume(args) -> int:
    """Rerun the pipeline in RUN_DIR with its config.yaml (+ overrides): complete stages whose key matches are
    skipped; --from-stage first forgets that stage and every later one (manifest and files), so they rerun."""
    timeline.start_run()
    missing = f"{args.run_dir}: no config.yaml; RUN_DIR must be a run workspace (<output_dir>/<name>)"
    # the workspace's store (an s3:// one reached with the endpoint of the env or of storage.* overrides)
    storage = config_from_dict({"storage": apply_overrides({}, list(args.overrides)).get("storage", {})}).storage
    try:
        store = open_store(args.run_dir, storage)
    except ValueError as e:  # an s3:// RUN_DIR that is no usable URI (bucket name, '..' segments)
        raise ConfigError(f"RUN_DIR: {e}") from None
    if store.read("config.yaml") is None:
        raise ConfigError(missing)
    from grpoflow.tasks.pipeline.run_folder import WOULD_EMPTY, foreign_config, mirror_problem

    if foreign := foreign_config(store):  # another tool's folder: refused before the lock file is written there
        raise ConfigError(f"RUN_DIR: {foreign}; {WOULD_EMPTY}. RUN_DIR must be a run workspace (<output_dir>/<name>)")
    if mirrored := mirror_problem(store):
        raise ConfigError(f"RUN_DIR: {mirrored}")
    from grpoflow.tasks.storage.lock import workspace_lock

    with workspace_lock(store, "grpoflow resume"):  # before anything is read: another process may be writing it
        return _resume(args, store)


def _resume(args, store) -> int:
    text = store.read("config.yaml")
    config = store.local_root / "config.yaml"
    if not config.is_file() or config.read_bytes() != text:  # S3: into the local mirror, as a stage would
        write_atomic(config, text)
    run_dir = store.location
    parent, name = run_dir.rsplit("/", 1)
    cfg = load_config(str(config), list(args.overrides))
    # the workspace is RUN_DIR wherever it now lies (its MLflow store, by default, beside it)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name, "output_dir": parent})})
    timeline.mark("config_loaded")
    _setup_env(cfg)  # PREFECT_HOME and logging, before the stage modules below import Prefect
    from grpoflow.flows.stages import PIPELINE
    from grpoflow.tasks.pipeline.resume import explain, replaced
    from grpoflow.tasks.storage.workspace import Workspace

    if args.from_stage is not None and args.from_stage not in PIPELINE.names:
        names = ", ".join(PIPELINE.names)
        raise ConfigError(f"--from-stage: unknown stage {args.from_stage!r}; expected one of {names}")
    forget = PIPELINE.stages_from(args.from_stage) if args.from_stage else ()
    ws = Workspace(run_dir, cfg.storage)
    reruns = explain(PIPELINE, cfg, ws, forget)
    print_reruns(reruns, replaced(PIPELINE, cfg, ws, reruns))  # the config, files and code each rerun sees
    return _run_pipeline(cfg, lambda: ws.forget(forget, attempts=True))


def print_reruns(reruns: dict[str, list[str]], replaces: dict[str, str] | None = None) -> None:
    """What `grpoflow resume` reruns and why (tasks/pipeline/resume.py explain), and what each rerun does to the
    stage's finished results (``replaces``: resume.replaced), before the flow starts."""
    if not reruns:
        print("resume: every stage is complete with its current key; nothing reruns")
    for stage, why in reruns.items():
        if stage in (replaces or {}):
            print(f"resume: {stage} {replaces[stage]}")
        for line in why:
            print(f"resume: {stage} reruns: {line}")


def preflight(cfg: PipelineConfig) -> None:
    """What must be reachable for a run, checked in seconds before any stage (tasks/pipeline/preflight.py): the
    MLflow tracking server, and hub ids that are not cached. `grpoflow validate` stays offline and skips these."""
    from grpoflow.tasks.dataio.sources import BUILTIN_SOURCE, HUMANEVAL_SOURCE, looks_like_file
    from grpoflow.tasks.pipeline import preflight as pf

    uri = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    key = "tracking.uri" if cfg.tracking.uri else "MLFLOW_TRACKING_URI"
    if problem := pf.tracking_problem(uri):
        raise ConfigError(f"{key}: {problem}")
    m, d = cfg.model, cfg.data
    if pf.is_hub_model(m.name):
        if problem := pf.hub_problem("model.name", m.name, "model", m.revision):
            raise ConfigError(problem)
    if d.source not in (BUILTIN_SOURCE, HUMANEVAL_SOURCE) and not s3.is_s3_uri(d.source):
        if not looks_like_file(d.source) and pf.is_hub_id(d.source):
            if problem := pf.hub_problem("data.source", d.source, "dataset"):
                raise ConfigError(problem)


def _run_pipeline(cfg: PipelineConfig, before=None, check=None, command: str = "grpoflow resume") -> int:
    """Run the flow on ``cfg``'s workspace once the checks pass, holding the workspace (tasks/storage/lock.py;
    re-entrant: `resume` takes it first); ``check(store, cfg)`` runs under the lock, ``before()`` once the server is
    up. Under the lock too a hub model's revision is pinned to a commit (tasks/pipeline/revision.py), unless the
    workspace's config.yaml recorded it unpinned."""
    timeline.mark("config_loaded")
    preflight(cfg)
    _setup_env(cfg)
    for uri in (cfg.run.output_dir, cfg.data.source, cfg.data.eval_source):  # the workspace and data files on S3:
        if uri and s3.is_s3_uri(uri):  # bucket, credentials, endpoint checked before Prefect and MLflow start
            s3.S3Client(cfg.storage).check_access(uri)
    from grpoflow.tasks.storage.lock import workspace_lock

    store = open_store(join_location(cfg.run.output_dir, cfg.run.name), cfg.storage)
    from grpoflow.tasks.pipeline.run_folder import WOULD_EMPTY, foreign_config, mirror_problem

    if foreign := foreign_config(store):  # another tool's folder: refused before the lock file is written there
        raise ConfigError(
            f"run.name {cfg.run.name!r}: {foreign}; {WOULD_EMPTY}. Pick another run.name or run.output_dir"
        )
    if mirrored := mirror_problem(store):
        raise ConfigError(f"run.output_dir: {mirrored}, not a run.output_dir of its own")
    with workspace_lock(store, command):  # a second process: exit 2 naming this one, before any work
        from grpoflow.tasks.pipeline.revision import pin_revision

        cfg, pinned = pin_revision(cfg, store.read("config.yaml"))
        for line in (pinned or "").splitlines():
            print(f"grpoflow: {line}")
        if check is not None:
            check(store, cfg)
        return _serve_pipeline(cfg, before)


def _serve_pipeline(cfg: PipelineConfig, before) -> int:
    # Prefect's server starts in its own process (its own session: Ctrl-C reaches the CLI, which stops the server
    # last) while this one does its heavy imports (vLLM's too): on two cores the two starts overlap instead of
    # adding up
    server = start_server()
    try:
        if cfg.generation.backend == "vllm":  # fail now, not after data prep and SFT
            from grpoflow.tasks.generation.vllm_support import config_problem

            if problem := config_problem(cfg):
                raise ConfigError(f"generation.backend=vllm: {problem}")
        from grpoflow.flows.pipeline import grpo_pipeline  # heavy imports only after the config is valid
    except BaseException:
        if server is not None:
            server.stop()
        raise
    timeline.mark("imports_done")

    quiet_stage_errors()
    workspace = join_location(cfg.run.output_dir, cfg.run.name)
    t0 = time.perf_counter()
    with serving(server):
        timeline.mark("prefect_server_up")
        if before is not None:
            before()
        result = grpo_pipeline(config=cfg, workspace=str(workspace))
    print_summary(result, time.perf_counter() - t0)
    return 0


class _NoTracebackForStageErrors(logging.Filter):
    """Prefect logs a failed task and flow with the exception's traceback; for a StageError (the user's input,
    reported in one line at the end, the traceback in the workspace's logs/) it keeps just the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], StageError):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_stage_errors() -> None:
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForStageErrors) for f in logger.filters):
            logger.addFilter(_NoTracebackForStageErrors())


def cmd_validate(args) -> int:
    cfg = _load(args)
    print(json.dumps(cfg.to_dict(), indent=2) if args.show else "config OK")
    return 0
