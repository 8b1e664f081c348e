"""First-call peak memory of the two loss steps issue 41 took off the [tokens, vocabulary] logits: before / after.

    grpo   a GRPO loss step with the entropy bonus (entropy_coef > 0: the entropy carries a gradient): the token
           log-probs and entropies of N = B*C completion tokens from hidden states [B, C, D] and the lm_head
           W [V, D], grpo_loss (bnpo) with the bonus, backward.
             reference  kernels.logprobs.token_logprobs_reference: float32 [N, V] logits, log_softmax, their
                        softmax and gradients (what tasks/grpo/batch.py called before)
             fused      token_logprobs(..., entropy_grad=True, impl="chunked"): the CPU kernel, one
                        [rows, vocabulary tile] block at a time, the entropy's gradient in its backward
    sft    an SFT loss step: summed cross-entropy of N labels (a quarter of the positions ignored, -100), backward.
             reference  float32 logits of the labelled rows + cross_entropy (tasks/stages/sft.py before)
             fused      kernels.logprobs.label_nll (the same kernels, -sum logp)

Hidden states need a gradient (the backbone's); the head is frozen (LoRA, the default) unless --trainable-head.
Under the benchmark protocol (benchmarks/protocol.py, docs/benchmarks.md): each (step, path) is a side in a fresh
process, --rounds rounds (>= 2) visiting them in turn, gated on a quiet machine (1-minute load < --max-load, else
wait, or run marked contended with --allow-contended), --threads torch threads. A side reports its set-up, its first
call's time and peak RSS growth over what was resident before it (inputs), the median of --repeats more calls, and
its process's max RSS. Then per step the per-round ratios fused / reference of the first-call peak and of the call
time, with their spread, and a RESULTS.md row (the GRPO step's peak ratio as its headline).

    python benchmarks/bench_entropy_sft_peak.py                  # N=2048 (B=8 x C=256), D=256, V=32768
    python benchmarks/bench_entropy_sft_peak.py --b 2 --c 8 --d 16 --v 256 --repeats 1 --allow-contended --wait 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402

STEPS = ("grpo", "sft")
PATHS = ("reference", "fused")


def make_call(step: str, path: str, b: int, c: int, d: int, v: int, trainable_head: bool):
    """Inputs for one side and the closure running its loss step (forward + backward), gradients dropped after."""
    import torch

    from grpoflow.kernels.logprobs import label_nll, token_logprobs, token_logprobs_reference
    from grpoflow.tasks.grpo.loss import LossSettings, grpo_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, c, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 2 / d**0.5).requires_grad_(trainable_head)
    targets = torch.randint(0, v, (b, c), generator=g)
    mask = torch.ones(b, c)
    mask[:, c - c // 4 :] = 0.0  # padding after each completion / unlabelled positions
    advantages = torch.randn(b, generator=g)
    settings = LossSettings(loss_type="bnpo")
    params = [t for t in (hidden, weight) if t.requires_grad]

    def grpo() -> None:
        if path == "reference":
            logp, ent = token_logprobs_reference(hidden.reshape(-1, d), weight, targets.reshape(-1))
            logp, ent = logp.view(b, c), ent.view(b, c)
        else:
            logp, ent = token_logprobs(hidden, weight, targets, compute_entropy=True, impl="chunked", entropy_grad=True)
        loss, _ = grpo_loss(logp, None, advantages, mask, settings, entropy=ent, entropy_coef=0.01)
        torch.autograd.grad(loss, params)

    labels = torch.where(mask.bool(), targets, -100)

    def sft() -> None:
        if path == "reference":
            keep = labels != -100
            logits = (hidden[keep] @ weight.t()).float()
            loss = torch.nn.functional.cross_entropy(logits, labels[keep], reduction="sum")
        else:
            loss = label_nll(hidden, weight, labels, impl="chunked")
        torch.autograd.grad(loss, params)

    return grpo if step == "grpo" else sft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=int, default=8, help="rows (8)")
    parser.add_argument("--c", type=int, default=256, help="tokens a row (256): N = b * c")
    parser.add_argument("--d", type=int, default=256, help="hidden size (256)")
    parser.add_argument("--v", type=int, default=32768, help="vocabulary (32768)")
    parser.add_argument("--trainable-head", action="store_true", help="the head takes a gradient too")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every side (2)")
    protocol.add_protocol_args(parser)
    parser.add_argument("--side", help=argparse.SUPPRESS)  # step@path
    a = parser.parse_args()
    shape = (a.b, a.c, a.d, a.v, a.trainable_head)
    if a.side:
        step, path = a.side.split("@")
        setup = lambda: make_call(step, path, *shape)  # noqa: E731
        return protocol.side_main(lambda: protocol.measure_calls(setup, a.repeats, a.threads))
    protocol.check_rounds(a)
    argv = ["--b", str(a.b), "--c", str(a.c), "--d", str(a.d), "--v", str(a.v), "--repeats", str(a.repeats)]
    argv += ["--threads", str(a.threads)] + (["--trainable-head"] if a.trainable_head else [])
    print(f"machine now: {protocol.quiet_now()}, {protocol.machine()}")
    sides = [f"{step}@{path}" for step in STEPS for path in PATHS]
    runs = protocol.alternate(a, sides, lambda side: [sys.executable, __file__, "--side", side, *argv])
    head = "trainable" if a.trainable_head else "frozen"
    print(f"\n== loss steps, N={a.b * a.c} tokens (B={a.b} x C={a.c}), D={a.d}, V={a.v}, {head} head, "
          f"{a.threads} torch threads, {a.rounds} rounds x {a.repeats} timed calls")  # fmt: skip
    protocol.print_calls(runs)
    protocol.print_rounds(runs)
    peak, time_of = (lambda d: d["first_peak_mib"]), (lambda d: d["median_s"])
    mem = {}
    for step in STEPS:
        fused, ref = f"{step}@fused", f"{step}@reference"
        mem[step] = protocol.compare(runs, fused, ref, peak, f"{step} fused/reference first-call peak")
        protocol.compare(runs, fused, ref, time_of, f"{step} fused/reference call time")
    result = (
        f"N={a.b * a.c} D={a.d} V={a.v} {head} head: fused/reference first-call peak, GRPO step with entropy bonus "
        f"{mem['grpo']['median']:.3f}x, SFT step {mem['sft']['median']:.3f}x"
    )
    print("RESULTS.md row:\n" + protocol.results_row(runs, f"{a.threads}/-", result, mem["grpo"]))


if __name__ == "__main__":
    main()
