"""The GRPO sections of benchmarks/gpu_check.py: grpoflow's GRPOTrainer on the device with the transformers
generation backend, a tiny model, a few optimizer steps, and a checkpoint round trip.

Each training case runs the trainer twice from the same seed:

    A  steps 1..3, a checkpoint after each step (rounds of two optimizer steps: checkpoint-1 is mid-round)
    B  a fresh trainer loads checkpoint-1, then runs steps 2..3

and compares B with A: step 2's loss (from the restored round and weights: bitwise), step 3's loss (after a
backward in each run: within LATER_LOSS_TOL) and the completions of the round that step 3 generated (sampled with
the restored torch/CUDA RNG: token for token). Identical means the checkpoint holds everything the run needs, the
CUDA RNG included.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from gpu_check_kernels import Case, Skip, peak, reset_peak, sync

RESUME_FROM = 1  # checkpoint-1: after the first optimizer step, inside the first round
STEPS = 3
# The first step after the resume replays the restored round on the restored weights: bitwise equal. Later steps
# follow a backward in each run, which CUDA may sum in another order (atomics): equal within this relative bound.
LATER_LOSS_TOL = 1e-4


class _Tracker:
    """What GRPOTrainer logs, dropped (no MLflow on a bare GPU machine)."""

    def log_metrics(self, metrics, step=None):
        pass

    def log_table(self, table, name):
        pass


def arithmetic_rows(n: int, seed: int) -> list[dict]:
    """Rows of the built-in task's shape: a chat prompt, the answer, the reference completion."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        ref = f"<reasoning>\n{a} + {b} = {a + b}\n</reasoning>\n<answer>\n{a + b}\n</answer>"
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b), "ref": ref})
    return rows


def digit_share(prompts, completions, **columns) -> list[float]:
    """A reward that varies between an untrained model's completions (the share of digits in the text), so that
    advantages are not all 0 and the optimizer steps move the weights."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


class Setup:
    """The rows and tokenizer every GRPO case shares (built once per section)."""

    def __init__(self):
        from transformers.utils import logging as hf_logging

        from grpoflow.tasks.model.loading import prompt_ids
        from grpoflow.tasks.model.tiny import train_tiny_tokenizer

        self.rows = arithmetic_rows(64, seed=1)
        self.tok = train_tiny_tokenizer([r["prompt"][0]["content"] + "\n" + r["ref"] for r in self.rows], 300)
        self.prompts = [prompt_ids(self.tok, r["prompt"]) for r in self.rows]
        hf_logging.disable_progress_bar()  # "Writing model shards" at every checkpoint


def tensors_of(trainer) -> list[torch.Tensor]:
    """Every parameter, gradient, optimizer state tensor and tensor of the round in progress."""
    params = list(trainer.model.parameters())
    out = params + [p.grad for p in params if p.grad is not None]
    out += [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    if trainer.round is not None:
        r = trainer.round
        fields = [getattr(r.batch, f) for f in r.batch.__dataclass_fields__]
        extra = [r.advantages, r.old_logp, r.ref_logp, r.is_ratio]
        out += [t for t in fields + extra if torch.is_tensor(t)]
    return out


def misplaced(trainer, device: torch.device) -> list[str]:
    """Devices other than ``device`` (index included: cuda:0 is not cuda:1) holding the trainer's tensors."""
    return sorted({str(t.device) for t in tensors_of(trainer) if t.device != device})


