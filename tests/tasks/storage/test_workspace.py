"""The run workspace (tasks/storage/workspace.py) on both stores: a local folder and S3 (a real SeaweedFS server).
The same calls, the same outcomes; where the stores differ it is only in what a second machine (an empty cache)
sees."""

import json
import logging
import shutil
import uuid

import pytest

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage.store import LocalStore
from grpoflow.tasks.storage.workspace import (
    ATTEMPT,
    MANIFEST,
    CorruptManifest,
    Workspace,
    join_location,
    local_dir,
    reroot,
)


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "runs" / "r1")
    server = request.getfixturevalue("env")
    return f"s3://{server.bucket}/ws/{uuid.uuid4().hex[:8]}/r1"


def _open(location: str, cache) -> Workspace:
    return Workspace(location, StorageConfig(cache_dir=str(cache)))


def _is_local(ws: Workspace) -> bool:
    return isinstance(ws.store, LocalStore)


def test_publish_completed_and_forget(location, tmp_path):
    ws = _open(location, tmp_path / "c1")
    assert ws.location == location.rstrip("/") and ws.root == ws.store.local_root and ws.root.is_dir()
    assert repr(ws) == f"Workspace({ws.location!r})"
    ws.begin("sft", "k1")
    model = ws.stage_dir("sft") / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"w" * 64)
    (ws.stage_dir("base_model") / "config.json").write_text("{}")
    summary = {"model_path": str(model), "steps": 3}
    path = ws.publish("sft", "k1", summary, also=("base_model", "absent"), record={"note": "n"})
    assert path == ws.root / "sft" / MANIFEST and json.loads(path.read_text())["note"] == "n"
    assert ws.completed("sft", "k1") == summary and ws.completed("sft", "k2") is None
    manifest = ws.read_manifest("sft")
    assert manifest["key"] == "k1" and manifest["root"] == str(ws.root) and manifest["stage"] == "sft"

    # another machine (for S3 an empty cache): the summary's paths follow the workspace into its root
    other = _open(location, tmp_path / "c2")
    assert other.completed("sft", "k1") == {"model_path": str(other.root / "sft" / "model"), "steps": 3}
    other.fetch(("sft",), loose=("base_model",))
    assert (other.root / "sft" / "model" / "weights.bin").read_bytes() == b"w" * 64
    assert (other.root / "base_model" / "config.json").read_text() == "{}"  # published with sft (``also``)

    ws.forget(("sft",))
    assert ws.read_manifest("sft") is None and other.read_manifest("sft") is None
    assert json.loads(ws.store.read(f"sft/{ATTEMPT}"))["key"] == "k1"  # the attempt is kept
    ws.forget(("sft",), attempts=True)
    assert ws.store.read(f"sft/{ATTEMPT}") is None


def test_begin_empties_a_folder_of_another_key_and_keeps_one_of_the_same(location, tmp_path):
    ws = _open(location, tmp_path / "c1")
    ws.begin("grpo", "k1")
    ckpt = ws.stage_dir("grpo") / "checkpoints" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    ws.push("grpo", "checkpoints")

    again = _open(location, tmp_path / "c2")  # the same key, on another machine: the attempt's files come along
    again.begin("grpo", "k1")
    assert (again.root / "grpo/checkpoints/checkpoint-1/trainer_state.json").read_text() == "{}"
    assert json.loads(again.store.read(f"grpo/{ATTEMPT}"))["key"] == "k1"

    again.begin("grpo", "k2")  # another key: emptied, in the store and locally
    assert sorted(p.name for p in (again.root / "grpo").iterdir()) == [ATTEMPT]
    assert [e.name for e in again.store.list("grpo/")] == [f"grpo/{ATTEMPT}"]
    ws.begin("grpo", "k2")  # the first machine's copy of k1 goes too
    assert sorted(p.name for p in (ws.root / "grpo").iterdir()) == [ATTEMPT]


