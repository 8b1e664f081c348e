"""SFT loss step: the head on labelled positions only (ours) vs every position's logits (the textbook form), under
the benchmark protocol (benchmarks/protocol.py, docs/benchmarks.md).

    labelled   tasks/stages/sft.py labelled_token_loss: the output projection only where the next token is labelled
    full       the model's logits at every position, then cross-entropy with ignore_index (the baseline)

Both compute the same summed next-token cross-entropy of the same micro-batch (--batch chat-templated arithmetic
prompts with the XML system prompt, completion-only labels) and its backward through a LoRA (r16, all linear layers)
model in float32, with --threads torch threads. Each side of each round is a fresh process (labelled, full,
labelled, full, ...; --rounds >= 2), gated on a quiet machine; it reports its set-up (imports, model loading) and
its first forward + backward (time, and its memory peak: the resident-memory high-water mark, VmHWM reset through
/proc/self/clear_refs before the call, above the resident memory before it) apart from the --reps timed steps,
and its process's wall time and max RSS. Then the per-round speed-ups full / labelled (step time) and the ratio
of the first-call peaks, with their spread, and a RESULTS.md row.

    python benchmarks/bench_sft_loss.py --model smollm2-135m-instruct    # the real model (fetched once)
    python benchmarks/bench_sft_loss.py --model tiny --batch 16 --reps 5
    python benchmarks/bench_sft_loss.py --model tiny --batch 2 --reps 1 --allow-contended --wait 0   # smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402
from bench_trl_throughput import arithmetic_rows, model_folder  # noqa: E402

SIDES = ("labelled", "full")


def full_logits_loss(model, ids, labels, mask):
    import torch

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


def peak_above_start(fn) -> float:
    """MiB the resident set rose above its start at its highest while ``fn()`` ran (protocol.peak_above_start)."""
    return protocol.peak_above_start(fn)[1]


def model_cli(doc: str) -> argparse.ArgumentParser:
    """The options the step benchmarks share: the model, its cache, repetitions, threads, the protocol's."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "grpoflow" / "models"))
    ap.add_argument("--reps", type=int, default=3, help="timed steps per side process, after the first step")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every side (2)")
    protocol.add_protocol_args(ap)
    for hidden in ("--side", "--folder"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    return ap


def lora_model(args: argparse.Namespace, rows: list[dict]):
    """(tokenizer, model): ``args.folder`` (else ``args.model``, resolved) with LoRA r16 (alpha 32) on all linear
    layers, float32, on the CPU, with ``args.threads`` torch threads."""
    import torch

    from grpoflow.tasks.config import ModelConfig
    from grpoflow.tasks.model.loading import load_tokenizer, load_trainable

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        folder = args.folder or model_folder(args.model, args.cache_dir, rows, Path(work))
        lora = {"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"}
        mcfg = ModelConfig(name=folder, dtype="float32", lora=lora)
        return load_tokenizer(folder, mcfg), load_trainable(folder, mcfg, True, torch.device("cpu"))


def run_in_sides(args, sides: list[str], work_rows: list[dict]) -> list[protocol.SideRun]:
    """The parent's part for the step benchmarks: the model folder made once, then the protocol's alternating
    rounds, each side this script again with every option the parent got plus --side and --folder."""
    protocol.check_rounds(args)
    print(f"machine now: {protocol.quiet_now()}, {protocol.machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, args.cache_dir, work_rows, Path(tmp))
        script = sys.argv[0]
        return protocol.alternate(
            args, sides, lambda side: [sys.executable, script, *sys.argv[1:], "--side", side, "--folder", folder]
        )


def run_side(args: argparse.Namespace, setup_side) -> None:
    """The body of a side process of the step benchmarks: ``setup_side(args)`` gives (the call to time, what the side
    computes); the protocol times the call (protocol.measure_calls) and the side's facts join its result."""

    def measure() -> dict:
        made = {}
        res = protocol.measure_calls(lambda: made.setdefault("s", setup_side(args))[0], args.reps, args.threads)
        return res | made["s"][1]

    protocol.side_main(measure)


def sft_rows(batch: int) -> list[dict]:
    rows = arithmetic_rows(batch, seed=1)
    for r in rows:
        r["reference"] = (
            f"<reasoning>\nCompute {r['question'][8:-1]}.\n</reasoning>\n<answer>\n{r['answer']}\n</answer>"
        )
    return rows


def setup_side(args):
    from grpoflow.tasks.stages.sft import collate, labelled_token_loss, tokenize_sft

    rows = sft_rows(args.batch)
    tok, model = lora_model(args, rows)
    ids, labels, mask = collate(tokenize_sft(rows, tok, 128, True)[0], tok.pad_token_id)
    loss = labelled_token_loss if args.side == "labelled" else full_logits_loss
    shape = {"tokens": int(ids.numel()), "labelled": int((labels[:, 1:] != -100).sum()), "vocab": len(tok)}

    def call() -> None:
        loss(model, ids, labels, mask).backward()
        model.zero_grad(set_to_none=True)

    return call, shape


def main() -> None:
    ap = model_cli(__doc__)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    if args.side:
        return run_side(args, setup_side)
    runs = run_in_sides(args, list(SIDES), sft_rows(args.batch))
    ok = [r.result for r in runs if not r.error]
    shape = f"{ok[0]['tokens']} tokens, {ok[0]['labelled']} labelled, vocab {ok[0]['vocab']}" if ok else "?"
    print(f"\n== SFT loss step, model {args.model}: batch {args.batch} ({shape}), forward + backward through LoRA, "
          f"{args.threads} torch threads on both sides, {args.rounds} rounds x {args.reps} timed steps")  # fmt: skip
    print("  labelled: the head on labelled positions only (labelled_token_loss); full: every position's logits")
    protocol.print_calls(runs)
    protocol.print_rounds(runs)
    speed = protocol.compare(runs, "labelled", "full", lambda d: 1 / d["median_s"], "labelled/full (steps/s)")
    mem = protocol.compare(runs, "labelled", "full", lambda d: d["first_peak_mib"], "labelled/full first-call peak")
    result = (f"SFT loss {args.model} batch {args.batch}: labelled/full steps/s {speed['median']:.2f}x, first-call "
              f"peak {mem['median']:.2f}x" if speed["per_round"] else "SFT loss: no ratio (a side failed)")  # fmt: skip
    print("RESULTS.md row:\n" + protocol.results_row(runs, f"{args.threads}/-", result, speed))


if __name__ == "__main__":
    main()
