"""The lengths against the model's context (issue 27): refused with both numbers, and the prompts that
grpo.max_prompt_length cuts counted and warned once."""

import json
import logging

from grpoflow.tasks.config import config_from_dict
from grpoflow.tasks.model.context import config_context, context_problem, known_context, tokenize_prompts
from tests.paths import MICRO


def _cfg(**grpo):
    tiny = {"max_position_embeddings": 128}
    return config_from_dict({"model": {"tiny": tiny}, "grpo": grpo, "sft": {"max_length": 96}})


def test_lengths_past_the_context_are_refused_naming_both_numbers():
    cfg = _cfg(max_prompt_length=64, max_completion_length=200)
    assert known_context(cfg) == (128, "model.tiny")
    assert context_problem(cfg, 128, "model.tiny") == (
        "grpo.max_prompt_length + grpo.max_completion_length = 64 + 200 = 264 tokens, beyond the model's context "
        "of 128 (max_position_embeddings of model.tiny); lower them"
    )
    assert context_problem(_cfg(max_prompt_length=64, max_completion_length=64), 128, "x") is None
    assert "grpo.max_completion_length = 200 tokens" in context_problem(
        _cfg(max_prompt_length=None, max_completion_length=200), 128, "x"
    )
    long_sft = config_from_dict(
        {"sft": {"max_length": 600}, "grpo": {"max_prompt_length": 256, "max_completion_length": 16}}
    )
    assert context_problem(long_sft, 512, "model.tiny").startswith("sft.max_length = 600 tokens, beyond")
    assert context_problem(long_sft, 512, "model.tiny", sft=False) is None  # the GRPO stage's own check
    assert context_problem(cfg, None, "x") is None  # unknown: the stage checks after loading
    # in the GRPO stage: the longest prompt as fed, in place of the key
    assert context_problem(_cfg(max_prompt_length=512, max_completion_length=16), 128, "x", prompt_tokens=20) is None
    assert context_problem(_cfg(max_prompt_length=512, max_completion_length=116), 128, "m", prompt_tokens=20) == (
        "the longest prompt (20 tokens, grpo.max_prompt_length=512) + grpo.max_completion_length=116 = 136 tokens, "
        "beyond the model's context of 128 (max_position_embeddings of m); lower them"
    )


def test_an_eval_token_budget_past_the_context_is_refused():
    """eval.max_new_tokens=500 on a 128-token model: validate said OK and eval decoded 500 tokens a row."""
    cfg = config_from_dict(
        {
            "model": {"tiny": {"max_position_embeddings": 128}},
            "sft": {"max_length": 96},
            "grpo": {"max_prompt_length": 64, "max_completion_length": 32},
            "eval": {"max_new_tokens": 500},
        }
    )
    assert context_problem(cfg, 128, "model.tiny").startswith("eval.max_new_tokens = 500 tokens, not below")
    off = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"enabled": False})})
    assert context_problem(off, 128, "model.tiny") is None


def test_tracking_names_follow_mlflows_own_rules():
    """registered_model and champion_alias are refused at load as MLflow's registry refuses them (checked against
    its validators): before, 'a/b' failed the export stage after training and 'latest' never moved."""
    import pytest
    from mlflow.exceptions import MlflowException
    from mlflow.utils import validation as v

    from grpoflow.tasks.config import ConfigError

    def mlflow_ok(check, *values):
        try:
            for value in values:
                check(value)
            return True
        except MlflowException:
            return False

    for name in ["grpoflow-qwen2.5-0.5b", "a/b", "a:b", ".", "..", "../x", "x/..", " ", "m_1"]:
        ours = True
        try:
            config_from_dict({"tracking": {"registered_model": name}})
        except ConfigError:
            ours = False
        assert ours == mlflow_ok(v._validate_model_name, name), name
    for alias in ["champion", "latest", "LATEST", "v1", "V22", "v1x", "best model", "a.b", "x" * 256, "prod-2"]:
        ours = True
        try:
            config_from_dict({"tracking": {"champion_alias": alias}})
        except ConfigError:
            ours = False
        theirs = mlflow_ok(v._validate_model_alias_name, alias) and mlflow_ok(
            v._validate_model_alias_name_reserved, alias
        )
        assert ours == theirs, alias
    with pytest.raises(ConfigError, match="tracking.champion_alias.*reserved"):
        config_from_dict({"tracking": {"champion_alias": "latest"}})
    with pytest.raises(ConfigError, match="tracking.uri: scheme 'htp' is no MLflow tracking store"):
        config_from_dict({"tracking": {"uri": "htp://localhost:5000"}})  # was MLflow's traceback before stage one
    for uri in ("http://127.0.0.1:5000", "sqlite:///x.db", "postgresql+psycopg2://h/db", "/tmp/mlruns", "file:///m"):
        assert config_from_dict({"tracking": {"uri": uri}}).tracking.uri == uri


def test_known_context_reads_a_local_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    cfg = config_from_dict({"model": {"name": str(tmp_path)}})
    assert known_context(cfg) == (4096, f"{tmp_path}'s config.json")
    assert config_context({"max_position_embeddings": 0}) is None
    assert known_context(config_from_dict({"model": {"name": "no-owner/not-cached-here"}})) is None


def test_cut_prompts_are_counted_and_warned_once(caplog):
    from grpoflow.tasks.model.tiny import train_tiny_tokenizer

    texts = ["What is 1 + 2?", "What is 12 + 30? " * 20, "Answer in <answer></answer>."]
    tok = train_tiny_tokenizer(texts, 300)
    rows = [{"prompt": [{"role": "user", "content": t}]} for t in texts]
    full, stats = tokenize_prompts(tok, rows, None)
    longest = max(len(p) for p in full)
    assert stats == {"truncated_prompts": 0, "longest_prompt_tokens": longest}
    limit = sorted(len(p) for p in full)[1]  # the longest prompt is cut, the two others fit
    with caplog.at_level(logging.WARNING, logger="grpoflow.tasks.model.context"):
        ids, stats = tokenize_prompts(tok, rows, limit)
    assert stats == {"truncated_prompts": 1, "longest_prompt_tokens": longest}
    assert max(len(p) for p in ids) == limit and ids[1] == full[1][-limit:]  # left truncation, as TRL
    assert len(caplog.records) == 1 and f"cuts 1 of 3 prompts (the longest has {longest} tokens)" in caplog.text


def test_validate_refuses_completions_past_the_context():
    import os
    import subprocess
    import sys

    micro = MICRO
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpoflow.flows.cli",
            "validate",
            str(micro),
            "grpo.max_completion_length=200",
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "grpoflow: grpo.max_prompt_length + grpo.max_completion_length = 64 + 200 = 264 tokens, beyond the model's "
        "context of 128 (max_position_embeddings of model.tiny); lower them"
    )
