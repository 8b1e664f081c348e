"""Stage fingerprints see content (tasks/pipeline/fingerprint.py): an edited data file, an S3 object rewritten, a
model folder replaced in place and an edited reward module change the keys of the stages that read them, and
explain() (tasks/pipeline/resume.py) names the change."""

import hashlib
import os
import shutil

import pytest

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import load_config
from grpoflow.tasks.pipeline import legacy, resume
from grpoflow.tasks.pipeline.fingerprint import continue_key, fingerprints, key_of, stage_keys
from grpoflow.tasks.pipeline.legacy import adopt_legacy_keys
from grpoflow.tasks.pipeline.resume import explain, replaced
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


BIG = 64 * 2**20 + 4096  # over the 64 MiB above which keys used to take size + mtime_ns


def _model_with_big_weights(folder):
    """A model folder whose weights file is over 64 MiB (sparse: cheap to write and to hash)."""
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    with (folder / "model.safetensors").open("wb") as f:
        f.truncate(BIG)
        f.seek(BIG // 2)
        f.write(b"weights")
    return folder


def test_a_model_folder_restored_with_new_mtimes_keeps_the_training_keys(tmp_path):
    """A copy to another machine, a restore from a backup, `git lfs` checking the weights out again: the same
    bytes with new mtimes (and inodes) rerun nothing."""
    model = _model_with_big_weights(tmp_path / "model")
    cfg = _cfg(f"model.name={model}", f"storage.cache_dir={tmp_path / 'cache'}")
    before = stage_keys(PIPELINE, cfg)
    ws = Workspace(tmp_path / "ws")
    _publish_all(ws, cfg)
    shutil.copytree(model, tmp_path / "backup", copy_function=shutil.copyfile)
    shutil.rmtree(model)
    shutil.copytree(tmp_path / "backup", model, copy_function=shutil.copyfile)
    os.utime(model / "model.safetensors", ns=(10**18, 10**18))
    assert stage_keys(PIPELINE, cfg) == before
    assert explain(PIPELINE, cfg, ws) == {}
    with (model / "model.safetensors").open("r+b") as f:  # other weights, same size
        f.seek(BIG // 2)
        f.write(b"WEIGHTS")
    assert {"sft", "grpo", "eval", "export"} <= _changed(before, stage_keys(PIPELINE, cfg))
    assert explain(PIPELINE, cfg, ws)["sft"][0].startswith("file: model.name model.safetensors changed (sha256 ")


def _legacy_file_digest(path, *args, **kwargs):
    """file_digest as grpoflow had it before every file was hashed: size + mtime_ns above 64 MiB."""
    st = path.stat()
    if st.st_size > 64 * 2**20:
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"size": st.st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def test_a_run_keyed_by_mtimes_is_adopted_not_rerun_and_then_survives_a_copy(tmp_path, monkeypatch):
    """Manifests and attempt records an older grpoflow wrote (big files as size + mtime_ns) still count while the
    files keep their mtimes; adopting them rewrites their keys, after which a restore with new mtimes keeps them."""
    model = _model_with_big_weights(tmp_path / "model")
    cfg = _cfg(f"model.name={model}", f"storage.cache_dir={tmp_path / 'cache'}", "grpo.max_steps=2")
    ws = Workspace(tmp_path / "ws")
    with monkeypatch.context() as m:
        m.setattr(content, "file_digest", _legacy_file_digest)
        old = fingerprints(PIPELINE, cfg)
        ws.begin("grpo", key_of(old["grpo"]), continue_key(old["grpo"], ("grpo.max_steps",)), {"grpo.max_steps": 2})
        _publish_all(ws, cfg)
    new = stage_keys(PIPELINE, cfg)
    assert new["sft"] != key_of(old["sft"])  # the weights are named by their sha256 now
    assert explain(PIPELINE, cfg, ws) == {}  # the old keys still count: nothing reruns
    more = _cfg(f"model.name={model}", f"storage.cache_dir={tmp_path / 'cache'}", "grpo.max_steps=4")
    assert replaced(PIPELINE, more, ws, ["grpo"])["grpo"].startswith("continues from its finished attempt")

    assert adopt_legacy_keys(PIPELINE, cfg, ws) == ["sft", "grpo", "eval", "export"]  # data reads no model
    assert all(ws.read_manifest(s)["key"] == new[s] for s in PIPELINE.names)
    assert ws.read_manifest("sft")["fingerprint"] == fingerprints(PIPELINE, cfg)["sft"]
    assert ws.last_attempt("grpo")["key"] == new["grpo"]
    computed = []  # once adopted, no key is an old one: the old-way fingerprints are never computed again
    for module in (legacy, resume):
        monkeypatch.setattr(module, "legacy_fingerprints", lambda *a: computed.append(a) or {})
    assert adopt_legacy_keys(PIPELINE, cfg, ws) == []  # done once
    os.utime(model / "model.safetensors", ns=(10**18, 10**18))  # restored from a backup: new mtimes
    assert explain(PIPELINE, cfg, ws) == {}
    assert replaced(PIPELINE, more, ws, ["grpo"])["grpo"].startswith("continues from its finished attempt")
    assert computed == []


def test_a_run_keyed_by_mtimes_whose_weights_were_touched_since_reruns_and_says_why(tmp_path, monkeypatch):
    model = _model_with_big_weights(tmp_path / "model")
    cfg = _cfg(f"model.name={model}", f"storage.cache_dir={tmp_path / 'cache'}")
    ws = Workspace(tmp_path / "ws")
    with monkeypatch.context() as m:
        m.setattr(content, "file_digest", _legacy_file_digest)
        _publish_all(ws, cfg)
    os.utime(model / "model.safetensors", ns=(10**18, 10**18))  # the old key cannot tell this from new weights
    assert adopt_legacy_keys(PIPELINE, cfg, ws) == []  # no stage holds the key its files give now
    why = explain(PIPELINE, cfg, ws)["sft"]
    assert why == ["file: model.name model.safetensors: recorded by size + mtime_ns (grpoflow before files over "
                   "64 MiB were hashed); its mtime changed since, so its content may have"]  # fmt: skip


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
