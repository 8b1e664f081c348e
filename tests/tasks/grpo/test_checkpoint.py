"""A GRPO checkpoint written to a disk that fills up: on a small tmpfs made for the test (root only; skipped
elsewhere), the write fails with CheckpointDiskFull naming the folder and the bytes free and needed, leaves no
partial folder, and the previous checkpoint stays intact and loadable."""

import shutil
import subprocess

import pytest

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.grpo.checkpoint import CheckpointDiskFull, folder_bytes, list_checkpoints
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
