"""Export stage: the LoRA adapter, merged 16-bit safetensors weights (verified) and GGUF files.

    export/adapter/   the peft adapter (adapter_config.json + adapter_model.safetensors)
    export/merged/    base + adapter merged, cast to export.merged_dtype, with the tokenizer
    export/gguf/      model-<type>.gguf of the merged folder for each of export.gguf (tasks/model/gguf.py)

The merge target is always 16-bit: the adapter is merged into the GRPO base loaded unquantized in
``model.dtype`` (a QLoRA run's base is SFT's 16-bit checkpoint or the original model, which GRPO
quantized at load time); a base whose config.json carries a quantization_config is refused.

Verification (tasks/model/verify.py): the trained model (base + adapter, ``model.dtype``) completes
``export.verify_prompts`` eval prompts greedily; prompt + completion go teacher-forced through it and
through the merged folder loaded back with plain transformers in ``merged_dtype``. The stage fails
when a completion token's log-prob differs by more than the dtypes' tolerance (logprob_tolerance);
the summary reports the max and mean gap, the tolerance and the greedy agreement (the share of each
completion the merged model's greedy choices follow before the first divergence, averaged), which
16-bit rounding lowers on real models without anything being wrong.

Each GGUF is read back with gguf.GGUFReader. A GGUF that cannot be made (an architecture or tokenizer
the converter does not support, q4_k_m without llama.cpp's llama-quantize) is skipped with a warning and
listed under ``gguf_skipped``: the default ``export.gguf: [f16]`` must not fail other models' runs.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.dataio.splits import load_split
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
from grpoflow.tasks.generation.types import SamplingParams
from grpoflow.tasks.model.loading import (
    DTYPES,
    load_causal_lm,
    load_tokenizer,
    load_with_adapter,
    prompt_ids,
    require_unquantized,
)
from grpoflow.tasks.model.save import save_merged
from grpoflow.tasks.model.verify import compare_logprobs, logprob_tolerance, teacher_forced
from grpoflow.tasks.pipeline.shell import run_stage
from grpoflow.tasks.pipeline.spec import Pipeline, StageSpec
from grpoflow.tasks.stages.common import prepared
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.run_meta import short_model
from grpoflow.tasks.tracking.tracker import RunLogger

log = logging.getLogger(__name__)


def greedy_tokens(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The greedy completion ids of each prompt, in one batch."""
    gen = TransformersGenerator(model, tokenizer, batch_size=len(prompts) or 1)
    return gen.generate(prompts, 1, SamplingParams(max_new_tokens=max_new_tokens, greedy=True)).completion_ids


def export_gguf(
    merged_dir: Path, gguf_dir: Path, types: list[str], tracker: RunLogger, quantize_timeout_s: float
) -> tuple[dict, dict]:
    """export/gguf/model-<type>.gguf for each type: ({type: path}, {skipped type: reason}). A type llama.cpp is
    missing for is skipped with a warning; a llama-quantize that fails or times out fails the stage (QuantizeError,
    naming the command)."""
    from grpoflow.tasks.model.gguf import GGUFUnavailable, write_gguf

    shutil.rmtree(gguf_dir, ignore_errors=True)
    written, skipped = {}, {}
    for out_type in dict.fromkeys(types):
        try:
            info = write_gguf(merged_dir, gguf_dir / f"model-{out_type}.gguf", out_type, quantize_timeout_s)
        except (GGUFUnavailable, ValueError) as e:
            log.warning("export: %s", e)
            skipped[out_type] = str(e)
            continue
        log.info("export: GGUF %s, %d tensors, %.1f MB", info["path"], info["tensors"], info["bytes"] / 1e6)
        written[out_type] = info["path"]
    if written:
        tracker.log_artifact(gguf_dir, "gguf")
    return written, skipped


