"""StageSpec and Pipeline (tasks/pipeline/spec.py): a stage declared once; the order and the loose folders."""

import pytest

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import load_config
from grpoflow.tasks.pipeline.fingerprint import stage_keys
from grpoflow.tasks.pipeline.spec import Pipeline, StageSpec
from grpoflow.tasks.tracking import run_meta
from tests.paths import MICRO


def test_a_spec_naming_a_renamed_field_raises():
    with pytest.raises(AttributeError, match="stage 'x': config path 'grpo.learning_rat'"):
        StageSpec(name="x", keys=("grpo.learning_rat",))
    with pytest.raises(AttributeError, match="stage 'x'"):
        StageSpec(name="x", param_sections=("nosuch",))


def test_the_pipeline_order_and_its_loose_folders():
    assert PIPELINE.names == ("data", "sft", "grpo", "eval", "export")
    assert [s.name for s in PIPELINE.loose] == ["base_model"]  # written by sft and grpo, keyed by its own spec
    assert PIPELINE.stages_from("grpo") == ("grpo", "eval", "export")
    assert PIPELINE.before("eval") == ("data", "sft", "grpo")
    with pytest.raises(ValueError, match="unknown stage 'train'; expected one of data, sft"):
        PIPELINE.stages_from("train")


def test_grpo_hangs_off_sft_only_when_sft_runs():
    on, off = (load_config(str(MICRO), o) for o in ([], ["sft.enabled=false"]))
    assert PIPELINE["grpo"].upstream(on) == ("sft",) and PIPELINE["grpo"].upstream(off) == ("data",)
    assert PIPELINE["sft"].enabled(on) and not PIPELINE["sft"].enabled(off)


def test_adding_a_stage_means_writing_its_spec():
    """A new stage after export: keyed, named and described from its spec alone."""
    cfg = load_config(str(MICRO), [])
    report = StageSpec(
        name="report",
        keys=("eval.pass_k",),
        upstream=lambda c: ("eval",),
        description="Wrote a report on {dataset}.",
        param_sections=("eval",),
        name_parts=lambda c: (run_meta.short_model(c.model.name),),
        result=lambda s: f"{s['pages']} pages." if "pages" in s else "",
    )
    longer = Pipeline((*PIPELINE.specs, report))
    keys = stage_keys(longer, cfg)
    assert {k: v for k, v in keys.items() if k != "report"} == stage_keys(PIPELINE, cfg)
    changed = stage_keys(longer, load_config(str(MICRO), ["eval.max_samples=3"]))
    assert changed["report"] != keys["report"]  # its upstream eval changed
    assert longer.stages_from("export") == ("export", "report")
    assert run_meta.stage_name(cfg, report) == "report · tiny"
    assert run_meta.describe(cfg, report, {"pages": 3}) == "Wrote a report on arithmetic.\n\n3 pages."
    assert run_meta.filter_tags(cfg, report, "p", None)["stage"] == "report"
