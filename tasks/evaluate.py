"""Evaluation stage: greedy accuracy and mean rewards on the held-out split, before and after GRPO.

"before" is the model GRPO started from (the SFT checkpoint, or the base model); "after" is
the GRPO result (base + adapter, or the fully fine-tuned model). Accuracy is the fraction of
rows whose <answer> equals the gold answer (the ``correctness`` reward > 0), whatever reward
functions the run trained with; those are reported too. One report: JSON + a Markdown table.
"""

from __future__ import annotations

import json
import logging
import time

from prefect import task

from tasks.config import PipelineConfig
from tasks.data import load_split
from tasks.generation import SamplingParams, TransformersGenerator
from tasks.modeling import load_causal_lm, load_tokenizer, load_with_adapter, prompt_ids
from tasks.progress import progress_bar
from tasks.rewards import BUILTIN_REWARDS, resolve_reward_funcs, score_completions
from tasks.stage import run_stage
from tasks.tracking import RunLogger
from tasks.workspace import Workspace

log = logging.getLogger(__name__)


def evaluate_model(
    model,
    tokenizer,
    rows: list[dict],
    reward_funcs,
    max_new_tokens: int,
    batch_size: int,
    label: str = "eval",
    max_prompt_length: int | None = None,
    threads: int | None = None,
) -> tuple[dict, list[dict]]:
    """Greedy-decode every row once (``threads``: torch threads while decoding); return metrics and samples."""
    gen = TransformersGenerator(model, tokenizer, batch_size, threads=threads)
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    texts: list[str] = []
    lengths: list[int] = []
    with progress_bar(f"eval {label}", len(rows)) as advance:
        for s in range(0, len(rows), batch_size):
            chunk = rows[s : s + batch_size]
            out = gen.generate([prompt_ids(tokenizer, r["prompt"], max_prompt_length) for r in chunk], 1, params)
            texts += tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
            lengths += [len(c) for c in out.completion_ids]
            advance(len(chunk))
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    funcs = list(reward_funcs)
    names = {n for n, _ in funcs}
    for extra in ("correctness", "strict_format"):
        if extra not in names:
            funcs.append((extra, BUILTIN_REWARDS[extra]))
    scores = score_completions(funcs, [r["prompt"] for r in rows], completions, columns)
    correct = [v > 0 for v in scores["correctness"]]
    metrics = {
        "accuracy": sum(correct) / len(rows),
        "format_rate": sum(v > 0 for v in scores["strict_format"]) / len(rows),
        "mean_completion_length": sum(lengths) / len(lengths),
        "rows": len(rows),
    }
    for name, vals in scores.items():
        real = [v for v in vals if v == v]
        metrics[f"rewards/{name}/mean"] = sum(real) / len(real) if real else float("nan")
    samples = [
        {"question": r.get("question", ""), "answer": r.get("answer", ""), "completion": t, "correct": c}
        for r, t, c in zip(rows, texts, correct)
    ]
    return metrics, samples


def report_markdown(report: dict) -> str:
    before, after = report["before"], report["after"]
    keys = [k for k in after if k != "rows"]
    lines = [
        f"Evaluation on {after['rows']} held-out rows (greedy)",
        "",
        "| metric | before GRPO | after GRPO |",
        "|---|---|---|",
    ]
    for k in keys:
        lines.append(f"| {k} | {before.get(k, float('nan')):.4f} | {after[k]:.4f} |")
    return "\n".join(lines) + "\n"


def run_eval(
    cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, before_model: str, after_model: str, after_is_adapter: bool
) -> dict:
    e = cfg.eval
    rows = list(load_split(ws, "eval"))
    if e.max_samples:
        rows = rows[: e.max_samples]
    if not rows:
        raise ValueError("eval: the eval split is empty (data.eval_size)")
    reward_funcs = resolve_reward_funcs(cfg.grpo.reward_funcs)
    max_new = e.max_new_tokens or cfg.grpo.max_completion_length
    tokenizer = load_tokenizer(before_model, cfg.model)
    t0 = time.perf_counter()
    report = {}
    models = {
        "before": lambda: load_causal_lm(before_model, cfg.model).eval(),
        "after": lambda: (
            load_with_adapter(before_model, after_model, cfg.model)
            if after_is_adapter
            else load_causal_lm(after_model, cfg.model).eval()
        ),
    }
    out = ws.stage_dir("eval")
    for label, load in models.items():
        metrics, samples = evaluate_model(
            load(),
            tokenizer,
            rows,
            reward_funcs,
            max_new,
            e.batch_size,
            label,
            cfg.grpo.max_prompt_length,
            threads=cfg.generation.torch_threads,
        )
        report[label] = metrics
        tracker.log_metrics({f"{label}/{k}": v for k, v in metrics.items()})
        tracker.log_table({k: [s[k] for s in samples] for k in samples[0]}, f"eval_samples_{label}.json")
    report["accuracy_gain"] = report["after"]["accuracy"] - report["before"]["accuracy"]
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_markdown(report))
    tracker.log_artifact(out / "report.json")
    tracker.log_artifact(out / "report.md")
    summary = {
        "report_path": str(out / "report.json"),
        "rows": len(rows),
        "accuracy_before": report["before"]["accuracy"],
        "accuracy_after": report["after"]["accuracy"],
        "seconds": time.perf_counter() - t0,
    }
    ws.write_manifest("eval", summary)
    return summary


@task(name="evaluate")
def eval_task(
    cfg_dict: dict,
    workspace_root: str,
    parent_run_id: str | None,
    before_model: str,
    after_model: str,
    after_is_adapter: bool,
) -> dict:
    return run_stage(
        "eval",
        run_eval,
        cfg_dict,
        workspace_root,
        parent_run_id,
        before_model=before_model,
        after_model=after_model,
        after_is_adapter=after_is_adapter,
    )