def build_model(kind: str, setup: Setup, device: torch.device, small: bool):
    """(model, autocast dtype) of a case: the tiny model trained in full with float32 weights and bf16 autocast,
    or a bf16 base with float32 LoRA adapters trained under bf16 autocast, as a real LoRA run on a bf16 base trains
    (tasks/model/loading.compute_dtype -> precision.lora_autocast_dtype; the trainer enters train_precision: autocast
    with peft's input casting off); 'qwen_shape' is Qwen2.5-0.5B's shape from config (random weights, its 151936
    vocabulary; toy dimensions with --small)."""
    from grpoflow.tasks.config import LoraConfig, TinyModelConfig
    from grpoflow.tasks.model.loading import add_lora
    from grpoflow.tasks.model.precision import lora_autocast_dtype
    from grpoflow.tasks.model.tiny import build_tiny_model

    torch.manual_seed(0)
    if kind == "full_bf16_autocast":
        return build_tiny_model(TinyModelConfig(), setup.tok, seed=0).to(device), torch.bfloat16
    if kind == "qwen_shape_lora" and not small:
        shape = TinyModelConfig(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
        )
    elif kind == "qwen_shape_lora":
        shape = TinyModelConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
        )
    else:
        shape = TinyModelConfig()
    model = build_tiny_model(shape, setup.tok, seed=0)
    if kind == "qwen_shape_lora" and not small:
        model.resize_token_embeddings(151936)  # ids past the tokenizer's decode to nothing: a speed check
    model = model.to(device=device, dtype=torch.bfloat16)
    autocast = lora_autocast_dtype("bfloat16", use_lora=True, load_in_4bit=False)  # what compute_dtype gives
    return add_lora(model, LoraConfig(r=16, alpha=32, target_modules="all-linear")), autocast


def grpo_settings(small: bool, max_steps: int, qwen: bool = False, entropy_coef: float = 0.0):
    """The cases' GRPO settings; ``entropy_coef`` > 0 turns the entropy bonus on (grpo.entropy_coef)."""
    from grpoflow.tasks.config import GRPOConfig

    return GRPOConfig(
        max_steps=max_steps,
        per_device_train_batch_size=8,
        generation_batch_size=16,  # two micro-batches per round: a checkpoint inside a round
        num_generations=4,
        learning_rate=1e-3,
        max_completion_length=(16 if small else 32) if not qwen else (16 if small else 128),
        reward_funcs=["correctness", "gpu_check_grpo:digit_share"],
        save_steps=1,
        log_completions=False,
        entropy_coef=entropy_coef,
    )


def make_trainer(
    kind: str, setup: Setup, device: torch.device, small: bool, max_steps: int, folder: Path, entropy_coef: float = 0.0
):
    from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
    from grpoflow.tasks.grpo.trainer import GRPOTrainer
    from grpoflow.tasks.grpo.trainer_runtime import TrainerRuntime
    from grpoflow.tasks.rewards import resolve_reward_funcs

    model, autocast = build_model(kind, setup, device, small)
    cfg = grpo_settings(small, max_steps, qwen=kind == "qwen_shape_lora", entropy_coef=entropy_coef)
    random.seed(0)
    torch.manual_seed(0)
    rt = TrainerRuntime(
        model,
        setup.tok,
        setup.rows,
        setup.prompts,
        resolve_reward_funcs(cfg.reward_funcs),
        TransformersGenerator(model, setup.tok),
        _Tracker(),
        folder,
        autocast_dtype=autocast,
    )
    return GRPOTrainer(cfg, rt, seed=0)


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.history}


