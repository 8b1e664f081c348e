"""Command line: ``grpoflow run [CONFIG] [key=value ...]``, ``grpoflow validate`` and
``grpoflow resume RUN_DIR [--from-stage STAGE] [key=value ...]``, ``grpoflow sync RUN_DIR`` (sends what an
unreachable MLflow server missed: docs/tracking.md) and ``grpoflow compare RUN_A RUN_B``. RUN_DIR
may be an s3:// workspace (its config.yaml is read with $AWS_ENDPOINT_URL or a storage.endpoint_url override).
``grpoflow deploy`` and ``grpoflow data-landed PATH`` talk to a Prefect server (flows/operations.py).

The config is loaded and validated before anything heavy is imported, so a bad key fails in
about a second with a message naming it (exit code 2). Prefect runs the flow in-process against a
server the CLI starts and stops itself (flows/embedded_server.py), with its SQLite store under
<output_dir>/.prefect; set PREFECT_API_URL to use a Prefect server instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

from grpoflow.flows.embedded_server import Terminated, handle_sigterm, serving, start_server
from grpoflow.flows.run_logs import FLOW_RUN_LOG_ENV
from grpoflow.tasks.config import (
    ConfigError,
    PipelineConfig,
    apply_overrides,
    config_from_dict,
    load_config,
    load_run_config,
)
from grpoflow.tasks.config.trl_keys import TRLKeyWarning
from grpoflow.tasks.pipeline.errors import StageError
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.lock import WorkspaceBusy
from grpoflow.tasks.storage.store import open_store, write_atomic
from grpoflow.tasks.storage.workspace import join_location, local_dir
from grpoflow.tasks.tracking import timeline


def busy_cores(seconds: float = 0.5) -> float:
    """Cores kept busy by other processes right now: non-idle share of /proc/stat's CPU time over ``seconds``,
    times the core count (this process is idle meanwhile). Falls back to the 1-minute load average."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values[:8])  # idle + iowait, total (without guest time)

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    total = max(total1 - total0, 1)
    return (1 - (idle1 - idle0) / total) * (os.cpu_count() or 1)


