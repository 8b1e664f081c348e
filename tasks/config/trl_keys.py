"""TRL 1.16 ``GRPOConfig`` keys, accepted verbatim in a ``trl:`` section of the run config.

Every field of ``trl.GRPOConfig`` (TRL's own keys plus the ``transformers.TrainingArguments`` ones it inherits)
has one rule in :data:`TRL_KEYS`:

* **maps** -- the value lands on our key with the same meaning (converted where TRL spells it differently, e.g.
  ``use_vllm: true`` -> ``generation.backend: vllm``, ``bf16: true`` -> ``model.dtype: bfloat16``);
* **warned** -- the key has no meaning in grpoflow (hub, report_to, logging folders, dataloader workers...): it is
  accepted and one :class:`TRLKeyWarning` names it;
* **only** -- the key changes the math and grpoflow honours one behaviour: accepted at the values that ask for
  that behaviour (TRL's default), any other value refused with an error that names the key.

A ``trl:`` key and one of our own keys that land on the same setting with different values is an error that
names both; so are two ``trl:`` keys that disagree (e.g. ``vllm_importance_sampling_cap`` and ``..._clip_max``).
Keys absent from the ``trl:`` section keep grpoflow's defaults (docs/trl.md: where they differ from TRL's).
Imports nothing from TRL: the table is plain data, and a test checks it against ``dataclasses.fields``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpoflow.tasks.config.base import ConfigError


class TRLKeyWarning(UserWarning):
    """A ``trl:`` key that has no meaning in grpoflow was accepted and is not used."""


@dataclass(frozen=True)
class Rule:
    kind: str  # "maps" | "warned" | "only"
    what: str  # the table's words (docs/configuration.md, `trl`): the target key, or why it is warned/refused
    apply: Callable[[Any], dict[str, Any]]  # value -> {dotted target: value}; raises ValueError to refuse


def maps(target: str, convert: Callable[[Any], Any] | None = None, note: str = "") -> Rule:
    """Same meaning: the value (converted) lands on ``target``; ``convert`` returning ``_SKIP`` sets nothing."""

    def apply(v: Any) -> dict[str, Any]:
        out = convert(v) if convert else v
        return {} if out is _SKIP else {target: out}

    return Rule("maps", f"`{target}`" + (f" ({note})" if note else ""), apply)


def warned(reason: str) -> Rule:
    return Rule("warned", reason, lambda v: {})


def only(allowed: tuple, reason: str) -> Rule:
    """Accepted at ``allowed`` values (what grpoflow does), refused otherwise."""

    def apply(v: Any) -> dict[str, Any]:
        if _canon(v) not in [_canon(a) for a in allowed]:
            raise ValueError(f"{v!r} is not supported: {reason}")
        return {}

    shown = " / ".join("null" if a is None else repr(a) for a in allowed if a not in ({}, [], ""))
    return Rule("only", f"accepted at {shown}; {reason}", apply)


def custom(kind: str, what: str, fn: Callable[[Any], dict[str, Any]]) -> Rule:
    return Rule(kind, what, fn)


_SKIP = object()


def _canon(v: Any) -> Any:
    if v in ({}, [], "", "none"):  # TRL/HF spell "nothing" several ways (None, {}, [], "", "none")
        return None
    return v


def _int_steps(name: str) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1 or v != int(v):
            raise ValueError(f"{v!r}: grpoflow takes a whole number of steps >= 1 here (no fraction of the run)")
        return int(v)

    return convert


def _warmup(v: Any) -> dict[str, Any]:
    """transformers 5: warmup_steps >= 1 is a step count, 0 < warmup_steps < 1 a fraction of the run."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"{v!r}: must be a number >= 0")
    if 0 < v < 1:
        return {"grpo.warmup_ratio": float(v)}
    return {"grpo.warmup_steps": int(v)}


_OPTIM = {
    "adamw_torch": "adamw_torch",
    "adamw_torch_fused": "adamw_torch",  # the fused kernel of the same AdamW
    "adamw_8bit": "adamw_8bit",
    "adamw_bnb_8bit": "adamw_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
}


def _optim(v: Any) -> Any:
    if v not in _OPTIM:
        raise ValueError(f"{v!r} is not supported: grpoflow runs {', '.join(sorted(_OPTIM))}")
    return _OPTIM[v]


