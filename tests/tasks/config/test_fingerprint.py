"""The one list of config fields that cannot change a result, and the config digest without them
(tasks/config/fingerprint.py)."""

import pytest
from pydantic import BaseModel

from grpoflow.tasks.config import PipelineConfig, config_from_dict
from grpoflow.tasks.config import fingerprint as fp


def test_every_ignored_field_exists_and_says_why():
    for cls, fields in fp.IGNORED.items():
        assert issubclass(cls, BaseModel)
        for name, why in fields.items():
            assert name in cls.model_fields, f"{cls.__name__}.{name}"
            assert why.strip(), f"{cls.__name__}.{name} has no reason"


def test_a_renamed_field_raises_at_import(monkeypatch):
    monkeypatch.setitem(fp.IGNORED, fp.RunConfig, {"no_such_field": "x"})
    with pytest.raises(AttributeError, match="RunConfig has no field \\['no_such_field'\\]"):
        fp._check()


def _digest(section: str = "", **values) -> str:
    return fp.config_digest(config_from_dict({section: values} if section else {}))


@pytest.mark.parametrize(
    ("section", "values"),
    [
        ("run", {"seed": 7}),
        ("run", {"torch_threads": 2}),  # the order of float sums: other sampled tokens (measured)
        ("generation", {"torch_threads": 1}),
        ("generation", {"batch_size": 3}),
        ("grpo", {"learning_rate": 3e-6}),
        ("grpo", {"max_steps": 9}),
        ("eval", {"max_samples": 3}),
        ("distributed", {"nproc_per_node": 2}),
        ("distributed", {"backend": "gloo"}),
        ("model", {"lora": {"r": 8}}),  # a nested section's field
    ],
)
def test_a_keyed_field_changes_the_digest(section, values):
    assert _digest(section, **values) != _digest()


@pytest.mark.parametrize(
    ("section", "values"),
    [
        ("run", {"name": "other", "output_dir": "/elsewhere"}),
        ("tracking", {"experiment": "x"}),
        ("storage", {"cache_dir": "/elsewhere"}),
        ("grpo", {"save_steps": 3, "logging_steps": 2, "log_completions": False, "resume": "never"}),
        ("sft", {"logging_steps": 9}),  # inherited from OptimizerFields: ignored in every subclass
        ("model", {"cache_dir": "/x"}),
        ("distributed", {"timeout_s": 5, "master_port": 29555}),
    ],
)
def test_an_ignored_field_keeps_the_digest(section, values):
    assert _digest(section, **values) == _digest()


def test_exclude_drops_a_field_of_the_section_only():
    a, b = PipelineConfig().grpo, config_from_dict({"grpo": {"max_steps": 9}}).grpo
    assert fp.config_digest(a) != fp.config_digest(b)
    assert fp.config_digest(a, exclude=frozenset({"max_steps"})) == fp.config_digest(
        b, exclude=frozenset({"max_steps"})
    )


def test_paths_are_checked_against_the_config_classes():
    fp.check_path("model.tiny.hidden_size")
    with pytest.raises(AttributeError, match="ModelConfig has no field 'nmae'"):
        fp.check_path("model.nmae")
    assert fp.section_value(PipelineConfig(), "run") == {"seed": 42, "device": "auto", "torch_threads": None}


def test_a_field_added_at_its_old_value_keeps_every_recorded_key():
    """grpo.code_reward.cpus came after runs recorded their keys: at its default the grpo section keys exactly as
    it did without the field; set otherwise it is keyed."""
    code = PipelineConfig().grpo.code_reward
    before = {name: fp.keyed_values(getattr(code, name)) for name in type(code).model_fields if name != "cpus"}
    assert fp.keyed_values(code) == before
    assert _digest("grpo", code_reward={"cpus": 2.0}) != _digest()
    assert fp.keyed_values(config_from_dict({"grpo": {"code_reward": {"cpus": 2.0}}}).grpo.code_reward)["cpus"] == 2.0


def test_an_added_field_whose_default_moved_raises_at_import(monkeypatch):
    monkeypatch.setitem(fp.ADDED, fp.CodeRewardConfig, {"cpus": (4.0, "x")})
    with pytest.raises(AttributeError, match=r"CodeRewardConfig.cpus defaults to 1.0, not 4.0"):
        fp._check()
