"""Config sections of the training stages: the optimizer keys they share, SFT, and GRPO with TRL's names
(tasks/config/pipeline.py assembles them into the run config and re-exports them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from grpoflow.tasks.config.base import _Section
from grpoflow.tasks.config.reward_names import check_reward_names


# --------------------------------------------------------------------------------------------
# stages
# --------------------------------------------------------------------------------------------
class OptimizerFields(_Section):
    """The optimizer and batch keys the sft and grpo sections share."""

    learning_rate: float = Field(1e-5, gt=0, description="Peak learning rate of the optimizer.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay.")
    warmup_ratio: float = Field(
        0.0, ge=0, le=1, description="Fraction of the steps over which the learning rate rises linearly from 0."
    )
    warmup_steps: int = Field(0, ge=0, description="Warm-up steps; overrides warmup_ratio when > 0 (as in HF).")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="Learning-rate schedule after the warm-up (linear and cosine decay to 0 at the end)."
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the gradients' global norm to this before each step; null: no clipping."
    )
    optim: Literal["adamw_torch", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw_torch",
        description="adamw_torch: torch's AdamW; adamw_8bit: bitsandbytes' AdamW with 8-bit state; paged_adamw_8bit: "
        "the same with its state paged out of GPU memory under pressure.",
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's decay rate of the gradient's running mean.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW's decay rate of the squared gradient's mean.")
    per_device_train_batch_size: int = Field(
        8, ge=1, description="Sequences in one forward and backward pass (micro-batch) of each process."
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches summed into one optimizer step.")
    logging_steps: int = Field(1, ge=1, description="Log metrics every N optimizer steps, and at the last one.")


class SFTConfig(OptimizerFields):
    """The ``sft`` section: supervised fine-tuning on the reference completions before GRPO. It teaches the answer
    format (and the whole task to the tiny model); GRPO then starts from its checkpoint."""

    enabled: bool = Field(True, description="Run the SFT stage; false: GRPO starts from model.name.")
    num_train_epochs: float = Field(1.0, gt=0, description="Passes over the training rows, unless max_steps is set.")
    max_steps: int | None = Field(None, ge=1, description="Overrides num_train_epochs when set.")
    max_length: int = Field(
        512,
        ge=8,
        description="Prompt plus reference completion are cut to this many tokens (the cut ones counted and "
        "warned about; one whose prompt alone fills it is dropped).",
    )
    use_lora: bool = Field(True, description="Train model.lora adapters (merged into the checkpoint) or all weights.")
    completion_only_loss: bool = Field(
        True, description="Loss on the completion's tokens only; false: on the prompt's tokens too."
    )


ScaleRewards = Literal["group", "batch", "none"]


class CodeRewardConfig(_Section):
    """Limits of the ``code_tests`` reward's sandbox (docs/rewards.md, "Code reward"), per program run."""

    timeout_s: float = Field(5.0, gt=0, le=600, description="Wall-clock limit; the process group is killed.")
    cpu_s: int = Field(5, ge=1, le=600, description="RLIMIT_CPU seconds (SIGXCPU, then SIGKILL 1 s later).")
    cpus: float = Field(
        1.0,
        ge=0.01,
        le=256,
        description="CPU bandwidth cap of the run's cgroup, all its processes together (cpu.max or "
        "cpu.cfs_quota_us), in CPUs; none where no cpu controller is writable (the sandbox logs which).",
    )
    memory_mb: int = Field(
        512, ge=64, description="RLIMIT_AS (address space) in MiB; the run's cgroup cap is this + 2 tmpfs + 64 MiB."
    )
    max_processes: int = Field(16, ge=1, le=4096, description="RLIMIT_NPROC: processes and threads of one run.")
    max_output_bytes: int = Field(
        65536, ge=1024, description="stdout/stderr kept, and RLIMIT_FSIZE (this + 4 KiB) on any file written."
    )
    tmpfs_mb: int = Field(64, ge=1, description="Size of the sandbox's private working folder and /tmp (bwrap).")
    workers: int = Field(4, ge=1, le=256, description="Programs run at once.")
    allow_unsafe: bool = Field(
        False,
        description="Run programs with rlimits only where bwrap cannot create namespaces (no network or PID "
        "isolation); refused anyway when not root while credentials are readable (docs/rewards.md); off: the "
        "reward refuses to run there.",
    )


