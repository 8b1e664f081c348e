"""The table `grpoflow run` and `grpoflow resume` print when the flow ends: the workspace, the MLflow run, reward
and accuracy before and after GRPO, what was registered and exported, and the time spent outside the training
loops."""

from __future__ import annotations


def _num(value, spec: str) -> str:
    """A number of the summary as ``spec`` formats it; "n/a" for None or NaN (a reward that scored nothing)."""
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    return format(value, spec)


def print_summary(result: dict, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"grpoflow run finished in {seconds / 60:.1f} min", show_header=False)
    table.add_row("workspace", result["workspace"])
    if "local_copy" in result:
        table.add_row("local copy", result["local_copy"])
    table.add_row("MLflow run", result["mlflow_run_id"])
    table.add_row("MLflow UI", result.get("mlflow_url", ""))  # the model-training view (?workflowType=...)
    g = result["grpo"]
    reward = f"{_num(g.get('first_reward'), '.3f')} -> {_num(g.get('final_reward'), '.3f')}"
    table.add_row("GRPO", f"{g.get('steps')} steps, reward {reward}")
    if "eval" in result:
        e = result["eval"]
        before, after = _num(e.get("accuracy_before"), ".1%"), _num(e.get("accuracy_after"), ".1%")
        table.add_row("accuracy", f"before GRPO {before} -> after {after} ({e.get('rows')} held-out rows)")
        table.add_row("report", str(e.get("report_path")))
    if "registry" in result:
        r = result["registry"]
        table.add_row("registry", f"{r['name']} version {r['version']}: {r['reason']}")
    if "export" in result:
        x = result["export"]
        for key in ("adapter_path", "merged_path"):
            if key in x:
                table.add_row(key.removesuffix("_path"), x[key])
        for kind, path in x.get("gguf", {}).items():
            table.add_row(f"gguf {kind}", path)
        for kind, why in x.get("gguf_skipped", {}).items():
            table.add_row(f"gguf {kind}", f"skipped: {why}")
    for label, text in timeline_rows(result.get("timeline")):
        table.add_row(label, text)
    console.print(table)


def timeline_rows(t: dict | None) -> list[tuple[str, str]]:
    """The summary's rows on time outside the training loops (tasks/tracking/timeline.py; up to the flow's end)."""
    if not t:
        return []
    s = lambda k: f"{t[k]:.1f} s" if k in t else "-"  # noqa: E731
    return [
        ("outside loops", f"{t['run/wall_s'] - t['run/loop_s']:.1f} s of {t['run/wall_s']:.1f} s "
         f"({t['run/outside_loop_share']:.0%}; training loops {t['run/loop_s']:.1f} s)"),
        ("start-up", f"config {s('startup/config_s')}, imports {s('startup/imports_s')}, Prefect server "
         f"{s('startup/prefect_server_s')}, flow {s('startup/flow_start_s')}, MLflow run {s('startup/parent_run_s')}; "
         f"first SFT step after {s('startup/to_first_sft_loop_s')}"),
        ("stage overhead", f"sft {s('stage_overhead/sft_s')}, grpo {s('stage_overhead/grpo_s')} (generator "
         f"{s('startup/generator_s')}); data {s('stage/data_s')}, eval {s('stage/eval_s')}, export "
         f"{s('stage/export_s')}"),
    ]  # fmt: skip
