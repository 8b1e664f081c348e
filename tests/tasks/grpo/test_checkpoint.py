"""GRPO checkpoints that go wrong. Written to a disk that fills up: on a small tmpfs made for the test (root only;
skipped elsewhere), the write fails with CheckpointDiskFull naming the folder and the bytes free and needed, leaves
no partial folder, and the previous checkpoint stays intact and loadable. Damaged after a crash (trainer_state.json
truncated, a file cut short): a named CheckpointCorrupt, and a resume falls back to the checkpoint before it, or
starts from scratch when none is left. Written durably: every file fsynced before the rename, the folder after."""

import json
import logging
import os
import shutil
import subprocess

import pytest
import torch

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.checkpoint import CheckpointCorrupt, CheckpointDiskFull, folder_bytes, list_checkpoints
from tests.tasks.grpo.test_trainer import make, make_trainer


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs at tmp_path/disk, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _cfg(steps: int) -> GRPOConfig:
    return GRPOConfig(
        max_steps=steps,
        save_steps=100,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        reward_funcs=["proximity"],
    )


@pytest.mark.faults
def test_a_full_disk_fails_the_checkpoint_cleanly_and_keeps_the_previous_one(small_disk):
    tok, model = make()
    trainer = make_trainer(_cfg(1), tok, model, small_disk / "checkpoints")
    trainer.train()  # saves checkpoint-1: the last step's checkpoint (a raised max_steps trains on from it)
    first = list_checkpoints(small_disk / "checkpoints")[-1]
    assert first.name == "checkpoint-1"
    size = folder_bytes(first)
    assert 0 < size < 1024 * 1024, size
    filler = small_disk / "filler"
    with filler.open("wb") as f:  # leave half a checkpoint free
        free = shutil.disk_usage(small_disk).free
        f.write(b"\0" * (free - size // 2))
    trainer.cfg = _cfg(2)  # one more step, then a checkpoint that does not fit
    with pytest.raises(CheckpointDiskFull) as err:
        trainer.train()
    msg = str(err.value)
    assert err.value.errno == 28
    assert f"no space left on the device of {small_disk / 'checkpoints'} for checkpoint-2:" in msg, msg
    assert " MiB free after removing the partial checkpoint-2.tmp" in msg, msg
    assert f"about {size / 2**20:.1f} MiB needed (the size of checkpoint-1); checkpoint-1 is intact" in msg, msg
    assert sorted(p.name for p in (small_disk / "checkpoints").iterdir()) == ["checkpoint-1"]  # no partial folder
    assert list_checkpoints(small_disk / "checkpoints") == [first]

    tok2, model2 = make()
    other = make_trainer(_cfg(2), tok2, model2, small_disk / "checkpoints")
    other.load_checkpoint(first)  # the previous checkpoint is whole
    assert other.step == 1
    filler.unlink()  # space freed: the next save goes through
    assert trainer.save_checkpoint().name == "checkpoint-2"


# ---------------------------------------------------------------- damaged checkpoints: resume falls back
def _trained(tmp_path, steps: int = 3):
    """A short real run of ``steps - 1`` steps saving after every one, the last included (checkpoint-1 ..
    checkpoint-<steps - 1>)."""
    cfg = _cfg(steps - 1).model_copy(update={"save_steps": 1})
    tok, model = make()
    trainer = make_trainer(cfg, tok, model, tmp_path / "checkpoints")
    trainer.train()
    ckpts = list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == [f"checkpoint-{i}" for i in range(1, steps)]
    return cfg, ckpts


def _fresh(cfg, tmp_path):
    tok, model = make()
    return make_trainer(cfg, tok, model, tmp_path / "checkpoints"), model


def _trainable(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _saved(path) -> dict:
    return torch.load(path / "trainer_state.pt", weights_only=True)["trainable"]


def test_a_truncated_trainer_state_json_is_a_named_error(tmp_path):
    cfg, ckpts = _trained(tmp_path)
    state = ckpts[-1] / "trainer_state.json"
    state.write_bytes(state.read_bytes()[:40])
    trainer, _ = _fresh(cfg, tmp_path)
    with pytest.raises(CheckpointCorrupt) as err:
        trainer.load_checkpoint(ckpts[-1])
    assert not isinstance(err.value, json.JSONDecodeError)
    assert err.value.file == state and "checkpoint-2" in str(err.value) and "trainer_state.json" in str(err.value)
    assert "not valid JSON (40 bytes; truncated or corrupt)" in str(err.value)
    assert trainer.step == 0  # nothing was loaded


@pytest.mark.parametrize("damage", ["manifest", "weights", "adapter"])
def test_resume_falls_back_to_the_previous_checkpoint_when_the_newest_is_damaged(tmp_path, caplog, damage):
    cfg, ckpts = _trained(tmp_path)
    newest = ckpts[-1]
    if damage == "manifest":
        (newest / "trainer_state.json").write_text('{"step": 2, "micro')  # cut mid-write
        why = "trainer_state.json: not valid JSON"
    elif damage == "weights":
        blob = newest / "trainer_state.pt"
        blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
        why = "trainer_state.pt: "
    else:  # the save_pretrained output: not read on resume, but trainer_state.json lists its size
        adapter = next(newest.glob("adapter_model.*"))
        adapter.write_bytes(adapter.read_bytes()[:10])
        why = f"{adapter.name}: 10 bytes, "
    trainer, model = _fresh(cfg, tmp_path)
    with caplog.at_level(logging.WARNING):
        assert trainer.resume() == ckpts[0]
    msg = caplog.text
    assert f"skipping checkpoint {newest.name}, it cannot be resumed" in msg and why in msg, msg
    assert "resuming from checkpoint-1 instead" in msg, msg
    assert trainer.step == 1
    saved = _saved(ckpts[0])
    assert all(torch.equal(p, saved[n]) for n, p in _trainable(model).items())
    trainer.train()  # goes on from step 1 and writes checkpoint-2 anew, whole
    assert trainer.step == cfg.max_steps
    again, _ = _fresh(cfg, tmp_path)
    assert again.resume() == newest and again.step == 2


def test_resume_with_every_checkpoint_damaged_starts_from_scratch_and_says_so(tmp_path, caplog):
    cfg, ckpts = _trained(tmp_path)
    for path in ckpts:
        (path / "trainer_state.pt").write_bytes(b"")
    trainer, model = _fresh(cfg, tmp_path)
    before = _trainable(model)
    with caplog.at_level(logging.WARNING):
        assert trainer.resume() is None
    assert "skipping checkpoint checkpoint-2" in caplog.text and "resuming from checkpoint-1 instead" in caplog.text
    assert "skipping checkpoint checkpoint-1" in caplog.text and "GRPO starts from scratch" in caplog.text
    assert trainer.step == 0 and trainer.history == []
    assert all(torch.equal(p, before[n]) for n, p in _trainable(model).items())  # untouched by the failed loads


def test_a_checkpoint_records_its_file_sizes_and_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    cfg, ckpts = _trained(tmp_path, steps=2)
    state = json.loads((ckpts[0] / "trainer_state.json").read_text())
    on_disk = {p.relative_to(ckpts[0]).as_posix(): p.stat().st_size for p in ckpts[0].rglob("*") if p.is_file()}
    on_disk.pop("trainer_state.json")
    assert state["files"] == on_disk and "trainer_state.pt" in on_disk
    trainer, _ = _fresh(cfg, tmp_path)
    trainer.resume()
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    real_replace = os.replace
    at_rename: list[int] = []
    monkeypatch.setattr(os, "replace", lambda a, b: (at_rename.append(len(synced)), real_replace(a, b)))
    final = trainer.save_checkpoint()
    tmp = f"{final}.tmp"
    before = synced[: at_rename[0]]
    assert {f"{tmp}/{name}" for name in state["files"]} | {f"{tmp}/trainer_state.json", tmp} <= set(before)
    assert synced[at_rename[0] :] == [str(final.parent)]  # the rename made durable
