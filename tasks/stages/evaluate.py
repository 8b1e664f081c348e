"""Evaluation stage: the model before and after GRPO on the held-out split, in one report.

"before" is the model GRPO started from (the SFT checkpoint, or the base model); "after" is the GRPO
result (base + adapter, or the fully fine-tuned model). For each, on the same rows:

- greedy decoding, one completion per row: ``accuracy`` (the ``correctness`` reward > 0: the <answer>
  equals the gold answer; for a run trained with ``code_tests``, that reward > 0: the program passes the
  tests), ``format_compliance`` (the ``strict_format`` check accepts it), ``accuracy_in_format`` (accuracy
  among the completions in the format: whether a model answers better, not only in the format more often; NaN
  when none is),
  ``mean_completion_length`` (tokens, EOS included) and ``rewards/<f>/mean`` and ``/std`` of every reward
  function the run trained with (plus correctness and strict_format when it did not);
- sampling, ``eval.num_samples`` (n) completions per row with GRPO's sampling settings (temperature,
  top_p, top_k, min_p, repetition_penalty): ``pass_at_<k>`` for each k of ``eval.pass_k`` (the unbiased
  estimator of :func:`pass_at_k`, averaged over rows), and ``sampled/format_compliance`` and
  ``sampled/mean_completion_length`` of those samples.

Written to eval/report.json and eval/report.md (a Markdown table), logged to MLflow with a bar chart
(accuracy.png) and one table of greedy completions with their rewards per model
(eval/completions_before.json, eval/completions_after.json). Sampling is seeded with run.seed before
each model, so a rerun reproduces the report.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Callable

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.dataio.splits import load_split
from grpoflow.tasks.generation.backend import compile_choice
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
from grpoflow.tasks.generation.types import SamplingParams
from grpoflow.tasks.model.context import tokenize_prompts
from grpoflow.tasks.model.device import model_device, select_device
from grpoflow.tasks.model.loading import load_causal_lm, load_tokenizer, load_with_adapter
from grpoflow.tasks.pipeline.fingerprint import reward_files, reward_modules
from grpoflow.tasks.pipeline.shell import run_stage
from grpoflow.tasks.pipeline.spec import Pipeline, StageSpec
from grpoflow.tasks.rewards import BUILTIN_REWARDS, resolve_reward_funcs, score_completions
from grpoflow.tasks.stages.common import model_and_dataset, prepared
from grpoflow.tasks.storage.workspace import Workspace
from grpoflow.tasks.tracking.plots import plot_eval_report
from grpoflow.tasks.tracking.progress import progress_bar
from grpoflow.tasks.tracking.tracker import RunLogger

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", eq. 1):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that k samples drawn without replacement from the n hold at least one correct one
    (C(n - c, k) = 0 when n - c < k: then it is 1). Exact integer binomials: n is small here."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n (got n={n}, c={c})")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: need 1 <= k <= n (got n={n}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(values: list[float]) -> float:
    """The mean of the real values (NaN: a row a reward skipped); NaN when there is none."""
    real = [v for v in values if v == v]  # a reward may skip a row (None -> NaN)
    return sum(real) / len(real) if real else float("nan")


def _std(values: list[float]) -> float:
    """Sample std (n - 1), as TRL's rewards/<f>/std; NaN with fewer than two values."""
    real = [v for v in values if v == v]
    return statistics.stdev(real) if len(real) > 1 else float("nan")


def eval_reward_funcs(reward_funcs: list) -> list:
    """The run's reward functions plus ``correctness`` and ``strict_format``, which accuracy and format
    compliance are defined by whatever the run trained with."""
    funcs = list(reward_funcs)
    names = {n for n, _ in funcs}
    funcs += [(name, BUILTIN_REWARDS[name]) for name in ("correctness", "strict_format") if name not in names]
    return funcs


def accuracy_reward(funcs: list) -> str:
    """The reward accuracy and pass@k count: ``code_tests`` when the run trained with it, else ``correctness``."""
    return "code_tests" if any(name == "code_tests" for name, _ in funcs) else "correctness"


def score(
    funcs: list, rows: list[dict], texts: list[str], n: int = 1, timeout: float | None = None
) -> dict[str, list[float]]:
    """Every reward of ``texts``: n completions per row, row-major (row 0's n, then row 1's, ...)."""
    expanded = [r for r in rows for _ in range(n)]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {k: [r[k] for r in expanded] for k in rows[0] if k != "prompt"}
    return score_completions(funcs, [r["prompt"] for r in expanded], completions, columns, timeout)


