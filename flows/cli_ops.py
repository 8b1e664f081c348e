"""The commands around runs rather than running one: ``grpoflow compare`` (two runs side by side), ``grpoflow sync``
(what an unreachable MLflow server missed), ``grpoflow continuous-status`` and ``continuous-skip`` (the continuous
flow's ledger), and ``grpoflow deploy`` / ``grpoflow data-landed``, which talk to a Prefect server
(flows/operations.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grpoflow.tasks.config import ConfigError, config_from_dict, load_config
from grpoflow.tasks.storage.store import open_store


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
    from grpoflow.tasks.pipeline.run_folder import foreign_config

    if foreign := foreign_config(open_store(run_dir)):  # another tool's folder: no lock file left there
        raise ConfigError(f"RUN_DIR: {foreign}; RUN_DIR must be a local run workspace (<output_dir>/<name>)")
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
        elif r.deleted:  # its run or experiment is deleted: not an outage
            print(f"{name}: {r.deleted}{dropped}")
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


def _continuous_ledger(args):
    """(the state location, its Ledger) of the continuous deployment on ``args.source`` (``--state-dir``,
    ``--output-dir``), as the flow finds them (continuous.py)."""
    from grpoflow.flows.continuous import LEDGER, join_location
    from grpoflow.tasks.ops.datasource import Ledger, state_location

    state = state_location(args.source, args.state_dir, args.output_dir or config_from_dict({}).run.output_dir)
    return state, Ledger(join_location(state, LEDGER))


def _file_names(keys: list[str]) -> str:
    from grpoflow.tasks.ops.datasource import DataFile

    return ", ".join(DataFile.from_key(k).name for k in keys)


def cmd_continuous_skip(args) -> int:
    """Set the continuous flow's unfinished cycle aside (one that fails on every run): its files are quarantined
    with the reason, so the next run goes on to newer files; holding the state folder, as a cycle does."""
    from grpoflow.tasks.ops.datasource import list_source
    from grpoflow.tasks.storage.lock import workspace_lock
    from grpoflow.tasks.storage.store import join_location

    state, ledger = _continuous_ledger(args)
    reason = f"set aside by grpoflow continuous-skip: {args.reason}"
    try:
        if ledger.pending() is None:  # before the lock: no state folder is made for nothing
            raise ConfigError(f"ledger {ledger.location}: no unfinished cycle to set aside")
        with workspace_lock(open_store(state, config_from_dict({}).storage), "grpoflow continuous-skip"):
            pending = ledger.set_aside(reason, list_source(args.source))
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    if pending is None:  # ended by a cycle between the check and the lock
        raise ConfigError(f"ledger {ledger.location}: no unfinished cycle to set aside (it finished meanwhile)")
    print(f"set aside cycle {pending['cycle']}: quarantined {_file_names(pending['files'])} ({reason})")
    print(f"its workspace stays: {join_location(state, 'cycles', pending['cycle'])}; land a file again with new "
          "content to train it")  # fmt: skip
    return 0


def cmd_continuous_status(args) -> int:
    """What the continuous flow has consumed from SOURCE, what it quarantined and why, and what waits."""
    from grpoflow.tasks.ops.datasource import list_source

    ledger = _continuous_ledger(args)[1]
    try:
        entries = ledger.entries()
        pending = ledger.pending()
        waiting = ledger.new_files(list_source(args.source))
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    consumed = [e for e in entries if not e.get("quarantined")]
    again = sum(1 for e in consumed if e.get("same_as"))  # uploaded again, the same bytes: recorded, not trained
    print(f"ledger {ledger.location}: {len(consumed) - again} files consumed"
          + (f" ({again} uploaded again with the same bytes, not trained again)" if again else ""))  # fmt: skip
    for e in ledger.quarantined():
        when = e.get("quarantined_at", "?")
        print(f"quarantined: {e['name']} (cycle {e.get('cycle', '?')}, {when}): {e['error']}")
    if pending is not None:  # killed or failed: the next run continues it while its files are unchanged
        start = f"champion version {pending['champion']}" if pending["champion"] else "no champion"
        names = _file_names(pending["files"])
        print(f"unfinished: cycle {pending['cycle']} ({start}): {names}; the next run continues it")
    print(f"waiting: {len(waiting)} new files{': ' if waiting else ''}{', '.join(f.name for f in waiting)}")
    return 0