def grpo_case(
    kind: str, setup: Setup, device: torch.device, small: bool, round_trip: bool = True, entropy_coef: float = 0.0
) -> dict:
    """Train ``kind`` on ``device`` (run A), check placement and that the optimizer stepped, then resume a fresh
    trainer from checkpoint-1 (run B) and compare it with A (module docstring)."""
    current_before = torch.cuda.current_device() if device.type == "cuda" else None
    folder = Path(tempfile.mkdtemp(prefix=f"gpu_check_{kind}_"))
    a = make_trainer(kind, setup, device, small, STEPS, folder, entropy_coef)
    a.pinned = lambda: [f"checkpoint-{RESUME_FROM}"]  # kept for run B (the trainer keeps only the newest two)
    start = {n: p.detach().clone() for n, p in a.model.named_parameters() if p.requires_grad}
    reset_peak(device)
    t0 = time.perf_counter()
    a.train()
    sync(device)
    seconds = time.perf_counter() - t0
    top = peak(device)
    wrong = misplaced(a, device)
    changed = any(not torch.equal(p.detach(), start[n]) for n, p in a.model.named_parameters() if n in start)
    steps_taken = [int(s["step"].item()) for s in a.optimizer.state.values() if "step" in s]
    h = a.history
    out = {
        "device": str(device),
        "parameters": sum(p.numel() for p in a.model.parameters()),
        "trainable": sum(t.numel() for t in start.values()),
        "weights_dtype": str(next(iter(start.values())).dtype).removeprefix("torch."),
        "autocast": str(a.autocast_dtype).removeprefix("torch.") if a.autocast_dtype else None,
        "entropy_coef": entropy_coef,
        "steps": len(h),
        "optimizer_steps": max(steps_taken, default=0),
        "weights_changed": changed,
        "losses": [x["loss"] for x in h],
        "rewards": [x["reward"] for x in h],
        "step_seconds": statistics.median(x["step_time"] for x in h),
        "seconds": seconds,
        "tokens_per_second": h[-1]["tokens_per_second"],
        "peak_gb": None if top is None else top / 2**30,
        "all_on_device": not wrong,
        "misplaced_on": wrong,
    }
    bad = [] if not wrong else [f"tensors on {wrong}, not {device}"]
    if not changed or out["optimizer_steps"] != STEPS:
        bad.append(f"optimizer: {out['optimizer_steps']} steps, weights changed {changed}")
    if not all(math.isfinite(x) for x in out["losses"]):
        bad.append(f"non-finite losses {out['losses']}")
    if round_trip:
        out.update(round_trip_check(kind, setup, device, small, a, folder))
        if not out["checkpoint_round_trip_identical"]:
            bad.append("the resumed run differs from the uninterrupted one")
    if device.type == "cuda":
        out["current_device_before"] = current_before
        out["current_device_after"] = torch.cuda.current_device()
    if bad:
        out.update(status="failed", reason="; ".join(bad))
    return out


def round_trip_check(kind: str, setup: Setup, device: torch.device, small: bool, a, folder: Path) -> dict:
    """Run B: a fresh trainer loads checkpoint-1 and trains to the end; compared with run A."""
    ckpt = folder / f"checkpoint-{RESUME_FROM}"
    if not (ckpt / "trainer_state.json").is_file():
        raise RuntimeError(f"run A wrote no {ckpt.name} (found {sorted(p.name for p in folder.iterdir())})")
    blob = torch.load(ckpt / "trainer_state.pt", weights_only=True, map_location="cpu")
    # B is built from seed 0 like A, so its RNG states at the load are those before round 1 was sampled, not A's at
    # checkpoint-1: only the checkpoint's (torch and CUDA) can make its next round's completions agree with A's
    b = make_trainer(kind, setup, device, small, STEPS, Path(tempfile.mkdtemp(prefix=f"gpu_check_{kind}_b_")))
    b.load_checkpoint(ckpt)
    b.train()
    la, lb = _losses(a), _losses(b)
    first, *later = [s for s in sorted(la) if s > RESUME_FROM]
    ra, rb = a.round, b.round
    same_tokens = ra is not None and rb is not None and torch.equal(ra.batch.completion_ids, rb.batch.completion_ids)
    later_diff = max((abs(la[s] - lb.get(s, float("nan"))) for s in later), default=0.0)
    later_close = all(abs(la[s] - lb.get(s, float("nan"))) <= LATER_LOSS_TOL * max(1.0, abs(la[s])) for s in later)
    placed = not misplaced(b, device)
    return {
        "resumed_from_step": RESUME_FROM,
        "cuda_rng_states_saved": len(blob["cuda_rng"]),
        "round_saved": blob["round"] is not None,
        "losses_after_resume": {str(s): [la[s], lb.get(s)] for s in (first, *later)},
        "first_loss_identical": la[first] == lb.get(first),
        "later_losses_max_diff": later_diff,
        "new_round_tokens_identical": same_tokens,
        "resumed_on_device": placed,
        "checkpoint_round_trip_identical": la[first] == lb.get(first) and same_tokens and later_close and placed,
    }