def test_begin_continues_an_attempt_whose_extents_were_raised(location, tmp_path):
    ws = _open(location, tmp_path / "c1")
    assert ws.begin("grpo", "k1", "c", {"grpo.max_steps": 4}) is None
    ckpt = ws.stage_dir("grpo") / "checkpoints" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    ws.push("grpo", "checkpoints")

    other = _open(location, tmp_path / "c2")  # raised on another machine: the checkpoints come along
    assert other.begin("grpo", "k2", "c", {"grpo.max_steps": 6}) == "continued"
    assert (other.root / "grpo/checkpoints/checkpoint-4/trainer_state.json").read_text() == "{}"
    assert json.loads(other.store.read(f"grpo/{ATTEMPT}"))["extents"] == {"grpo.max_steps": 6}
    assert ws.continues("grpo", "c", {"grpo.max_steps": 6}) and not ws.continues("grpo", "c", {"grpo.max_steps": 5})
    assert not ws.continues("grpo", "other", {"grpo.max_steps": 9})

    assert other.begin("grpo", "k3", "c", {"grpo.max_steps": 5}) == "removed"  # lowered: starts over
    assert [e.name for e in other.store.list("grpo/")] == [f"grpo/{ATTEMPT}"]


def test_fetch_restores_a_deleted_cache_and_moves_nothing_when_current(location, tmp_path):
    ws = _open(location, tmp_path / "c1")
    ws.begin("data", "k")
    (ws.stage_dir("data") / "train.jsonl").write_text("row\n")
    ws.publish("data", "k", {"train": str(ws.root / "data" / "train.jsonl")})
    if not _is_local(ws):
        shutil.rmtree(ws.root)  # the mirror is a cache
    fresh = _open(location, tmp_path / "c1")
    fresh.fetch(("data", "sft"))  # sft was never published: skipped
    assert (fresh.root / "data" / "train.jsonl").read_text() == "row\n"
    assert json.loads((fresh.root / "data" / MANIFEST).read_text()) == fresh.read_manifest("data")
    mtime = (fresh.root / "data" / "train.jsonl").stat().st_mtime_ns
    fresh.fetch(("data",))
    assert (fresh.root / "data" / "train.jsonl").stat().st_mtime_ns == mtime


def test_run_level_files(location, tmp_path):
    ws = _open(location, tmp_path / "c1")
    assert ws.read_text("run.json") is None
    ws.write_text("run.json", '{"a": 1}')
    assert _open(location, tmp_path / "c2").read_text("run.json") == '{"a": 1}'
    assert (ws.root / "run.json").read_text() == '{"a": 1}'
    assert not [p for p in ws.root.iterdir() if p.name.endswith(".tmp")]


def _push(ws: Workspace, name: str, keep: int = 2) -> None:
    """A checkpoint's upload as a queued job runs it: published, then the older ones pruned."""
    for job in ws.checkpoint_jobs("grpo", "checkpoints", name, keep=keep):
        job()


def test_checkpoints_are_pruned_to_the_newest_complete_ones(location, tmp_path):
    ws = _open(location, tmp_path / "c1")
    folder = ws.stage_dir("grpo") / "checkpoints"
    for step in (1, 2, 3, 4):
        (folder / f"checkpoint-{step}").mkdir(parents=True)
        (folder / f"checkpoint-{step}" / "model.bin").write_text(str(step))
        if step != 3:  # checkpoint-3 never got its marker: incomplete
            (folder / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
        _push(ws, f"checkpoint-{step}")
    kept = {e.name.split("/")[2] for e in ws.store.list("grpo/checkpoints/")}
    assert kept == {"checkpoint-2", "checkpoint-4"}  # the newest two complete; the incomplete 3 below 4 goes too
    shutil.rmtree(folder / "checkpoint-2")  # the trainer pruned it locally meanwhile: no error either way
    _push(ws, "checkpoint-4")


def test_reroot_and_locations(tmp_path, env):
    assert reroot({"a": ["/old/x", "/older"], "b": 1}, "/old", "/new") == {"a": ["/new/x", "/older"], "b": 1}
    assert local_dir(tmp_path / "x") == (tmp_path / "x").resolve()
    assert local_dir("s3://bkt/runs/r1", tmp_path) == tmp_path.resolve() / "bkt" / "runs" / "r1"
    assert join_location("s3://bkt/runs", "r1") == "s3://bkt/runs/r1"
    assert join_location(tmp_path, "r1") == str(tmp_path.resolve() / "r1")


def test_local_pruning_by_the_trainer_and_a_queued_job_do_not_race_into_an_error(tmp_path):
    """For a local workspace a checkpoint job prunes the very folders the trainer prunes: whichever removes a file
    first, the other goes on."""
    import threading

    ws = _open(str(tmp_path / "r"), tmp_path / "cache")
    folder = ws.stage_dir("grpo") / "checkpoints"
    for step in (1, 2, 3):
        ckpt = folder / f"checkpoint-{step}"
        (ckpt / "shards").mkdir(parents=True)
        for i in range(300):
            (ckpt / "shards" / f"{i}.bin").write_text("x")
        (ckpt / "trainer_state.json").write_text("{}")
    trainer = threading.Thread(target=shutil.rmtree, args=(folder / "checkpoint-1",), kwargs={"ignore_errors": True})
    trainer.start()
    _push(ws, "checkpoint-3")
    trainer.join()
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-2", "checkpoint-3"]


def _checkpoint(folder, step: int, complete: bool = True) -> None:
    ckpt = folder / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.bin").write_bytes(bytes([step]) * 100)
    if complete:
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))