def _openmp_wait_policy() -> None:
    """OMP_WAIT_POLICY=PASSIVE when other processes keep at least 0.7 of a core busy as the run starts.

    Waiting OpenMP threads spin by default. On a quiet machine that is fastest (passive waiting made the default
    run 9.2 min instead of 6.1 here), but when another process holds a core, spinning threads crawl: two GRPO
    micro-batches on 2 threads took 1.7 s beside one busy loop and 11.6-14.3 s on a loaded machine, against 0.9
    and 1.9-2.9 s with passive waiting. OpenMP reads this when torch loads it, so it is set before anything
    imports torch; an OMP_WAIT_POLICY already in the environment wins. Measured now, not by the load average,
    which still counts a pip install that just ended."""
    if "OMP_WAIT_POLICY" not in os.environ and busy_cores() >= 0.7:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _library_env() -> None:
    """Settings the libraries read once, as they are imported: set before anything loads a config (its checks
    import datasets, which reads HF_DATASETS_DISABLE_PROGRESS_BARS then); a value already set wins."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    for key, value in FLOW_RUN_LOG_ENV.items():  # grpoflow's lines in the flow run's Prefect logs
        os.environ.setdefault(key, value)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _setup_env(cfg: PipelineConfig) -> None:
    out = local_dir(cfg.run.output_dir, cfg.storage.cache_dir)  # an s3:// output_dir: its local mirror
    out.mkdir(parents=True, exist_ok=True)
    _openmp_wait_policy()
    home = Path(os.environ.setdefault("PREFECT_HOME", str(out / ".prefect")))
    home.mkdir(parents=True, exist_ok=True)
    # Prefect 3.7 puts its server's memo store under ~/.prefect whatever PREFECT_HOME says (the server settings'
    # default does not see `home`), and warns on a first run where ~/.prefect does not exist
    os.environ.setdefault("PREFECT_SERVER_MEMO_STORE_PATH", str(home / "memo_store.toml"))
    # the embedded server migrates its SQLite store on first start: slow on a busy 2-core machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("mlflow", "alembic", "httpx", "prefect", "datasets", "transformers", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # bitsandbytes (imported by peft) warns on every CPU import that Hugging Face's optional `kernels` package is
    # missing; nothing here uses its CPU gemm kernel (4-bit layers stay on the generic path: model/loading.py)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if s3.is_s3_uri(cfg.run.output_dir) and not (cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        logging.getLogger("grpoflow").warning(
            "run.output_dir is on S3 but MLflow's default SQLite store stays on this machine (%s); set tracking.uri "
            "to an MLflow server (with --artifacts-destination s3://...) to keep tracking beside the workspace",
            out / "mlflow.db",
        )


def _load(args) -> PipelineConfig:
    with warnings.catch_warnings(record=True) as caught:  # trl: keys with no meaning here, one line each
        warnings.simplefilter("always", TRLKeyWarning)
        cfg = load_run_config(args.config, args.overrides, name=args.command == "run", trl_config=args.trl_config)
    for w in caught:
        if issubclass(w.category, TRLKeyWarning):
            print(f"grpoflow: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    from grpoflow.tasks.model.sources import model_problem

    if problem := model_problem(cfg.model.name):  # a bad GGUF or folder: now, not after data prep
        raise ConfigError(f"model.name: {problem}")
    from grpoflow.tasks.model.sources import cached_model

    folder = cached_model(cfg.model.name, cfg.model.cache_dir)
    if cfg.model.name != "tiny" and folder and Path(folder).expanduser().is_dir():  # a local folder: its template
        from grpoflow.tasks.model.template import chat_template_problem

        if problem := chat_template_problem(folder, cfg.model, cfg.data.system_prompt):
            raise ConfigError(problem)
    from grpoflow.tasks.model.context import context_problem, known_context

    if (known := known_context(cfg)) and (problem := context_problem(cfg, *known)):  # lengths past the context
        raise ConfigError(problem)
    from grpoflow.tasks.dataio.sources import file_problem

    d = cfg.data
    for key, source in (("data.source", d.source), ("data.eval_source", d.eval_source)):
        if source and (problem := file_problem(source, d.question_field, d.answer_field)):
            raise ConfigError(f"{key}: {problem}")
    from grpoflow.tasks.pipeline.preflight import output_dir_problem

    if problem := output_dir_problem(cfg.run.output_dir):
        raise ConfigError(problem)
    from grpoflow.tasks.rewards import resolve_reward_funcs

    try:  # imported and their signatures checked now, not in the GRPO stage after data prep and SFT
        resolve_reward_funcs(cfg.grpo.reward_funcs, cfg.grpo.code_reward)
    except ValueError as e:
        raise ConfigError(f"grpo.reward_funcs: {e}") from None
    return cfg


def cmd_run(args) -> int:
    """Run the pipeline in <output_dir>/<run.name>, holding the workspace; a run.name that names an existing run
    is resumed when its finished stages keep their keys, else refused (``--force``: replaced, each named)."""
    cfg = _load(args)
    return _run_pipeline(cfg, check=lambda store: refuse_replacing(cfg, store, args.force), command="grpoflow run")


def refuse_replacing(cfg: PipelineConfig, store, force: bool) -> None:
    """`grpoflow run` onto an existing run whose finished stages this config would rerun: a ConfigError naming
    them and pointing at `grpoflow resume`; with ``force`` each is named as it is replaced."""
    if store.read("config.yaml") is None:
        return
    from grpoflow.flows.stages import PIPELINE
    from grpoflow.tasks.pipeline.resume import explain, replaced
    from grpoflow.tasks.storage.workspace import Workspace

    ws = Workspace(store.location, cfg.storage)
    reruns = explain(PIPELINE, cfg, ws)
    lost = replaced(PIPELINE, cfg, ws, reruns)
    if not lost:
        return
    lines = [f"  {stage}: {lost[stage]}; {'; '.join(reruns[stage])}" for stage in lost]
    if force:
        for line in lines:
            print(f"run --force:{line[1:]}")
        return
    raise ConfigError(
        f"run.name {cfg.run.name!r}: a run with another config exists at {store.location}; this config would rerun "
        "its finished stages:\n" + "\n".join(lines) + f"\nTo change that run's config use `grpoflow resume "
        f"{store.location} key=value ...` (it says what reruns); to keep it, pick another run.name; to replace "
        "them, add --force"
    )


def cmd_resume(args) -> int:
    """Rerun the pipeline in RUN_DIR with its config.yaml (+ overrides): complete stages whose key matches are
    skipped; --from-stage first forgets that stage and every later one (manifest and files), so they rerun."""
    missing = f"{args.run_dir}: no config.yaml; RUN_DIR must be a run workspace (<output_dir>/<name>)"
    # the workspace's store (an s3:// one reached with the endpoint of the env or of storage.* overrides)
    storage = config_from_dict({"storage": apply_overrides({}, list(args.overrides)).get("storage", {})}).storage
    store = open_store(args.run_dir, storage)
    if store.read("config.yaml") is None:
        raise ConfigError(missing)
    from grpoflow.tasks.storage.lock import workspace_lock

    with workspace_lock(store, "grpoflow resume"):  # before anything is read: another process may be writing it
        return _resume(args, store)


def _resume(args, store) -> int:
    text = store.read("config.yaml")
    config = store.local_root / "config.yaml"
    if not config.is_file() or config.read_bytes() != text:  # S3: into the local mirror, as a stage would
        write_atomic(config, text)
    run_dir = store.location
    parent, name = run_dir.rsplit("/", 1)
    cfg = load_config(str(config), list(args.overrides))
    # the workspace is RUN_DIR wherever it now lies (its MLflow store, by default, beside it)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name, "output_dir": parent})})
    timeline.mark("config_loaded")
    _setup_env(cfg)  # PREFECT_HOME and logging, before the stage modules below import Prefect
    from grpoflow.flows.stages import PIPELINE
    from grpoflow.tasks.pipeline.resume import explain, replaced
    from grpoflow.tasks.storage.workspace import Workspace

    if args.from_stage is not None and args.from_stage not in PIPELINE.names:
        names = ", ".join(PIPELINE.names)
        raise ConfigError(f"--from-stage: unknown stage {args.from_stage!r}; expected one of {names}")
    forget = PIPELINE.stages_from(args.from_stage) if args.from_stage else ()
    ws = Workspace(run_dir, cfg.storage)
    reruns = explain(PIPELINE, cfg, ws, forget)
    print_reruns(reruns, replaced(PIPELINE, cfg, ws, reruns))  # the config, files and code each rerun sees
    return _run_pipeline(cfg, lambda: ws.forget(forget, attempts=True))


def print_reruns(reruns: dict[str, list[str]], replaces: dict[str, str] | None = None) -> None:
    """What `grpoflow resume` reruns and why (tasks/pipeline/resume.py explain), and what each rerun does to the
    stage's finished results (``replaces``: resume.replaced), before the flow starts."""
    if not reruns:
        print("resume: every stage is complete with its current key; nothing reruns")
    for stage, why in reruns.items():
        if stage in (replaces or {}):
            print(f"resume: {stage} {replaces[stage]}")
        for line in why:
            print(f"resume: {stage} reruns: {line}")