def greedy_metrics(funcs: list, rows: list[dict], texts: list[str], lengths: list[int]) -> tuple[dict, dict]:
    """Metrics of one greedy completion per row; also returns the per-row scores (for the completion table)."""
    scores = score(funcs, rows, texts)
    acc = scores[accuracy_reward(funcs)]
    correct = [v > 0 for v in acc]
    scored = sum(not math.isnan(v) for v in acc)  # NaN: a reward that did not score it (a sandbox that failed)
    formatted = [v > 0 for v in scores["strict_format"]]
    metrics = {
        "rows": len(rows),
        "accuracy": sum(correct) / scored if scored else float("nan"),
        "format_compliance": sum(formatted) / len(rows),
        "accuracy_in_format": (
            sum(c and f for c, f in zip(correct, formatted)) / sum(formatted) if any(formatted) else float("nan")
        ),
        "mean_completion_length": sum(lengths) / len(lengths),
        **({"unscored_rows": len(rows) - scored} if scored < len(rows) else {}),
    }
    for name, vals in scores.items():
        metrics[f"rewards/{name}/mean"] = _mean(vals)
        metrics[f"rewards/{name}/std"] = _std(vals)
    return metrics, scores


def sampled_metrics(
    funcs: list, rows: list[dict], texts: list[str], lengths: list[int], n: int, pass_k: list[int]
) -> tuple[dict, list[int]]:
    """pass@k (the mean over rows of :func:`pass_at_k`) and format compliance of n samples per row (row-major);
    also returns the number of correct samples per row."""
    acc = accuracy_reward(funcs)
    scores = score([f for f in funcs if f[0] in (acc, "strict_format")], rows, texts, n)
    per_row = [scores[acc][i * n : (i + 1) * n] for i in range(len(rows))]
    correct = [sum(v > 0 for v in vals) for vals in per_row]
    # a sample no reward scored (NaN) is left out of its row's n; a row left with fewer than k is out of pass@k
    scored = [sum(not math.isnan(v) for v in vals) for vals in per_row]
    metrics = {}
    for k in pass_k:
        counted = [(m, c) for m, c in zip(scored, correct, strict=True) if m >= k]
        metrics[f"pass_at_{k}"] = sum(pass_at_k(m, c, k) for m, c in counted) / len(counted) if counted else math.nan
    metrics["sampled/format_compliance"] = sum(v > 0 for v in scores["strict_format"]) / len(texts)
    metrics["sampled/mean_completion_length"] = sum(lengths) / len(lengths)
    return metrics, correct


