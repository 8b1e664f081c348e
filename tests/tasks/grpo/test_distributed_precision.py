"""FSDP2 with mixed precision: the policy the GRPO stage gives fully_shard, and 2 ranks training under it (the cases
of distributed_precision_cases.py, ONE torchrun launch with gloo, ~30 s on 2 cores)."""

import math

import pytest
import torch

from grpoflow.tasks.config import ModelConfig
from grpoflow.tasks.grpo.distributed import mixed_precision
from grpoflow.tasks.model.loading import train_dtypes
from tests.tasks.grpo.two_ranks import run_two_ranks


def test_the_policy_follows_the_training_dtypes():
    """bf16 compute over float32 shards with a float32 gradient reduction for full fine-tuning in bf16; nothing for
    LoRA (a bf16 base and float32 adapters, each gathered in its own dtype) nor for float32 training."""
    _, autocast = train_dtypes(ModelConfig(dtype="bfloat16"), use_lora=False)
    policy = mixed_precision(autocast)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(train_dtypes(ModelConfig(dtype="bfloat16"), use_lora=True)[1]) is None
    assert mixed_precision(train_dtypes(ModelConfig(dtype="float32"), use_lora=False)[1]) is None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision") / "two.pt"
    run_two_ranks("tests.tasks.grpo.distributed_precision_cases", str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_full_fine_tuning_in_bf16_computes_in_bf16_over_float32_shards(runs):
    r = runs["full-bf16"]
    assert r["policies"] and set(r["policies"]) == {(torch.bfloat16, torch.float32)}  # every layer and the root
    assert r["seen"] == [(torch.bfloat16,)]  # the unsharded weight inside the training forward
    assert r["trainable_dtypes"] == ["torch.float32"]  # the shards the optimizer steps
    assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"])
    assert r["moved"] > 1e-3


@pytest.mark.slow
def test_lora_in_bf16_keeps_its_adapters_float32(runs):
    r = runs["lora-bf16"]
    assert r["policies"] and set(r["policies"]) == {(None, None)}
    assert r["seen"] == [(torch.bfloat16, torch.float32)]  # the base gathered in bf16, the adapter in float32
    assert r["frozen_dtypes"] == ["torch.bfloat16"] and r["trainable_dtypes"] == ["torch.float32"]
    assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"])
    assert r["moved"] > 1e-3