GRPO_KINDS = (("full_bf16_autocast", 20.0, True), ("lora", 20.0, True), ("qwen_shape_lora", 60.0, False))


def entropy_bonus_case(setup: Setup, device: torch.device, small: bool, without: dict | None) -> dict:
    """The Qwen-shaped LoRA run (bf16 base, bf16 autocast, its 151936 vocabulary) with the entropy bonus on
    (grpo.entropy_coef 0.01: the entropy's gradient through the fused kernels, entropy_grad=True), beside the same
    run without it (``without``, the qwen_shape_lora case): the peak memory with and without the bonus tells
    whether it builds [tokens, vocabulary] tensors (at 151936 a float32 [N, V] is 0.6 MB per token)."""
    out = grpo_case("qwen_shape_lora", setup, device, small, round_trip=False, entropy_coef=0.01)
    base = (without or {}).get("peak_gb")
    out["peak_gb_without_bonus"] = base
    if out.get("peak_gb") is not None and base:
        out["peak_ratio_bonus_over_without"] = out["peak_gb"] / base
    return out


def planned_pass_case(setup: Setup, device: torch.device, small: bool, reps: int = 3) -> dict:
    """The loss pass as the trainer plans it (tasks/grpo/micro_plan.py: the head on real tokens only, the rows of
    zero-advantage groups in a no-grad forward of their own) beside one forward of every row and position with a
    backward, on the Qwen-shaped LoRA model under its bf16 autocast: a round of the trainer's with half of its groups'
    advantages set to 0. The gradients must agree (the rows left out have none); the median time of ``reps`` passes
    and the peak memory of each tell what it saves on the device."""
    from grpoflow.tasks.grpo.batch import prompt_keys, root_logprobs
    from grpoflow.tasks.grpo.loss import grpo_loss, rows_with_gradient
    from grpoflow.tasks.grpo.micro_plan import micro_plan, planned_logprobs

    t = make_trainer("qwen_shape_lora", setup, device, small, 1, Path(tempfile.mkdtemp(prefix="gpu_check_plan_")))
    r = t.new_round()
    mb, adv = r.batch, r.advantages.clone()
    half = adv.numel() // 2
    adv[:half] = 0.0  # the first groups' rewards were all equal (rows are prompt-major)
    cpu = mb.to("cpu")
    trains = rows_with_gradient(adv.cpu(), t.settings, entropy_bonus=False)
    plan = micro_plan(prompt_keys(cpu.prompt_ids, cpu.prompt_mask), cpu.completion_mask, trains, True, device)
    params = [p for p in t.root.parameters() if p.requires_grad]
    n_items = float(cpu.completion_mask.sum())

    def one(planned: bool) -> list[torch.Tensor]:
        with t._autocast():
            if planned:
                logp, ent = planned_logprobs(t.root, mb, plan, t.cfg.temperature)
            else:
                logp, ent = root_logprobs(t.root, mb, t.cfg.temperature, compute_entropy=True)
        loss, _ = grpo_loss(logp.float(), None, adv, mb.completion_mask, t.settings, num_items_in_round=n_items)
        return list(torch.autograd.grad(loss, params))

    out: dict = {"rows": adv.numel(), "rows_with_gradient": int(trains.sum()),
                 "real_tokens": int(n_items), "positions": cpu.completion_mask.numel()}  # fmt: skip
    grads = {}
    for name, planned in (("planned", True), ("one_forward", False)):
        reset_peak(device)
        grads[name] = one(planned)
        top = peak(device)
        out[f"{name}_first_peak_gb"] = None if top is None else top / 2**30
        times = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            one(planned)
            sync(device)
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1e3 * statistics.median(times)
    out["one_forward_over_planned"] = out["one_forward_ms"] / out["planned_ms"]
    num = sum(float((a.float() - b.float()).norm() ** 2) for a, b in zip(grads["planned"], grads["one_forward"]))
    den = sum(float(b.float().norm() ** 2) for b in grads["one_forward"])
    out["gradient_rel_diff"] = math.sqrt(num / max(den, 1e-30))
    if not out["gradient_rel_diff"] <= 2e-2:  # bf16 autocast: the batch shapes differ, so does rounding
        out.update(status="failed", reason=f"planned gradients differ by {out['gradient_rel_diff']:.3g} (relative)")
    return out