def decode(
    gen: TransformersGenerator, tokenizer, prompts: list[list[int]], n: int, params: SamplingParams, label: str
) -> tuple[list[str], list[int]]:
    """n completions per prompt (row-major), in chunks of about gen.batch_size sequences: texts and lengths."""
    texts: list[str] = []
    lengths: list[int] = []
    rows_per_chunk = max(1, gen.batch_size // n)
    with progress_bar(label, len(prompts)) as advance:
        for s in range(0, len(prompts), rows_per_chunk):
            chunk = prompts[s : s + rows_per_chunk]
            out = gen.generate(chunk, n, params)
            texts += tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
            lengths += [len(c) for c in out.completion_ids]
            advance(len(chunk))
    return texts, lengths


def evaluate_model(
    model,
    tokenizer,
    rows: list[dict],
    reward_funcs: list,
    params: SamplingParams,
    pass_k: list[int],
    n: int,
    batch_size: int,
    label: str = "eval",
    max_prompt_length: int | None = None,
    threads: int | None = None,
    seed: int = 0,
    compiled: bool = False,
    compile_mode: str | None = None,
) -> tuple[dict, dict]:
    """Greedy-decode every row once, then sample n completions per row with ``params`` (none when n = 0);
    ``threads``: torch threads while decoding; ``compiled``: through the compiled decode step (generation.compile,
    ``compile_mode``: torch.compile's mode). Returns metrics and a table of the greedy completions."""
    gen = TransformersGenerator(
        model, tokenizer, batch_size, threads=threads, compiled=compiled, compile_mode=compile_mode
    )
    funcs = eval_reward_funcs(reward_funcs)
    # cut as training cuts them (left, to grpo.max_prompt_length), warned and counted: a cut prompt is likely
    # answered wrong, and the report says how many there were
    prompts, cut = tokenize_prompts(tokenizer, rows, max_prompt_length)
    t0 = time.perf_counter()
    greedy = SamplingParams(max_new_tokens=params.max_new_tokens, greedy=True)
    texts, lengths = decode(gen, tokenizer, prompts, 1, greedy, f"eval {label} greedy")
    metrics, scores = greedy_metrics(funcs, rows, texts, lengths)
    if cut["truncated_prompts"]:
        metrics["truncated_prompts"] = cut["truncated_prompts"]
    metrics["seconds/greedy"] = time.perf_counter() - t0
    table = {
        "question": [r.get("question", "") for r in rows],
        "answer": [r.get("answer", "") for r in rows],
        "completion": texts,
        "correct": [None if math.isnan(v) else v > 0 for v in scores[accuracy_reward(funcs)]],
        **{f"rewards/{name}": vals for name, vals in scores.items()},
    }
    if n:
        t0 = time.perf_counter()
        torch.manual_seed(seed)  # the same draws for every model and every rerun
        s_texts, s_lengths = decode(gen, tokenizer, prompts, n, params, f"eval {label} {n} samples")
        sampled, correct = sampled_metrics(funcs, rows, s_texts, s_lengths, n, pass_k)
        metrics.update(sampled)
        metrics["seconds/sampling"] = time.perf_counter() - t0
        table[f"samples_correct_of_{n}"] = correct
    return metrics, table


def _cell(v: float) -> str:
    """A report cell: n/a for NaN, one decimal from 10 up, else three."""
    return "n/a" if v != v else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"


def report_markdown(report: dict) -> str:
    """The report as a readable Markdown table (one row per metric; timings left to the JSON)."""
    before, after, s = report["before"], report["after"], report["sampling"]
    head = f"Evaluation on {report['rows']} held-out rows (greedy decoding"
    if s["n"]:
        head += f"; pass@k from n={s['n']} samples per row at temperature {s['temperature']}, top_p {s['top_p']}"
    lines = [head + ")", "", "| metric | before GRPO | after GRPO | change |", "|---|---|---|---|"]
    for k in after:
        if k == "rows" or k.startswith("seconds/"):
            continue
        a, b = after[k], before.get(k, float("nan"))
        name = k.replace("pass_at_", "pass@")
        lines.append(f"| {name} | {_cell(b)} | {_cell(a)} | {'+' if a - b >= 0 else ''}{_cell(a - b)} |")
    return "\n".join(lines) + "\n"


def run_eval(
    cfg: PipelineConfig, ws: Workspace, tracker: RunLogger, before_model: str, after_model: str, after_is_adapter: bool
) -> dict:
    """The eval stage: both models on the same held-out rows, then report.json, report.md and the bar chart;
    returns the summary."""
    rows, reward_funcs, params = eval_inputs(cfg, ws)
    n = cfg.eval.samples_per_row
    tokenizer = load_tokenizer(before_model, cfg.model)
    t0 = time.perf_counter()
    report: dict = {
        "rows": len(rows),
        "sampling": {
            "n": n,
            "pass_k": cfg.eval.pass_k,
            **{k: v for k, v in dataclasses.asdict(params).items() if k != "greedy"},
        },
    }
    models = eval_models(cfg, before_model, after_model, after_is_adapter)
    out = ws.stage_dir("eval")
    correct: dict[str, list[bool]] = {}
    for label, load in models.items():
        report[label], correct[label] = evaluate_and_log(
            cfg, tracker, load(), tokenizer, rows, reward_funcs, params, label
        )
    report["accuracy_gain"] = report["after"]["accuracy"] - report["before"]["accuracy"]
    report["correct"] = correct  # per row, in the same order: what a paired comparison of the two models reads
    save_report(report, out, tracker)
    return {
        "report_path": str(out / "report.json"),
        "rows": len(rows),
        "accuracy_before": report["before"]["accuracy"],
        "accuracy_after": report["after"]["accuracy"],
        # per held-out row, was the greedy answer correct: the registry's paired promotion test
        # (tasks/tracking/promotion.py) when "before" is the champion the continuous cycle started from
        "correct_before": correct["before"],
        "correct_after": correct["after"],
        "seconds": time.perf_counter() - t0,
    }


def eval_inputs(cfg: PipelineConfig, ws: Workspace) -> tuple[list[dict], list, SamplingParams]:
    """The eval rows (at most eval.max_samples; an empty split fails), the run's reward functions and GRPO's
    sampling settings (eval.max_new_tokens, when set, in place of grpo.max_completion_length)."""
    e = cfg.eval
    rows = list(load_split(prepared(ws), "eval"))
    if e.max_samples:
        rows = rows[: e.max_samples]
    if not rows:
        raise ValueError("eval: the eval split is empty (data.eval_size)")
    reward_funcs = resolve_reward_funcs(cfg.grpo.reward_funcs, cfg.grpo.code_reward)
    params = SamplingParams.from_grpo(cfg.grpo)
    if e.max_new_tokens:
        params = dataclasses.replace(params, max_new_tokens=e.max_new_tokens)
    return rows, reward_funcs, params


def eval_models(cfg: PipelineConfig, before_model: str, after_model: str, after_is_adapter: bool) -> dict:
    """{"before": loader, "after": loader}: each model is loaded only when its turn comes (one in memory at a
    time); "after" is the GRPO adapter on the "before" model, or the fully fine-tuned model."""
    device = select_device(cfg.run.device)
    models: dict[str, Callable] = {
        "before": lambda: load_causal_lm(before_model, cfg.model, device=device).eval(),
        "after": lambda: (
            load_with_adapter(before_model, after_model, cfg.model, device=device)
            if after_is_adapter
            else load_causal_lm(after_model, cfg.model, device=device).eval()
        ),
    }
    return models


def evaluate_and_log(
    cfg: PipelineConfig, tracker: RunLogger, model, tokenizer, rows, reward_funcs, params, label: str
) -> tuple[dict, list[bool]]:
    """:func:`evaluate_model` with the run's eval settings; logs the metrics under ``<label>/`` and the table of
    greedy completions as eval/completions_<label>.json. Returns the metrics and, per row, whether the greedy
    answer was correct."""
    e = cfg.eval
    compiled, mode, _ = compile_choice(cfg.generation.compile, model_device(model).type)
    metrics, table = evaluate_model(
        model,
        tokenizer,
        rows,
        reward_funcs,
        params,
        e.pass_k,
        e.samples_per_row,
        e.batch_size,
        label,
        cfg.grpo.max_prompt_length,
        threads=cfg.generation.torch_threads,
        seed=cfg.run.seed,
        compiled=compiled,
        compile_mode=mode,
    )
    # a NaN here is a mean or spread over no rows (every row skipped, none formatted): undefined, not a diverging
    # value, so no point (the tracker logs NaN as it is and warns)
    tracker.log_metrics({f"{label}/{k}": None if v != v else v for k, v in metrics.items()})
    tracker.log_table(table, f"eval/completions_{label}.json")
    return metrics, [None if c is None else bool(c) for c in table["correct"]]


def save_report(report: dict, out, tracker: RunLogger) -> None:
    """Write report.json and report.md into ``out``; log both, the accuracy chart, and the Markdown table."""
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_markdown(report))
    tracker.log_artifact(out / "report.json")
    tracker.log_artifact(out / "report.md")
    tracker.log_artifact(plot_eval_report(report, out / "accuracy.png"))
    log.info("evaluation:\n%s", report_markdown(report))


