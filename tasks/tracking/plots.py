"""PNG plots: GRPO learning curves from the step history (reward and each reward component, and
completion length, against the optimizer step) and the evaluation report's before/after bars."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_learning_curves(history: list[dict], path: Path, title: str = "GRPO") -> Path:
    """Two panels: reward (raw and moving average) with each rewards/<f>/mean; completion lengths."""
    steps = [h["step"] for h in history]
    window = max(1, len(steps) // 10)
    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(12, 4.5))
    rewards = [h.get("reward", math.nan) for h in history]  # missing: a step whose round nothing scored
    ax_r.plot(steps, rewards, color="black", alpha=0.25, label="reward")
    ax_r.plot(
        steps,
        _smooth(rewards, window),
        color="black",
        lw=2,
        label=f"reward ({window}-step mean)",
    )
    for key in sorted(k for k in history[0] if k.startswith("rewards/") and k.endswith("/mean")):
        label = f"{key.split('/')[1]} ({window}-step mean)"
        ax_r.plot(steps, _smooth([h[key] for h in history], window), lw=1.2, label=label)
    ax_r.set_xlabel("optimizer step")
    ax_r.set_ylabel("reward")
    ax_r.set_title(f"{title}: reward per step")
    ax_r.grid(alpha=0.3)
    ax_r.legend(fontsize=8)
    for key, style in (
        ("completions/mean_length", "-"),
        ("completions/max_length", ":"),
        ("completions/min_length", ":"),
    ):
        ax_l.plot(steps, [h[key] for h in history], style, label=key.split("/")[1])
    ax_l.set_xlabel("optimizer step")
    ax_l.set_ylabel("tokens")
    ax_l.set_title("completion length")
    ax_l.grid(alpha=0.3)
    ax_l.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_eval_report(report: dict, path: Path) -> Path:
    """Grouped bars, before vs after GRPO: greedy accuracy (of all rows and of those in the format), each pass@k,
    and format compliance (greedy and sampled), each a fraction of the held-out rows (of the rows in the format,
    of the samples, for sampled format compliance)."""
    before, after = report["before"], report["after"]
    keys = [k for k in ("accuracy", "accuracy_in_format") if k in after]
    keys += sorted((k for k in after if k.startswith("pass_at_")), key=lambda k: int(k[8:]))
    keys += [k for k in ("format_compliance", "sampled/format_compliance") if k in after]
    labels = {
        "accuracy": "accuracy\n(greedy)",
        "accuracy_in_format": "accuracy among\nformatted (greedy)",
        "format_compliance": "format\n(greedy)",
        "sampled/format_compliance": "format\n(sampled)",
    }
    sampling = report.get("sampling", {})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(keys) + 2), 4.5))
    width = 0.38
    for j, (name, values, color) in enumerate((("before GRPO", before, "#9e9e9e"), ("after GRPO", after, "#1f77b4"))):
        xs = [i + (j - 0.5) * width for i in range(len(keys))]
        ys = [values.get(k, float("nan")) for k in keys]
        bars = ax.bar(xs, ys, width, label=name, color=color)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=8, padding=2)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([labels.get(k, k.replace("pass_at_", "pass@")) for k in keys])
    ax.set_ylim(0, 1.25)  # room for the bar labels and the legend above 1.0
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("fraction")
    title = f"Held-out evaluation, {report['rows']} rows: before vs after GRPO"
    if sampling.get("n"):
        title += f"\npass@k and sampled format from n={sampling['n']} samples per row"
        title += f" at temperature {sampling['temperature']:g}, top_p {sampling['top_p']:g}"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", ncol=2, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
