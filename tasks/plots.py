"""Learning-curve plots (PNG) from the GRPO step history: reward and each reward component, and
completion length, against the optimizer step."""

from __future__ import annotations

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
    ax_r.plot(steps, [h["reward"] for h in history], color="black", alpha=0.25, label="reward")
    ax_r.plot(
        steps,
        _smooth([h["reward"] for h in history], window),
        color="black",
        lw=2,
        label=f"reward ({window}-step mean)",
    )
    for key in sorted(k for k in history[0] if k.startswith("rewards/") and k.endswith("/mean")):
        ax_r.plot(steps, _smooth([h[key] for h in history], window), lw=1.2, label=key.split("/")[1])
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
