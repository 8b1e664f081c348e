"""What `grpoflow resume` reruns and why (tasks/pipeline/resume.py changes/explain), from recorded fingerprints."""

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import load_config
from grpoflow.tasks.pipeline.fingerprint import fingerprints, key_of
from grpoflow.tasks.pipeline.resume import changes, explain, warm_start_version
from grpoflow.tasks.storage.workspace import Workspace
from tests.paths import MICRO


def _fp(stage: str, *overrides: str) -> dict:
    return fingerprints(PIPELINE, load_config(str(MICRO), list(overrides)))[stage]


def test_changes_lists_config_values_old_to_new():
    old, new = _fp("sft"), _fp("sft", "sft.learning_rate=0.01", "model.lora.r=8")
    assert changes(old, new) == [
        f"config: model.lora.r {old['config']['model']['lora']['r']} -> 8",
        f"config: sft.learning_rate {old['config']['sft']['learning_rate']} -> 0.01",
    ]


def test_upstream_is_named_only_when_nothing_of_the_stage_changed():
    old, new = _fp("eval"), _fp("eval", "grpo.learning_rate=0.003")
    assert changes(old, new) == ["upstream grpo reruns"]
    assert changes(old, _fp("eval", "grpo.learning_rate=0.003", "eval.max_samples=2"))[0].startswith(
        "config: eval.max_samples"
    )
    assert changes(_fp("grpo"), _fp("grpo", "sft.enabled=false")) == [
        "upstream is now data",
        "upstream sft no longer feeds it",
    ]


def test_a_stage_after_a_rerun_reruns_even_with_its_key(tmp_path):
    """The shell forgets every later stage of one that runs: a killed grpo (no manifest) reruns eval and export."""
    cfg = load_config(str(MICRO), [])
    ws = Workspace(tmp_path)
    for name, fp in fingerprints(PIPELINE, cfg).items():
        if name in PIPELINE.names and name != "grpo":
            ws.publish(name, key_of(fp), {}, record={"fingerprint": fp})
    why = explain(PIPELINE, cfg, ws)
    assert why == {
        "grpo": ["no complete earlier attempt"],
        "eval": ["earlier stage grpo reruns (the stages after it rerun too)"],
        "export": ["earlier stage grpo reruns (the stages after it rerun too)"],
    }


def test_a_manifest_without_a_fingerprint_still_explains(tmp_path):
    cfg = load_config(str(MICRO), [])
    ws = Workspace(tmp_path)
    ws.publish("data", "an-old-key", {})
    assert explain(PIPELINE, cfg, ws)["data"] == ["key changed (its manifest records no fingerprint)"]


def test_the_champion_version_of_a_warm_start_is_recorded_for_a_later_resume(tmp_path):
    """The continuous flow passes the champion's registry version; a hand `grpoflow resume` of the cycle's
    workspace passes none and gets the recorded one back, for the same folder only."""
    ws = Workspace(str(tmp_path / "ws"))
    cold = load_config(str(MICRO))
    warm = load_config(str(MICRO), ["sft.enabled=false", f"model.warm_start={tmp_path / 'champion'}"])
    assert warm_start_version(ws, cold, "4") is None and ws.read_text("warm_start.json") is None
    assert warm_start_version(ws, warm, None) is None  # nothing recorded yet
    assert warm_start_version(ws, warm, "4") == "4"
    assert warm_start_version(ws, warm, None) == "4"  # the resume
    other = load_config(str(MICRO), ["sft.enabled=false", f"model.warm_start={tmp_path / 'another'}"])
    assert warm_start_version(ws, other, None) is None
