"""Stage fingerprints see content (tasks/pipeline/fingerprint.py): an edited data file, an S3 object rewritten, a
model folder replaced in place and an edited reward module change the keys of the stages that read them, and
explain() (tasks/pipeline/resume.py) names the change."""

import os

import pytest

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import load_config
from grpoflow.tasks.pipeline.fingerprint import continue_key, fingerprints, key_of, stage_keys
from grpoflow.tasks.pipeline.resume import explain
from grpoflow.tasks.storage import content
from grpoflow.tasks.storage.workspace import Workspace
from tests.paths import MICRO

ROWS = '{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n'


def _cfg(*overrides: str):
    return load_config(str(MICRO), list(overrides))


def _changed(before: dict, after: dict) -> set[str]:
    return {s for s in before if before[s] != after[s]}


def _publish_all(ws: Workspace, cfg) -> None:
    """What the stage shell leaves after a complete run: each stage's manifest with its key and fingerprint."""
    for name, fp in fingerprints(PIPELINE, cfg).items():
        if name in PIPELINE.names:
            ws.publish(name, key_of(fp), {"ok": True}, record={"fingerprint": fp})


def test_a_local_data_file_edit_reruns_data_and_everything_after(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(ROWS)
    cfg = _cfg(f"data.source={data}")
    before = stage_keys(PIPELINE, cfg)
    ws = Workspace(tmp_path / "ws")
    _publish_all(ws, cfg)
    assert explain(PIPELINE, cfg, ws) == {}  # nothing changed: nothing reruns
    data.write_text(ROWS + '{"question": "3+3?", "answer": "6"}\n')
    after = stage_keys(PIPELINE, cfg)
    assert _changed(before, after) == {"data", "sft", "grpo", "eval", "export", "base_model"}
    why = explain(PIPELINE, cfg, ws)
    assert list(why) == ["data", "sft", "grpo", "eval", "export"]
    assert why["data"][0].startswith("file: data.source train.jsonl changed (size ")
    assert "sha256" in why["data"][0]
    assert why["sft"] == ["upstream data reruns"]


def test_an_s3_object_rewritten_changes_the_key(seaweedfs, monkeypatch):
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    client = seaweedfs.client()
    client.put_object(Bucket=seaweedfs.bucket, Key="fp/train.jsonl", Body=ROWS.encode())
    cfg = _cfg(f"data.source=s3://{seaweedfs.bucket}/fp/train.jsonl")
    first = fingerprints(PIPELINE, cfg)["data"]["content"]["data.source"]
    assert first == {"fp/train.jsonl": {"size": len(ROWS), "etag": first["fp/train.jsonl"]["etag"]}}
    key = stage_keys(PIPELINE, cfg)["data"]
    assert stage_keys(PIPELINE, cfg)["data"] == key  # the same object: the same key
    client.put_object(Bucket=seaweedfs.bucket, Key="fp/train.jsonl", Body=ROWS.replace("2+2", "2*2").encode())
    assert stage_keys(PIPELINE, cfg)["data"] != key  # same size, another ETag


def test_a_model_folder_replaced_in_place_changes_the_training_keys(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    cfg = _cfg(f"model.name={model}")
    before = stage_keys(PIPELINE, cfg)
    ws = Workspace(tmp_path / "ws")
    _publish_all(ws, cfg)
    (model / "model.safetensors").write_bytes(b"\1" * 64)  # same size, other weights
    after = stage_keys(PIPELINE, cfg)
    assert {"sft", "grpo", "eval", "export"} <= _changed(before, after)
    assert any(
        line.startswith("file: model.name model.safetensors changed (sha256")
        for line in explain(PIPELINE, cfg, ws)["sft"]
    )


def test_large_files_are_identified_by_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setattr(content, "HASH_LIMIT", 4)
    big = tmp_path / "w.bin"
    big.write_bytes(b"12345678")
    first = content.file_digest(big)
    assert set(first) == {"size", "mtime_ns"}
    os.utime(big, ns=(first["mtime_ns"] + 10**9, first["mtime_ns"] + 10**9))
    assert content.file_digest(big) != first


def test_an_edited_reward_module_reruns_grpo_not_data(tmp_path, monkeypatch):
    module = tmp_path / "fp_rewards.py"
    module.write_text("def score(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg("grpo.reward_funcs=[fp_rewards:score,correctness]")
    before = stage_keys(PIPELINE, cfg)
    ws = Workspace(tmp_path / "ws")
    _publish_all(ws, cfg)
    module.write_text("def score(prompts, completions, **kw):\n    return [0.0 for _ in completions]\n")
    after = stage_keys(PIPELINE, cfg)
    assert _changed(before, after) == {"grpo", "eval", "export"}
    why = explain(PIPELINE, cfg, ws)
    assert list(why) == ["grpo", "eval", "export"]
    assert why["grpo"] == ["code: fp_rewards (reward module, fp_rewards.py) changed"]
    assert why["eval"] == ["code: fp_rewards (reward module, fp_rewards.py) changed"]  # eval scores with it too


def test_explain_names_config_changes_and_missing_attempts(tmp_path):
    cfg = _cfg()
    ws = Workspace(tmp_path / "ws")
    assert explain(PIPELINE, cfg, ws)["data"] == ["no complete earlier attempt"]
    _publish_all(ws, cfg)
    why = explain(PIPELINE, _cfg("grpo.learning_rate=0.003"), ws)
    assert list(why) == ["grpo", "eval", "export"]
    assert why["grpo"] == [f"config: grpo.learning_rate {cfg.grpo.learning_rate} -> 0.003"]
    assert why["eval"] == ["upstream grpo reruns"]
    assert list(explain(PIPELINE, _cfg("eval.enabled=false", "eval.max_samples=2"), ws)) == []  # disabled: not run
    assert list(explain(PIPELINE, cfg, ws, forget=PIPELINE.stages_from("eval"))) == ["eval", "export"]


@pytest.mark.parametrize("source", ["arithmetic", "openai/gsm8k"])
def test_sources_named_by_the_config_have_no_content_digest(source):
    assert "content" in fingerprints(PIPELINE, _cfg(f"data.source={source}"))["data"]
    assert fingerprints(PIPELINE, _cfg(f"data.source={source}"))["data"]["content"] == {}


def test_continue_key_ignores_only_the_extends_fields():
    spec = PIPELINE["grpo"]
    assert spec.extends == ("grpo.max_steps",)
    fp = {n: fingerprints(PIPELINE, load_config(str(MICRO), o))["grpo"] for n, o in
          (("a", []), ("b", ["grpo.max_steps=99"]), ("c", ["grpo.learning_rate=0.5"]))}  # fmt: skip
    assert key_of(fp["a"]) != key_of(fp["b"])
    assert continue_key(fp["a"], spec.extends) == continue_key(fp["b"], spec.extends)
    assert continue_key(fp["a"], spec.extends) != continue_key(fp["c"], spec.extends)
    assert "max_steps" in fp["a"]["config"]["grpo"]  # the fingerprint itself is left as it was
