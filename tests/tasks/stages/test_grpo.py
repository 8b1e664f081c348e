"""The GRPO stage's recipe steps on the tiny model: setup loads what the config asks, save writes the final model,
history and learning curves and returns the summary, and a stage with a checkpoint in its folder resumes from it."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from grpoflow.tasks.config import config_from_dict
from grpoflow.tasks.grpo.checkpoint import list_checkpoints
from grpoflow.tasks.launch.dist import Comm
from grpoflow.tasks.stages.data import prepare_data
from grpoflow.tasks.stages.grpo import build_trainer, setup_grpo, train_grpo
from grpoflow.tasks.stages.grpo_setup import reference_dtype
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.tracker import RunLogger

TINY = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
}


def make_cfg(tmp_path: Path, lora: bool = True, dtype: str = "float32", **grpo):
    """A micro GRPO run (as tests/fixtures/micro.yaml): 2 steps of 2 prompts x 4 generations on the tiny model."""
    return config_from_dict(
        {
            "run": {"output_dir": str(tmp_path), "seed": 3},
            "data": {"source": "arithmetic", "arithmetic": {"train_size": 40, "eval_size": 4, "operations": ["+"]}},
            "model": {
                "name": "tiny",
                "dtype": dtype,
                "tiny": TINY,
                "lora": {"enabled": lora, "r": 4, "alpha": 8, "target_modules": "all-linear"},
            },
            "grpo": {
                "max_steps": 2,
                "per_device_train_batch_size": 8,
                "gradient_accumulation_steps": 1,
                "num_generations": 4,
                "max_prompt_length": 64,
                "max_completion_length": 8,
                "reward_funcs": ["correctness", "strict_format"],
                "save_steps": 2,
                **grpo,
            },
            "generation": {"backend": "transformers"},
            "export": {"adapter": lora},
        }
    )


def workspace(cfg, tmp_path: Path) -> Workspace:
    ws = Workspace(tmp_path / "ws")
    prepare_data(cfg, ws)
    return ws


def test_full_fine_tuning_with_beta_loads_a_frozen_reference_in_the_reference_dtype(tmp_path):
    cfg = make_cfg(tmp_path, lora=False, dtype="bfloat16", beta=0.04)
    s = setup_grpo(cfg, workspace(cfg, tmp_path), RunLogger.disabled(), None, Comm())
    assert s.ref_model is not None and s.ref_model is not s.model
    assert s.ref_model.dtype == reference_dtype(cfg) == torch.bfloat16  # frozen: no float32 master weights
    assert not any(p.requires_grad for p in s.ref_model.parameters()) and not s.ref_model.training
    assert s.model.dtype == torch.float32 and all(p.requires_grad for p in s.model.parameters())
    assert s.autocast_dtype == torch.bfloat16 and not s.use_lora
    assert s.generator.name == "transformers"
    assert len(s.prompts) == len(s.rows) > 0 and s.out_dir == tmp_path / "ws" / "grpo"


def test_lora_uses_its_disabled_adapters_as_reference(tmp_path):
    cfg = make_cfg(tmp_path, lora=True, beta=0.04)
    s = setup_grpo(cfg, workspace(cfg, tmp_path), RunLogger.disabled(), None, Comm())
    assert s.ref_model is None and s.use_lora
    trainable = {n for n, p in s.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_train_grpo_saves_final_history_and_curves_and_returns_the_summary(tmp_path):
    cfg = make_cfg(tmp_path)
    ws = workspace(cfg, tmp_path)
    summary = train_grpo(cfg, ws, RunLogger.disabled())
    out = ws.stage_dir("grpo")
    assert summary["model_path"] == str(out / "final")
    assert (out / "final" / "adapter_config.json").is_file()  # LoRA: the adapter only
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert len(history) == summary["steps"] == 2
    assert (out / "learning_curves.png").stat().st_size > 0
    assert summary["adapter"] is True and summary["reference_dtype"] is None
    assert summary["first_reward"] == history[0]["reward"] and summary["final_reward"] == history[-1]["reward"]
    assert summary["generation_backend"] == "transformers" and summary["seconds"] > 0
    assert "world_size" not in summary and summary["base_model"] == str(ws.stage_dir("base_model"))


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_a_stage_with_a_checkpoint_resumes_from_it_unless_told_not_to(tmp_path, resume):
    cfg = make_cfg(tmp_path, save_steps=1)  # checkpoints after steps 1 and 2 (the last)
    ws = workspace(cfg, tmp_path)
    train_grpo(cfg, ws, RunLogger.disabled())
    history = [json.loads(line) for line in (ws.stage_dir("grpo") / "history.jsonl").read_text().splitlines()]
    assert (ws.stage_dir("grpo") / "checkpoints" / "checkpoint-1").is_dir()
    shutil.rmtree(ws.stage_dir("grpo") / "checkpoints" / "checkpoint-2")  # as if killed before the last step
    again = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"resume": resume})})
    s = setup_grpo(again, ws, RunLogger.disabled(), None, Comm())
    trainer, uploads = build_trainer(again, ws, RunLogger.disabled(), s, Comm(), node_mirrors=False)
    assert uploads.pending() == []
    if resume == "auto":
        assert uploads.done == ["checkpoint-1"]  # what the folder held when it began
        assert trainer.step == 1 and trainer.history == history[:1]
    else:
        assert uploads.done == [] and list_checkpoints(ws.stage_dir("grpo") / "checkpoints") == []
        assert trainer.step == 0 and trainer.history == []


def test_resume_never_starts_over_without_the_earlier_attempts_checkpoints(tmp_path):
    """grpo.resume=never on a folder whose earlier attempt (same key) left checkpoint-9: it is removed before
    training. Kept, the pruning (the newest two by step) removed the new attempt's checkpoint-1 beside it, and a
    later resume continued the old attempt."""
    cfg = make_cfg(tmp_path, save_steps=1)
    ws = workspace(cfg, tmp_path)
    train_grpo(cfg, ws, RunLogger.disabled())
    ckpts = ws.stage_dir("grpo") / "checkpoints"
    shutil.copytree(ckpts / "checkpoint-2", ckpts / "checkpoint-9")  # an earlier, longer attempt's
    never = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"resume": "never"})})
    train_grpo(never, ws, RunLogger.disabled())
    assert [p.name for p in list_checkpoints(ckpts)] == ["checkpoint-1", "checkpoint-2"]
