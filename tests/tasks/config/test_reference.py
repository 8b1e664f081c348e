"""docs/configuration.md is generated from the config models (tasks/config/reference.py) and kept current."""

import difflib
from typing import Literal

import pytest
from pydantic import Field

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.config.base import _Section
from grpoflow.tasks.config.reference import (
    COMMAND,
    allowed,
    keys,
    missing_descriptions,
    render,
    section_text,
    sections,
    trl_names,
    type_name,
)
from tests.paths import REPO

DOC = REPO / "docs" / "configuration.md"


def test_configuration_md_is_generated_from_the_current_models():
    assert DOC.is_file(), f"docs/configuration.md is missing: run `{COMMAND}`"
    text, want = DOC.read_text(), render()
    if text != want:
        diff = difflib.unified_diff(text.splitlines(True), want.splitlines(True), "docs/configuration.md", "generated")
        shown = "".join(list(diff)[:24])
        pytest.fail(f"docs/configuration.md is stale: run `{COMMAND}` and commit the result\n{shown}")


def test_every_key_has_a_description_and_every_section_an_intro():
    assert missing_descriptions() == [], "give these Fields a description (one sentence a user understands)"
    assert [name for name, cls in sections() if not cls.__dict__.get("__doc__")] == []


def test_every_key_is_in_the_reference_once():
    text = render()
    every = [key for name, cls in sections() for key, _ in keys(cls, name)]
    assert len(every) == len(set(every)) > 150
    for key in every:
        assert text.count(f"| `{key}` |") == 1, key
    assert '| `grpo.loss_type` | `str` | `"dapo"` | one of `grpo`, `bnpo`' in text
    assert {name for name, _ in sections()} >= {"grpo.code_reward", "distributed.trainjob", "model.lora", "storage"}
    assert set(PipelineConfig.model_fields) == {name for name, _ in sections() if "." not in name}


class Toy(_Section):
    """A toy section."""

    mode: Literal["a", "b"] | None = Field(None, description="Mode.")
    rate: float = Field(0.5, gt=0, le=1, description="Rate | ratio of <things>.")
    names: list[Literal["x", "y"]] = Field(default_factory=lambda: ["x"], min_length=1, description="Names.")


def test_a_changed_field_changes_its_row():
    """What the staleness test relies on: a key's type, default, bounds, choices and description are in its row."""
    rows = section_text("toy", Toy, {"toy.rate": ["trl_rate"]}).splitlines()
    assert rows[0] == "## `toy`" and "A toy section." in rows
    assert "| `toy.mode` | `str \\| null` | `null` | one of `a`, `b` |  | Mode. |" in rows
    rate = "| `toy.rate` | `float` | `0.5` | &gt; 0, &lt;= 1 | `trl: trl_rate` | Rate \\| ratio of &lt;things&gt;. |"
    assert rate in rows
    assert '| `toy.names` | `list[str]` | `["x"]` | each of `x`, `y`, at least 1 item |  | Names. |' in rows

    class Changed(Toy):
        rate: float = Field(0.25, gt=0, lt=1, description="Rate.")

    assert section_text("toy", Changed, {}) != section_text("toy", Toy, {})
    assert allowed(Changed.model_fields["rate"]) == "> 0, < 1"
    assert type_name(dict[str, list[int]]) == "dict[str, list[int]]"


def test_trl_names_beside_our_keys():
    trl = trl_names()
    assert trl["grpo.num_generations"] == ["num_generations"]
    assert set(trl["grpo.vllm_importance_sampling_cap"]) == {
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_cap",
    }
    assert "bf16" in trl["model.dtype"] and "use_vllm" in trl["generation.backend"]
    every = {key for name, cls in sections() for key, _ in keys(cls, name)}
    assert set(trl) <= every, set(trl) - every  # every target a TRL rule names is a real key