def cmd_compare(args) -> int:
    """Key metrics and config differences of two runs, side by side (tasks/ops/compare.py)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from rich.console import Console
    from rich.table import Table

    from grpoflow.tasks.ops.compare import resolve_run, run_summary, table_rows

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
    try:
        refs = [resolve_run(r, uri) for r in (args.run_a, args.run_b)]
    except ValueError as e:
        raise ConfigError(str(e)) from e
    from grpoflow.tasks.tracking.reach import tracking_problem

    for u in dict.fromkeys(u for u, _ in refs):  # a server that is down: now, not after minutes of retries
        if problem := tracking_problem(u):
            raise ConfigError(problem)
    try:
        summaries = [run_summary(MlflowClient(u), rid, args.window) for u, rid in refs]
    except MlflowException as e:  # an unknown run id, a store that does not answer: its first line, no traceback
        ref = next((r for r, (_, rid) in zip((args.run_a, args.run_b), refs, strict=True) if rid in str(e)), None)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"compare: {ref + ': ' if ref else ''}{first}") from None
    table = Table(title="grpoflow compare")
    table.add_column("")
    for s in summaries:
        table.add_column(f"{s['run']} ({s['run_id'][:8]})")
    for row in table_rows(*summaries):
        table.add_row(*row)
    Console().print(table)
    return 0


def preflight(cfg: PipelineConfig) -> None:
    """What must be reachable for a run, checked in seconds before any stage (tasks/pipeline/preflight.py): the
    MLflow tracking server, and hub ids that are not cached. `grpoflow validate` stays offline and skips these."""
    from grpoflow.tasks.dataio.sources import BUILTIN_SOURCE, HUMANEVAL_SOURCE, looks_like_file
    from grpoflow.tasks.model.sources import ALIASES, is_gguf
    from grpoflow.tasks.pipeline import preflight as pf

    uri = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    key = "tracking.uri" if cfg.tracking.uri else "MLFLOW_TRACKING_URI"
    if problem := pf.tracking_problem(uri):
        raise ConfigError(f"{key}: {problem}")
    m, d = cfg.model, cfg.data
    if m.name != "tiny" and m.name not in ALIASES and not is_gguf(m.name) and pf.is_hub_id(m.name):
        if problem := pf.hub_problem("model.name", m.name, "model", m.revision):
            raise ConfigError(problem)
    if d.source not in (BUILTIN_SOURCE, HUMANEVAL_SOURCE) and not s3.is_s3_uri(d.source):
        if not looks_like_file(d.source) and pf.is_hub_id(d.source):
            if problem := pf.hub_problem("data.source", d.source, "dataset"):
                raise ConfigError(problem)


def _run_pipeline(cfg: PipelineConfig, before=None, check=None, command: str = "grpoflow resume") -> int:
    """Run the flow on ``cfg``'s workspace once the checks pass, holding the workspace (tasks/storage/lock.py;
    re-entrant: `resume` takes it first); ``check(store)`` runs under the lock, ``before()`` once the server is up."""
    timeline.mark("config_loaded")
    preflight(cfg)
    _setup_env(cfg)
    if s3.is_s3_uri(cfg.run.output_dir):
        s3.S3Client(cfg.storage).check_access(
            cfg.run.output_dir
        )  # bucket, credentials, endpoint: before Prefect and MLflow start
    from grpoflow.tasks.storage.lock import workspace_lock

    store = open_store(join_location(cfg.run.output_dir, cfg.run.name), cfg.storage)
    with workspace_lock(store, command):  # a second process: exit 2 naming this one, before any work
        if check is not None:
            check(store)
        return _serve_pipeline(cfg, before)


def _serve_pipeline(cfg: PipelineConfig, before) -> int:
    # Prefect's server starts in its own process (its own session: Ctrl-C reaches the CLI, which stops the server
    # last) while this one does its heavy imports (vLLM's too): on two cores the two starts overlap instead of
    # adding up
    server = start_server()
    try:
        if cfg.generation.backend == "vllm":  # fail now, not after data prep and SFT
            from grpoflow.tasks.generation.vllm_engine import config_problem

            if problem := config_problem(cfg):
                raise ConfigError(f"generation.backend=vllm: {problem}")
        from grpoflow.flows.pipeline import grpo_pipeline  # heavy imports only after the config is valid
    except BaseException:
        if server is not None:
            server.stop()
        raise
    timeline.mark("imports_done")

    quiet_stage_errors()
    workspace = join_location(cfg.run.output_dir, cfg.run.name)
    t0 = time.perf_counter()
    with serving(server):
        timeline.mark("prefect_server_up")
        if before is not None:
            before()
        result = grpo_pipeline(config=cfg, workspace=str(workspace))
    print_summary(result, time.perf_counter() - t0)
    return 0


class _NoTracebackForStageErrors(logging.Filter):
    """Prefect logs a failed task and flow with the exception's traceback; for a StageError (the user's input,
    reported in one line at the end, the traceback in the workspace's logs/) it keeps just the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], StageError):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_stage_errors() -> None:
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForStageErrors) for f in logger.filters):
            logger.addFilter(_NoTracebackForStageErrors())


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


