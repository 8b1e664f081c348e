"""Shows that tests/tasks/grpo/test_learning_regression.py catches the breaks it is meant to catch: runs its shortened
default run once as is and once per deliberate break, applied by patching the trainer module's names for the run
only (no product code changes), and prints each run's gain against the test's MARGIN.

    python -m tests.tasks.grpo.learning_breaks [seed [threads [break ...]]]   # from the repo root; minutes per run

advantage sign   group_advantages returns -A: the policy moves away from rewarded completions
pg term zeroed   grpo_loss gets A = 0: no policy-gradient term left (beta 0, no entropy bonus: zero loss)
frozen adapter   clip_and_step skips optimizer.step(): the LoRA weights never change
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

from grpoflow.tasks.grpo import trainer
from tests.tasks.grpo.test_learning_regression import MARGIN, gain, reward_curve

_group_advantages, _grpo_loss = trainer.group_advantages, trainer.grpo_loss


def negated_advantages(*args, **kwargs):
    adv, stats = _group_advantages(*args, **kwargs)
    return -adv, stats


def zero_pg_loss(logp, old, advantages, *args, **kwargs):
    return _grpo_loss(logp, old, torch.zeros_like(advantages), *args, **kwargs)


def no_update(model, optimizer, scheduler, max_grad_norm):
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


BREAKS = {
    "none": nullcontext,
    "advantage sign": lambda: mock.patch.object(trainer, "group_advantages", negated_advantages),
    "pg term zeroed": lambda: mock.patch.object(trainer, "grpo_loss", zero_pg_loss),
    "frozen adapter": lambda: mock.patch.object(trainer, "clip_and_step", no_update),
}


def main(seed: int = 42, threads: int = 1, *names: str) -> None:
    for name, make in BREAKS.items():
        if names and name not in names:
            continue
        with make(), tempfile.TemporaryDirectory() as tmp:
            curve = reward_curve(Path(tmp) / "ws", seed=seed, threads=threads)
        verdict = "passes" if gain(curve) > MARGIN else "FAILS"
        shown = " ".join(f"{r:.2f}" for r in curve)
        print(f"{name:15s} gain {gain(curve):+.3f} (margin {MARGIN}): the test {verdict}; rewards {shown}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(a) for a in args[:2]), *args[2:])