def verify_merged(trained_logprobs, prompts, completions, merged_dir: Path, merged_dtype: str, trained_dtype: str):
    """The merged folder loaded back in ``merged_dtype`` against the trained model's log-probs on the verify batch:
    the summary entries; raises RuntimeError when the max gap exceeds logprob_tolerance(trained, merged dtype)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=DTYPES[merged_dtype]).eval()
    forced = [teacher_forced(reloaded, p, c) for p, c in zip(prompts, completions)]
    v = compare_logprobs(trained_logprobs, [lp for lp, _ in forced], [am for _, am in forced], completions)
    tol = logprob_tolerance(trained_dtype, merged_dtype)
    entries = {
        "verify_prompts": len(prompts),
        "verify_tokens": v.tokens,
        "verify_max_logprob_gap": v.max_gap,
        "verify_mean_logprob_gap": v.mean_gap,
        "verify_tolerance": tol,
        "verify_greedy_agreement": v.greedy_agreement,
    }
    log.info(
        "export: merged %s vs trained %s on %d tokens: max log-prob gap %.3g (tolerance %.3g), greedy agreement %.3f",
        merged_dtype,
        trained_dtype,
        v.tokens,
        v.max_gap,
        tol,
        v.greedy_agreement,
    )
    if v.max_gap > tol:
        overflow = (
            " (log-probs that are not finite: NaN weights, or activations past the range of "
            f"{merged_dtype}; try export.merged_dtype bfloat16 or float32)"
            if math.isinf(v.max_gap)
            else ""
        )
        raise RuntimeError(
            f"export: the merged {merged_dtype} model at {merged_dir} does not match the trained model "
            f"({trained_dtype}){overflow}: max per-token log-prob gap {v.max_gap:.4g} > tolerance {tol:.4g} "
            f"(eval prompt {v.worst[0]}, completion token {v.worst[1]}; mean gap {v.mean_gap:.4g} over {v.tokens} "
            "teacher-forced tokens)"
        )
    return entries


def run_export(
    cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, base_model: str, trained_model: str, is_adapter: bool
) -> dict:
    """The export stage: the trained model and its verify batch, then the adapter, the merged folder (verified)
    and the GGUF files as export asks; returns the summary."""
    x = cfg.export
    t0 = time.perf_counter()
    out = ws.stage_dir("export")
    tokenizer = load_tokenizer(trained_model, cfg.model)
    trained = load_trained(cfg, base_model, trained_model, is_adapter)
    trained_dtype = str(next(trained.parameters()).dtype).removeprefix("torch.")
    prompts, completions, trained_logprobs = verify_batch(cfg, ws, trained, tokenizer)
    summary: dict = {"seconds": 0.0}
    if x.adapter and is_adapter:
        adapter_dir = out / "adapter"
        shutil.rmtree(adapter_dir, ignore_errors=True)
        trained.save_pretrained(adapter_dir)
        tokenizer.save_pretrained(adapter_dir)
        summary["adapter_path"] = str(adapter_dir)
        summary["base_model"] = base_model  # what the adapter applies to: the registry loads it to log the adapter
        tracker.log_artifact(adapter_dir, "adapter")
    if x.merged:
        merged_dir = out / "merged"
        save_merged(trained, tokenizer, merged_dir, x.merged_dtype, is_adapter)
        summary["merged_path"] = str(merged_dir)
        summary["merged_dtype"] = x.merged_dtype
        if prompts:
            summary |= verify_merged(trained_logprobs, prompts, completions, merged_dir, x.merged_dtype, trained_dtype)
        tracker.log_artifact(merged_dir, "merged")
        if x.gguf:
            summary["gguf"], skipped = export_gguf(merged_dir, out / "gguf", x.gguf, tracker, x.quantize_timeout_s)
            if skipped:
                summary["gguf_skipped"] = skipped
    summary["seconds"] = time.perf_counter() - t0
    return summary


def load_trained(cfg: PipelineConfig, base_model: str, trained_model: str, is_adapter: bool):
    """The trained model in ``model.dtype``: the adapter on its 16-bit base (QLoRA too: the merge folds it into
    the 16-bit weights, never a 4-bit copy), or the fully fine-tuned model. A quantized base is refused."""
    if is_adapter:
        require_unquantized(base_model, cfg.model, "export merges the adapter into its base model")
        return load_with_adapter(base_model, trained_model, cfg.model, quantize=False)
    require_unquantized(trained_model, cfg.model, "export saves the trained model")
    return load_causal_lm(trained_model, cfg.model).eval()


def verify_batch(cfg: PipelineConfig, ws: Workspace, trained, tokenizer) -> tuple[list, list, list]:
    """The first export.verify_prompts eval prompts, the trained model's greedy completions of them and their
    teacher-forced log-probs; taken before the merge folds the adapter into ``trained`` in place."""
    rows = list(load_split(prepared(ws), "eval"))[: cfg.export.verify_prompts]
    prompts = [prompt_ids(tokenizer, r["prompt"], cfg.grpo.max_prompt_length) for r in rows]
    max_new = cfg.eval.max_new_tokens or cfg.grpo.max_completion_length
    completions = greedy_tokens(trained, tokenizer, prompts, max_new) if prompts else []
    trained_logprobs = [teacher_forced(trained, p, c)[0] for p, c in zip(prompts, completions)]
    return prompts, completions, trained_logprobs


def _result(s: dict) -> str:
    kept = [k.removesuffix("_path") for k in ("adapter_path", "merged_path") if k in s]
    kept += [f"gguf {t}" for t in s.get("gguf", {})]
    if not kept:
        return ""
    result = "Wrote " + ", ".join(kept) + "."
    if s.get("verify_max_logprob_gap") is not None:
        result += (
            f" Merged vs trained: log-prob gap {s['verify_max_logprob_gap']:.2g} (tolerance "
            f"{s['verify_tolerance']:.2g}) on {s['verify_prompts']} prompts, greedy agreement "
            f"{s['verify_greedy_agreement']:.0%}."
        )
    return result


SPEC = StageSpec(
    name="export",
    keys=("run.torch_threads", "export", "eval.max_new_tokens"),  # eval.max_new_tokens: the verification decode
    upstream=lambda cfg: ("grpo",),
    enabled=lambda cfg: cfg.export.enabled,
    description="Exported the trained model (adapter, merged weights, GGUF).",
    param_sections=("export",),
    name_parts=lambda cfg: (short_model(cfg.model.name),),
    result=_result,
)


# no Prefect cache: the pipeline's stage keys decide what reruns (tasks/pipeline/fingerprint.py); hashing the
# inputs (the stage table, the config) would only cost time
@task(name="export", cache_policy=NO_CACHE)
def export_task(
    stages: Pipeline,
    cfg: PipelineConfig,
    workspace_root: str,
    parent_run_id: str | None,
    base_model: str,
    trained_model: str,
    is_adapter: bool,
) -> dict:
    return run_stage(
        stages,
        SPEC,
        run_export,
        cfg,
        workspace_root,
        parent_run_id,
        base_model=base_model,
        trained_model=trained_model,
        is_adapter=is_adapter,
    )
