"""A process that queues GRPO-like checkpoint uploads and then "trains" (sleeps): what the SIGTERM fault test
(test_uploads.py) starts and stops.

    python tests/tasks/storage/sigterm_uploads.py <s3 workspace> <cache dir> <checkpoints> <MiB each>

It writes each checkpoint into the workspace's mirror, queues its upload on the real UploadQueue
(Workspace.checkpoint_jobs, as the GRPO stage does) inside drain_on_sigterm, prints "queued" with what is
pending, and sleeps until signalled."""

import logging
import os
import sys
import time

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.storage.uploads import UploadQueue, drain_on_sigterm
from grpoflow.tasks.storage.workspace import Workspace


def main(location: str, cache: str, count: int, mib: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    ws = Workspace(location, StorageConfig(cache_dir=cache))
    ws.begin("grpo", "k1")
    folder = ws.stage_dir("grpo") / "checkpoints"
    queue = UploadQueue(ws.store.where, budget_s=60, max_pending=count)
    with drain_on_sigterm(queue):
        for step in range(1, count + 1):
            ckpt = folder / f"checkpoint-{step}"
            ckpt.mkdir(parents=True)
            (ckpt / "model.safetensors").write_bytes(os.urandom(mib * 2**20))
            (ckpt / "trainer_state.json").write_text(f'{{"step": {step}}}')
            queue.submit(ckpt.name, *ws.checkpoint_jobs("grpo", "checkpoints", ckpt.name, keep=count))
        print(f"queued; pending: {queue.pending()}", flush=True)
        time.sleep(600)  # training


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
