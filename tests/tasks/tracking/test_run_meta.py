"""Run names, params, tags, descriptions and constant-metric rules of the MLflow runs (tasks/tracking/run_meta.py),
and the RunLogger behaviour they rely on, against a real SQLite MLflow store."""

import pytest
from mlflow.tracking import MlflowClient

from grpoflow.flows.stages import PIPELINE as P
from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.tracking import run_meta as m
from grpoflow.tasks.tracking.entities import adaptive_interval, next_system_step
from grpoflow.tasks.tracking.tracker import RunLogger


def cfg(**grpo) -> PipelineConfig:
    return PipelineConfig.model_validate({"model": {"name": "Qwen/Qwen2.5-0.5B-Instruct"}, "grpo": grpo})


def test_names_say_what_ran():
    c = cfg(loss_type="dr_grpo", learning_rate=1e-6)
    assert m.stage_name(c, P["grpo"]) == "grpo · qwen2.5-0.5b-instruct · arithmetic · dr_grpo · lr 1e-6"
    assert m.stage_name(c, P["data"]) == "data · arithmetic"
    assert m.parent_name(c, "2025-06-01 10:00") == "qwen2.5-0.5b-instruct · arithmetic · 2025-06-01 10:00"
    named = c.model_copy(update={"run": c.run.model_copy(update={"name": "lr-sweep-3"})})
    assert m.parent_name(named, "x") == "lr-sweep-3"
    default = c.model_copy(update={"run": c.run.model_copy(update={"name": "run-20250601-100000"})})
    assert m.parent_name(default, "d") == "qwen2.5-0.5b-instruct · arithmetic · d"
    assert m.short_dataset("openai/gsm8k") == "gsm8k" and m.short_dataset("s3://b/p/train.jsonl") == "train"
    assert [m.fmt_lr(x) for x in (5e-4, 1.5e-5, 0.003)] == ["5e-4", "1.5e-5", "3e-3"]


def test_grpo_params_hold_the_hyperparameters_by_trl_names():
    p = m.stage_params(cfg(learning_rate=5e-4, beta=0.04), P["grpo"], "cpu", "abcd1234")
    assert p["learning_rate"] == 5e-4 and p["beta"] == 0.04 and p["loss_type"] == "dapo"
    assert p["vllm_importance_sampling_clip_max"] == 2.0 and "vllm_importance_sampling_cap" not in p  # TRL's name
    assert p["generation_batch_size"] == 8 and p["steps_per_generation"] == 1  # resolved, not None
    assert p["generation.backend"] == "auto" and p["model.lora.r"] == 16
    assert (p["model"], p["dataset"], p["dataset_digest"], p["seed"], p["device"]) == (
        "Qwen/Qwen2.5-0.5B-Instruct",
        "arithmetic",
        "abcd1234",
        42,
        "cpu",
    )
    eval_params = m.stage_params(cfg(), P["eval"], "cpu", None)
    assert "learning_rate" not in eval_params and "dataset_digest" not in eval_params and "batch_size" in eval_params


def test_config_hash_ignores_where_the_run_is():
    a = cfg()
    b = a.model_copy(update={"run": a.run.model_copy(update={"name": "other", "output_dir": "/elsewhere"})})
    assert m.config_hash(a) == m.config_hash(b) != m.config_hash(cfg(learning_rate=2e-6))


def test_tags_and_pipeline_description_come_from_the_spec():
    c = cfg(loss_type="dr_grpo")
    assert m.filter_tags(c, P["grpo"], "p", None)["loss_type"] == "dr_grpo"
    assert "loss_type" not in m.filter_tags(c, P["eval"], "p", None)
    assert m.filter_tags(c, None, "p", None)["stage"] == "pipeline"
    text = m.describe_pipeline(c, P.names, {"accuracy_before": 0.25, "accuracy_after": 0.5})
    assert "data -> sft -> grpo -> eval -> export" in text and "25.0% -> 50.0%" in text


def test_clip_ratios_are_constant_only_when_the_policy_cannot_move_within_a_round():
    assert "clip_ratio/" in m.constant_metrics(cfg()) and "kl" in m.constant_metrics(cfg())
    moving = m.constant_metrics(cfg(num_iterations=2, beta=0.1))  # replays: old_logp differs from logp
    assert moving == {}
    spg = m.constant_metrics(cfg(gradient_accumulation_steps=1, steps_per_generation=2))
    assert "clip_ratio/" not in spg  # the optimizer steps within the round
    assert m.omitted("clip_ratio/low_mean", {"clip_ratio/": ""}) and not m.omitted("kl_x", {"kl": ""})


def test_descriptions_give_the_key_result():
    c = cfg()
    assert "0.100 -> 0.500" in m.describe(c, P["grpo"], {"steps": 3, "first_reward": 0.1, "final_reward": 0.5})
    assert "25.0% before GRPO -> 50.0% after" in m.describe(
        c, P["eval"], {"accuracy_before": 0.25, "accuracy_after": 0.5, "rows": 8}
    )
    metrics, counts = m.summary_results({"steps": 3, "final_reward": 0.5, "adapter": True, "model_path": "/x"})
    assert metrics == {"final_reward": 0.5} and counts == {"result.steps": 3}


def test_system_metrics_interval_suits_the_stage_length():
    assert adaptive_interval(0) == 1.0 and adaptive_interval(150) == 5.0 and adaptive_interval(3600) == 15.0


def test_a_reopened_run_continues_its_system_metrics_steps_without_asking_the_server():
    assert next_system_step({}) == 0 and next_system_step({"loss": 40}) == 0
    assert next_system_step({"loss": 40, "system/cpu_utilization_percentage": 6, "system/disk_usage_megabytes": 7}) == 8


@pytest.fixture
def logger(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("t", artifact_location=(tmp_path / "a").as_uri())
    return RunLogger(client, client.create_run(exp).info.run_id)


def test_run_logger_skips_constant_metrics_and_keeps_the_first_param(logger):
    logger.omit_constant(m.constant_metrics(cfg()))
    logger.log_metrics({"clip_ratio/low_mean": 0.0, "kl": 0.0, "reward": 0.5}, step=1)
    logger.log_params({"generation_batch_size": 8})
    logger.log_params({"generation_batch_size": 8, "num_iterations": 1})  # same value again: fine
    logger.log_params({"generation_batch_size": 16})  # differs: warned, not logged (MLflow params are immutable)
    run = logger.client.get_run(logger.run_id)
    assert set(run.data.metrics) == {"reward"}
    assert run.data.params == {"generation_batch_size": "8", "num_iterations": "1"}
    assert "0 by construction" in run.data.tags["metric_omitted.clip_ratio"]
    assert "beta = 0" in run.data.tags["metric_omitted.kl"]


def test_export_description_reports_the_verification_figures():
    summary = {
        "merged_path": "/x/merged",
        "verify_prompts": 8,
        "verify_max_logprob_gap": 0.0008,
        "verify_tolerance": 0.0625,
        "verify_greedy_agreement": 1.0,
        "seconds": 2.0,
    }
    text = m.describe(cfg(), P["export"], summary)
    assert "log-prob gap 0.0008 (tolerance 0.062) on 8 prompts, greedy agreement 100%" in text
    assert "Wrote merged." in m.describe(cfg(), P["export"], {"merged_path": "/x/merged"})
