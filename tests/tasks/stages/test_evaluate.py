"""The evaluation report: pass@k math, metrics on completions of known correctness, a before/after report
from a tiny model taught one answer, and the accuracy plot."""

import itertools
import json
import math

import pytest
import torch
from PIL import Image

from grpoflow.tasks.config import EvalConfig, GRPOConfig, TinyModelConfig
from grpoflow.tasks.generation.types import SamplingParams
from grpoflow.tasks.grpo.round_stats import completion_tables
from grpoflow.tasks.model.loading import prompt_ids
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer
from grpoflow.tasks.rewards import resolve_reward_funcs
from grpoflow.tasks.stages.evaluate import (
    eval_reward_funcs,
    evaluate_model,
    greedy_metrics,
    pass_at_k,
    report_markdown,
    run_eval,
    sampled_metrics,
)
from grpoflow.tasks.stages.grpo import train_grpo
from grpoflow.tasks.tracking.plots import plot_eval_report
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.tasks.stages.test_grpo import make_cfg, workspace

GOOD = "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>"
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


# ------------------------------------------------------------------------------------------ pass@k
def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of all k-subsets of n samples (c of them correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_special_cases():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction of correct samples
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0  # fewer than k wrong samples: every k-subset holds a correct one
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)
    assert pass_at_k(20, 2, 3) == pytest.approx(1 - math.comb(18, 3) / math.comb(20, 3))


