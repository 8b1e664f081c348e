"""SFT stage: teach the output format (and, for the tiny model, the task) before GRPO.

Each training example is the chat-templated prompt followed by the reference completion
("<reasoning>...</reasoning><answer>...</answer>") and EOS; with ``completion_only_loss`` the
prompt tokens carry label -100. Cross-entropy is the token mean over the accumulated batch.
With LoRA the adapter is merged before saving, so the checkpoint is always a plain model that
GRPO (or evaluation) loads as its base. On a 4-bit base (QLoRA) the adapter is merged into the base
reloaded unquantized in ``model.dtype``, never into the 4-bit copy: sft/model carries no
quantization_config, and GRPO quantizes it itself when ``model.load_in_4bit`` asks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import tempfile
import time
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.kernels.logprobs import label_nll
from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.dataio.splits import load_split
from grpoflow.tasks.model.device import select_device
from grpoflow.tasks.model.loading import (
    backbone_and_head,
    compute_dtype,
    count_parameters,
    load_tokenizer,
    load_trainable,
    prompt_ids,
    require_unquantized,
)
from grpoflow.tasks.model.optim import build_optimizer, build_scheduler, clip_and_step
from grpoflow.tasks.model.precision import train_precision
from grpoflow.tasks.model.save import merge_into_16bit_base
from grpoflow.tasks.pipeline.fingerprint import model_files
from grpoflow.tasks.pipeline.shell import run_stage
from grpoflow.tasks.pipeline.spec import Pipeline, StageSpec
from grpoflow.tasks.stages.common import BASE_MODEL, base_model_path, model_and_dataset, model_params, prepared
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking import timeline
from grpoflow.tasks.tracking.progress import progress_bar
from grpoflow.tasks.tracking.run_meta import fmt_lr
from grpoflow.tasks.tracking.tracker import RunLogger

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LengthCut:
    """What sft.max_length did to the train split: ``cut`` examples lost the end of their reference, ``dropped``
    (among them) kept no reference token at all, of ``total``; ``longest``: the longest example, in tokens."""

    total: int
    cut: int
    dropped: int
    longest: int


def tokenize_sft(
    rows, tokenizer, max_length: int, completion_only: bool
) -> tuple[list[tuple[list[int], list[int]]], LengthCut]:
    """(ids, labels) of each row: chat-templated prompt + reference + EOS, cut to ``max_length``; with
    ``completion_only`` the prompt's labels are -100. A row whose prompt alone fills ``max_length`` is left out:
    none of its answer survives the cut (with completion_only it would train on nothing: loss 0.0). Returns the
    examples and the counts of what was cut (:func:`report_cut` warns about them)."""
    examples, cut, dropped, longest, total = [], 0, 0, 0, 0
    for row in rows:
        total += 1
        p = prompt_ids(tokenizer, row["prompt"])
        c = tokenizer(row["reference"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        longest = max(longest, len(p) + len(c))
        if len(p) + len(c) > max_length:
            cut += 1
            if len(p) >= max_length:
                dropped += 1
                continue
        ids = (p + c)[:max_length]
        labels = ([-100] * len(p) if completion_only else p) + c
        examples.append((ids, labels[:max_length]))
    return examples, LengthCut(total, cut, dropped, longest)


def report_cut(cut: LengthCut, max_length: int, tracker: RunLogger) -> None:
    """Warn, with the counts and sft.max_length, about examples the length cut shortened or dropped, and log the
    counts as the stage run's params; a ValueError naming the key when no example keeps any answer token."""
    tracker.log_params({"sft_examples_cut": cut.cut, "sft_examples_dropped": cut.dropped})
    if cut.total and cut.dropped == cut.total:
        raise ValueError(
            f"sft.max_length={max_length}: every one of the {cut.total} train examples has a prompt of "
            f"{max_length} tokens or more, so no answer token is left to train on; raise sft.max_length (the "
            f"longest example is {cut.longest} tokens) or shorten data.system_prompt"
        )
    if cut.cut:
        log.warning(
            "SFT: %d of %d train examples are longer than sft.max_length=%d tokens and lose the end of their "
            "answer (%d with no answer token left are dropped); the longest is %d tokens: raise sft.max_length",
            cut.cut,
            cut.total,
            max_length,
            cut.dropped,
            cut.longest,
        )


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded ids (``pad_id``), labels (-100) and attention mask of a batch of (ids, labels)."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return ids, labels, mask