def _result(s: dict) -> str:
    if "accuracy_after" not in s:
        return ""
    return (
        f"Accuracy {s['accuracy_before']:.1%} before GRPO -> {s['accuracy_after']:.1%} after "
        f"({s['rows']} held-out rows)."
    )


SPEC = StageSpec(
    name="eval",
    keys=("run.torch_threads", "generation.torch_threads", "eval"),
    upstream=lambda cfg: ("grpo",),
    enabled=lambda cfg: cfg.eval.enabled,
    reads=(reward_modules, reward_files),  # it scores with the run's reward functions
    splits=("eval",),
    description="Held-out evaluation of the model before and after GRPO on {dataset}.",
    param_sections=("eval",),
    name_parts=model_and_dataset,
    result=_result,
)


# no Prefect cache: the pipeline's stage keys decide what reruns (tasks/pipeline/fingerprint.py); hashing the
# inputs (the stage table, the config) would only cost time
@task(name="evaluate", cache_policy=NO_CACHE)
def eval_task(
    stages: Pipeline,
    cfg: PipelineConfig,
    workspace_root: str,
    parent_run_id: str | None,
    before_model: str,
    after_model: str,
    after_is_adapter: bool,
) -> dict:
    return run_stage(
        stages,
        SPEC,
        run_eval,
        cfg,
        workspace_root,
        parent_run_id,
        before_model=before_model,
        after_model=after_model,
        after_is_adapter=after_is_adapter,
    )
