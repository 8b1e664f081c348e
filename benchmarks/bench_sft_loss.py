"""SFT loss step: the head on labelled positions only (ours) vs every position's logits (the textbook form).

Both compute the same summed next-token cross-entropy of the same micro-batch (chat-templated arithmetic prompts
with the XML system prompt, completion-only labels) and its backward through a LoRA (r16, all linear layers)
model in float32. Alternating repetitions; prints the median seconds per forward+backward of each, the ratio,
and each one's first-call peak: the process's resident-memory high-water mark (VmHWM, reset before the call
through /proc/self/clear_refs) above its resident memory before the call.

    python benchmarks/bench_sft_loss.py --model smollm2-135m-instruct    # the real model (fetched once)
    python benchmarks/bench_sft_loss.py --model tiny --batch 16 --reps 5
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_trl_throughput import arithmetic_rows, model_folder


def full_logits_loss(model, ids, labels, mask) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_above_start(fn) -> float:
    """MiB the resident set rose above its start at its highest while ``fn()`` ran (freed heap memory is handed
    back to the system first, so what an earlier call left in malloc's free lists does not hide this one's)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    start = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - start) / 1024


def model_cli(doc: str) -> argparse.ArgumentParser:
    """The options the step benchmarks share: the model, its cache, repetitions, threads."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "grpoflow" / "models"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def lora_model(args: argparse.Namespace, rows: list[dict]):
    """(tokenizer, model): ``args.model`` with LoRA r16 (alpha 32) on all linear layers, float32, on the CPU."""
    from grpoflow.tasks.config import ModelConfig
    from grpoflow.tasks.model.loading import load_tokenizer, load_trainable

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        folder = model_folder(args.model, args.cache_dir, rows, Path(work))
        lora = {"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"}
        mcfg = ModelConfig(name=folder, dtype="float32", lora=lora)
        return load_tokenizer(folder, mcfg), load_trainable(folder, mcfg, True, torch.device("cpu"))


def main() -> None:
    ap = model_cli(__doc__)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()

    from grpoflow.tasks.model.loading import backbone_and_head
    from grpoflow.tasks.stages.sft import collate, labelled_token_loss, tokenize_sft

    rows = arithmetic_rows(args.batch, seed=1)
    for r in rows:
        r["reference"] = (
            f"<reasoning>\nCompute {r['question'][8:-1]}.\n</reasoning>\n<answer>\n{r['answer']}\n</answer>"
        )
    tok, model = lora_model(args, rows)
    ids, labels, mask = collate(tokenize_sft(rows, tok, 128, True), tok.pad_token_id)
    labelled = int((labels[:, 1:] != -100).sum())
    print(f"model {args.model}: batch {args.batch} x {ids.shape[1]} tokens, {labelled} labelled, vocab {len(tok)}")

    # one-time set-up (autograd, thread pools, the body's activations at this shape) through the part both share
    backbone_and_head(model)[0](input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    model.zero_grad(set_to_none=True)
    fns = {"full": full_logits_loss, "labelled": labelled_token_loss}
    times: dict[str, list[float]] = {k: [] for k in fns}
    first_peak: dict[str, float] = {}
    for rep in range(args.reps + 1):
        for name, fn in fns.items() if rep % 2 == 0 else reversed(fns.items()):
            t = time.perf_counter()
            peak = peak_above_start(lambda fn=fn: fn(model, ids, labels, mask).backward())
            elapsed = time.perf_counter() - t
            model.zero_grad(set_to_none=True)
            if rep == 0:
                first_peak[name] = peak
            else:
                times[name].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in fns:
        print(f"{k:9s} {med[k]:7.3f} s/step (median of {args.reps})  first-call peak {first_peak[k]:7.1f} MiB")
    print(f"ratio full / labelled: {med['full'] / med['labelled']:.2f}x")


if __name__ == "__main__":
    main()
