"""Export verification: merged against trained by teacher-forced log-probs within a per-dtype tolerance, greedy
agreement as a figure, a corrupted merge caught with its numbers, and no merge into a quantized checkpoint."""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpoflow.tasks.config import load_config
from grpoflow.tasks.model.loading import load_causal_lm
from grpoflow.tasks.model.verify import (
    EPS,
    agreement_until_divergence,
    compare_logprobs,
    logprob_tolerance,
)
from grpoflow.tasks.stages import export as export_stage
from grpoflow.tasks.stages.common import base_model_path
from grpoflow.tasks.stages.data import prepare_data
from grpoflow.tasks.stages.export import run_export
from grpoflow.tasks.stages.sft import run_sft
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.adapters import save_trained_adapter
from tests.paths import MICRO

FAST = ["export.gguf=[]", "export.adapter=false", "grpo.max_completion_length=24"]


def test_tolerance_per_dtype_follows_its_formula():
    for d in ("float32", "bfloat16", "float16"):
        assert EPS[d] == torch.finfo(getattr(torch, d)).eps
    assert logprob_tolerance("float32") == logprob_tolerance("float32", "float32") == 1e-3  # the floor
    assert logprob_tolerance("float16") == 64 * 2.0**-10 == 0.0625
    assert logprob_tolerance("bfloat16") == 64 * 2.0**-7 == 0.5
    # the coarser dtype of the two models governs, in either order
    assert logprob_tolerance("float32", "float16") == logprob_tolerance("float16", "float32") == 0.0625
    assert logprob_tolerance("bfloat16", "float16") == 0.5
    with pytest.raises(ValueError, match="float8"):
        logprob_tolerance("float32", "float8")


def test_greedy_agreement_is_the_share_before_the_first_divergence():
    assert agreement_until_divergence([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreement_until_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5  # later agreement does not count
    assert agreement_until_divergence([1, 2, 3, 4], [7, 2, 3, 4]) == 0.0
    assert agreement_until_divergence([], []) == 1.0
    v = compare_logprobs(
        [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.1, -3.0])],
        [torch.tensor([-1.0, -2.25, -0.5]), torch.tensor([-0.1, -2.5])],
        [torch.tensor([5, 6, 7]), torch.tensor([8, 1])],
        [[5, 6, 0], [1, 1]],
    )
    assert v.tokens == 5 and v.max_gap == 0.5 and v.worst == (1, 1)
    assert v.mean_gap == pytest.approx(0.75 / 5)
    assert v.greedy_agreement == pytest.approx((2 / 3 + 0.0) / 2)


def test_a_log_prob_that_is_not_finite_is_an_infinite_gap_not_none():
    """A merged model whose float16 activations overflow, or with a NaN weight, gives NaN log-probs: before,
    ``NaN > max_gap`` was False and such a prompt was skipped, so a NaN merged model verified with max_gap 0."""
    v = compare_logprobs(
        [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -0.5])],
        [torch.tensor([-1.0, float("nan")]), torch.tensor([-0.5, -float("inf")])],
        [torch.tensor([1, 2]), torch.tensor([3, 4])],
        [[1, 2], [3, 4]],
    )
    assert v.max_gap == float("inf") and v.worst == (0, 1) and v.mean_gap == float("inf")


@pytest.fixture
def trained_adapter(tmp_path):
    """A micro workspace (data, tiny base) and a LoRA adapter on that base with non-zero updates, as GRPO leaves."""
    cfg = load_config(MICRO, FAST)
    ws = Workspace(tmp_path / "ws")
    prepare_data(cfg, ws)
    base = base_model_path(cfg, ws)
    adapter = save_trained_adapter(cfg, base, tmp_path / "adapter")
    return cfg, ws, base, str(adapter)


@pytest.mark.parametrize("merged_dtype", ["float32", "float16", "bfloat16"])
def test_correct_export_passes_with_its_figures(trained_adapter, merged_dtype):
    cfg, ws, base, adapter = trained_adapter
    cfg = load_config(MICRO, [*FAST, f"export.merged_dtype={merged_dtype}"])
    ex = run_export(cfg, ws, RunLogger.disabled(), base, adapter, True)
    assert ex["verify_prompts"] == 2 and ex["verify_tokens"] > 2
    assert ex["verify_tolerance"] == logprob_tolerance("float32", merged_dtype)
    assert 0.0 <= ex["verify_mean_logprob_gap"] <= ex["verify_max_logprob_gap"] <= ex["verify_tolerance"]
    if merged_dtype != "float32":  # 16-bit rounding shows up, well inside its tolerance
        assert ex["verify_max_logprob_gap"] > 0
    assert 0.0 <= ex["verify_greedy_agreement"] <= 1.0
    assert (Path(ex["merged_path"]) / "model.safetensors").is_file()


def test_corrupted_merge_fails_with_the_gap_tolerance_dtype_and_folder(trained_adapter, monkeypatch):
    """The merged folder is written by the real save_merged, then the final norm's weight is doubled on disk (every
    logit doubled: a wrong scale). The micro model is untrained (logits spread about 0.1): smaller corruptions,
    e.g. one down_proj scaled by 2 (a gap of 0.004 here), stay inside a tolerance sized for real models' logits."""
    cfg, ws, base, adapter = trained_adapter
    real_save = export_stage.save_merged

    def save_then_corrupt(trained, tokenizer, merged_dir, dtype, is_adapter):
        real_save(trained, tokenizer, merged_dir, dtype, is_adapter)
        weights = load_file(merged_dir / "model.safetensors")
        weights["model.norm.weight"] *= 2
        save_file(weights, merged_dir / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(export_stage, "save_merged", save_then_corrupt)
    with pytest.raises(RuntimeError) as err:
        run_export(cfg, ws, RunLogger.disabled(), base, adapter, True)
    msg = str(err.value)
    assert "float16" in msg and str(ws.stage_dir("export") / "merged") in msg
    gap, tol = map(float, re.search(r"log-prob gap (\S+) > tolerance (\S+)", msg).groups())
    assert tol == logprob_tolerance("float32", "float16") and gap > tol


def test_export_and_qlora_sft_refuse_a_quantized_checkpoint(tmp_path, trained_adapter):
    """A folder saved from a 4-bit model (what SFT used to write) loads 4-bit whatever is asked: no merge into it."""
    cfg, ws, base, adapter = trained_adapter
    quantized = tmp_path / "base-4bit"
    load_causal_lm(base, cfg.model, quantize=True).save_pretrained(quantized)
    with pytest.raises(ValueError, match=r"export merges the adapter into its base model: .*base-4bit is a quantized "):
        run_export(cfg, ws, RunLogger.disabled(), str(quantized), adapter, True)
    with pytest.raises(ValueError, match="export saves the trained model: .*bitsandbytes"):
        run_export(cfg, ws, RunLogger.disabled(), str(quantized), str(quantized), False)
    sft_cfg = load_config(MICRO, [f"model.name={quantized}", "model.load_in_4bit=true", "sft.use_lora=true"])
    with pytest.raises(ValueError, match=r"sft \(use_lora with model.load_in_4bit\) merges into model.name"):
        run_sft(sft_cfg, ws, RunLogger.disabled())