def _max_steps(v: Any) -> dict[str, Any]:
    if v == -1:
        warnings.warn(
            "trl.max_steps=-1 (train num_train_epochs epochs) is accepted and not used: grpoflow runs grpo.max_steps "
            "optimizer steps; set trl.max_steps or grpo.max_steps",
            TRLKeyWarning,
            stacklevel=2,
        )
        return {}
    return {"grpo.max_steps": v}


def _bf16(v: Any) -> dict[str, Any]:
    if v is None:  # TRL: bf16 = not fp16, and fp16 is refused below unless false
        return {"model.dtype": "bfloat16"}
    return {"model.dtype": "bfloat16" if v else "float32"}


def _grad_norm(v: Any) -> Any:
    return None if v is not None and v <= 0 else v  # HF: 0 (or less) turns clipping off


def _model_init_kwargs(v: Any) -> dict[str, Any]:
    if v is None or v == {}:
        return {}
    if not isinstance(v, dict):
        raise ValueError(f"{v!r}: expected a mapping of from_pretrained keyword arguments")
    keys = {
        "dtype": "model.dtype",
        "torch_dtype": "model.dtype",
        "attn_implementation": "model.attn_implementation",
        "revision": "model.revision",
        "trust_remote_code": "model.trust_remote_code",
    }
    unknown = sorted(set(v) - set(keys))
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)} not supported (grpoflow loads the model from model.*: "
            f"{', '.join(sorted(keys))} are taken from here)"
        )
    return {keys[k]: val for k, val in v.items()}


def _use_vllm(v: Any) -> dict[str, Any]:
    return {"generation.backend": "vllm" if v else "transformers"}


def _use_cpu(v: Any) -> dict[str, Any]:
    return {"run.device": "cpu"} if v else {}


def _clip_max(v: Any) -> Any:
    if v is None:
        raise ValueError("null (no upper bound) is not supported: grpoflow's correction always has a cap")
    return v


def _hub_token(v: Any) -> dict[str, Any]:
    if v is not None and v != "<HUB_TOKEN>":  # HF's to_dict() writes the placeholder
        raise ValueError("credentials do not belong in the config (it is logged to MLflow and saved with the run)")
    return {}


def _gen_batch(v: Any) -> dict[str, Any]:
    return {} if v is None else {"grpo.generation_batch_size": v}


def _spg(v: Any) -> dict[str, Any]:
    return {} if v is None else {"grpo.steps_per_generation": v}


def _num_generations_eval(v: Any) -> dict[str, Any]:
    return {} if v is None else {"eval.num_samples": v}


def _top_k(v: Any) -> Any:
    return None if v in (0, None) else v


def _max_completion_length(v: Any) -> Any:
    if v is None:
        raise ValueError("null is not supported: grpoflow needs a bound on the completion length")
    return v


_NO_EVAL = "grpoflow evaluates once after training, in its evaluate stage (eval.*)"
_NO_HUB = "grpoflow does not push to the Hugging Face Hub (the export stage writes files and MLflow models)"
_NO_LOG = "grpoflow logs to MLflow (tracking.*) every grpo.logging_steps"
_NO_DATALOADER = "grpoflow's rounds are built from the prompt sampler, no torch DataLoader"
_NO_DIST = "grpoflow runs one training process here"
_NO_SAVE = "grpoflow checkpoints every grpo.save_steps and keeps the newest two"
_SPEED = "a speed/memory knob of TRL's stack with no effect on the math; grpoflow has its own"

