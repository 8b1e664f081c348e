"""The GRPO stage's setup for one process: the policy (LoRA or full, on its device), the frozen reference (full
fine-tuning with beta > 0), the tokenized prompts, the reward functions and the generator (tasks/stages/grpo.py
trains and saves with what :func:`setup_grpo` returns)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.dataio.splits import load_split
from grpoflow.tasks.generation.backend import make_generator
from grpoflow.tasks.grpo.batch import PolicyLogProbs
from grpoflow.tasks.grpo.distributed import wrap_root
from grpoflow.tasks.launch.dist import Comm
from grpoflow.tasks.model.context import config_context, context_problem, tokenize_prompts
from grpoflow.tasks.model.device import select_device
from grpoflow.tasks.model.loading import (
    compute_dtype,
    count_parameters,
    load_causal_lm,
    load_tokenizer,
    load_trainable,
    train_dtypes,
)
from grpoflow.tasks.rewards import resolve_reward_funcs
from grpoflow.tasks.stages.common import base_model_path, prepared
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking import timeline
from grpoflow.tasks.tracking.tracker import RunLogger

log = logging.getLogger("grpoflow.tasks.stages.grpo")  # the stage's log lines keep the stage's logger name


@dataclasses.dataclass(frozen=True)
class GRPOSetup:
    """What :func:`setup_grpo` builds for one process's GRPO run: the policy and its wrapped root (what DDP/FSDP2
    own), the frozen reference (full fine-tuning with beta > 0, else None), the prompts and the generator."""

    start: str  # the starting model: the SFT checkpoint, the init model, or the base model
    use_lora: bool
    tokenizer: Any
    model: Any
    ref_model: Any
    root: Any
    autocast_dtype: torch.dtype | None  # the training passes' precision (LoRA's over a bf16 base too)
    reward_funcs: list
    rows: list[dict]
    prompts: list[list[int]]
    cut: dict  # tokenize_prompts' counts of prompts cut to grpo.max_prompt_length
    generator: Any
    out_dir: Path


def setup_grpo(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, init_model: str | None, comm: Comm) -> GRPOSetup:
    """Seed, then load the policy (and reference), the prompts and the generator, and wrap the policy for
    DDP/FSDP2. Seeding comes before any loading (LoRA's and the tiny model's initial weights draw from it)."""
    g = cfg.grpo
    torch.manual_seed(cfg.run.seed)
    # fail on a bad import path (or a code_tests sandbox that cannot isolate) before loading anything
    reward_funcs = resolve_reward_funcs(g.reward_funcs, g.code_reward)
    start = init_model or base_model_path(cfg, ws)
    tokenizer = load_tokenizer(start, cfg.model)
    use_lora = cfg.model.lora.enabled
    device = select_device(cfg.run.device, local_rank=comm.local_rank if comm.world > 1 else None)
    model, ref_model, wrap_dtype = load_policy(cfg, start, device)
    counts = count_parameters(model)
    rows, prompts, cut = load_prompts(cfg, ws, tracker, tokenizer, model, start)
    generator = start_generator(cfg, model, tokenizer, start, prompts)
    log_setup_params(cfg, tracker, counts, generator, ref_model, comm)
    share = g.share_prompt_forward and not (cfg.distributed.strategy == "fsdp2" and comm.world > 1)
    policy = PolicyLogProbs(model, share_prompts=share)
    root = wrap_root(policy, comm, cfg.distributed.strategy, wrap_dtype)  # what DDP/FSDP2 own
    autocast_dtype = compute_dtype(cfg.model, use_lora)  # and LoRA's over a bf16 base: the passes' precision
    log_plan(cfg, device, model, autocast_dtype, len(rows), comm)
    return GRPOSetup(
        start, use_lora, tokenizer, model, ref_model, root, autocast_dtype, reward_funcs, rows, prompts, cut,
        generator, ws.stage_dir("grpo"),
    )  # fmt: skip


def load_policy(cfg: PipelineConfig, start: str, device: torch.device) -> tuple[Any, Any, torch.dtype | None]:
    """The trainable policy on ``device``, the frozen reference (full fine-tuning with beta > 0: in
    :func:`reference_dtype`; LoRA disables its adapters instead, so None) and full fine-tuning's autocast dtype
    (FSDP2's mixed-precision policy)."""
    use_lora = cfg.model.lora.enabled
    model_cfg = cfg.model
    if cfg.grpo.gradient_checkpointing is not None:
        model_cfg = model_cfg.model_copy(update={"gradient_checkpointing": cfg.grpo.gradient_checkpointing})
    model = load_trainable(start, model_cfg, use_lora, device)
    weights_dtype, autocast_dtype = train_dtypes(cfg.model, use_lora)  # full fine-tuning's (FSDP2's policy)
    ref_model = None
    if cfg.grpo.beta > 0 and not use_lora:
        ref_dtype = reference_dtype(cfg)
        ref_model = load_causal_lm(start, cfg.model, device=device, dtype=ref_dtype).eval().requires_grad_(False)
    return model, ref_model, autocast_dtype


def load_prompts(
    cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, tokenizer, model, start: str
) -> tuple[list[dict], list[list[int]], dict]:
    """The train rows, their prompt ids (cut to grpo.max_prompt_length, the counts logged) and the counts; fails
    when the model's context cannot hold the longest prompt plus a completion."""
    rows = list(load_split(prepared(ws), "train"))
    prompts, cut = tokenize_prompts(tokenizer, rows, cfg.grpo.max_prompt_length)  # warns once when prompts are cut
    tracker.log_metrics({f"prompts/{k}": v for k, v in cut.items()})
    fed = max(map(len, prompts), default=0)  # the context of a model downloaded or converted in this stage:
    if problem := context_problem(cfg, config_context(model.config), start, sft=False, prompt_tokens=fed):
        raise ValueError(problem)
    return rows, prompts, cut


def start_generator(cfg: PipelineConfig, model, tokenizer, start: str, prompts: list[list[int]]):
    """The generation backend of generation.backend, sized for the longest prompt plus a completion."""
    timeline.mark("grpo/generator_start")
    generator = make_generator(  # on several processes: one engine per rank (vLLM's starts are collective)
        cfg.generation,
        model,
        tokenizer,
        model_path=start,
        dtype=cfg.model.dtype,
        load_in_4bit=cfg.model.load_in_4bit,
        max_model_len=max(len(p) for p in prompts) + cfg.grpo.max_completion_length,
        seed=cfg.run.seed,
        revision=cfg.model.revision if start == cfg.model.name else None,  # the hub commit the policy loaded
    )
    timeline.mark("grpo/generator_up")
    return generator


def log_setup_params(cfg: PipelineConfig, tracker: RunLogger, counts: tuple[int, int], generator, ref_model, comm):
    """Log the run's parameters: parameter counts, the generation backend, the reference dtype, the batching."""
    trainable, total = counts
    tracker.log_params(
        {
            "trainable_params": trainable,
            "total_params": total,
            "generation_backend": generator.name,
            "reference_dtype": dtype_name(ref_model),
            **cfg.grpo.batching(comm.world).model_dump(),
        }
    )


def log_plan(cfg: PipelineConfig, device, model, autocast_dtype, n_rows: int, comm: Comm) -> None:
    """Say where and in what precision the run trains, and how its rounds divide into micro-batches."""
    g, b = cfg.grpo, cfg.grpo.batching(comm.world)
    log.info("GRPO on %s: weights %s, autocast %s", device, model.dtype, autocast_dtype or "off")
    log.info(
        "GRPO: %d prompts, %d per round x %d generations, %d micro-batches of %d per round and process, "
        "%d process(es), %d optimizer steps",
        n_rows,
        b.unique_prompts,
        g.num_generations,
        b.steps_per_generation,
        b.micro_batch_size,
        comm.world,
        g.max_steps,
    )


def reference_dtype(cfg: PipelineConfig) -> torch.dtype | None:
    """The dtype of full fine-tuning's reference model (grpo.beta > 0; None: model.dtype as configured).

    The dtype its forward runs in when training: bf16 under bf16 autocast (model.dtype bfloat16). It is frozen and
    needs no float32 master weights: half their memory. With grpo.sync_ref_model (TR-DPO) it is not frozen: each
    sync moves it by alpha * (policy - ref), which bf16 would round away for a small alpha: float32 then."""
    weights, autocast = train_dtypes(cfg.model, use_lora=False)
    return weights if cfg.grpo.sync_ref_model else autocast or weights


def dtype_name(model) -> str | None:
    """A model's dtype as the params and summary name it ("bfloat16"); None for no model."""
    return None if model is None else str(model.dtype).removeprefix("torch.")