def test_a_resume_pull_keeps_local_checkpoints_not_yet_uploaded(location, tmp_path, caplog):
    """A stage killed with checkpoint uploads queued: its complete local checkpoints newer than the store's stay
    through the pull of the resumed attempt (the upload queue sends them: ``unpublished`` names them); an older
    local one the store pruned and an incomplete one go, as before."""
    ws = _open(location, tmp_path / "c1")
    ws.begin("grpo", "k1")
    folder = ws.stage_dir("grpo") / "checkpoints"
    for step in (1, 2):
        _checkpoint(folder, step)
        _push(ws, f"checkpoint-{step}", keep=1)  # the store keeps checkpoint-2
    _checkpoint(folder, 3)  # saved, never uploaded (killed with it queued)
    _checkpoint(folder, 4)
    _checkpoint(folder, 5, complete=False)  # killed while writing it
    again = _open(location, tmp_path / "c1")
    with caplog.at_level(logging.WARNING):
        again.begin("grpo", "k1")
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    left = sorted({name.split("/")[0] for name in files})
    if _is_local(ws):  # the folder is the store (_push pruned checkpoint-1 in it): nothing else moves
        assert left == ["checkpoint-2", "checkpoint-3", "checkpoint-4", "checkpoint-5"]
        assert again.unpublished("grpo", "checkpoints") == []
        return
    assert left == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]  # 1: pruned on S3; 5: incomplete
    for step in (3, 4):
        assert files[f"checkpoint-{step}/model.bin"] == bytes([step]) * 100
        assert json.loads(files[f"checkpoint-{step}/trainer_state.json"]) == {"step": step}
    assert "keeping local checkpoint(s) checkpoints/checkpoint-3, checkpoints/checkpoint-4" in caplog.text
    assert again.unpublished("grpo", "checkpoints") == ["checkpoint-3", "checkpoint-4"]
    _push(again, "checkpoint-3")
    assert again.unpublished("grpo", "checkpoints") == ["checkpoint-4"]
    third = _open(location, tmp_path / "c2")  # another machine: sees what reached S3
    third.begin("grpo", "k1")
    got = {p.parent.name for p in (third.root / "grpo/checkpoints").rglob("*") if p.is_file()}
    assert got == {"checkpoint-2", "checkpoint-3"}


def test_a_truncated_stage_manifest_is_a_named_error_and_the_stage_reruns(location, tmp_path, caplog):
    ws = _open(location, tmp_path / "c1")
    ws.begin("sft", "k1")
    ws.publish("sft", "k1", {"model_path": "x"})
    body = ws.store.read("sft/" + MANIFEST)
    ws.store.write("sft/" + MANIFEST, body[: len(body) // 2])
    with pytest.raises(CorruptManifest, match=r"sft/manifest.json: not valid JSON \(\d+ bytes; truncated"):
        ws.read_manifest("sft")
    with caplog.at_level(logging.WARNING):
        assert ws.completed("sft", "k1") is None
    assert "the stage sft counts as not complete and reruns" in caplog.text
