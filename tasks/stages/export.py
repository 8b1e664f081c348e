"""Export stage: the LoRA adapter, merged 16-bit safetensors weights (verified) and GGUF files.

    export/adapter/   the peft adapter (adapter_config.json + adapter_model.safetensors)
    export/merged/    base + adapter merged, cast to export.merged_dtype, with the tokenizer
    export/gguf/      model-<type>.gguf of the merged folder for each of export.gguf (tasks/model/gguf.py)

Verification: the merged folder is loaded back with plain transformers and must produce the
same greedy tokens as the trained model (base + adapter, in the training dtype) on
``export.verify_prompts`` eval prompts; the match count is in the summary and a mismatch fails
the stage. Each GGUF is read back with gguf.GGUFReader. A GGUF that cannot be made (an architecture or
tokenizer the converter does not support, q4_k_m without llama.cpp's llama-quantize) is skipped with a
warning and listed under ``gguf_skipped``: the default ``export.gguf: [f16]`` must not fail other models' runs.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from prefect import task

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.dataio.splits import load_split
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
from grpoflow.tasks.generation.types import SamplingParams
from grpoflow.tasks.model.loading import DTYPES, load_causal_lm, load_tokenizer, load_with_adapter, prompt_ids
from grpoflow.tasks.model.save import save_merged
from grpoflow.tasks.runtime.stage import run_stage
from grpoflow.tasks.runtime.tracking import RunLogger
from grpoflow.tasks.runtime.workspace import Workspace

log = logging.getLogger(__name__)


def greedy_tokens(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    gen = TransformersGenerator(model, tokenizer, batch_size=len(prompts) or 1)
    return gen.generate(prompts, 1, SamplingParams(max_new_tokens=max_new_tokens, greedy=True)).completion_ids


def export_gguf(merged_dir: Path, gguf_dir: Path, types: list[str], tracker: RunLogger) -> tuple[dict, dict]:
    """export/gguf/model-<type>.gguf for each type: ({type: path}, {skipped type: reason})."""
    from grpoflow.tasks.model.gguf import GGUFUnavailable, write_gguf

    shutil.rmtree(gguf_dir, ignore_errors=True)
    written, skipped = {}, {}
    for out_type in dict.fromkeys(types):
        try:
            info = write_gguf(merged_dir, gguf_dir / f"model-{out_type}.gguf", out_type)
        except (GGUFUnavailable, ValueError) as e:
            log.warning("export: %s", e)
            skipped[out_type] = str(e)
            continue
        log.info("export: GGUF %s, %d tensors, %.1f MB", info["path"], info["tensors"], info["bytes"] / 1e6)
        written[out_type] = info["path"]
    if written:
        tracker.log_artifact(gguf_dir, "gguf")
    return written, skipped


def run_export(
    cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, base_model: str, trained_model: str, is_adapter: bool
) -> dict:
    x = cfg.export
    t0 = time.perf_counter()
    out = ws.stage_dir("export")
    tokenizer = load_tokenizer(trained_model, cfg.model)
    trained = (
        # QLoRA too merges into the full-precision base (base + B @ A), never into the 4-bit copy
        load_with_adapter(base_model, trained_model, cfg.model, quantize=False)
        if is_adapter
        else load_causal_lm(trained_model, cfg.model).eval()
    )
    rows = list(load_split(ws, "eval"))[: x.verify_prompts]
    prompts = [prompt_ids(tokenizer, r["prompt"], cfg.grpo.max_prompt_length) for r in rows]
    max_new = cfg.eval.max_new_tokens or cfg.grpo.max_completion_length
    expected = greedy_tokens(trained, tokenizer, prompts, max_new) if prompts else []
    summary: dict = {"seconds": 0.0}

    if x.adapter and is_adapter:
        adapter_dir = out / "adapter"
        shutil.rmtree(adapter_dir, ignore_errors=True)
        trained.save_pretrained(adapter_dir)
        tokenizer.save_pretrained(adapter_dir)
        summary["adapter_path"] = str(adapter_dir)
        tracker.log_artifact(adapter_dir, "adapter")

    if x.merged:
        merged_dir = out / "merged"
        save_merged(trained, tokenizer, merged_dir, x.merged_dtype, is_adapter)
        summary["merged_path"] = str(merged_dir)
        summary["merged_dtype"] = x.merged_dtype
        if prompts:
            from transformers import AutoModelForCausalLM

            reloaded = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=DTYPES[x.merged_dtype]).eval()
            got = greedy_tokens(reloaded, tokenizer, prompts, max_new)
            matches = sum(a == b for a, b in zip(expected, got))
            summary["verify_prompts"] = len(prompts)
            summary["verify_matches"] = matches
            if matches != len(prompts):
                bad = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
                raise RuntimeError(
                    f"export: merged {x.merged_dtype} model at {merged_dir} differs from the trained model in greedy "
                    f"tokens on eval prompts {bad} ({matches}/{len(prompts)} match)"
                )
        tracker.log_artifact(merged_dir, "merged")
        if x.gguf:
            summary["gguf"], skipped = export_gguf(merged_dir, out / "gguf", x.gguf, tracker)
            if skipped:
                summary["gguf_skipped"] = skipped
    summary["seconds"] = time.perf_counter() - t0
    ws.write_manifest("export", summary)
    return summary


@task(name="export")
def export_task(
    cfg_dict: dict,
    workspace_root: str,
    parent_run_id: str | None,
    base_model: str,
    trained_model: str,
    is_adapter: bool,
) -> dict:
    return run_stage(
        "export",
        run_export,
        cfg_dict,
        workspace_root,
        parent_run_id,
        base_model=base_model,
        trained_model=trained_model,
        is_adapter=is_adapter,
    )