def grpo_cases(device: torch.device, small: bool) -> list[Case]:
    """The training cases (GRPO_KINDS), the entropy bonus, the shared prompt gradient and FSDP2 on one device."""
    setup: list[Setup] = []
    results: dict[str, dict] = {}

    def ready() -> Setup:
        if not setup:
            setup.append(Setup())
        return setup[0]

    def run(kind: str, round_trip: bool) -> dict:
        results[kind] = grpo_case(kind, ready(), device, small, round_trip)
        return results[kind]

    def fsdp2() -> dict:
        import gpu_check_fsdp

        return gpu_check_fsdp.fsdp2_one_device_case(ready(), device)

    cases = [Case(k, lambda k=k, rt=rt: run(k, rt), est_s=est) for k, est, rt in GRPO_KINDS]
    bonus = Case(
        "entropy_bonus", lambda: entropy_bonus_case(ready(), device, small, results.get("qwen_shape_lora")), 60.0
    )
    shared = Case("shared_prompt_gradient", lambda: shared_prompt_gradient_case(device), est_s=2.0)
    planned = Case("planned_pass", lambda: planned_pass_case(ready(), device, small), est_s=20.0)
    return [*cases, bonus, shared, planned, Case("fsdp2_one_device", fsdp2, est_s=15.0)]


def repeatable_gradient(op, x: torch.Tensor, index: torch.Tensor, g: torch.Tensor, repeats: int = 5) -> bool:
    """Whether op(x, index)'s gradient wrt x is bitwise the same on every one of ``repeats`` calls."""
    first = None
    for _ in range(repeats):
        (grad,) = torch.autograd.grad(op(x, index), x, g)
        if first is None:
            first = grad
        elif not torch.equal(grad, first):
            return False
    return True


def shared_prompt_gradient_case(device: torch.device) -> dict:
    """The shared prompt forward's row expansion (tasks/grpo/batch.py expand_rows: a KV cache of 16 prompts out to
    64 interleaved rows, as grpo.share_prompt_forward does) sums each prompt's gradient in the same order on every
    call; the two torch ops it chooses between are recorded too (which is repeatable depends on the device)."""
    from grpoflow.tasks.grpo.batch import expand_rows

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 128, 64, generator=gen).to(device).requires_grad_()
    index = (torch.arange(64) % 16).to(device)
    g = torch.randn(64, 2, 128, 64, generator=gen).to(device)
    out = {
        "expand_rows_repeatable": repeatable_gradient(expand_rows, x, index, g),
        "getitem_repeatable": repeatable_gradient(lambda a, i: a[i], x, index, g),
        "index_select_repeatable": repeatable_gradient(lambda a, i: a.index_select(0, i), x, index, g),
    }
    if not out["expand_rows_repeatable"]:
        out.update(status="failed", reason="expand_rows' gradient differs between calls: reruns will differ")
    return out


def second_device_cases(device: torch.device, small: bool) -> list[Case]:
    """The same training cases on cuda:1 without torch.cuda.set_device: the current device stays cuda:0 (what a
    run with run.device cuda:1 meets when nothing sets it)."""
    if device.type != "cuda":
        reason = f"--device {device}: a second GPU is a CUDA check"
        return [Case(k, lambda r=reason: _skip(r)) for k, _, rt in GRPO_KINDS if rt]
    if torch.cuda.device_count() < 2:
        reason = f"{torch.cuda.device_count()} GPU visible"
        return [Case(k, lambda r=reason: _skip(r)) for k, _, rt in GRPO_KINDS if rt]
    kinds = {k for k, _, rt in GRPO_KINDS if rt} | {"shared_prompt_gradient"}
    return [c for c in grpo_cases(torch.device("cuda", 1), small) if c.name in kinds]


def _skip(reason: str) -> dict:
    raise Skip(reason)
