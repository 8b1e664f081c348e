import pytest
from pydantic import ValidationError

from grpoflow.tasks.config import ConfigError, config_from_dict, load_config, resolve_eval_size
from tests.paths import REPO


def test_default_config_loads_and_resolves_batching():
    cfg = load_config()
    b = cfg.grpo.batching()
    assert b.generation_batch_size == cfg.grpo.per_device_train_batch_size * b.steps_per_generation
    assert b.unique_prompts * cfg.grpo.num_generations == b.generation_batch_size
    assert cfg.grpo.loss_type == "dapo" and cfg.grpo.beta == 0.0


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["grpo.bogus=1"], "grpo.bogus: unknown key"),
        (["nosection.x=1"], "nosection: unknown key"),
        (["grpo.beta=abc"], "grpo.beta"),
        (["grpo.num_generations=1"], "grpo.num_generations: must be >= 2"),
        (
            ["grpo.per_device_train_batch_size=6", "grpo.gradient_accumulation_steps=1", "grpo.num_generations=4"],
            "grpo: generation_batch_size",
        ),
        (["grpo.steps_per_generation=2", "grpo.generation_batch_size=64"], "mutually exclusive"),
        (["grpo.generation_batch_size=60"], "divisible by per_device_train_batch_size"),
        (["grpo.loss_type=ppo"], "grpo.loss_type"),
        (["grpo.reward_weights=[1.0]"], "reward_weights has 1 values"),
        (["model.tiny.hidden_size=130"], "model.tiny: Value error, hidden_size must be divisible"),
        (["model.load_in_4bit=true", "model.lora.enabled=false", "export.adapter=false"], "load_in_4bit needs"),
    ],
)
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key.split(": Value error")[0] in str(err.value)


def test_batch_formula_in_message():
    with pytest.raises(ConfigError, match=r"= 6 \* 1 \* 1 = 6 must be divisible by num_generations \(4\)"):
        load_config(
            None, ["grpo.per_device_train_batch_size=6", "grpo.gradient_accumulation_steps=1", "grpo.num_generations=4"]
        )


def test_overrides_parse_yaml_values_and_aliases():
    cfg = load_config(None, ["grpo.beta=0.04", "grpo.scale_rewards=false", "grpo.reward_funcs=[correctness]"])
    assert cfg.grpo.beta == 0.04
    assert cfg.grpo.scale_rewards == "none"
    assert cfg.grpo.reward_funcs == ["correctness"]
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["grpo.beta"])


