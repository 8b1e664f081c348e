"""GRPO loss pass: every row and position with a backward vs only what the loss uses (tasks/grpo/micro_plan.py).

``planned`` (what the trainer does on one process): the rows whose log-probs get a gradient (loss.rows_with_gradient:
advantage not 0, with beta 0 and no entropy bonus) go through the model with autograd; the others (a zero-advantage
group's) in a forward of their own under no_grad, for their values (the metrics); the head computes the real tokens
only. ``all``: one forward of every row with autograd and the head on every position of [B, C] (what the trainer
did before, and what TRL's and Liger's GRPO losses do). The same loss (dapo, beta 0, entropy computed for the
metrics), hence the same gradients, on both sides.

A round as the real-model config makes one: --groups prompts x 8 completions (chat-templated arithmetic prompts with
the XML system prompt, their real lengths; each group shares its prompt, whose forward runs once per group as the
trainer does), completions of random tokens with lengths drawn like a GRPO round's (uniform 8..max, a quarter
clipped at max), advantages drawn per row with --zero-groups of the groups' all 0 (a group whose rewards were
equal). Forward + backward through a LoRA (r16, all linear layers) model in float32 with --threads torch threads.

Under the benchmark protocol (benchmarks/protocol.py, docs/benchmarks.md): each side a fresh process, --rounds
rounds (>= 2) alternating, gated on a quiet machine. A side reports its set-up and first pass (time and first-call
peak) apart from the median of --reps timed passes, and the positions its head computed with and without a backward.

    python benchmarks/bench_head_rows.py --model smollm2-135m-instruct --zero-groups 0.25
    python benchmarks/bench_head_rows.py --model tiny --groups 1 --max-completion 12 --reps 1 \\
        --allow-contended --wait 0                                     # smoke run: checks the fields only
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402
from bench_sft_loss import lora_model, model_cli, run_in_sides, run_side  # noqa: E402
from bench_trl_throughput import arithmetic_rows  # noqa: E402

SIDES = ("planned", "all")
GROUP = 8  # completions a prompt (grpo.num_generations)


def setup_side(args):
    """The pass one side times, and what its head computes."""
    import torch

    from grpoflow.tasks.grpo.batch import PolicyLogProbs, build_round, prompt_keys, root_logprobs
    from grpoflow.tasks.grpo.loss import LossSettings, grpo_loss, rows_with_gradient
    from grpoflow.tasks.grpo.micro_plan import micro_plan, planned_logprobs
    from grpoflow.tasks.model.loading import prompt_ids

    rows = arithmetic_rows(args.groups, seed=2)
    tok, model = lora_model(args, rows)
    g = torch.Generator().manual_seed(0)
    n_max, B = args.max_completion, args.groups * GROUP
    lengths = [n_max if torch.rand((), generator=g) < 0.25 else int(torch.randint(8, n_max, (), generator=g))
               for _ in range(B)]  # fmt: skip
    completions = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in lengths]
    reasons = ["length" if n == n_max else "stop" for n in lengths]
    prompts = [prompt_ids(tok, rows[i // GROUP]["prompt"]) for i in range(B)]
    batch = build_round(prompts, completions, [[0.0] * n for n in lengths], reasons, tok.pad_token_id, False)
    zero = round(args.zero_groups * args.groups)
    adv = torch.randn(B, generator=g)
    adv[: zero * GROUP] = 0.0  # the first ``zero`` groups' rewards were all equal
    mask = batch.completion_mask
    s = LossSettings(loss_type="dapo")
    trains = rows_with_gradient(adv, s, entropy_bonus=False)
    plan = micro_plan(prompt_keys(batch.prompt_ids, batch.prompt_mask), mask, trains, True, "cpu")
    root = PolicyLogProbs(model)
    n_tokens = float(mask.sum())

    planned = args.side == "planned"

    def step() -> None:
        if planned:
            logp, ent = planned_logprobs(root, batch, plan, 1.0)
        else:
            logp, ent = root_logprobs(root, batch, 1.0, compute_entropy=True)
        loss, _ = grpo_loss(logp, None, adv, mask, s, num_items_in_round=n_tokens, entropy=ent)
        loss.backward()
        model.zero_grad(set_to_none=True)

    train_rows = int(trains.sum())
    if planned:
        free = int(plan.free.head_rows[1].numel()) if plan.free is not None else 0
        computed = {"rows_backward": train_rows, "head_backward": int(mask.sum()) - free, "head_values_only": free}
    else:
        computed = {"rows_backward": B, "head_backward": int(mask.numel()), "head_values_only": 0}
    shape = {"positions": int(mask.numel()), "real_tokens": int(mask.sum()), "zero_groups": zero, **computed}
    return step, shape | {"vocab": len(tok)}


def main() -> None:
    ap = model_cli(__doc__)
    ap.add_argument("--groups", type=int, default=8, help="prompts in the round, 8 completions each (8)")
    ap.add_argument("--max-completion", type=int, default=48)
    ap.add_argument("--zero-groups", type=float, default=0.25, help="fraction of groups with advantage 0 (0.25)")
    args = ap.parse_args()
    if args.max_completion < 9:
        ap.error(f"--max-completion {args.max_completion}: at least 9 (completion lengths are drawn from 8 up to it)")
    if not 0 <= args.zero_groups <= 1:
        ap.error(f"--zero-groups {args.zero_groups}: a fraction of the groups, between 0 and 1")
    if args.side:
        return run_side(args, setup_side)
    runs = run_in_sides(args, list(SIDES), arithmetic_rows(args.groups, seed=2))
    ok = {r.side: r.result for r in runs if not r.error}
    print(f"\n== GRPO loss pass, model {args.model}: {args.groups} prompts x {GROUP}, forward + backward through LoRA, "
          f"{args.threads} torch threads, {args.rounds} rounds x {args.reps} timed passes")  # fmt: skip
    for side, d in ok.items():
        print(f"  {side}: {d['positions']} positions, {d['real_tokens']} real tokens, {d['zero_groups']} "
              f"zero-advantage groups; {d['rows_backward']} rows with a backward; the head computed "
              f"{d['head_backward']} positions with a backward, {d['head_values_only']} values only "
              f"(vocabulary {d['vocab']})")  # fmt: skip
    protocol.print_calls(runs)
    protocol.print_rounds(runs)
    ratio = protocol.compare(runs, "planned", "all", lambda d: 1 / d["median_s"], "planned/all (passes/s)")
    protocol.compare(runs, "planned", "all", lambda d: d["first_peak_mib"], "planned/all first-call peak")
    result = (f"GRPO loss pass {args.model}, {args.groups}x{GROUP} rows, {args.zero_groups:.0%} zero-advantage groups: "
              f"planned / every row and position with a backward, passes/s {ratio['median']:.2f}x"
              if ratio["per_round"] else "GRPO loss pass: no ratio (a side failed)")  # fmt: skip
    print("RESULTS.md row:\n" + protocol.results_row(runs, f"{args.threads}/-", result, ratio))


if __name__ == "__main__":
    main()