def cmd_sync(args) -> int:
    """Send what RUN_DIR's tracking journal holds unsent (a tracking server that was down when the run ended).

    Exit 0 when all was sent; 1 while records remain (each journal's count and the store's last answer are
    printed); 2 when a journal was written for another store than the one it would send to (both named), unless
    --force-store."""
    run_dir = Path(args.run_dir).resolve()
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(
            f"{args.run_dir}: no config.yaml; RUN_DIR must be a local run workspace (<output_dir>/<name>)"
        )
    from grpoflow.tasks.storage.lock import workspace_lock

    with workspace_lock(open_store(run_dir), "grpoflow sync"):  # a live run sends its own journal
        return _sync(args, run_dir)


def _sync(args, run_dir: Path) -> int:
    from grpoflow.tasks.tracking.journal import JOURNAL_DIR
    from grpoflow.tasks.tracking.journal_store import describe, other_store, redact_uri
    from grpoflow.tasks.tracking.reach import tracking_problem
    from grpoflow.tasks.tracking.sender import replay
    from grpoflow.tasks.tracking.tracker import tracking_uri

    cfg = load_config(str(run_dir / "config.yaml"), [])
    cfg = cfg.model_copy(
        update={"run": cfg.run.model_copy(update={"name": run_dir.name, "output_dir": str(run_dir.parent)})}
    )
    uri = args.tracking_uri or tracking_uri(cfg)
    folder = run_dir / JOURNAL_DIR
    others = {p: r for p in sorted(folder.glob("*.jsonl")) if (r := other_store(p, uri)) is not None}
    if others and not args.force_store:
        lines = "; ".join(f"{p} was written for {describe(r)}" for p, r in others.items())
        raise ConfigError(
            f"sync: {lines}, not {redact_uri(uri)} (the store this sync would send to); its runs are not there. "
            "Pass --tracking-uri with the journal's store, or --force-store to send to this one anyway"
        )
    if problem := tracking_problem(uri):
        raise ConfigError(problem)
    done = replay(folder, uri, args.timeout, cfg.tracking.request_timeout_s, force_store=args.force_store)
    for name, r in done.items():
        dropped = f"; {len(r.dropped)} refused by the store and dropped: {', '.join(r.dropped)}" if r.dropped else ""
        if r.left == 0:
            print(f"{name}: sent{dropped}")
        else:
            why = f"written for {r.other_store}" if r.other_store else r.error or "no answer"
            print(f"{name}: {r.left} records remain in {folder / (name + '.jsonl')} ({why}){dropped}")
    if not done:
        print(f"{folder}: nothing unsent")
    if left := sum(r.left for r in done.values()):
        print(f"grpoflow: {left} records remain unsent; `grpoflow sync {args.run_dir}` sends them", file=sys.stderr)
        return 1
    return 0