def test_generation_batch_size_sets_steps_per_generation():
    cfg = config_from_dict(
        {
            "grpo": {
                "per_device_train_batch_size": 4,
                "generation_batch_size": 16,
                "num_generations": 4,
                "gradient_accumulation_steps": 2,
            }
        }
    )
    b = cfg.grpo.batching()
    assert (b.steps_per_generation, b.unique_prompts, b.micro_steps_per_round) == (4, 4, 4)


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.grpo.beta = 1.0


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_a_section_given_twice_or_a_file_not_in_utf8_is_refused_naming_it(tmp_path):
    """YAML keeps the last of two equal keys: a second grpo: block silently reset the first one's keys to their
    defaults. And a Latin-1 file raised a raw UnicodeDecodeError."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("grpo:\n  learning_rate: 1.0e-3\nmodel:\n  name: tiny\ngrpo:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match="key 'grpo' given twice \\(lines 1 and 5\\)"):
        load_config(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("grpo:\n  max_steps: 3\n  max_steps: 4\n")
    with pytest.raises(ConfigError, match="key 'max_steps' given twice"):
        load_config(nested)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin.yaml: not UTF-8 text"):
        load_config(latin)


def test_resolve_eval_size():
    assert resolve_eval_size(0.1, 100) == 10
    assert resolve_eval_size(25, 100) == 25
    assert resolve_eval_size(0.001, 100) == 1
    assert resolve_eval_size(500, 100) == 99


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.grpo.batching().generation_batch_size % cfg.grpo.num_generations == 0


def test_a_trl_grpo_config_keyword_set_is_accepted_verbatim():
    """The GRPOConfig keywords a TRL / Unsloth user has in their script, pasted under `grpo:`."""
    trl_kwargs = dict(
        learning_rate=5e-6,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.1,
        warmup_ratio=0.1,
        warmup_steps=5,
        lr_scheduler_type="cosine",
        optim="paged_adamw_8bit",
        max_grad_norm=0.1,
        logging_steps=1,
        per_device_train_batch_size=6,
        gradient_accumulation_steps=2,
        num_generations=6,
        max_prompt_length=256,
        max_completion_length=200,
        max_steps=250,
        save_steps=250,
        beta=0.04,
        epsilon=0.2,
        epsilon_high=0.28,
        delta=1.5,
        num_iterations=2,
        importance_sampling_level="sequence",
        loss_type="dr_grpo",
        scale_rewards=False,
        reward_weights=[1.0, 0.5],
        mask_truncated_completions=True,
        temperature=0.9,
        top_p=0.95,
        top_k=50,
        min_p=0.1,
        repetition_penalty=1.05,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_max=3.0,
        use_bias_correction_kl=True,
        gradient_checkpointing=True,
        reward_funcs=["correctness", "soft_format"],
    )
    g = config_from_dict({"grpo": trl_kwargs}).grpo
    assert g.scale_rewards == "none" and g.vllm_importance_sampling_cap == 3.0 and g.warmup_steps == 5
    b = g.batching()
    assert (b.generation_batch_size, b.steps_per_generation, b.unique_prompts) == (12, 2, 2)
    with_gbs = config_from_dict({"grpo": {**trl_kwargs, "generation_batch_size": 24}}).grpo.batching()
    assert (with_gbs.steps_per_generation, with_gbs.unique_prompts) == (4, 4)


def test_vespo_refuses_a_sequence_level_sampler_correction():
    from grpoflow.tasks.config import GRPOConfig

    assert GRPOConfig(loss_type="vespo").vllm_importance_sampling_mode == "token_truncate"
    with pytest.raises(ValueError, match="loss_type=vespo .* token_truncate or token_mask, not sequence_mask"):
        GRPOConfig(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")


def test_correction_floor_must_be_below_the_cap():
    from grpoflow.tasks.config import GRPOConfig

    assert GRPOConfig(vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=3.0)
    with pytest.raises(ValueError, match=r"clip_min \(2.0\) must be less than .*\(2.0\)"):
        GRPOConfig(vllm_importance_sampling_clip_min=2.0)


def test_generation_compile_takes_on_and_off_as_typed(tmp_path):
    """YAML reads an unquoted on/off as a boolean: the override and a config file both still mean the word."""
    for word in ("on", "off", "auto"):
        assert load_config(None, [f"generation.compile={word}"]).generation.compile == word
    f = tmp_path / "c.yaml"
    f.write_text("generation:\n  compile: on\n")
    assert load_config(str(f), []).generation.compile == "on"
    with pytest.raises(ConfigError, match="generation.compile"):
        load_config(None, ["generation.compile=sometimes"])


def test_mlflow_experiment_name_names_the_experiment_unless_the_config_does(monkeypatch):
    """MLflow's convention (fluent API, HF Trainer, TRL): $MLFLOW_EXPERIMENT_NAME names the experiment a config
    leaves unset; an explicit tracking.experiment, in the file or an override, wins over it."""
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    assert load_config(REPO / "configs" / "default.yaml").tracking.experiment == "grpoflow"  # the built-in default

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    assert load_config(REPO / "configs" / "default.yaml").tracking.experiment == "from-env"
    assert config_from_dict({}).tracking.experiment == "from-env"  # no tracking section at all
    assert config_from_dict({"tracking": {"flush_timeout_s": 5}}).tracking.experiment == "from-env"
    overridden = load_config(REPO / "configs" / "default.yaml", ["tracking.experiment=explicit"])
    assert overridden.tracking.experiment == "explicit"
    assert load_config(REPO / "configs" / "smollm2-135m.yaml").tracking.experiment == "grpoflow-smollm2"  # in file
    # the resolved name travels with the config: a launch's worker reading it back keeps it whatever its env says
    resolved = config_from_dict({}).to_dict()
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "other")
    assert config_from_dict(resolved).tracking.experiment == "from-env"

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "  ")  # blank: unset
    assert config_from_dict({}).tracking.experiment == "grpoflow"
