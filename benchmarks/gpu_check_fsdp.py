"""The FSDP2 case of benchmarks/gpu_check.py: gradient accumulation under FSDP2 on one device, in a world-size-1
process group (the only group one GPU allows).

The model is sharded as a real FSDP2 run shards it (tasks/grpo/distributed.py: fully_shard per decoder layer, then
the root, with mixed_precision(bf16): bf16 compute, float32 reduce), trained under bf16 autocast for MICRO_STEPS
micro-steps inside gradient_sync(root, enabled=last), as the trainer does. What one device can show:

- after every micro-step, the final one or not, each trainable parameter holds a sharded gradient (a DTensor):
  the micro-step reduce-scattered into the sharded ``.grad``. FSDP2 with ``set_requires_gradient_sync(False)``
  would leave ``.grad`` None and hold an unsharded float32 gradient per layer until the last micro-step instead
  (issue 41): the check fails then, even at world size 1;
- on CUDA, the memory allocated after micro-step 1 and after the last differ by less than a tenth of the sharded
  gradient's bytes: nothing grows across the accumulation window;
- the accumulated gradient equals the unsharded model's (the same micro-batches under autocast, summed by
  autograd) within GRAD_REL_TOL of its largest entry: the sum over micro-steps is complete. The report also has
  the error the unsharded sum without its last micro-step would show ("lost_micro_step_rel_err"); the case fails
  when that is within the tolerance too (the comparison could not tell a lost micro-step).

What it cannot show: the 1/world share of gradient memory (world size 1 shards nothing: the shard is the whole
gradient). tests/ has the 2-process gloo test of that; on GPUs it needs two of them.
"""

from __future__ import annotations

import copy

import torch
from gpu_check_kernels import Skip, allocated

MICRO_STEPS = 3
GRAD_REL_TOL = 0.1  # bf16 compute in two orders; a lost micro-step is off by about 1/MICRO_STEPS of the sum or more


def _model(setup, device: torch.device):
    """A float32 model of a few decoder layers (full fine-tuning: float32 master weights, bf16 autocast); on CUDA
    wide enough (~50M parameters, a 200 MB float32 gradient) that a held unsharded gradient shows in the bytes."""
    from grpoflow.tasks.config import TinyModelConfig
    from grpoflow.tasks.model.tiny import build_tiny_model

    cfg = TinyModelConfig()
    if device.type == "cuda":
        cfg = TinyModelConfig(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4
        )
    return build_tiny_model(cfg, setup.tok, seed=0).to(device)


def _micro_batches(vocab: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (4, 24), generator=g).to(device) for _ in range(MICRO_STEPS)]


def _loss(model, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids).loss / MICRO_STEPS


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def fsdp2_one_device_case(setup, device: torch.device) -> dict:
    """Shard, accumulate MICRO_STEPS micro-steps, check the three things of the module docstring."""
    import torch.distributed as dist

    if not dist.is_available():
        raise Skip("torch.distributed is not built into this torch")
    if dist.is_initialized():
        raise Skip("a process group already exists in this process: a world-size-1 group cannot be made beside it")
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        raise Skip(f"{device} is not the current device: init_device_mesh would put the mesh on another GPU")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        raise Skip("this torch has no NCCL: FSDP2 on a GPU needs it")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from grpoflow.tasks.grpo.distributed import decoder_layers, gradient_sync, mixed_precision

    model = _model(setup, device)
    reference = copy.deepcopy(model)
    batches = _micro_batches(model.config.vocab_size, device)
    partial = {}
    for i, ids in enumerate(batches):  # the unsharded model: autograd sums the micro-steps into .grad
        if i == MICRO_STEPS - 1:  # the sum without the last micro-step: what a lost one would give
            partial = {n: p.grad.float().clone() for n, p in reference.named_parameters() if p.grad is not None}
        _loss(reference, ids, device).backward()
    ref = {n: p.grad.float() for n, p in reference.named_parameters() if p.grad is not None}
    lost = max(((ref[n] - partial[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item() for n in partial)
    del reference

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device.type, (1,))
        policy = mixed_precision(torch.bfloat16)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        base = allocated(device)
        sharded, after = [], []
        for i, ids in enumerate(batches):
            with gradient_sync(model, enabled=i == MICRO_STEPS - 1):
                _loss(model, ids, device).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            sharded.append(all(isinstance(p.grad, DTensor) for _, p in trainable))
            after.append(allocated(device) - base)
        grad_bytes = sum(
            _local(p.grad).numel() * _local(p.grad).element_size() for _, p in trainable if p.grad is not None
        )
        worst = 0.0
        for n, p in trainable:
            if p.grad is None:
                continue
            got = p.grad.full_tensor().float() if isinstance(p.grad, DTensor) else p.grad.float()
            want = ref[_strip(n, ref)]
            worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    finally:
        dist.destroy_process_group()
    out = {
        "backend": backend,
        "world_size": 1,
        "micro_steps": MICRO_STEPS,
        "grads_sharded_after_each_micro_step": sharded,
        "sharded_grad_bytes": grad_bytes,
        "allocated_growth_after_each_micro_step": after if device.type == "cuda" else None,
        "grad_rel_err_vs_unsharded": worst,
        "tolerance": GRAD_REL_TOL,
        "lost_micro_step_rel_err": lost,
        "not_shown": "1/world of the gradient memory: world size 1 shards nothing (a 2-GPU check)",
    }
    bad = []
    if not all(sharded):
        bad.append(f"a micro-step left unsharded gradients (.grad not a DTensor after steps {sharded})")
    if device.type == "cuda" and abs(after[-1] - after[0]) > 0.1 * grad_bytes:
        bad.append(f"memory grew across micro-steps: {after} bytes (sharded gradient {grad_bytes})")
    if not worst <= GRAD_REL_TOL:
        bad.append(f"accumulated gradient off the unsharded one by {worst:.3g} of its largest entry")
    if not lost > GRAD_REL_TOL:
        bad.append(f"a lost micro-step would be off by only {lost:.3g}: the tolerance {GRAD_REL_TOL} cannot tell")
    if bad:
        out.update(status="failed", reason="; ".join(bad))
    return out


def _strip(name: str, ref: dict) -> str:
    """The unsharded model's name of parameter ``name`` (fully_shard keeps the names; a wrapper prefix, if any,
    is dropped)."""
    if name in ref:
        return name
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name
