"""The trl: section: every field of TRL 1.16's own GRPOConfig is mapped, warned or refused (tasks/config/trl_keys.py),
checked against TRL's dataclass and configs TRL itself builds."""

import dataclasses
import json
import warnings

import pytest
import trl
import yaml

from grpoflow.flows.cli import main
from grpoflow.tasks.config import ConfigError, config_from_dict, load_config
from grpoflow.tasks.config.trl_keys import TRL_KEYS, TRLKeyWarning, markdown_table
from tests.paths import REPO

CONFIG_REFERENCE = REPO / "docs" / "configuration.md"


def trl_dump(**kwargs) -> dict:
    """A GRPOConfig as TRL builds it (its __post_init__ fills derived keys), every field present, as YAML holds it."""
    cfg = trl.GRPOConfig(output_dir="trl-out", bf16=False, **kwargs)
    return yaml.safe_load(yaml.safe_dump(json.loads(json.dumps(cfg.to_dict(), default=str))))


def load(raw: dict):
    """(config, names of the trl keys warned about)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_dict(raw)
    other = [w for w in caught if not issubclass(w.category, TRLKeyWarning)]
    assert not other, [str(w.message) for w in other]
    return cfg, [str(w.message).split()[0].removeprefix("trl.").split("=")[0] for w in caught]


def test_the_table_covers_exactly_trls_fields():
    """Fails when TRL adds, renames or drops a GRPOConfig key (TrainingArguments' fields included)."""
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert len(theirs) > 150
    assert sorted(theirs - set(TRL_KEYS)) == []  # a TRL key without a rule
    assert sorted(set(TRL_KEYS) - theirs) == []  # a rule for a key TRL no longer has


def test_a_full_trl_config_validates_with_the_documented_warnings_only():
    dump = trl_dump()
    assert set(dump) == set(TRL_KEYS)  # every key is set
    cfg, warned = load({"trl": dump})
    expected = sorted(k for k, r in TRL_KEYS.items() if r.kind == "warned") + ["max_steps"]  # -1: train by epochs
    assert sorted(warned) == sorted(expected)
    assert len(warned) == len(set(warned))  # one warning per key
    # TRL's defaults where they differ from ours land on our config
    assert cfg.grpo.max_completion_length == 512
    assert cfg.grpo.vllm_importance_sampling_mode == "sequence_mask"
    assert cfg.grpo.vllm_importance_sampling_cap == 3.0
    assert cfg.grpo.gradient_checkpointing is True and cfg.grpo.logging_steps == 10 and cfg.grpo.save_steps == 500
    assert cfg.grpo.top_k is None and cfg.model.dtype == "float32" and cfg.generation.backend == "transformers"
    assert cfg.grpo.batching().steps_per_generation == 1 and cfg.grpo.generation_batch_size is None


def test_mapped_keys_have_trls_meaning():
    kw = dict(
        learning_rate=3e-6,
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        max_steps=7,
        beta=0.04,
        loss_type="grpo",
        epsilon=0.1,
        epsilon_high=0.3,
        delta=1.6,
        scale_rewards=False,
        max_completion_length=64,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        importance_sampling_level="sequence",
        mask_truncated_completions=True,
        num_iterations=2,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_max=2.5,
        vllm_importance_sampling_clip_min=0.5,
        top_entropy_quantile=0.3,
        off_policy_mask_threshold=0.4,
        reward_weights=[1.0, 0.5, 0.5, 0.5, 0.5],
        warmup_steps=0.1,
        max_grad_norm=0.0,
        optim="adamw_torch_fused",
        seed=7,
        use_cpu=True,
        num_generations_eval=6,
    )
    their = trl.GRPOConfig(output_dir="trl-out", bf16=False, **kw)
    raw = {"trl": {**kw, "use_vllm": True, "bf16": True}}
    cfg, _ = load(raw)
    g = cfg.grpo
    for key in ("learning_rate", "num_generations", "beta", "loss_type", "epsilon", "epsilon_high", "delta"):
        assert getattr(g, key) == getattr(their, key), key
    for key in ("max_completion_length", "temperature", "top_p", "top_k", "min_p", "importance_sampling_level"):
        assert getattr(g, key) == getattr(their, key), key
    assert g.scale_rewards == their.scale_rewards == "none"
    assert g.vllm_importance_sampling_cap == their.vllm_importance_sampling_clip_max
    assert g.vllm_importance_sampling_clip_min == their.vllm_importance_sampling_clip_min
    assert (g.max_steps, g.num_iterations, g.mask_truncated_completions) == (7, 2, True)
    assert (g.top_entropy_quantile, g.off_policy_mask_threshold) == (0.3, 0.4)
    assert g.reward_weights == their.reward_weights
    b = g.batching()  # the round layout TRL's __post_init__ resolved
    assert (b.generation_batch_size, b.steps_per_generation) == (their.generation_batch_size, 4)
    assert g.warmup_ratio == 0.1 and g.warmup_steps == 0 and g.max_grad_norm is None and g.optim == "adamw_torch"
    assert cfg.run.seed == 7 and cfg.run.device == "cpu" and cfg.eval.num_samples == 6
    assert cfg.generation.backend == "vllm" and cfg.model.dtype == "bfloat16"


@pytest.mark.parametrize(
    "trl_section, ours, named",
    [
        ({"beta": 0.04}, {"grpo": {"beta": 0.0}}, ["trl.beta", "grpo.beta"]),
        ({"use_vllm": True}, {"generation": {"backend": "transformers"}}, ["trl.use_vllm", "generation.backend"]),
        ({"bf16": True}, {"model": {"dtype": "float32"}}, ["trl.bf16", "model.dtype"]),
        ({"vllm_importance_sampling_cap": 2.0, "vllm_importance_sampling_clip_max": 3.0}, {}, ["_cap", "_clip_max"]),
        ({"generation_batch_size": 16, "steps_per_generation": 1}, {}, ["generation_batch_size", "steps_per"]),
        ({"fp16": True}, {}, ["trl.fp16", "loss scaler"]),
        ({"vllm_mode": "server"}, {}, ["trl.vllm_mode"]),
        ({"disable_dropout": True}, {}, ["trl.disable_dropout"]),
        ({"vllm_importance_sampling_clip_max": None}, {}, ["trl.vllm_importance_sampling_clip_max"]),
        ({"hub_token": "hf_abc"}, {}, ["trl.hub_token", "credentials"]),
        ({"model_init_kwargs": {"device_map": "auto"}}, {}, ["trl.model_init_kwargs", "device_map"]),
        ({"model_name_or_path": "x"}, {}, ["trl: unknown key", "model_name_or_path"]),
        ({"logging_steps": 0.5}, {}, ["trl.logging_steps"]),
        ({"loss_type": "nope"}, {}, ["grpo.loss_type (from trl.loss_type)"]),
    ],
)
def test_refused_and_conflicting_keys_are_named(trl_section, ours, named):
    with pytest.raises(ConfigError) as e:
        load({**ours, "trl": trl_section})
    for part in named:
        assert part in str(e.value), str(e.value)


def test_agreeing_keys_and_overrides(tmp_path):
    cfg, _ = load({"grpo": {"beta": 0.04, "scale_rewards": "batch"}, "trl": {"beta": 0.04, "scale_rewards": "batch"}})
    assert cfg.grpo.beta == 0.04
    cfg, _ = load({"run": {"name": "mine"}, "trl": {"run_name": None, "max_grad_norm": 1.0}})  # null: no opinion
    assert cfg.run.name == "mine"
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    cfg = load_config(empty, ["trl.loss_type=bnpo", "trl.epsilon_high=0.28"])
    assert (cfg.grpo.loss_type, cfg.grpo.effective_epsilon_high) == ("bnpo", 0.28)
    with pytest.raises(ConfigError, match=r"trl.loss_type \('bnpo'\) and grpo.loss_type \('dapo'\)"):
        load_config(None, ["trl.loss_type=bnpo"])  # the default config sets grpo.loss_type itself


def test_cli_reads_a_trl_config_file(tmp_path, capsys):
    path = tmp_path / "grpo_trl.yaml"
    path.write_text(yaml.safe_dump({"learning_rate": 2e-6, "report_to": "wandb", "use_vllm": False, "beta": 0.02}))
    ours = tmp_path / "run.yaml"
    ours.write_text(yaml.safe_dump({"grpo": {"max_steps": 3, "learning_rate": 2e-6}}))  # agrees with the TRL file
    assert main(["validate", "--show", "--trl-config", str(path), str(ours), "grpo.max_steps=3"]) == 0
    out = capsys.readouterr()
    shown = json.loads(out.out)
    assert shown["grpo"]["learning_rate"] == 2e-6 and shown["grpo"]["beta"] == 0.02 and "trl" not in shown
    assert shown["generation"]["backend"] == "transformers"
    assert out.err.count("grpoflow: warning: trl.") == 1 and "trl.report_to" in out.err
    clash = tmp_path / "clash.yaml"
    clash.write_text(yaml.safe_dump({"trl": {"beta": 0.1}}))
    with pytest.raises(ConfigError, match="trl.beta"):
        load_config(clash, trl_config=path)
    assert (
        main(["validate", "--trl-config", str(path)]) == 2
    )  # a config error; the default config sets grpo.beta: 0.0 itself
    assert "trl.beta (0.02) and grpo.beta (0.0)" in capsys.readouterr().err


def test_readme_has_the_table():
    assert markdown_table() in CONFIG_REFERENCE.read_text()
