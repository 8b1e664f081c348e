"""Stage fingerprints see content (tasks/pipeline/fingerprint.py): an edited data file, an S3 object rewritten, a
model folder replaced in place and an edited reward module change the keys of the stages that read them, and
explain() (tasks/pipeline/resume.py) names the change."""

import contextlib
import hashlib
import os
import shutil

import pytest

from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import load_config
from grpoflow.tasks.pipeline import legacy, resume
from grpoflow.tasks.pipeline.fingerprint import continue_key, fingerprints, key_of, reward_files_only, stage_keys
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


def _reward_project(root, name):
    """A project whose reward module ``name`` imports helpers of its own three ways (a top-level module, a package
    through relative imports, an import inside the function) beside an unrelated file and a virtualenv inside it."""
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / name).with_suffix(".py").write_text(
        "import json\nimport helpers\nfrom pkg.sub import deep\nimport vendored\n\n"
        "def score(prompts, completions, **kw):\n"
        "    from lazy import bonus\n\n    return [bonus() for _ in completions]\n"
    )
    (root / "helpers.py").write_text("WEIGHT = 1.0\n")
    (root / "lazy.py").write_text("def bonus():\n    return 1.0\n")
    (root / "unrelated.py").write_text("X = 1\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "util.py").write_text("def g():\n    return 1\n")
    (root / "pkg" / "sub" / "__init__.py").write_text("from . import deep\n")
    (root / "pkg" / "sub" / "deep.py").write_text("from ..util import g\n")
    venv = root / ".venv" / "lib" / "python3" / "site-packages"
    (venv / "vendored").mkdir(parents=True)
    (venv / "vendored" / "__init__.py").write_text("")
    return venv


def test_an_edited_file_a_reward_module_imports_reruns_grpo_and_says_which(tmp_path, monkeypatch):
    """A helper of the user's project that the reward module imports is part of its key; a file it does not import,
    the standard library and a virtualenv inside the project are not."""
    venv = _reward_project(tmp_path, "imp_rewards")
    monkeypatch.syspath_prepend(str(venv))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg("grpo.reward_funcs=[imp_rewards:score,correctness]")
    files = fingerprints(PIPELINE, cfg)["grpo"]["content"]["reward imp_rewards"]
    assert sorted(files) == [
        "helpers.py", "imp_rewards.py", "lazy.py", "pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/deep.py",
        "pkg/util.py",
    ]  # fmt: skip
    ws = Workspace(tmp_path / "ws")
    _publish_all(ws, cfg)
    before = stage_keys(PIPELINE, cfg)
    (tmp_path / "unrelated.py").write_text("X = 2\n")
    (venv / "vendored" / "__init__.py").write_text("Y = 2\n")
    assert stage_keys(PIPELINE, cfg) == before and explain(PIPELINE, cfg, ws) == {}
    for edited in ("helpers.py", "lazy.py", "pkg/util.py"):  # directly, inside a function, two relative hops
        (tmp_path / edited).write_text((tmp_path / edited).read_text() + "# edited\n")
        after = stage_keys(PIPELINE, cfg)
        assert _changed(before, after) == {"grpo", "eval", "export"}, edited
        why = explain(PIPELINE, cfg, ws)
        assert why["grpo"] == [f"code: imp_rewards (reward module, {edited}) changed"]
        _publish_all(ws, cfg)
        before = after
    (tmp_path / "imp_rewards.py").write_text(
        "import helpers\n\ndef score(prompts, completions, **kw):\n    return []\n"
    )
    assert explain(PIPELINE, cfg, ws)["grpo"] == [
        "code: imp_rewards (reward module, imp_rewards.py) changed",
        "code: imp_rewards (reward module, lazy.py) removed",
        *(f"code: imp_rewards (reward module, {f}) removed" for f in ("pkg/__init__.py", "pkg/sub/__init__.py")),
        "code: imp_rewards (reward module, pkg/sub/deep.py) removed",
        "code: imp_rewards (reward module, pkg/util.py) removed",
    ]


def test_a_reward_module_that_imports_no_local_file_keeps_the_key_it_always_had(tmp_path, monkeypatch):
    (tmp_path / "lone_rewards.py").write_text(
        "import json\nimport torch\n\ndef score(prompts, completions, **kw):\n    return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg("grpo.reward_funcs=[lone_rewards:score]")
    files = fingerprints(PIPELINE, cfg)["grpo"]["content"]["reward lone_rewards"]
    assert list(files) == ["lone_rewards.py"]  # the same content, so the same key, as before imports were keyed


def test_a_run_keyed_before_reward_imports_were_keyed_is_adopted_then_sees_its_helpers(tmp_path, monkeypatch):
    """Manifests from before a reward module's imports were keyed (its own file only) still count, with big files
    named by mtime too; adopting rewrites their keys, after which an edited helper reruns grpo."""
    venv = _reward_project(tmp_path, "old_rewards")
    monkeypatch.syspath_prepend(str(venv))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = _model_with_big_weights(tmp_path / "model")
    for case, contexts in (("own file", ()), ("own file and mtimes", (content.legacy_digests,))):
        cfg = _cfg(
            "grpo.reward_funcs=[old_rewards:score]", f"model.name={model}", f"storage.cache_dir={tmp_path / 'cache'}"
        )
        ws = Workspace(tmp_path / case)
        with reward_files_only(), contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            old = fingerprints(PIPELINE, cfg)
            _publish_all(ws, cfg)
        new = stage_keys(PIPELINE, cfg)
        assert new["grpo"] != key_of(old["grpo"])
        assert explain(PIPELINE, cfg, ws) == {}, case  # the old keys still count: nothing reruns
        adopted = adopt_legacy_keys(PIPELINE, cfg, ws)
        assert adopted == (["grpo", "eval", "export"] if not contexts else ["sft", "grpo", "eval", "export"]), case
        assert all(ws.read_manifest(s)["key"] == new[s] for s in PIPELINE.names)
    (tmp_path / "helpers.py").write_text("WEIGHT = 2.0\n")
    assert explain(PIPELINE, cfg, ws)["grpo"] == ["code: old_rewards (reward module, helpers.py) changed"]


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