TRL_KEYS: dict[str, Rule] = {
    # ---- transformers.TrainingArguments (as overridden by TRL's _BaseConfig)
    "output_dir": warned("the run workspace is run.output_dir/run.name"),
    "per_device_train_batch_size": maps("grpo.per_device_train_batch_size"),
    "num_train_epochs": warned("grpoflow's GRPO runs grpo.max_steps optimizer steps (no epoch count)"),
    "max_steps": custom("maps", "`grpo.max_steps`; -1 (train by epochs) is warned", _max_steps),
    "learning_rate": maps("grpo.learning_rate"),
    "lr_scheduler_type": maps("grpo.lr_scheduler_type"),
    "lr_scheduler_kwargs": only((None, {}), "grpoflow's schedules take no extra arguments"),
    "warmup_steps": custom("maps", "`grpo.warmup_steps` (>= 1) or `grpo.warmup_ratio` (< 1)", _warmup),
    "optim": maps("grpo.optim", _optim, "adamw_torch_fused -> adamw_torch, adamw_bnb_8bit -> adamw_8bit"),
    "optim_args": only((None,), "grpoflow's optimizers take no extra arguments"),
    "weight_decay": maps("grpo.weight_decay"),
    "adam_beta1": maps("grpo.adam_beta1"),
    "adam_beta2": maps("grpo.adam_beta2"),
    "adam_epsilon": only((1e-8,), "grpoflow's AdamW uses eps 1e-8"),
    "optim_target_modules": only((None,), "GaLore/APOLLO target modules: those optimizers are not supported"),
    "gradient_accumulation_steps": maps("grpo.gradient_accumulation_steps"),
    "average_tokens_across_devices": warned(_NO_DIST + "; GRPO's loss normalizes by its own token counts"),
    "max_grad_norm": maps("grpo.max_grad_norm", _grad_norm, "0 -> null: no clipping"),
    "label_smoothing_factor": warned("not read by TRL's GRPO loss either"),
    "bf16": custom("maps", "`model.dtype`: true -> bfloat16, false -> float32", _bf16),
    "fp16": only((False,), "float16 training needs a loss scaler, which grpoflow does not run"),
    "bf16_full_eval": warned(_NO_EVAL + " in model.dtype"),
    "fp16_full_eval": warned(_NO_EVAL + " in model.dtype"),
    "tf32": warned("a matmul precision switch of Ampere GPUs; grpoflow keeps torch's setting"),
    "gradient_checkpointing": maps("grpo.gradient_checkpointing"),
    "gradient_checkpointing_kwargs": warned(_SPEED),
    "torch_compile": warned(_SPEED),
    "torch_compile_backend": warned(_SPEED),
    "torch_compile_mode": warned(_SPEED),
    "use_liger_kernel": warned(_SPEED + " (its fused log-prob kernel, kernels/)"),
    "liger_kernel_config": warned(_SPEED),
    "use_cache": warned(_SPEED),
    "neftune_noise_alpha": only((None,), "NEFTune embedding noise is not supported"),
    "torch_empty_cache_steps": warned(_SPEED),
    "auto_find_batch_size": only((False,), "it breaks the prompt groups (TRL refuses it too)"),
    "logging_strategy": warned(_NO_LOG),
    "logging_steps": maps("grpo.logging_steps", _int_steps("logging_steps")),
    "logging_first_step": warned(_NO_LOG),
    "log_on_each_node": warned(_NO_LOG),
    "logging_nan_inf_filter": warned(_NO_LOG),
    "include_num_input_tokens_seen": warned("num_tokens is always logged"),
    "log_level": warned("grpoflow's log level is set by the CLI"),
    "log_level_replica": warned(_NO_DIST),
    "disable_tqdm": warned("grpoflow shows its own progress bar"),
    "report_to": warned("grpoflow reports to MLflow (tracking.*)"),
    "run_name": maps("run.name", lambda v: _SKIP if v is None else v, "null: run.name's default"),
    "project": warned("a trackio project; grpoflow's MLflow experiment is tracking.experiment"),
    "trackio_space_id": warned(_NO_LOG),
    "trackio_bucket_id": warned(_NO_LOG),
    "trackio_static_space_id": warned(_NO_LOG),
    "eval_strategy": warned(_NO_EVAL),
    "eval_steps": warned(_NO_EVAL),
    "eval_delay": warned(_NO_EVAL),
    "per_device_eval_batch_size": warned(_NO_EVAL + "; its batch is eval.batch_size"),
    "prediction_loss_only": warned(_NO_EVAL),
    "eval_on_start": warned(_NO_EVAL),
    "eval_do_concat_batches": warned(_NO_EVAL),
    "eval_use_gather_object": warned(_NO_EVAL),
    "eval_accumulation_steps": warned(_NO_EVAL),
    "include_for_metrics": warned(_NO_EVAL),
    "batch_eval_metrics": warned(_NO_EVAL),
    "save_only_model": warned(_NO_SAVE),
    "save_strategy": warned(_NO_SAVE),
    "save_steps": maps("grpo.save_steps", _int_steps("save_steps")),
    "save_on_each_node": warned(_NO_SAVE),
    "save_total_limit": warned(_NO_SAVE),
    "enable_jit_checkpoint": warned(_NO_SAVE),
    "push_to_hub": warned(_NO_HUB),
    "hub_token": custom("only", "accepted when null; a token is refused (credentials come from the env)", _hub_token),
    "hub_private_repo": warned(_NO_HUB),
    "hub_model_id": warned(_NO_HUB),
    "hub_strategy": warned(_NO_HUB),
    "hub_always_push": warned(_NO_HUB),
    "hub_revision": warned(_NO_HUB),
    "load_best_model_at_end": warned(_NO_EVAL),
    "metric_for_best_model": warned(_NO_EVAL + "; the registry's champion alias follows held-out accuracy"),
    "greater_is_better": warned(_NO_EVAL),
    "ignore_data_skip": warned("a resumed run continues the prompt sampler where it stopped"),
    "restore_callback_states_from_checkpoint": warned("grpoflow has no trainer callbacks"),
    "full_determinism": warned("grpoflow seeds python, numpy and torch from run.seed"),
    "seed": maps("run.seed"),
    "data_seed": warned("the prompt order is drawn from run.seed"),
    "use_cpu": custom("maps", "`run.device: cpu` when true", _use_cpu),
    "accelerator_config": warned(_NO_DIST),
    "parallelism_config": only((None,), "context/sequence parallelism is not supported"),
    "dataloader_drop_last": warned(_NO_DATALOADER),
    "dataloader_num_workers": warned(_NO_DATALOADER),
    "dataloader_pin_memory": warned(_NO_DATALOADER),
    "dataloader_persistent_workers": warned(_NO_DATALOADER),
    "dataloader_prefetch_factor": warned(_NO_DATALOADER),
    "dataloader_multiprocessing_context": warned(_NO_DATALOADER),
    "dataloader_in_order": warned(_NO_DATALOADER),
    "remove_unused_columns": warned("every dataset column reaches the reward functions (TRL's false)"),
    "label_names": warned(_NO_DATALOADER),
    "train_sampling_strategy": warned("prompts are drawn as grpo.shuffle_dataset says (TRL's GRPO sampler too)"),
    "length_column_name": warned(_NO_DATALOADER),
    "ddp_find_unused_parameters": warned(_NO_DIST),
    "ddp_bucket_cap_mb": warned(_NO_DIST),
    "ddp_broadcast_buffers": warned(_NO_DIST),
    "ddp_static_graph": warned(_NO_DIST),
    "ddp_backend": warned(_NO_DIST),
    "ddp_timeout": warned(_NO_DIST),
    "fsdp": only((None, False), "FSDP through TRL's keys is not supported"),
    "fsdp_config": only((None,), "FSDP through TRL's keys is not supported"),
    "deepspeed": only((None,), "DeepSpeed is not supported"),
    "debug": warned("transformers' debug options"),
    "skip_memory_metrics": warned(_NO_LOG),
    "do_train": warned("the pipeline's stages decide what runs (sft.enabled, eval.enabled...)"),
    "do_eval": warned(_NO_EVAL),
    "do_predict": warned(_NO_EVAL),
    "resume_from_checkpoint": warned("grpoflow resumes from the run's newest checkpoint (grpo.resume)"),
    "local_rank": warned(_NO_DIST),
    # ---- trl.GRPOConfig: model and reference model
    "model_init_kwargs": custom(
        "maps",
        "`model.dtype`, `model.attn_implementation`, `model.revision`, `model.trust_remote_code`; "
        "other from_pretrained arguments refused",
        _model_init_kwargs,
    ),
    "trust_remote_code": maps("model.trust_remote_code"),
    "router_aux_loss_coef": only((None, 0.0), "grpoflow adds no MoE load-balancing loss"),
    "disable_dropout": only((False,), "grpoflow does not zero a model's dropout layers (set model.lora.dropout: 0)"),
    "cast_lm_head_to_fp32": only((False,), "the LM head runs in model.dtype"),
    # ---- data and generation
    "num_generations": maps("grpo.num_generations"),
    "num_generations_eval": custom(
        "maps", "`eval.num_samples`: completions sampled per held-out prompt (pass@k)", _num_generations_eval
    ),
    "max_completion_length": maps("grpo.max_completion_length", _max_completion_length),
    "ds3_gather_for_generation": warned("DeepSpeed is not supported"),
    "shuffle_dataset": maps("grpo.shuffle_dataset"),
    "pad_to_multiple_of": warned("padding does not change the math; rounds are padded to their longest row"),
    "generation_batch_size": custom("maps", "`grpo.generation_batch_size`", _gen_batch),
    "steps_per_generation": custom("maps", "`grpo.steps_per_generation`", _spg),
    "temperature": maps("grpo.temperature"),
    "top_p": maps("grpo.top_p"),
    "top_k": maps("grpo.top_k", _top_k, "0 -> null: no top-k"),
    "min_p": maps("grpo.min_p"),
    "generation_kwargs": only((None,), "extra sampling arguments are not supported (grpo.temperature, top_p...)"),
    "chat_template_kwargs": only((None,), "the chat template is applied without extra arguments"),
    "repetition_penalty": maps("grpo.repetition_penalty"),
    "cache_implementation": warned(_SPEED),
    "use_vllm": custom("maps", "`generation.backend`: true -> vllm, false -> transformers", _use_vllm),
    "vllm_mode": only(("colocate",), "grpoflow runs the vLLM engine in the training process (no server mode)"),
    "vllm_model_impl": warned("grpoflow's engine uses vLLM's own model implementation"),
    "vllm_enable_sleep_mode": maps("generation.vllm_sleep_mode"),
    "vllm_structured_outputs_regex": only((None,), "structured outputs are not supported"),
    "vllm_server_base_url": warned("vLLM server mode is not supported"),
    "vllm_server_host": warned("vLLM server mode is not supported"),
    "vllm_server_port": warned("vLLM server mode is not supported"),
    "vllm_server_timeout": warned("vLLM server mode is not supported"),
    "vllm_group_port": warned("vLLM server mode is not supported"),
    "vllm_gpu_memory_utilization": maps("generation.vllm_gpu_memory_utilization"),
    "vllm_max_model_length": warned("the engine's context is sized from the prompts and max_completion_length"),
    "vllm_tensor_parallel_size": only((1,), "the engine runs on one device"),
    # ---- the loss
    "beta": maps("grpo.beta"),
    "num_iterations": maps("grpo.num_iterations"),
    "epsilon": maps("grpo.epsilon"),
    "delta": maps("grpo.delta"),
    "epsilon_high": maps("grpo.epsilon_high"),
    "sapo_temperature_neg": maps("grpo.sapo_temperature_neg"),
    "sapo_temperature_pos": maps("grpo.sapo_temperature_pos"),
    "vespo_k_pos": maps("grpo.vespo_k_pos"),
    "vespo_lambda_pos": maps("grpo.vespo_lambda_pos"),
    "vespo_k_neg": maps("grpo.vespo_k_neg"),
    "vespo_lambda_neg": maps("grpo.vespo_lambda_neg"),
    "importance_sampling_level": maps("grpo.importance_sampling_level"),
    "reward_weights": maps("grpo.reward_weights"),
    "multi_objective_aggregation": maps("grpo.multi_objective_aggregation"),
    "scale_rewards": maps("grpo.scale_rewards", lambda v: {True: "group", False: "none"}.get(v, v)),
    "loss_type": maps("grpo.loss_type"),
    "mask_truncated_completions": maps("grpo.mask_truncated_completions"),
    "sync_ref_model": maps("grpo.sync_ref_model"),
    "ref_model_mixup_alpha": maps("grpo.ref_model_mixup_alpha"),
    "ref_model_sync_steps": maps("grpo.ref_model_sync_steps"),
    "top_entropy_quantile": maps("grpo.top_entropy_quantile"),
    "entropy_coef": maps("grpo.entropy_coef"),
    "use_adaptive_entropy": maps("grpo.use_adaptive_entropy"),
    "entropy_coef_min": maps("grpo.entropy_coef_min"),
    "entropy_coef_max": maps("grpo.entropy_coef_max"),
    "entropy_coef_delta": maps("grpo.entropy_coef_delta"),
    "entropy_target": maps("grpo.entropy_target"),
    "max_tool_calling_iterations": warned("grpoflow has no tool calling"),
    "vllm_importance_sampling_correction": maps("grpo.vllm_importance_sampling_correction"),
    "vllm_importance_sampling_mode": maps("grpo.vllm_importance_sampling_mode"),
    "vllm_importance_sampling_clip_max": maps("grpo.vllm_importance_sampling_cap", _clip_max),
    "vllm_importance_sampling_clip_min": maps("grpo.vllm_importance_sampling_clip_min"),
    "off_policy_mask_threshold": maps("grpo.off_policy_mask_threshold"),
    "use_bias_correction_kl": maps("grpo.use_bias_correction_kl"),
    # ---- logging
    "log_completions": maps("grpo.log_completions", note="MLflow tables at the first, middle and last step"),
    "log_multimodal": warned("grpoflow trains on text"),
    "num_completions_to_print": warned("completions are logged as MLflow tables, not printed"),
    "log_unique_prompts": warned("completions are logged as MLflow tables, not printed"),
    "log_completions_hub_repo": warned(_NO_HUB),
    # ---- transformers' continuous batching; deprecated keys
    "use_transformers_continuous_batching": warned(_SPEED + " (generation.backend picks the sampler)"),
    "transformers_continuous_batching_config": warned(_SPEED),
    "use_transformers_paged": warned(_SPEED + " (deprecated in TRL)"),
    "vllm_importance_sampling_cap": maps(
        "grpo.vllm_importance_sampling_cap", lambda v: _SKIP if v is None else v, "TRL's deprecated name"
    ),
}


