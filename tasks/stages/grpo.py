"""GRPO stage: load the policy (the SFT checkpoint, else the base model), train, save.

With LoRA the stage trains a fresh adapter on top of its starting model and saves only the
adapter (``grpo/final``); the reference for beta > 0 is the same model with adapters disabled.
Full fine-tuning saves the whole model and, for beta > 0, loads a frozen reference copy.

With ``distributed.nproc_per_node > 1`` (or several nodes) the stage launches torchrun
(tasks/launch/torchrun.py): every process runs :func:`train_grpo` (tasks/stages/grpo_worker.py), rank 0 logs into
this stage's MLflow run and writes the summary this process reads back and publishes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.grpo.distributed import full_state_dict
from grpoflow.tasks.grpo.trainer import GRPOTrainer, list_checkpoints
from grpoflow.tasks.grpo.trainer_runtime import CheckpointHooks, TrainerRuntime
from grpoflow.tasks.launch.dist import Comm
from grpoflow.tasks.launch.torchrun import run_torchrun, torchrun_command
from grpoflow.tasks.pipeline.fingerprint import model_files, reward_files, reward_modules
from grpoflow.tasks.pipeline.shell import run_stage
from grpoflow.tasks.pipeline.spec import Pipeline, StageSpec
from grpoflow.tasks.stages.common import BASE_MODEL, model_and_dataset, model_params
from grpoflow.tasks.stages.grpo_launch import WORKER, launch_spec
from grpoflow.tasks.stages.grpo_setup import GRPOSetup, dtype_name, setup_grpo
from grpoflow.tasks.storage.lock import held_fds
from grpoflow.tasks.storage.uploads import UploadQueue, drain_on_sigterm
from grpoflow.tasks.storage.workspace import MARKERS, Workspace
from grpoflow.tasks.tracking import timeline
from grpoflow.tasks.tracking.plots import plot_learning_curves
from grpoflow.tasks.tracking.run_meta import constant_metrics, fmt_lr
from grpoflow.tasks.tracking.tracker import RunLogger

log = logging.getLogger(__name__)


def run_grpo(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, init_model: str | None = None) -> dict:
    """Train and return the summary (the stage shell publishes it); on several processes through torchrun, or on
    the nodes of a Kubeflow TrainJob (distributed.launcher: trainjob)."""
    if cfg.distributed.launcher == "trainjob":
        from grpoflow.tasks.stages.grpo_trainjob import launch_trainjob  # the kubernetes client only when used

        return launch_trainjob(cfg, ws, tracker, init_model)
    if cfg.distributed.world_size > 1:
        return launch_grpo(cfg, ws, tracker, init_model)
    return train_grpo(cfg, ws, tracker, init_model)


def launch_grpo(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, init_model: str | None) -> dict:
    """Run :func:`train_grpo` on every process of ``cfg.distributed`` with torchrun; rank 0 logs into ``tracker``'s
    run and writes the summary returned here. A failing rank fails the stage with its error."""
    d = cfg.distributed
    folder = ws.stage_dir("grpo") / "launch"
    spec = launch_spec(cfg, ws, tracker, init_model, folder)
    (folder / "spec.json").write_text(json.dumps(spec))
    # the workspace lock held until the last worker exits: a kill -9 of this process leaves rank 0 draining its
    # checkpoint uploads (tasks/storage/uploads.py) for a while, and no second run may start meanwhile
    cmd = torchrun_command(d, WORKER, [str(folder / "spec.json")])
    run_torchrun(cmd, folder, d.world_size, keep_fds=held_fds())
    return json.loads((folder / "summary.json").read_text())


def train_grpo(
    cfg: PipelineConfig,
    ws: Workspace,
    tracker: RunLogger,
    init_model: str | None = None,
    comm: Comm | None = None,
    node_mirrors: bool = False,
) -> dict:
    """The GRPO run of this process (rank ``comm.rank`` of a torchrun launch, or the only one): its summary.
    Only rank 0 writes files and logs (the other ranks get a disabled ``tracker``). With ``node_mirrors`` each node
    has its own mirror of the S3 workspace (a TrainJob's): each node uploads its own checkpoint shards."""
    comm = comm or Comm()
    setup = setup_grpo(cfg, ws, tracker, init_model, comm)
    trainer, uploads = build_trainer(cfg, ws, tracker, setup, comm, node_mirrors)
    t0 = time.perf_counter()
    timeline.mark("grpo/loop_start")
    with drain_on_sigterm(uploads) if uploads is not None else contextlib.nullcontext():  # rank 0 (or the only one)
        result = train(trainer, setup.generator, comm)
    return save_grpo(setup, trainer, result, tracker, comm, uploads, t0)


def build_trainer(
    cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, s: GRPOSetup, comm: Comm, node_mirrors: bool
) -> tuple[GRPOTrainer, UploadQueue | None]:
    """The trainer over ``s`` with its checkpoint hooks (on S3: uploaded in the background, the queue returned),
    resumed from the newest checkpoint in grpo/checkpoints when grpo.resume is auto."""
    g, out_dir = cfg.grpo, s.out_dir
    if g.resume == "never" and comm.is_main:
        discard_checkpoints(ws, out_dir / "checkpoints")
    unsent = ws.unpublished("grpo", "checkpoints") if comm.is_main else []  # saved, killed before their upload
    uploads = checkpoint_uploads(ws, out_dir / "checkpoints", unsent) if comm.is_main else None  # in the background

    def on_checkpoint(final):  # S3: a killed stage resumes from there (a TrainJob's node 0 keeps others' shards)
        if uploads is not None:
            uploads.submit(final.name, *ws.checkpoint_jobs("grpo", "checkpoints", final.name, merged=node_mirrors))

    hooks = CheckpointHooks(
        on_checkpoint=on_checkpoint,
        node_push=(lambda final: ws.push_added("grpo", f"checkpoints/{final.name}")) if node_mirrors else None,
        pinned=uploads.pending if uploads is not None else None,  # never pruned before they are on S3
    )
    runtime = TrainerRuntime(
        s.model, s.tokenizer, s.rows, s.prompts, s.reward_funcs, s.generator, tracker, out_dir / "checkpoints",
        ref_model=s.ref_model, autocast_dtype=s.autocast_dtype, comm=comm, root=s.root, hooks=hooks,
    )  # fmt: skip
    trainer = GRPOTrainer(g, runtime, seed=cfg.run.seed, row_seeded=cfg.distributed.row_seeded)
    resumed = trainer.resume() if g.resume == "auto" else None  # the newest that loads (damaged ones: a warning)
    for name in unsent:  # kept by the pull on resume; a damaged one (newer than the one resumed) is not sent
        if resumed is not None and int(name.rsplit("-", 1)[1]) <= int(resumed.name.rsplit("-", 1)[1]):
            log.info("GRPO: uploading %s, saved before the stage was stopped and not on S3 yet", name)
            on_checkpoint(trainer.checkpoint_dir / name)
    return trainer, uploads


def discard_checkpoints(ws: Workspace, local) -> None:
    """grpo.resume=never: the checkpoints an earlier attempt of the same key left (locally and in the store) are
    removed before training starts over. Kept, the trainer's pruning (the newest two by step) removed the new
    attempt's checkpoint-10 and -20 beside the old -90 and -100, and a later resume (auto) continued the old
    attempt's weights."""
    stored = {e.name.split("/")[2] for e in ws.store.list("grpo/checkpoints/") if e.name.count("/") >= 3}
    old = sorted({p.name for p in list_checkpoints(local)} | stored)
    if not old:
        return
    log.warning("GRPO: grpo.resume is never: removing the checkpoints of an earlier attempt (%s)", ", ".join(old))
    ws.store.delete_folder("grpo/checkpoints", markers=MARKERS)
    shutil.rmtree(local, ignore_errors=True)


def train(trainer: GRPOTrainer, generator, comm: Comm) -> dict:
    """Run the loop; on one process the generator closes right after it, even when it fails (frees the engine
    before eval and export). On several, :func:`save_grpo` closes it after the last collective."""
    try:
        return trainer.train()  # a vLLM generator syncs the trained weights before each generation round
    finally:
        if comm.world == 1 and hasattr(generator, "close"):
            generator.close()  # free the engine before eval and export


def save_grpo(
    s: GRPOSetup, trainer: GRPOTrainer, result: dict, tracker: RunLogger, comm: Comm, uploads, t0: float
) -> dict:
    """Write grpo/final (the adapter, or the whole model gathered from FSDP2's shards), history.jsonl and the
    learning curves (rank 0), wait for the checkpoint uploads; return the summary (``t0``: the loop's start)."""
    final_dir = s.out_dir / "final"
    gathered = full_state_dict(s.root, comm)  # FSDP2: the shards gathered on rank 0 (every rank takes part)
    if comm.world > 1 and hasattr(s.generator, "close"):  # after the last collective: vLLM's shutdown destroys
        s.generator.close()  # the default process group (a rank that failed leaves its engine to the process's end)
    if comm.is_main:  # DDP: every rank holds the same weights; rank 0 writes them
        s.model.save_pretrained(final_dir, **({} if gathered is None else {"state_dict": gathered}))
        s.tokenizer.save_pretrained(final_dir)
        history_path = s.out_dir / "history.jsonl"
        history_path.write_text("".join(json.dumps(h) + "\n" for h in trainer.history))
        tracker.log_artifact(history_path)
        if trainer.history:
            tracker.log_artifact(plot_learning_curves(trainer.history, s.out_dir / "learning_curves.png"))
    if uploads is not None:
        finish_uploads(uploads, trainer.checkpoint_dir)
    summary = {
        "model_path": str(final_dir),
        "base_model": s.start,
        "adapter": s.use_lora,
        "steps": result["steps"],
        "final_reward": result["final"].get("reward"),
        "first_reward": trainer.history[0].get("reward") if trainer.history else None,
        "seconds": time.perf_counter() - t0,
        "generation_backend": s.generator.name,
        "reference_dtype": dtype_name(s.ref_model),  # full fine-tuning with beta > 0: the frozen copy's dtype
        **s.cut,
    }
    if comm.world > 1:
        summary["world_size"] = comm.world
    return summary


def checkpoint_uploads(ws: Workspace, folder, unsent: list[str] = ()) -> UploadQueue:
    """The background queue of checkpoint uploads, bounded by storage.outage_budget_s and
    storage.max_pending_uploads. Built for every workspace: for a local one its jobs upload nothing and only prune
    what the trainer prunes too (a file either removes first is fine for the other). ``unsent``: local checkpoints
    not on S3 yet (queued by :func:`build_trainer`), not counted as done."""
    st = ws.store.settings
    cap = min(30.0, max(1.0, st.outage_budget_s / 5))  # several attempts fit in a small budget
    done = [p.name for p in list_checkpoints(folder) if p.name not in unsent]  # pulled from S3 when the stage began
    return UploadQueue(ws.store.where, st.outage_budget_s, st.max_pending_uploads, backoff_cap_s=cap, done=done)


def finish_uploads(uploads: UploadQueue, folder) -> None:
    """At the stage's end: wait for the queued checkpoint uploads (each within the budget), then prune the
    checkpoints kept locally while they were queued (the newest two stay, as on S3)."""
    if pending := uploads.pending():
        log.info("GRPO: waiting for %d checkpoint upload(s) to %s: %s", len(pending), uploads.where, pending)
    uploads.drain()
    for stale in list_checkpoints(folder)[:-2]:
        shutil.rmtree(stale, ignore_errors=True)


def _result(s: dict) -> str:
    if s.get("final_reward") is None:
        return ""
    first = s.get("first_reward")
    start = f"{first:.3f} -> " if first is not None else ""
    return f"{s['steps']} steps, mean reward {start}{s['final_reward']:.3f}."


def _params(cfg: PipelineConfig) -> dict:
    """The resolved round layout (batching) and model.*."""
    return {**cfg.grpo.batching(cfg.distributed.world_size).model_dump(), **model_params(cfg)}


def _omit_constant(tracker: RunLogger, cfg: PipelineConfig) -> None:
    """Metrics that cannot move at these settings are not logged; a tag on the run says why."""
    tracker.omit_constant(constant_metrics(cfg))


SPEC = StageSpec(
    name="grpo",
    # distributed: the world size sets the round's rows, strategy and seed_by_row what each process samples;
    # its plumbing (addresses, ports, launcher) is IGNORED in tasks/config/fingerprint.py
    keys=("run.seed", "run.torch_threads", "model", "grpo", "generation", "distributed"),
    upstream=lambda cfg: ("sft",) if cfg.sft.enabled else ("data",),
    reads=(model_files, reward_modules, reward_files),
    writes=(BASE_MODEL,),
    extends=("grpo.max_steps",),  # raised: train on from the last checkpoint (the trainer's hash ignores it)
    splits=("train",),
    trains=True,
    description="GRPO training of {model} on {dataset} ({loss_type} loss, learning rate {lr}).",
    param_sections=("grpo", "generation"),
    name_parts=lambda cfg: (*model_and_dataset(cfg), cfg.grpo.loss_type, f"lr {fmt_lr(cfg.grpo.learning_rate)}"),
    params=_params,
    tags=lambda cfg: {"loss_type": cfg.grpo.loss_type},
    result=_result,
    before=_omit_constant,
)


# no Prefect cache: the pipeline's stage keys decide what reruns (tasks/pipeline/fingerprint.py); hashing the
# inputs (the stage table, the config) would only cost time
@task(name="grpo", cache_policy=NO_CACHE)
def grpo_task(
    stages: Pipeline, cfg: PipelineConfig, workspace_root: str, parent_run_id: str | None, init_model: str | None
) -> dict:
    return run_stage(stages, SPEC, run_grpo, cfg, workspace_root, parent_run_id, init_model=init_model)