def labelled_token_loss(model, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the labelled positions: sum_t -log p(labels[t+1] | ids[:t+1]).

    The output projection runs only where the next token carries a label (with completion-only loss, the
    completion): the prompt's vocabulary-wide logits are never formed. On SmolLM2 (49k vocabulary) a prompt of
    ~60 tokens before a ~40-token completion made those logits most of the head's work and memory. Even those run
    through the fused log-prob kernels (kernels.logprobs.label_nll: loss = -sum logp of the labels), so no
    [tokens, vocabulary] logits exist: a float32 copy of them was 4 * tokens * V bytes, and as much again for its
    softmax and gradient."""
    backbone, head = backbone_and_head(model)
    hidden = backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    return label_nll(hidden, head.weight, labels[:, 1:], getattr(head, "bias", None))


@dataclasses.dataclass(frozen=True)
class SFTSetup:
    """What :func:`setup_sft` prepares besides the model (which :func:`run_sft` alone holds, so that a QLoRA run can
    drop its 4-bit copy before the 16-bit merge loads): the tokenized examples and the step plan."""

    base: str  # the model SFT starts from (and, with LoRA, merges into)
    tokenizer: Any
    device: torch.device
    autocast_dtype: torch.dtype | None
    use_lora: bool
    qlora: bool  # LoRA over a 4-bit base: merged into the base reloaded in 16 bits
    examples: list[tuple[list[int], list[int]]]
    per_step: int  # examples per optimizer step (batch size x gradient accumulation)
    total_steps: int
    examples_cut: int = 0  # longer than sft.max_length (tokenize_sft)
    examples_dropped: int = 0  # of those, with no answer token left: not among ``examples``


def run_sft(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger) -> dict:
    """The SFT stage: setup (seed, load, tokenize), train, merge a LoRA adapter, save; returns the summary."""
    s, model = setup_sft(cfg, ws, tracker)
    loss_val, t0 = train_sft(cfg, s, model, tracker)
    if s.qlora:
        with tempfile.TemporaryDirectory() as adapter_dir:
            model.save_pretrained(adapter_dir)
            del model  # the 4-bit training copy goes before the 16-bit one loads (its optimizer went with train_sft)
            model = merge_into_16bit_base(s.base, adapter_dir, cfg.model, "sft")
    elif s.use_lora:
        model = model.merge_and_unload()  # a 16-bit base in model.dtype: the merge is exact up to its rounding
    return save_sft(ws, s, model, loss_val, t0)


def setup_sft(cfg: PipelineConfig, ws: Workspace, tracker: RunLogger) -> tuple[SFTSetup, Any]:
    """Seed, then load the tokenizer and the trainable model and tokenize the train split; logs the parameter
    counts and the step count. A QLoRA run fails here, before training, when its base is not 16-bit."""
    s = cfg.sft
    torch.manual_seed(cfg.run.seed)
    base = base_model_path(cfg, ws)
    tokenizer = load_tokenizer(base, cfg.model)
    use_lora = s.use_lora and cfg.model.lora.enabled
    qlora = use_lora and cfg.model.load_in_4bit
    if qlora:  # before training: the merge at the end needs 16-bit base weights
        require_unquantized(base, cfg.model, "sft (use_lora with model.load_in_4bit) merges into model.name")
    device = select_device(cfg.run.device)
    model = load_trainable(base, cfg.model, use_lora, device)
    autocast_dtype = compute_dtype(cfg.model, use_lora)
    trainable, total = count_parameters(model)
    examples, cut = tokenize_sft(load_split(prepared(ws), "train"), tokenizer, s.max_length, s.completion_only_loss)
    report_cut(cut, s.max_length, tracker)
    per_step = s.per_device_train_batch_size * s.gradient_accumulation_steps
    steps_per_epoch = max(1, math.ceil(len(examples) / per_step))
    total_steps = s.max_steps or max(1, math.ceil(s.num_train_epochs * steps_per_epoch))
    tracker.log_params({"trainable_params": trainable, "total_params": total, "total_steps": total_steps})
    log.info("SFT: %d examples, %d steps, %d/%d trainable parameters", len(examples), total_steps, trainable, total)
    setup = SFTSetup(
        base, tokenizer, device, autocast_dtype, use_lora, qlora, examples, per_step, total_steps, cut.cut, cut.dropped
    )
    return setup, model


def train_sft(cfg: PipelineConfig, s: SFTSetup, model, tracker: RunLogger) -> tuple[float, float]:
    """The training loop: sft.total steps over seeded shuffled epochs of the examples; logs loss, grad norm,
    learning rate, throughput and epoch every sft.logging_steps. Returns the last step's loss and the loop's start
    (perf_counter)."""
    c = cfg.sft
    optimizer = build_optimizer(model.parameters(), c)
    scheduler = build_scheduler(optimizer, c, s.total_steps)
    rng = random.Random(cfg.run.seed)
    order: list[int] = []
    loss_val, t0, tokens = float("nan"), time.perf_counter(), 0
    timeline.mark("sft/loop_start")
    with progress_bar("sft", s.total_steps) as advance:
        for step in range(1, s.total_steps + 1):
            micro = draw_examples(s.examples, order, rng, s.per_step)
            loss_val, step_tokens = accumulate_gradients(s, model, micro, c.per_device_train_batch_size)
            tokens += step_tokens
            grad_norm = clip_and_step(model, optimizer, scheduler, c.max_grad_norm)
            if step % c.logging_steps == 0 or step == s.total_steps:
                elapsed = time.perf_counter() - t0
                tracker.log_metrics(
                    {
                        "loss": loss_val,
                        "grad_norm": grad_norm,
                        "learning_rate": scheduler.get_last_lr()[0],
                        "tokens_per_second": tokens / max(elapsed, 1e-9),
                        "epoch": step * s.per_step / len(s.examples),
                    },
                    step=step,
                )
            advance(loss=loss_val)
    return loss_val, t0


def draw_examples(examples: list, order: list[int], rng: random.Random, n: int) -> list:
    """The next ``n`` examples of the epoch ``order`` (a shuffled permutation consumed from its end), starting a
    new seeded shuffle whenever it runs out; ``order`` is updated in place."""
    micro = []
    for _ in range(n):
        if not order:
            order.extend(range(len(examples)))
            rng.shuffle(order)
        micro.append(examples[order.pop()])
    return micro


def accumulate_gradients(s: SFTSetup, model, micro: list, batch_size: int) -> tuple[float, int]:
    """Backward over the micro-batches of one optimizer step. Each micro-batch's summed loss is divided by the
    step's labelled tokens, so the gradient is the token mean over the whole step. Returns the step's loss and the
    tokens it saw."""
    n_label = sum(sum(1 for t in y[1:] if t != -100) for _, y in micro)
    step_loss, tokens = 0.0, 0
    for k in range(0, s.per_step, batch_size):
        batch = collate(micro[k : k + batch_size], s.tokenizer.pad_token_id)
        ids, labels, mask = (t.to(s.device) for t in batch)
        with train_precision(model, s.device.type, s.autocast_dtype):
            loss = labelled_token_loss(model, ids, labels, mask) / max(1, n_label)
        loss.backward()
        step_loss += loss.item()
        tokens += int(mask.sum())
    return step_loss, tokens


def save_sft(ws: Workspace, s: SFTSetup, model, loss_val: float, t0: float) -> dict:
    """Write sft/model (model and tokenizer) and return the summary (``t0``: the loop's start)."""
    out = ws.stage_dir("sft") / "model"
    model.save_pretrained(out)
    s.tokenizer.save_pretrained(out)
    return {
        "model_path": str(out),
        "base_model": s.base,
        "steps": s.total_steps,
        "final_loss": loss_val,
        "train_examples": len(s.examples),
        "examples_cut": s.examples_cut,  # longer than sft.max_length: the end of their answer lost
        "examples_dropped": s.examples_dropped,  # no answer token left: not trained on
        "seconds": time.perf_counter() - t0,
    }


def _result(s: dict) -> str:
    return f"{s['steps']} steps, final loss {s['final_loss']:.4f}." if s.get("final_loss") is not None else ""


SPEC = StageSpec(
    name="sft",
    keys=("run.seed", "run.torch_threads", "model", "sft"),
    upstream=lambda cfg: ("data",),
    enabled=lambda cfg: cfg.sft.enabled,
    reads=(model_files,),
    writes=(BASE_MODEL,),
    splits=("train",),
    trains=True,
    description="Supervised fine-tuning of {model} on the reference answers of {dataset}.",
    param_sections=("sft",),
    name_parts=lambda cfg: (*model_and_dataset(cfg), f"lr {fmt_lr(cfg.sft.learning_rate)}"),
    params=model_params,
    result=_result,
)


# no Prefect cache: the pipeline's stage keys decide what reruns (tasks/pipeline/fingerprint.py); hashing the
# inputs (the stage table, the config) would only cost time
@task(name="sft", cache_policy=NO_CACHE)
def sft_task(stages: Pipeline, cfg: PipelineConfig, workspace_root: str, parent_run_id: str | None) -> dict:
    return run_stage(stages, SPEC, run_sft, cfg, workspace_root, parent_run_id)