def translate_trl(section: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """A ``trl:`` section -> ({dotted key of ours: value}, {dotted key of ours: the trl key it came from}).

    Warns (:class:`TRLKeyWarning`) once per key that has no meaning here; raises :class:`ConfigError` naming the
    key for an unknown key, a value grpoflow cannot honour, or two trl keys that disagree."""
    if section is None:
        return {}, {}
    if not isinstance(section, dict):
        raise ConfigError("trl: must be a mapping of TRL GRPOConfig keys")
    unknown = sorted(str(k) for k in section if k not in TRL_KEYS)
    if unknown:
        raise ConfigError(f"trl: unknown key(s) {', '.join(unknown)} (not fields of TRL 1.16's GRPOConfig)")
    updates: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, value in section.items():
        rule = TRL_KEYS[key]
        if rule.kind == "warned":
            warnings.warn(f"trl.{key} has no meaning in grpoflow and is ignored: {rule.what}", TRLKeyWarning, 2)
            continue
        try:
            out = rule.apply(value)
        except ValueError as e:
            raise ConfigError(f"trl.{key}: {e}") from None
        for target, v in out.items():
            if target in updates and not _same(updates[target], v):
                raise ConfigError(
                    f"trl.{sources[target]} ({updates[target]!r}) and trl.{key} ({v!r}) disagree on {target}"
                )
            updates[target], sources[target] = v, key
    _generation_batch(section, updates, sources)
    return updates, sources


def _generation_batch(section: dict, updates: dict[str, Any], sources: dict[str, str]) -> None:
    """TRL's __post_init__ fills both generation_batch_size and steps_per_generation (a dumped GRPOConfig holds
    both); they agree when gbs = per_device_train_batch_size * steps_per_generation (one process): keep spg."""
    gbs, spg = updates.get("grpo.generation_batch_size"), updates.get("grpo.steps_per_generation")
    if gbs is None or spg is None:
        return
    pdb = section.get("per_device_train_batch_size", 8)
    if gbs != pdb * spg:
        raise ConfigError(
            f"trl.generation_batch_size ({gbs}) and trl.steps_per_generation ({spg}) disagree: "
            f"generation_batch_size must be per_device_train_batch_size * steps_per_generation = {pdb} * {spg}"
        )
    del updates["grpo.generation_batch_size"], sources["grpo.generation_batch_size"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b


def _get(raw: dict, dotted: str) -> tuple[bool, Any]:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def merge_trl_section(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The raw run config with its ``trl:`` section translated into our sections (the section itself removed);
    a key set both ways with different values is an error naming both. Returns (raw, sources)."""
    if "trl" not in raw:
        return raw, {}
    raw = dict(raw)
    updates, sources = translate_trl(raw.pop("trl"))
    for target, value in updates.items():
        present, ours = _get(raw, target)
        if present and not _same(ours, value):
            raise ConfigError(
                f"trl.{sources[target]} ({value!r}) and {target} ({ours!r}) are both set and disagree; keep one"
            )
        node = raw
        for part in target.split(".")[:-1]:
            child = node.get(part)
            node[part] = child = dict(child) if isinstance(child, dict) else {}
            node = child
        node[target.split(".")[-1]] = value
    return raw, sources


def markdown_table() -> str:
    """docs/configuration.md's `trl` table, one row per key (kept in sync by tests/tasks/config/test_trl_keys.py)."""
    rows = ["| TRL key | here |", "|---|---|"]
    for key, rule in TRL_KEYS.items():
        rows.append(f"| `{key}` | {rule.kind}: {rule.what} |")
    return "\n".join(rows)