def cmd_deploy(args) -> int:
    """Work pools (created when missing) and the deployments of infra/prefect.yaml (flows/operations.py); existing
    deployments keep their parameters unless --reset-params (flows/redeploy.py)."""
    from grpoflow.flows.operations import deploy

    return deploy(args.prefect_args)


def cmd_data_landed(args) -> int:
    from grpoflow.flows.operations import EVENT, emit_data_landed

    print(f"emitted {EVENT} for {args.path} (event {emit_data_landed(args.path)})")
    return 0


def cmd_continuous_status(args) -> int:
    """What the continuous flow has consumed from SOURCE, what it quarantined and why, and what waits."""
    from grpoflow.flows.continuous import LEDGER, join_location
    from grpoflow.tasks.ops.datasource import Ledger, list_source, state_location

    output_dir = args.output_dir or config_from_dict({}).run.output_dir
    ledger = Ledger(join_location(state_location(args.source, args.state_dir, output_dir), LEDGER))
    try:
        entries = ledger.entries()
        waiting = ledger.new_files(list_source(args.source))
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    consumed = [e for e in entries if not e.get("quarantined")]
    print(f"ledger {ledger.location}: {len(consumed)} files consumed")
    for e in ledger.quarantined():
        when = e.get("quarantined_at", "?")
        print(f"quarantined: {e['name']} (cycle {e.get('cycle', '?')}, {when}): {e['error']}")
    print(f"waiting: {len(waiting)} new files{': ' if waiting else ''}{', '.join(f.name for f in waiting)}")
    return 0