@pytest.mark.parametrize(("n", "c", "k", "message"), [(4, 5, 1, "0 <= c <= n"), (4, 2, 5, "1 <= k <= n")])
def test_pass_at_k_rejects_impossible_counts(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


# ------------------------------------------------------------------------------------------ metrics
def rows(*answers: str) -> list[dict]:
    return [{"prompt": PROMPT, "question": "What is 3 + 4?", "answer": a} for a in answers]


def test_greedy_metrics_of_known_completions():
    funcs = eval_reward_funcs(resolve_reward_funcs(["correctness", "proximity"]))
    assert [n for n, _ in funcs] == ["correctness", "proximity", "strict_format"]
    texts = [GOOD, GOOD, "<answer>7</answer>", "seven"]  # correct+format, wrong answer, unformatted, nothing
    metrics, scores = greedy_metrics(funcs, rows("7", "8", "7", "7"), texts, [20, 20, 8, 2])
    assert metrics["rows"] == 4
    assert scores["correctness"] == [2.0, 0.0, 2.0, 0.0]  # correctness reads <answer> whatever the format
    assert metrics["accuracy"] == 0.5
    assert metrics["format_compliance"] == 0.5
    assert metrics["accuracy_in_format"] == 0.5  # of the two in the format one is right (the unformatted right one
    # counts for accuracy only)
    none_formatted, _ = greedy_metrics(funcs, rows("7"), ["seven"], [2])
    assert math.isnan(none_formatted["accuracy_in_format"])
    assert metrics["mean_completion_length"] == 12.5
    assert metrics["rewards/strict_format/mean"] == 0.25
    assert metrics["rewards/strict_format/std"] == pytest.approx(torch.tensor([0.5, 0.5, 0, 0]).std().item())
    assert set(metrics) >= {f"rewards/{f}/{s}" for f in ("correctness", "proximity") for s in ("mean", "std")}


def test_sampled_metrics_are_the_mean_of_per_row_pass_at_k():
    funcs = eval_reward_funcs(resolve_reward_funcs(["correctness"]))
    bad = GOOD.replace("\n7\n", "\n6\n")
    # row 0: 3 of 4 samples correct; row 1: 1 of 4 (gold 6); row 2: none (gold 5)
    texts = [GOOD, GOOD, GOOD, bad] + [GOOD, GOOD, GOOD, bad] + [GOOD, bad, "x", "y"]
    metrics, correct = sampled_metrics(funcs, rows("7", "6", "5"), texts, [10] * 12, 4, [1, 2, 4])
    assert correct == [3, 1, 0]
    for k in (1, 2, 4):
        assert metrics[f"pass_at_{k}"] == pytest.approx((pass_at_k(4, 3, k) + pass_at_k(4, 1, k)) / 3)
    assert metrics["pass_at_1"] == pytest.approx(4 / 12)
    assert metrics["sampled/format_compliance"] == 10 / 12


def test_rows_the_accuracy_reward_did_not_score_are_left_out_not_counted_wrong():
    """A code sandbox that could not start scores None (NaN): such a row is out of accuracy and pass@k (its count
    reported), not a wrong answer; before, NaN > 0 made it one, and a champion's eval that hit a sandbox failure
    counted as a gain of the candidate."""
    from grpoflow.tasks.rewards.text import strict_format

    def scored(values):
        return lambda prompts, completions, **kw: values[: len(completions)]

    funcs = [("correctness", scored([2.0, None, 0.0, None])), ("strict_format", strict_format)]
    metrics, _ = greedy_metrics(funcs, rows("7", "7", "7", "7"), ["a", "b", "c", "d"], [1, 1, 1, 1])
    assert metrics["accuracy"] == 0.5 and metrics["unscored_rows"] == 2 and metrics["rows"] == 4
    funcs = [("correctness", scored([2.0, None, 0.0, 0.0])), ("strict_format", strict_format)]
    sampled, correct = sampled_metrics(funcs, rows("7", "7"), ["a", "b", "c", "d"], [1] * 4, 2, [1, 2])
    assert correct == [1, 0]
    assert sampled["pass_at_1"] == 0.5  # row 0: 1 of its 1 scored sample; row 1: 0 of 2
    assert sampled["pass_at_2"] == 0.0  # row 0 has 1 scored sample: out of pass@2


# ------------------------------------------------------------------------------------------ a real model
@pytest.fixture(scope="module")
def taught():
    """A tiny model before and after it is taught to answer GOOD to PROMPT (about 3 s of Adam)."""
    tok = train_tiny_tokenizer([PROMPT[0]["content"], GOOD] * 20, 280)
    tiny = TinyModelConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    before = build_tiny_model(tiny, tok, seed=0).eval()
    after = build_tiny_model(tiny, tok, seed=0)
    prompt = prompt_ids(tok, PROMPT)
    target = tok(GOOD, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])
    opt = torch.optim.Adam(after.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(300):
        loss = after(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    assert loss.item() < 1e-3
    return tok, before, after.eval()


def test_before_and_after_report_on_a_model_taught_one_answer(taught, tmp_path):
    """Two rows share the prompt: gold 7 (the taught answer) and gold 8. The taught model answers 7 every
    time, greedy or sampled (at temperature 0.5 it is near certain): accuracy 1/2, pass@k 1/2 for every k,
    full format compliance; the untrained model has neither."""
    tok, before, after = taught
    funcs = resolve_reward_funcs(["correctness", "strict_format"])
    sampling = SamplingParams.from_grpo(GRPOConfig(temperature=0.5, max_completion_length=24))
    report = {"rows": 2, "sampling": {"n": 4, **sampling.__dict__}}
    for label, model in (("before", before), ("after", after)):
        metrics, table = evaluate_model(model, tok, rows("7", "8"), funcs, sampling, [1, 4], 4, 8, label, seed=1)
        report[label] = metrics
        assert metrics["rows"] == 2 and len(table["completion"]) == 2
        assert metrics["accuracy"] == sum(table["correct"]) / 2
        assert metrics["pass_at_4"] == sum(pass_at_k(4, c, 4) for c in table["samples_correct_of_4"]) / 2
    a, b = report["after"], report["before"]
    assert a["accuracy"] == 0.5 and a["pass_at_1"] == 0.5 and a["pass_at_4"] == 0.5
    assert a["format_compliance"] == 1.0 and a["sampled/format_compliance"] == 1.0
    assert a["rewards/correctness/mean"] == 1.0 and a["rewards/correctness/std"] == pytest.approx(2**0.5)
    assert a["mean_completion_length"] == len(tok(GOOD, add_special_tokens=False)["input_ids"]) + 1  # + EOS
    assert b["accuracy"] == 0.0 and b["pass_at_4"] == 0.0 and b["format_compliance"] == 0.0
    # sampling is seeded: the same draws again
    again, _ = evaluate_model(before, tok, rows("7", "8"), funcs, sampling, [1, 4], 4, 8, "before", seed=1)
    assert again["sampled/mean_completion_length"] == b["sampled/mean_completion_length"]

    md = report_markdown(report)
    assert md.startswith("Evaluation on 2 held-out rows (greedy decoding; pass@k from n=4 samples per row")
    assert "| pass@4 | 0.000 | 0.500 | +0.500 |" in md
    assert "| format_compliance | 0.000 | 1.000 | +1.000 |" in md
    png = plot_eval_report(report, tmp_path / "eval" / "accuracy.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as im:
        assert im.size[0] >= 600 and im.size[1] >= 400


def test_eval_prompts_cut_to_max_prompt_length_are_warned_and_counted(taught, caplog):
    """Eval cuts prompts as training does (left, to grpo.max_prompt_length), and now says so: a warning and
    truncated_prompts in the metrics. Before, the cut was silent and the report claimed every row whole."""
    import logging

    tok, _, after = taught
    funcs = resolve_reward_funcs(["correctness"])
    sampling = SamplingParams.from_grpo(GRPOConfig(max_completion_length=4))
    whole, _ = evaluate_model(after, tok, rows("7"), funcs, sampling, [1], 0, 8, "after")
    assert "truncated_prompts" not in whole
    with caplog.at_level(logging.WARNING):
        cut, _ = evaluate_model(after, tok, rows("7", "8"), funcs, sampling, [1], 0, 8, "after", max_prompt_length=3)
    assert cut["truncated_prompts"] == 2 and "cuts 2 of 2 prompts" in caplog.text


def test_an_undefined_eval_metric_is_no_point_in_mlflow(taught, tmp_path, monkeypatch):
    """The untrained model formats no answer: its accuracy_in_format is NaN, a ratio over no rows, which is not
    logged (the tracker logs a NaN as a diverging value); the defined metrics are."""
    from mlflow.tracking import MlflowClient

    from grpoflow.tasks.config import config_from_dict
    from grpoflow.tasks.stages.evaluate import evaluate_and_log
    from grpoflow.tasks.tracking.tracker import start_pipeline_run, tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tok, before, _ = taught
    cfg = config_from_dict({"run": {"output_dir": str(tmp_path / "out"), "name": "r"}, "eval": {"pass_k": []}})
    (tmp_path / "out").mkdir()
    parent = start_pipeline_run(cfg)
    funcs = resolve_reward_funcs(["correctness", "strict_format"])
    sampling = SamplingParams.from_grpo(GRPOConfig(temperature=0.5, max_completion_length=24))
    metrics, _ = evaluate_and_log(cfg, parent, before, tok, rows("7", "8"), funcs, sampling, "before")
    assert math.isnan(metrics["accuracy_in_format"])
    assert parent.end(True)
    logged = MlflowClient(tracking_uri(cfg)).get_run(parent.run_id).data.metrics
    assert logged["before/accuracy"] == 0.0 and "before/accuracy_in_format" not in logged


# ------------------------------------------------------------------------------------------ config, tables
def test_num_samples_must_cover_the_largest_k():
    from pydantic import ValidationError

    assert EvalConfig().samples_per_row == 4
    assert EvalConfig(pass_k=[8, 1, 1]).pass_k == [1, 8]
    assert EvalConfig(pass_k=[]).samples_per_row == 0
    assert EvalConfig(pass_k=[1, 4], num_samples=10).samples_per_row == 10
    with pytest.raises(ValidationError, match=r"num_samples \(2\) must be >= max\(pass_k\) \(4\)"):
        EvalConfig(pass_k=[1, 4], num_samples=2)
    with pytest.raises(ValidationError, match="every k must be >= 1"):
        EvalConfig(pass_k=[0])


def test_log_completions_steps_is_retired_with_a_pointer():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="log_completions_steps was retired.*log_completions: true/false"):
        GRPOConfig(log_completions_steps=5)


@pytest.mark.parametrize(
    ("max_steps", "logged"),
    [
        (200, {1: ["start"], 100: ["middle"], 200: ["end"]}),
        (3, {1: ["start"], 2: ["middle"], 3: ["end"]}),
        (2, {1: ["start", "middle"], 2: ["end"]}),
        (1, {1: ["start", "middle", "end"]}),
    ],
)
def test_completion_tables_have_three_fixed_names(max_steps, logged):
    got = {s: completion_tables(s, max_steps) for s in range(1, max_steps + 1)}
    assert {s: names for s, names in got.items() if names} == logged


def test_plot_without_sampling(tmp_path):
    report = {
        "rows": 5,
        "sampling": {"n": 0},
        "before": {"accuracy": 0.2, "format_compliance": 0.4},
        "after": {"accuracy": 0.6, "format_compliance": 1.0},
    }
    with Image.open(plot_eval_report(report, tmp_path / "a.png")) as im:
        assert im.format == "PNG"


def test_run_eval_reports_both_models_of_a_grpo_run(tmp_path):
    """The stage on a 2-step LoRA GRPO run of the tiny model: report.json and report.md, the chart, the summary."""
    cfg = make_cfg(tmp_path)
    ws = workspace(cfg, tmp_path)
    grpo = train_grpo(cfg, ws, RunLogger.disabled())
    summary = run_eval(cfg, ws, RunLogger.disabled(), grpo["base_model"], grpo["model_path"], grpo["adapter"])
    out = ws.stage_dir("eval")
    report = json.loads((out / "report.json").read_text())
    assert summary["report_path"] == str(out / "report.json") and summary["rows"] == report["rows"] == 4
    assert summary["accuracy_before"] == report["before"]["accuracy"]
    assert summary["accuracy_after"] == report["after"]["accuracy"]
    # per row, both models, in the row order: what the registry's paired promotion test reads
    for label in ("before", "after"):
        correct = summary[f"correct_{label}"]
        assert correct == report["correct"][label] and len(correct) == 4
        assert sum(correct) / 4 == report[label]["accuracy"]
    assert report["accuracy_gain"] == report["after"]["accuracy"] - report["before"]["accuracy"]
    assert report["sampling"]["n"] == cfg.eval.samples_per_row and "greedy" not in report["sampling"]
    assert (out / "report.md").read_text() == report_markdown(report) and (out / "accuracy.png").is_file()