class GRPOConfig(OptimizerFields):
    """GRPO settings, with TRL GRPOConfig names and defaults (see docs/grpo.md)."""

    learning_rate: float = Field(1e-6, gt=0, description="Peak learning rate of the optimizer (TRL's default).")
    max_steps: int = Field(100, ge=1, description="Optimizer steps.")
    num_generations: int = Field(8, description="Completions per prompt (G), at least 2.")
    steps_per_generation: int | None = Field(
        None,
        ge=1,
        description="Micro-batches trained from one generation round; default gradient_accumulation_steps. Not "
        "with generation_batch_size.",
    )
    generation_batch_size: int | None = Field(
        None,
        ge=1,
        description="Completions per generation round, all processes together: per_device_train_batch_size * "
        "processes * steps_per_generation. Not with steps_per_generation.",
    )
    num_iterations: int = Field(1, ge=1, description="PPO epochs over each generation round (mu).")
    beta: float = Field(0.0, ge=0, description="KL coefficient (k3). 0 loads no reference model.")
    epsilon: float = Field(
        0.2, gt=0, lt=1, description="Clip range of the importance ratio: [1 - epsilon, 1 + epsilon_high]."
    )
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip; defaults to epsilon.")
    delta: float | None = Field(None, gt=1, description="Two-sided GRPO: cap on the unclipped ratio.")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="token: one importance ratio per token; sequence: one per completion, the geometric mean of "
        "its tokens' ratios (GSPO).",
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo",
        description="The policy loss and how it averages tokens (docs/grpo.md): dapo sums over the round's tokens "
        "and divides by their count; grpo averages each completion, then the completions; bnpo averages the "
        "micro-batch's tokens; dr_grpo divides by max_completion_length; gspo, cispo, sapo, luspo and vespo are the "
        "variants of their papers.",
    )
    top_entropy_quantile: float = Field(
        1.0, gt=0, le=1, description="Train only on the completion tokens whose entropy is in this top fraction."
    )
    off_policy_mask_threshold: float | None = Field(
        None, gt=0, description="Drop negative-advantage completions whose mean KL(sampler || policy) exceeds it."
    )
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: temperature of the soft gate, A < 0.")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: temperature of the soft gate, A > 0.")
    vespo_k_pos: float = Field(2.0, description="vespo: shape k of the gamma weight, A >= 0.")
    vespo_lambda_pos: float = Field(3.0, description="vespo: rate lambda of the gamma weight, A >= 0.")
    vespo_k_neg: float = Field(3.0, description="vespo: shape k of the gamma weight, A < 0.")
    vespo_lambda_neg: float = Field(2.0, description="vespo: rate lambda of the gamma weight, A < 0.")
    scale_rewards: ScaleRewards = Field(
        "group",
        description="Divide the advantages by the reward std of the prompt's group (group), of the whole round "
        "(batch), or not at all (none); true and false mean group and none.",
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="sum_then_normalize: weight and sum the reward functions, then group-normalize (scale_rewards); "
        "normalize_then_sum: normalize each function within its group, weight, sum, then normalize over the batch "
        "(GDPO, group reward-decoupled normalization; scale_rewards is not used, as in TRL).",
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus: loss -= entropy_coef * mean token entropy (0: off, TRL's meaning)."
    )
    use_adaptive_entropy: bool = Field(
        False,
        description="Skywork-OR1's adaptive entropy control: entropy_coef (the start value) moves by "
        "entropy_coef_delta each optimizer step, up while the step's entropy is <= entropy_target, down otherwise; "
        "the bonus applies only while the last step's entropy is <= entropy_target.",
    )
    entropy_coef_min: float = Field(0.0, ge=0, description="Adaptive entropy control: lower bound of the coef.")
    entropy_coef_max: float = Field(1.0, ge=0, description="Adaptive entropy control: upper bound of the coef.")
    entropy_coef_delta: float = Field(0.005, ge=0, description="Adaptive entropy control: step of the coef.")
    entropy_target: float = Field(0.2, description="Adaptive entropy control: target mean token entropy (nats).")
    sync_ref_model: bool = Field(
        False,
        description="TR-DPO reference updates: every ref_model_sync_steps optimizer steps, "
        "ref = alpha * policy + (1 - alpha) * ref (full fine-tuning with beta > 0; TRL refuses it with PEFT too).",
    )
    ref_model_mixup_alpha: float = Field(0.6, ge=0, le=1, description="alpha of sync_ref_model.")
    ref_model_sync_steps: int = Field(512, ge=1, description="Optimizer steps between reference updates.")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: groups whose rewards all agree are dropped and fresh prompts drawn for "
        "their places (tasks/grpo/dynamic.py); counts logged as dynamic_sampling/*.",
    )
    dynamic_sampling_max_rounds: int = Field(
        3, ge=0, description="Dynamic sampling: extra generation calls per round at most; then dropped groups fill it."
    )
    overlong_buffer_length: int | None = Field(
        None,
        ge=1,
        description="DAPO overlong reward shaping: a length penalty ramping from 0 to -overlong_penalty_factor over "
        "the last N tokens before max_completion_length, added as the reward 'overlong'. None: off.",
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, description="Overlong shaping: the penalty at full length.")
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["correctness", "strict_format", "soft_format", "int", "xmlcount"],
        min_length=1,
        description="Built-in names or 'module:function' import paths.",
    )
    reward_weights: list[float] | None = Field(
        None, description="Weight of each reward function in the summed reward, one per reward_funcs; null: all 1."
    )
    reward_files: list[str] = Field(
        [],
        description="Files or folders your custom reward functions read (a rubric, a judge prompt, a word list), "
        "local paths as the reward opens them or s3:// URIs: their content joins the keys of grpo and eval (as the "
        "reward modules' source does), so `grpoflow resume` after an edit reruns them. A path that does not exist "
        "is refused before any stage.",
    )
    code_reward: CodeRewardConfig = Field(
        default_factory=CodeRewardConfig, description="Sandbox limits of the code_tests reward."
    )
    reward_timeout_s: float | None = Field(
        120.0,
        ge=0,
        validation_alias=AliasChoices("reward_timeout_s", "reward_timeout"),
        description="Seconds one call of one reward function may take (also accepted as grpo.reward_timeout); over "
        "it the GRPO stage fails naming the reward, its checkpoints kept for `grpoflow resume`. 0 or None: no bound. "
        "The default is far above what a rule-based reward (GSM8K's take milliseconds a batch) needs; it is there for "
        "a remote scorer or judge that hangs. A reward with a known worst case of its own (code_tests: its programs' "
        "timeouts) gets at least that.",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_completion_length out of the loss."
    )
    logprob_chunk_rows: int = Field(
        0,
        ge=0,
        description="Log-prob passes (loss, old and reference log-probs) in chunks of this many rows, sorted by "
        "completion length, each cut to its own longest prompt and completion instead of the round's widths: less "
        "padding computed when lengths vary. 0 = one pass per micro-batch at the round's widths.",
    )
    share_prompt_forward: bool = Field(
        True,
        description="Log-prob passes run each distinct prompt of a micro-batch once and the completions of its "
        "group over its KV cache (gradients summed back): the same log-probs and gradients up to float rounding, "
        "with n-1 of every n prompt forwards and backwards saved. Off under gradient checkpointing (no cache), for "
        "models whose cache is not transformers' plain DynamicCache, and with distributed.strategy=fsdp2 on "
        "several processes (two passes over the sharded layers are not tested yet). Each prompt's gradient is summed "
        "over its rows in a fixed order, so reruns on one host are bit-identical with it on or off.",
    )
    logprob_impl: Literal["auto", "triton", "chunked"] = Field(
        "auto",
        description="Implementation of the per-token log-probs (loss, old and reference passes; "
        "kernels.token_logprobs): triton (the Triton kernels, CUDA only), chunked (chunked torch: cuBLAS GEMMs in "
        "the compute dtype with one Triton kernel per logit tile on CUDA, the float32 CPU path on CPU), auto (on "
        "CUDA the faster of the two at the call's shape, from the table of kernels/auto_table.py: the file "
        "GRPOFLOW_AUTO_TABLE names, which benchmarks/gpu_check.py writes, else the default, chunked everywhere (the "
        "estimate until a GPU measures one); chunked off CUDA, and chunked wherever the triton package is not "
        "installed: macOS, Windows, a Linux install without it). "
        "Under autocast on CUDA both run with the autocast dtype's operands and float32 accumulation. triton on a "
        "CPU device, or without the triton package, is refused when the GRPO trainer starts. Keyed as written: auto "
        "is one key whatever it picks, so a run resumed on another device or table continues with that choice "
        "(set triton or chunked to hold it).",
    )
    use_bias_correction_kl: bool = Field(
        True, description="Multiply the KL term by the importance ratio (unbiased off-policy); used when beta > 0."
    )
    vllm_importance_sampling_correction: bool = Field(
        True,
        description="Weight the loss by the ratio of the policy's and the sampling engine's token probabilities "
        "when a separate engine (vLLM) sampled the completions.",
    )
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        Field(
            "token_truncate",
            description="That ratio per token or per completion (token_*, sequence_*), capped at the bounds "
            "(*_truncate) or zeroed outside them (*_mask).",
        )
    )
    vllm_importance_sampling_cap: float = Field(
        2.0,
        gt=0,
        validation_alias=AliasChoices("vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max"),
        description="Upper bound of the correction ratio (TRL 1.16 calls it vllm_importance_sampling_clip_max).",
    )
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0, description="Lower bound (none by default).")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; the loss's log-probs are taken at the same temperature."
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Sample from the most likely tokens whose probabilities add up to top_p."
    )
    top_k: int | None = Field(None, ge=0, description="Sample from the k most likely tokens; null or 0: no limit.")
    min_p: float | None = Field(
        None, ge=0, le=1, description="Drop tokens less likely than min_p times the most likely one; null: off."
    )
    repetition_penalty: float = Field(
        1.0, gt=0, description="Above 1, tokens already in the prompt or completion become less likely; 1: off."
    )
    max_prompt_length: int | None = Field(
        512, ge=1, description="Longer prompts lose their first tokens (as in TRL); null: no cut."
    )
    max_completion_length: int = Field(256, ge=1, description="Most tokens generated per completion.")
    shuffle_dataset: bool = Field(
        True, description="Draw the prompts in a seeded random order each epoch; false: in the data's order."
    )
    shuffle_generation_batch: bool = Field(
        True,
        description="Shuffle a round's completions before splitting it into micro-batches, as TRL always does; "
        "false keeps them prompt-major (the layout of the seed's batch tables).",
    )
    gradient_checkpointing: bool | None = Field(None, description="Overrides model.gradient_checkpointing for GRPO.")
    save_steps: int = Field(50, ge=1, description="Checkpoint every N optimizer steps.")
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto: continue from the newest complete checkpoint of this run's GRPO stage; never: start "
        "from step 0, removing the checkpoints an earlier attempt left (locally and in the store).",
    )
    log_completions: bool = Field(
        True,
        description="Log the round's completions with their rewards as three MLflow tables: "
        "completions/start.json, middle.json, end.json (the first, (max_steps + 1) // 2-th and last step).",
    )

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "log_completions_steps" in raw:
            raise ValueError(
                "log_completions_steps was retired: completion tables are logged at the first, middle and last "
                "step under fixed names (MLflow limits its logged-artifact tag); use log_completions: true/false"
            )
        return raw

    @model_validator(mode="after")
    def _correction_bounds(self) -> GRPOConfig:
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_cap
        if lo is not None and lo >= hi:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({lo}) must be less than vllm_importance_sampling_cap "
                f"(TRL: vllm_importance_sampling_clip_max) ({hi}), as TRL 1.16 requires"
            )
        return self

    @model_validator(mode="after")
    def _regularizers(self) -> GRPOConfig:
        if self.sync_ref_model and self.beta == 0:
            raise ValueError(
                "sync_ref_model needs beta > 0: with beta = 0 no reference model is used, so there is nothing to "
                "synchronize (as TRL 1.16 refuses)"
            )
        if self.overlong_buffer_length is not None and self.overlong_buffer_length > self.max_completion_length:
            raise ValueError(
                f"overlong_buffer_length ({self.overlong_buffer_length}) must be <= max_completion_length "
                f"({self.max_completion_length})"
            )
        if self.use_adaptive_entropy and self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min ({self.entropy_coef_min}) must be <= entropy_coef_max ({self.entropy_coef_max})"
            )
        return self

    @model_validator(mode="after")
    def _vespo_correction(self) -> GRPOConfig:
        if self.loss_type == "vespo" and self.vllm_importance_sampling_mode.startswith("sequence"):
            raise ValueError(
                "loss_type=vespo folds the sampler correction into its sequence weight token by token: "
                f"vllm_importance_sampling_mode must be token_truncate or token_mask, not "
                f"{self.vllm_importance_sampling_mode} (as TRL 1.16 refuses)"
            )
        return self

    @field_validator("reward_files")
    @classmethod
    def _reward_files(cls, paths: list[str]) -> list[str]:
        if blank := [i for i, p in enumerate(paths) if not p.strip()]:
            raise ValueError(f"entry {blank[0]} is empty; give the path of a file or folder a reward reads")
        return paths

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_alias(cls, v: Any) -> Any:
        return {True: "group", False: "none"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("num_generations")
    @classmethod
    def _g(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"must be >= 2: group-relative advantages need at least 2 completions (got {v})")
        return v

    @model_validator(mode="after")
    def _batching(self, info: ValidationInfo) -> GRPOConfig:
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ValueError(
                "steps_per_generation and generation_batch_size are mutually exclusive "
                "(generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation)"
            )
        # raises with the formula; a run config validates its round over distributed's world size (load.py)
        self.batching((info.context or {}).get("num_processes", 1))
        check_reward_names(self.reward_funcs)
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} reward_funcs"
            )
        return self

    def batching(self, num_processes: int = 1) -> Batching:
        """Resolve the generation-round layout exactly as TRL's GRPOConfig.__post_init__; ``num_processes`` is the
        world size (distributed.nproc_per_node * nnodes)."""
        pdb, ga = self.per_device_train_batch_size, self.gradient_accumulation_steps
        if self.generation_batch_size is None:
            spg = self.steps_per_generation or ga
            gbs = pdb * num_processes * spg
        else:
            gbs = self.generation_batch_size
            if gbs % (pdb * num_processes):
                raise ValueError(
                    f"generation_batch_size ({gbs}) must be divisible by per_device_train_batch_size * "
                    f"num_processes ({pdb} * {num_processes} = {pdb * num_processes})"
                )
            spg = gbs // (pdb * num_processes)
        if gbs % self.num_generations:
            raise ValueError(
                f"generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation "
                f"= {pdb} * {num_processes} * {spg} = {gbs} must be divisible by num_generations "
                f"({self.num_generations})"
            )
        return Batching(
            generation_batch_size=gbs,
            steps_per_generation=spg,
            unique_prompts=gbs // self.num_generations,
            micro_batch_size=pdb,
            gradient_accumulation_steps=ga,
            num_iterations=self.num_iterations,
            num_processes=num_processes,
        )

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class Batching(BaseModel):
    """The resolved layout of one generation round: generation_batch_size and unique_prompts are the whole round's
    (all processes), each process trains rows_per_process of them in micro-batches of micro_batch_size."""

    model_config = ConfigDict(frozen=True)
    generation_batch_size: int
    steps_per_generation: int
    unique_prompts: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    num_iterations: int
    num_processes: int = 1

    @property
    def rows_per_process(self) -> int:
        """L = per_device_train_batch_size * steps_per_generation: process r trains rows [r*L, (r+1)*L) of a round."""
        return self.micro_batch_size * self.steps_per_generation

    @property
    def micro_steps_per_round(self) -> int:
        return self.steps_per_generation * self.num_iterations