def cmd_validate(args) -> int:
    cfg = _load(args)
    print(json.dumps(cfg.to_dict(), indent=2) if args.show else "config OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpoflow", description="GRPO fine-tuning pipeline (Prefect + MLflow)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (
        ("run", cmd_run, "run the whole pipeline: data -> sft -> grpo -> eval -> export"),
        ("validate", cmd_validate, "load and check a config without running anything"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", nargs="?", default=None, help="YAML config (default: the embedded offline config)")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.max_steps=10")
        p.set_defaults(fn=fn)
        p.add_argument(
            "--trl-config",
            metavar="FILE",
            help="a TRL GRPOConfig as YAML/JSON (flat keys): read as the config's trl: section (docs/trl.md)",
        )
        if name == "validate":
            p.add_argument("--show", action="store_true", help="print the resolved config")
        else:
            p.add_argument(
                "--force",
                action="store_true",
                help="run.name names a run with another config: replace its finished stages (each is named)",
            )
    p = sub.add_parser("resume", help="rerun a run workspace: skip complete stages, continue GRPO and the MLflow run")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run workspace (<output_dir>/<run name>, holds config.yaml)")
    p.add_argument(
        "--from-stage", metavar="STAGE", help="recompute this stage and all later ones: data, sft, grpo, eval, export"
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides of the run's config.yaml")
    p.set_defaults(fn=cmd_resume)
    p = sub.add_parser("sync", help="send a run's tracking journal (what an unreachable MLflow server missed)")
    p.add_argument("run_dir")
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="default: the run's tracking.uri, $MLFLOW_TRACKING_URI, else <RUN_DIR>/../mlflow.db",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to keep trying (default 300)")
    p.add_argument(
        "--force-store",
        action="store_true",
        help="send journals written for another tracking store to this one anyway (without it, sync exits 2 "
        "naming both stores)",
    )
    p.set_defaults(fn=cmd_sync)
    p = sub.add_parser("compare", help="two runs side by side from MLflow: accuracy, reward, step time, config diff")
    for name in ("run_a", "run_b"):
        p.add_argument(name, metavar=name.upper(), help="a run workspace folder (holds run.json) or an MLflow run id")
    p.add_argument("--tracking-uri", help="for run ids: the MLflow tracking URI (default $MLFLOW_TRACKING_URI)")
    p.add_argument("--window", type=int, default=20, help="steps averaged for the first/last reward (20)")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("deploy", help="create the work pools and deploy infra/prefect.yaml (needs PREFECT_API_URL)")
    p.add_argument(
        "prefect_args",
        nargs="*",
        help="passed on to `prefect deploy` (default --all), e.g. -n grpo-continuous/local --params '{...}'; "
        "a deployment that exists keeps its parameters (--params sets keys over them)",
    )
    p.add_argument(
        "--reset-params",
        action="store_true",
        help="deploy infra/prefect.yaml's parameters instead of the existing deployments' (then --params over them)",
    )
    p.set_defaults(fn=cmd_deploy)
    p = sub.add_parser("continuous-status", help="what the continuous flow consumed, quarantined (why), and what waits")
    p.add_argument("source", metavar="SOURCE", help="the deployment's data source (a folder or s3://bucket/prefix)")
    p.add_argument("--state-dir", help="the deployment's state_dir, when it sets one")
    p.add_argument("--output-dir", help="the config's run.output_dir, when not the default 'runs'")
    p.set_defaults(fn=cmd_continuous_status)
    p = sub.add_parser("data-landed", help="emit the grpoflow.data.landed event: starts a continuous cycle")
    p.add_argument("path", metavar="PATH", help="the new file or folder (or s3://bucket/prefix)")
    p.set_defaults(fn=cmd_data_landed)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["deploy"] and argv[1:2] not in (["-h"], ["--help"]):
        # everything after `deploy` belongs to `prefect deploy` (argparse would claim its options)
        args, extra = argparse.Namespace(command="deploy", fn=cmd_deploy, prefect_args=argv[1:]), []
    else:
        args, extra = parser.parse_known_args(argv)
    if extra and args.command == "resume" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]  # overrides on both sides of --from-stage
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handle_sigterm()
    _library_env()
    try:
        return args.fn(args)
    except (ConfigError, WorkspaceBusy) as e:
        print(f"grpoflow: {e}", file=sys.stderr)
        return 2
    except s3.S3Error as e:  # a bucket, key, endpoint or credentials problem: the message names it
        print(f"grpoflow: {e}", file=sys.stderr)
        return 1
    except StageError as e:  # the user's input, found inside a stage: one line; completed stages are kept
        print(
            f"grpoflow: {e.stage}: {e.message} (traceback: {e.log_path}; after fixing it, "
            f"`grpoflow resume {e.workspace}` reruns from this stage)",
            file=sys.stderr,
        )
        return 1
    except Exception as e:
        if not type(e).__module__.startswith("mlflow."):
            raise
        # MLflow's own error outside a stage (the parent run, the registry, compare): its first line, no traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"grpoflow: MLflow ({type(e).__name__}): {first}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        print(
            f"grpoflow: {'terminated' if isinstance(e, Terminated) else 'interrupted'}; `grpoflow resume RUN_DIR` "
            "continues (GRPO from its newest checkpoint)",
            file=sys.stderr,
        )
        return 143 if isinstance(e, Terminated) else 130


if __name__ == "__main__":
    sys.exit(main())
