"""The GRPO loop: generate a round, score it, then replay it as micro-batches.

One generation round (TRL's buffering; docs/grpo.md):
  1. take ``unique_prompts`` prompts, sample ``num_generations`` completions for each;
  2. score every completion with every reward function, weight, sum, group-normalize -> A;
  3. shuffle the round and split it into ``steps_per_generation`` micro-batches of
     ``per_device_train_batch_size``; replay them ``num_iterations`` times;
  4. step the optimizer every ``gradient_accumulation_steps`` micro-batches (windows may span
     rounds, as in TRL).
old log-probs are computed once per round when they can differ from the current ones (TRL: when
gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0, or with the sampler
correction); otherwise old_logp = logp.detach() and the ratio is exactly 1.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.config.fingerprint import config_digest
from grpoflow.tasks.generation.types import SamplingParams
from grpoflow.tasks.grpo import checkpoint, dist_checkpoint
from grpoflow.tasks.grpo.batch import (
    PolicyLogProbs,
    RoundTensors,
    build_round,
    check_logprob_impl,
    head_positions,
    host_prompt_groups,
    prompt_keys,
    root_logprobs,
)
from grpoflow.tasks.grpo.checkpoint import list_checkpoints
from grpoflow.tasks.grpo.distributed import (
    collective_free,
    gathered,
    gradient_sync,
    local_rows,
    rounds_done,
    row_seed,
)
from grpoflow.tasks.grpo.dynamic import Drawn, fill_round, with_overlong_penalty
from grpoflow.tasks.grpo.flops import StepFlops
from grpoflow.tasks.grpo.loss import (
    LossSettings,
    correction_parts,
    correction_stats,
    grpo_loss,
    importance_sampling_ratio,
    rows_with_gradient,
)
from grpoflow.tasks.grpo.micro_plan import MicroPlan, planned_logprobs, round_plans
from grpoflow.tasks.grpo.regularizers import EntropyControl, mix_reference
from grpoflow.tasks.grpo.round_stats import (
    completion_stats,
    completion_tables,
    reward_stats,
    round_advantages,
    round_samples,
)
from grpoflow.tasks.grpo.rounds import PromptSampler, Round
from grpoflow.tasks.grpo.schedule import is_optimizer_step, micro_batch_rows
from grpoflow.tasks.grpo.step_metrics import StepMetrics
from grpoflow.tasks.grpo.trainer_runtime import TrainerRuntime
from grpoflow.tasks.launch.dist import Comm
from grpoflow.tasks.model.device import model_device
from grpoflow.tasks.model.optim import build_optimizer, build_scheduler, clip_and_step
from grpoflow.tasks.model.precision import train_precision
from grpoflow.tasks.rewards import UnscoredRounds, score_completions
from grpoflow.tasks.tracking.progress import progress_bar

log = logging.getLogger(__name__)


def loss_settings(g: GRPOConfig, spg: int, num_processes: int = 1) -> LossSettings:
    return LossSettings(
        loss_type=g.loss_type,
        importance_sampling_level=g.importance_sampling_level,  # grpo_loss makes gspo sequence-level itself
        epsilon=g.epsilon,
        epsilon_high=g.effective_epsilon_high,
        delta=g.delta,
        beta=g.beta,
        use_bias_correction_kl=g.use_bias_correction_kl,
        max_completion_length=g.max_completion_length,
        gradient_accumulation_steps=g.gradient_accumulation_steps,
        steps_per_generation=spg,
        sapo_temperature_neg=g.sapo_temperature_neg,
        sapo_temperature_pos=g.sapo_temperature_pos,
        vespo_k_pos=g.vespo_k_pos,
        vespo_lambda_pos=g.vespo_lambda_pos,
        vespo_k_neg=g.vespo_k_neg,
        vespo_lambda_neg=g.vespo_lambda_neg,
        top_entropy_quantile=g.top_entropy_quantile,
        off_policy_mask_threshold=g.off_policy_mask_threshold,
        num_processes=num_processes,
    )


class GRPOTrainer:
    # rows without a gradient get a no-grad forward of their own, on one process and under DDP (micro_plan.py); the
    # tests turn it off to compare with the one-forward pass
    split_rows = True

    def __init__(
        self,
        cfg: GRPOConfig,
        rt: TrainerRuntime,
        *,
        seed: int = 42,
        row_seeded: bool = False,
        is_correction: bool | None = None,
    ):
        """``cfg`` the grpo section, ``rt`` the runtime objects; ``seed`` run.seed, ``row_seeded`` whether each
        completion is seeded by its row (distributed.row_seeded); ``is_correction`` whether to correct for the
        sampler's drift (default: grpo.vllm_importance_sampling_correction with a separate engine, e.g. vLLM)."""
        self.cfg, self.runtime = cfg, rt
        model, generator = rt.model, rt.generator
        self.model, self.tokenizer, self.generator, self.tracker = model, rt.tokenizer, generator, rt.tracker
        self.rows, self.prompt_ids, self.reward_funcs = rt.rows, rt.prompt_ids, rt.reward_funcs
        self.checkpoint_dir, self.ref_model, self.seed = rt.checkpoint_dir, rt.ref_model, seed
        if is_correction is None:
            is_correction = cfg.vllm_importance_sampling_correction and generator.separate_engine
        self.is_correction = is_correction  # the sampler is a separate engine: correct for its drift
        hooks = rt.hooks
        self.on_checkpoint, self.node_push, self.pinned = hooks.on_checkpoint, hooks.node_push, hooks.pinned
        self.device = model_device(model)  # rounds, log-probs, loss and optimizer state live beside the model
        check_logprob_impl(cfg.logprob_impl, self.device)
        self.autocast_dtype = rt.autocast_dtype  # full fine-tuning in bf16: float32 weights, bf16 forward passes
        # distributed (tasks/grpo/distributed.py): this process's rank, the root module the engine wraps (the
        # log-prob path, PolicyLogProbs(model) at world size 1) and whether completions are seeded per row
        self.comm = rt.comm or Comm()
        self.root = rt.root if rt.root is not None else PolicyLogProbs(model, cfg.share_prompt_forward)
        self.free_root = collective_free(self.root)  # where rows without a gradient may forward apart (micro_plan)
        self.row_seeded = row_seeded
        if self.comm.world > 1 and generator.separate_engine:  # it syncs after each optimizer step, decided
            generator.weights_key = lambda: self.step  # alike on every rank (FSDP2: the sync is collective)
        self.batching = cfg.batching(self.comm.world)
        self.settings = loss_settings(cfg, self.batching.steps_per_generation, self.comm.world)
        self.sampler = PromptSampler(len(rt.rows), seed, cfg.shuffle_dataset)
        self.optimizer = build_optimizer(model.parameters(), cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, cfg.max_steps)
        self.params = SamplingParams.from_grpo(cfg)
        self.weights = torch.tensor(cfg.reward_weights) if cfg.reward_weights else None
        self.reward_names = [name for name, _ in rt.reward_funcs]
        if cfg.overlong_buffer_length is not None:  # the column with_overlong_penalty adds, weight 1
            self.reward_names.append("overlong")
            self.weights = None if self.weights is None else torch.cat([self.weights, torch.ones(1)])
        self.entropy = EntropyControl.from_config(cfg)  # None: no entropy bonus
        self.perm_rng = torch.Generator().manual_seed(seed)
        self.round: Round | None = None
        # what a checkpoint must agree with to be resumed: the grpo section's digest without the fields that cannot
        # change a result (tasks/config/fingerprint.py, the digest the stage keys use) and without max_steps: the
        # learning-rate schedule is built from it, but a trainer asked to go further on the same checkpoints folder
        # (max_steps raised) should continue from its newest checkpoint rather than refuse it. (In the pipeline the
        # stage key includes max_steps: a changed value reruns the stage in an emptied folder, tasks/pipeline/shell.py)
        self.config_hash = config_digest(cfg, exclude=frozenset({"max_steps"}))[:16]
        self.step = 0
        self.micro_step = 0
        self.num_tokens = 0
        self.history: list[dict] = []
        self.unscored_rounds = UnscoredRounds()  # per reward: rounds it scored nothing
        self.flops = StepFlops(model)  # perf/train_tflops: the training half's model FLOPs per second (flops.py)
        self.step_metrics = StepMetrics()  # the micro-steps' metrics, on the device until the optimizer step

    # ---------------------------------------------------------------- generation round
    def draw(self, n_prompts: int) -> Drawn:
        """The next ``n_prompts`` prompts, num_generations completions each, scored by every reward function.

        Every rank takes the same prompts in the same order; with several processes (or seed_by_row) each samples
        and scores only its rows of the round (local_rows: all of them at world size 1), ``per_func`` [L, K]."""
        g, b, comm = self.cfg, self.batching, self.comm
        n_round = rounds_done(self.sampler.epoch, self.sampler.cursor, len(self.rows), b.unique_prompts)
        idx = self.sampler.take(n_prompts)
        mine = local_rows(b, comm.rank)
        row_idx = [i for i in idx for _ in range(g.num_generations)][mine]
        if self.row_seeded:  # each row sampled with its own seed: the same completions whatever the world size
            seeds = [row_seed(self.seed, n_round, r) for r in range(mine.start, mine.stop)]
            # FSDP2: full weights while this rank decodes alone (a separate engine gathers them as it syncs)
            with nullcontext() if self.generator.separate_engine else gathered(self.root):
                gen = self.generator.generate([self.prompt_ids[i] for i in row_idx], 1, self.params, row_seeds=seeds)
        else:
            gen = self.generator.generate([self.prompt_ids[i] for i in idx], g.num_generations, self.params)
        rows = [self.rows[i] for i in row_idx]
        texts = self.tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        conversational = isinstance(rows[0]["prompt"], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
        scores = score_completions(
            self.reward_funcs, [r["prompt"] for r in rows], completions, columns, g.reward_timeout_s
        )
        per_func = torch.tensor([scores[name] for name, _ in self.reward_funcs], dtype=torch.float32).t()  # [L, K]
        if g.overlong_buffer_length is not None:  # DAPO's length penalty, one more reward column
            per_func = with_overlong_penalty(per_func, gen.completion_ids, g)
        return Drawn(idx, gen.completion_ids, gen.logprobs, gen.finish_reasons, rows, texts, per_func)

    def generate_round(self) -> tuple[RoundTensors, torch.Tensor, dict, list[dict]]:
        """One round: ``unique_prompts`` prompts drawn, sampled and scored (dynamic sampling refills it), this
        rank's rows as RoundTensors on the CPU, their advantages, the round's stats and its completion samples."""
        g, b, comm = self.cfg, self.batching, self.comm
        d = self.draw(b.unique_prompts)
        ds_stats = {}
        if g.dynamic_sampling:  # one process only (the config refuses it with distributed)
            d, ds_stats = fill_round(d, self.draw, self.weights, g.num_generations, g.dynamic_sampling_max_rounds)
        mine = local_rows(b, comm.rank)
        row_idx = [i for i in d.idx for _ in range(g.num_generations)][mine]
        per_func = comm.all_gather(d.per_func)  # [B, K]: the whole round's, on every rank
        total, unscored, adv, stats = round_advantages(per_func, self.weights, self.reward_names, g)
        stats.update(ds_stats)
        stats.update(reward_stats(per_func, unscored, self.reward_funcs, self.reward_names, self.unscored_rounds))
        batch = build_round(
            [self.prompt_ids[i] for i in row_idx],
            d.completion_ids,
            d.logprobs,
            d.finish_reasons,
            self.tokenizer.pad_token_id,
            g.mask_truncated_completions,
        )
        lengths, tokens = completion_stats(d.completion_ids, batch, comm)
        self.num_tokens += tokens
        stats.update(lengths, num_tokens=float(self.num_tokens))
        samples = round_samples(d, total, adv, mine, self.reward_names, comm, g.log_completions)
        return batch, adv[mine], stats, samples

    def place(self, batch: RoundTensors, adv: torch.Tensor) -> tuple[RoundTensors, torch.Tensor]:
        """A round built on the CPU from the sampler's lists, moved to the model's device."""
        return batch.to(self.device), adv.to(self.device)

    def _autocast(self):
        """torch.autocast to ``autocast_dtype`` on the model's device; a no-op context without one."""
        return train_precision(self.model, self.device.type, self.autocast_dtype)

    def _logprobs_no_grad(self, batch: RoundTensors, model=None, host: RoundTensors | None = None) -> torch.Tensor:
        """The log-probs of ``batch``'s completions, micro-batch by micro-batch, without gradients. ``host``: the same
        batch on the CPU; its prompts then need no read from the device, and the head computes the real tokens only
        (batch.head_positions), the padding holding 0."""
        out = []
        mb = self.batching.micro_batch_size
        on_host = host if host is not None else batch  # the device batch: one read for the pass, not one a forward
        keys = prompt_keys(on_host.prompt_ids, on_host.prompt_mask)
        with torch.no_grad(), self._autocast():
            for s in range(0, batch.completion_ids.shape[0], mb):
                sub = batch.select(torch.arange(s, min(s + mb, batch.completion_ids.shape[0])))
                groups = host_prompt_groups(keys[s : s + mb], self.device)
                kw = {"impl": self.cfg.logprob_impl, "chunk_rows": self.cfg.logprob_chunk_rows, "groups": groups}
                if host is not None:
                    kw["head_rows"] = head_positions(host.completion_mask[s : s + mb], None, self.device)
                # the policy through the root module (the distributed engine's); the reference model as it is
                root = self.root if model is None else PolicyLogProbs(model, self.cfg.share_prompt_forward)
                out.append(root_logprobs(root, sub, self.cfg.temperature, **kw)[0])
        return torch.cat(out)  # every slice keeps the round's width

    def reference_logprobs(self, batch: RoundTensors, host: RoundTensors | None = None) -> torch.Tensor:
        if self.ref_model is not None:
            return self._logprobs_no_grad(batch, self.ref_model, host)
        with self.model.disable_adapter():  # LoRA: the reference is the base, no second copy
            return self._logprobs_no_grad(batch, host=host)

    # ---------------------------------------------------------------- training
    def new_round(self) -> Round:
        g, b = self.cfg, self.batching
        t_gen = time.perf_counter()
        batch, adv, stats, samples = self.generate_round()
        stats["generation_time"] = time.perf_counter() - t_gen
        host = (batch, adv)  # on the CPU: the passes and micro-steps are planned from them (_plans)
        batch, adv = self.place(batch, adv)
        # TRL's rule: old log-probs differ from the current ones unless the whole round (all its replays)
        # falls inside optimizer windows, i.e. unless gradient_accumulation_steps % (spg * mu) == 0. TRL also
        # makes this pass for its vLLM correction; here, when the weights cannot move within the round, the loss
        # pass's own log-probs are the old ones: micro_loss takes the correction from them (one forward of the
        # round saved: about a quarter of a step's training compute)
        need_old = b.gradient_accumulation_steps % b.micro_steps_per_round != 0
        n_round = float(self.comm.all_reduce(batch.completion_mask.sum()))  # the whole round's (dapo)
        if n_round == 0:
            log.warning("every completion of this round is masked (truncated): its loss is 0")
        old_logp = self._logprobs_no_grad(batch, host=host[0]) if need_old else None
        is_ratio = None
        if self.is_correction and need_old:
            is_ratio = self.sampler_correction(old_logp, batch)
            parts = correction_parts(old_logp, batch.sampler_logp, batch.completion_mask, is_ratio)
            stats.update(correction_stats([parts]))
        r = Round(
            batch=batch,
            advantages=adv,
            stats=stats,
            samples=samples,
            old_logp=old_logp,
            ref_logp=self.reference_logprobs(batch, host[0]) if g.beta > 0 else None,
            is_ratio=is_ratio,
            n_tokens=n_round,
            order=torch.randperm(adv.numel(), generator=self.perm_rng)
            if g.shuffle_generation_batch
            else torch.arange(adv.numel()),
        )
        self._plans(r, host)  # here, from the host's tensors, not inside a micro-step
        return r

    def train(self) -> dict:
        """Run until max_steps optimizer steps; resumable at any optimizer step (see save_checkpoint)."""
        g, b = self.cfg, self.batching
        window: dict[str, list[float]] = defaultdict(list)
        t_start = step_start = time.perf_counter()
        bar = progress_bar("grpo", g.max_steps, self.step) if self.comm.is_main else nullcontext(lambda *a, **k: None)
        with bar as advance:
            while self.step < g.max_steps:
                if self.round is None:
                    self.round = self.new_round()
                    self.flops.add_round(self.round, self._seq_lens(self.round).tolist())
                r = self.round
                it, idx = micro_batch_rows(b, r.position, r.order)
                self._micro_step(r, idx, it)
                r.position += 1
                if r.position == b.micro_steps_per_round:
                    self.round = None
                    if r.correction:  # taken per micro-batch (micro_loss): the round's metrics from its parts
                        r.stats.update(correction_stats(r.correction))
                if not is_optimizer_step(self.micro_step, b):
                    continue
                grad_norm = clip_and_step(self.root, self.optimizer, self.scheduler, g.max_grad_norm)
                for entropy_sum, tokens in self.step_metrics.flush(self.comm, window):  # one collective, one read
                    self.entropy.observe(entropy_sum, tokens)
                self.step += 1
                self._after_step(window)
                now = time.perf_counter()
                metrics = {key: sum(v) / len(v) for key, v in window.items() if v}
                # a reward statistic of nothing scored is NaN: left out (frac_unscored says so), never logged
                metrics.update({k: v for k, v in r.stats.items() if not (_is_reward_key(k) and math.isnan(v))})
                metrics.update(
                    {
                        "grad_norm": grad_norm,
                        "learning_rate": self.scheduler.get_last_lr()[0],
                        "step_time": now - step_start,
                        "tokens_per_second": self.num_tokens / max(now - t_start, 1e-9),
                        **self.flops.take(now - step_start),
                    }
                )
                step_start = now
                window.clear()
                self.history.append({"step": self.step, **metrics})
                if self.step % g.logging_steps == 0 or self.step == g.max_steps:
                    self.tracker.log_metrics(metrics, step=self.step)
                for name in completion_tables(self.step, g.max_steps) if g.log_completions else ():
                    self._log_samples(r.samples, name)
                if self.step % g.save_steps == 0 or self.step == g.max_steps:  # the last one too: a raised
                    self.save_checkpoint()  # grpo.max_steps trains on from it (tasks/stages/grpo.py SPEC.extends)
                advance(reward=metrics.get("reward", math.nan), loss=metrics.get("loss", 0.0))
        last = self.history[-1] if self.history else {}
        return {"steps": self.step, "final": last, "seconds": time.perf_counter() - t_start}

    def sampler_correction(self, old_logp: torch.Tensor, batch: RoundTensors) -> torch.Tensor:
        """The importance-sampling ratio of ``batch``'s rows against the engine that sampled them (loss.py)."""
        g = self.cfg
        return importance_sampling_ratio(
            old_logp,
            batch.sampler_logp,
            batch.completion_mask,
            g.vllm_importance_sampling_mode,
            g.vllm_importance_sampling_cap,
            g.vllm_importance_sampling_clip_min,
        )

    def _plans(self, r: Round, host: tuple[RoundTensors, torch.Tensor] | None = None) -> list[MicroPlan]:
        """Each micro-step position's plan (micro_plan.round_plans): its prompt groups, the positions its head
        computes, and (one process, DDP) the rows without a gradient apart. Made once per round from the round's batch
        and advantages on the CPU (``host``: a new round's; a resumed round's are read from the device once), so no
        forward syncs to find them."""
        if r.plans is None:
            batch, adv = host if host is not None else (r.batch.to("cpu"), r.advantages.cpu())
            trains = rows_with_gradient(adv, self.settings, self.entropy is not None)
            split = self.split_rows and self.free_root is not None
            each_step = self.comm.world > 1  # every rank's collectives alike: one forward with autograd a micro-step
            r.plans = round_plans(self.batching, r.order, batch, trains, split, self.device, each_step)
        return r.plans

    def _seq_lens(self, r: Round) -> torch.Tensor:
        """Each row's real tokens (prompt + completion) on the CPU, read once per round (flops.py)."""
        if r.seq_lens is None:
            r.seq_lens = (r.batch.prompt_mask.sum(1) + r.batch.completion_mask.sum(1)).cpu()
        return r.seq_lens

    def micro_loss(self, r: Round, idx: torch.Tensor):
        """The loss of the round's rows ``idx`` (those of its micro-step ``r.position``) under the current policy,
        and what its metrics need: (loss, extras, the micro-batch, logp, entropy), all on the model's device."""
        mb = r.batch.select(idx)
        with self._autocast():
            logp, entropy = self._policy_logprobs(mb, self._plans(r)[r.position])
        old = r.old_logp[idx] if r.old_logp is not None else None
        ref = r.ref_logp[idx] if r.ref_logp is not None else None
        is_ratio = r.is_ratio[idx] if r.is_ratio is not None else None
        if self.is_correction and is_ratio is None:  # the round's weights: this pass's log-probs are the old ones
            now = logp.detach().float()
            is_ratio = self.sampler_correction(now, mb)
            r.correction.append(correction_parts(now, mb.sampler_logp, mb.completion_mask, is_ratio))
        loss, extras = grpo_loss(
            logp.float(),
            old,
            r.advantages[idx],
            mb.completion_mask,
            self.settings,
            ref_logp=ref,
            is_ratio=is_ratio,
            num_items_in_round=r.n_tokens,
            entropy=entropy,
            sampler_logp=mb.sampler_logp if self.is_correction else None,  # a separate engine's, as TRL with vLLM
            entropy_coef=self.entropy.applied() if self.entropy is not None else None,
        )
        return loss, extras, mb, logp, entropy

    def _policy_logprobs(self, mb: RoundTensors, plan: MicroPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss pass's log-probs and entropy [b, C] of micro-batch ``mb`` through the root module, as ``plan``
        says (micro_plan.planned_logprobs)."""
        g = self.cfg
        kw = {"impl": g.logprob_impl, "entropy_grad": self.entropy is not None, "chunk_rows": g.logprob_chunk_rows}
        return planned_logprobs(self.root, mb, plan, g.temperature, free_root=self.free_root, **kw)

    def _micro_step(self, r: Round, idx: torch.Tensor, iteration: int) -> None:
        """Forward and backward of the round's rows ``idx``; the metrics stay on the device (step_metrics) until the
        optimizer step."""
        g = self.cfg
        # DDP averages gradients over the ranks only on the micro-step that completes an optimizer step (FSDP2: on
        # every micro-step, into the sharded gradient; distributed.gradient_sync)
        with gradient_sync(self.root, is_optimizer_step(self.micro_step + 1, self.batching)):
            loss, extras, mb, logp, entropy = self.micro_loss(r, idx)
            if loss.requires_grad:
                loss.backward()
            else:  # no row of it has a gradient (micro_plan): it adds 0, as its backward would
                for p in self.root.parameters():
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
        self.flops.add_micro(self._seq_lens(r)[idx])
        old = r.old_logp[idx] if r.old_logp is not None else None
        self.micro_step += 1
        base = old if old is not None else logp.detach()
        sampled = iteration == 0 and not self.is_correction  # with the correction on, measured per round
        ga = g.gradient_accumulation_steps
        self.step_metrics.add(loss, extras, mb.completion_mask, entropy, base, mb.sampler_logp, sampled, ga)

    def _after_step(self, window: dict) -> None:
        """After an optimizer step: the adaptive entropy coefficient moves, the reference model follows the policy
        (sync_ref_model), as TRL does at the end of a step."""
        g = self.cfg
        if self.entropy is not None:
            self.entropy.step()
            window["entropy_coef"].append(self.entropy.coef)
        if g.sync_ref_model and self.ref_model is not None and self.step % g.ref_model_sync_steps == 0:
            mix_reference(self.model, self.ref_model, g.ref_model_mixup_alpha)

    def _log_samples(self, samples: list[dict], name: str) -> None:
        table = {"step": [self.step] * len(samples), **{k: [s[k] for s in samples] for k in samples[0]}}
        self.tracker.log_table(table, f"completions/{name}.json")

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Everything needed to continue exactly: trainable weights, optimizer, scheduler, RNG states
        (python, numpy, torch, the round shuffler), data position, step counters, history and the
        round in progress. Written to checkpoint-N.tmp and renamed, so a half-written checkpoint is
        never picked up; the newest two are kept. The folder also holds save_pretrained() output. On several
        processes the checkpoint is sharded (tasks/grpo/dist_checkpoint.py)."""
        final = self.checkpoint_dir / f"checkpoint-{self.step}"
        if self.comm.world > 1:  # sharded: torch.distributed.checkpoint and one file per rank
            dist_checkpoint.save(self, final)
            dist_checkpoint.publish(self, final, self.node_push)  # rank 0: _after_save; each node: its shards
            return final
        checkpoint.save(self, final)
        self._after_save(final)
        return final

    def _after_save(self, final: Path) -> None:
        pinned = set(self.pinned()) if self.pinned is not None else set()
        for stale in list_checkpoints(self.checkpoint_dir)[:-2]:
            if stale.name not in pinned:
                shutil.rmtree(stale, ignore_errors=True)
        if self.on_checkpoint is not None:
            self.on_checkpoint(final)

    def resume(self) -> Path | None:
        """Continue from the newest checkpoint in checkpoint_dir that loads, and return it. A damaged one
        (:class:`~checkpoint.CheckpointCorrupt`: trainer_state.json truncated, a file missing or cut short, a tensor
        file that does not load) is skipped with a warning naming it and why, and the one before it is tried; with
        none left the run starts from scratch (step 0), as it does when there is no checkpoint at all, and the
        warning says so. Other errors (another grpo config, another format) are raised as they are."""
        candidates = list_checkpoints(self.checkpoint_dir)
        for i, path in enumerate(reversed(candidates)):
            try:
                self.load_checkpoint(path)
                return path
            except checkpoint.CheckpointCorrupt as e:
                left = len(candidates) - i - 1
                if e.modified and not left:
                    raise checkpoint.CheckpointCorrupt(
                        e.path, e.file, f"{e.why}; no earlier checkpoint, and the model was partly loaded so the "
                        f"run cannot start from scratch: remove {e.path} and resume",
                    ) from e  # fmt: skip
                then = f"resuming from {candidates[left - 1].name} instead" if left else "GRPO starts from scratch"
                log.warning("GRPO: skipping checkpoint %s, it cannot be resumed: %s; %s", path.name, e, then)
        return None

    def load_checkpoint(self, path: Path) -> None:
        if (path / "dcp").is_dir():  # written by several processes (tasks/grpo/dist_checkpoint.py)
            return dist_checkpoint.load(self, path)
        if self.comm.world > 1:
            raise ValueError(
                f"checkpoint {path} was written by one process: resuming it on {self.comm.world} is not implemented; "
                f"remove {path.parent} or set grpo.resume=never to start over"
            )
        checkpoint.load(self, path)


def _is_reward_key(key: str) -> bool:
    return key in ("reward", "reward_std") or key.startswith("rewards/")
