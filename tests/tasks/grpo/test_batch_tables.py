"""The seed's four "GRPO batch examples" (Unsloth advanced RL documentation), reproduced.

Each table lists, per generation cycle, the micro-steps, the prompt of every completion in the
micro-batch, and where the optimizer steps. The plan is checked against the tables, then the real
GRPOTrainer (tiny model, real generation) is run on examples 1 and 3 and its micro-batches are
checked against the same tables. Example 3 follows its own arithmetic: 12 completions / 4
generations = 3 prompts per cycle, so cycle A holds prompts 0..2 and cycle B prompts 3..5 (the
seed's table prints "3" for prompt 2 and numbers cycle B 4..6).
"""

from collections import Counter

import pytest
import torch

from grpoflow.tasks.config import GRPOConfig
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
from grpoflow.tasks.grpo.schedule import plan
from grpoflow.tasks.grpo.trainer import GRPOTrainer
from grpoflow.tasks.grpo.trainer_runtime import TrainerRuntime
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.tasks.grpo.test_trainer import addition_rows, length, make

# (GRPOConfig keywords, the tables: per cycle, per micro-step (prompts of the batch, optimizer steps after it))
EXAMPLES = {
    "1: pdb 3, GA 2, spg 4, G 3": (
        dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, steps_per_generation=4, num_generations=3),
        [
            [((0, 0, 0), False), ((1, 1, 1), True), ((2, 2, 2), False), ((3, 3, 3), True)],
            [((4, 4, 4), False), ((5, 5, 5), True), ((6, 6, 6), False), ((7, 7, 7), True)],
        ],
    ),
    "2: pdb 3, spg = GA = 4, G 3": (
        dict(per_device_train_batch_size=3, gradient_accumulation_steps=4, num_generations=3),
        [
            [((0, 0, 0), False), ((1, 1, 1), False), ((2, 2, 2), False), ((3, 3, 3), True)],
            [((4, 4, 4), False), ((5, 5, 5), False), ((6, 6, 6), False), ((7, 7, 7), True)],
        ],
    ),
    "3: pdb 3, spg = GA = 4, G 4": (
        dict(per_device_train_batch_size=3, gradient_accumulation_steps=4, num_generations=4),
        [
            [((0, 0, 0), False), ((0, 1, 1), False), ((1, 1, 2), False), ((2, 2, 2), True)],
            [((3, 3, 3), False), ((3, 4, 4), False), ((4, 4, 5), False), ((5, 5, 5), True)],
        ],
    ),
    "4: pdb 6, spg = GA = 2, G 3": (
        dict(per_device_train_batch_size=6, gradient_accumulation_steps=2, num_generations=3),
        [
            [((0, 0, 0, 1, 1, 1), False), ((2, 2, 2, 3, 3, 3), True)],
            [((4, 4, 4, 5, 5, 5), False), ((6, 6, 6, 7, 7, 7), True)],
        ],
    ),
}
UNIQUE_PROMPTS = {"1": 4, "2": 4, "3": 3, "4": 4}


def flatten(tables):
    return [(c, step, prompts, opt) for c, rows in enumerate(tables) for step, (prompts, opt) in enumerate(rows)]


@pytest.mark.parametrize("name", EXAMPLES)
def test_plan_reproduces_the_table(name):
    kwargs, tables = EXAMPLES[name]
    b = GRPOConfig(**kwargs).batching()
    assert b.generation_batch_size == 12
    assert b.unique_prompts == UNIQUE_PROMPTS[name[0]]
    got = plan(b, kwargs["num_generations"], rounds=2)
    assert [(s.round, s.step, s.prompts, s.optimizer_step) for s in got] == flatten(tables)
    assert [s.new_round for s in got] == [step == 0 for _, step, _, _ in flatten(tables)]


@pytest.mark.parametrize("name", EXAMPLES)
def test_shuffled_rounds_keep_each_cycles_prompts_and_the_optimizer_steps(name):
    """TRL shuffles a round's completions before splitting it: the tables' cycles hold the same
    prompts (as multisets) and the optimizer steps at the same micro-steps."""
    kwargs, tables = EXAMPLES[name]
    b = GRPOConfig(**kwargs).batching()
    g = torch.Generator().manual_seed(0)
    orders = [torch.randperm(b.generation_batch_size, generator=g) for _ in range(2)]
    got = plan(b, kwargs["num_generations"], 2, orders)
    for cycle, rows in enumerate(tables):
        planned = [s for s in got if s.round == cycle]
        assert Counter(p for s in planned for p in s.prompts) == Counter(p for prompts, _ in rows for p in prompts)
        assert [s.optimizer_step for s in planned] == [opt for _, opt in rows]
    assert any(s.prompts != p for s, (_, _, p, _) in zip(got, flatten(tables)))  # the shuffle did reorder


class RecordingTrainer(GRPOTrainer):
    """The real trainer; records the dataset prompt of every completion each micro-step trains on."""

    trace: list  # (starts a round, prompts of the micro-batch, optimizer steps taken before it)

    def _micro_step(self, r, idx, iteration):
        prompts = tuple(int(r.samples[i]["question"].split("+")[0]) for i in idx.tolist())  # addition_rows: "a+a"
        self.trace.append((r.position == 0, prompts, self.step))
        super()._micro_step(r, idx, iteration)


@pytest.mark.parametrize("name", [n for n in EXAMPLES if n[0] in "13"])
def test_the_trainer_follows_the_table(tmp_path, name):
    kwargs, tables = EXAMPLES[name]
    cfg = GRPOConfig(
        **kwargs,
        max_steps=sum(opt for rows in tables for _, opt in rows),  # two cycles
        shuffle_dataset=False,
        shuffle_generation_batch=False,
        max_completion_length=4,
        learning_rate=1e-3,
        save_steps=100,
    )
    tok, model = make()
    rows, prompts = addition_rows(tok, 8)
    rt = TrainerRuntime(
        model, tok, rows, prompts, [("length", length)], TransformersGenerator(model, tok), RunLogger.disabled(),
        tmp_path,
    )  # fmt: skip
    trainer = RecordingTrainer(cfg, rt, seed=0)
    trainer.trace = []
    trainer.train()
    want, steps_before = [], 0
    for _, step, prompts_, opt in flatten(tables):
        want.append((step == 0, prompts_, steps_before))
        steps_before += opt
    assert trainer.trace == want
    assert trainer.step == steps_before
