"""Command line: ``grpoflow run [CONFIG] [key=value ...]``, ``grpoflow validate`` and
``grpoflow resume RUN_DIR [--from-stage STAGE] [key=value ...]``, ``grpoflow sync RUN_DIR`` (sends what an
unreachable MLflow server missed: docs/tracking.md) and ``grpoflow compare RUN_A RUN_B``. RUN_DIR
may be an s3:// workspace (its config.yaml is read with $AWS_ENDPOINT_URL or a storage.endpoint_url override).
``grpoflow deploy`` and ``grpoflow data-landed PATH`` talk to a Prefect server (flows/operations.py).

The config is loaded and validated before anything heavy is imported, so a bad key fails in
about a second with a message naming it (exit code 2). Prefect runs the flow in-process against a
server the CLI starts and stops itself (flows/embedded_server.py), with its SQLite store under
<output_dir>/.prefect; set PREFECT_API_URL to use a Prefect server instead.

The commands live beside this module, one job each: running the pipeline (flows/cli_run.py: run, resume, validate),
the commands around runs (flows/cli_ops.py: compare, sync, continuous-status, deploy, data-landed), the process
environment set before the libraries load (flows/cli_env.py) and the run's summary table (flows/cli_summary.py);
this module parses the command line and turns errors into exit codes.
"""

from __future__ import annotations

import argparse
import sys

from grpoflow.flows.cli_env import _library_env, busy_cores
from grpoflow.flows.cli_ops import (
    cmd_compare,
    cmd_continuous_skip,
    cmd_continuous_status,
    cmd_data_landed,
    cmd_deploy,
    cmd_sync,
)
from grpoflow.flows.cli_run import (
    cmd_resume,
    cmd_run,
    cmd_validate,
    preflight,
    print_reruns,
    quiet_stage_errors,
    refuse_replacing,
)
from grpoflow.flows.cli_summary import print_summary, timeline_rows
from grpoflow.flows.embedded_server import Terminated, handle_sigterm
from grpoflow.tasks.config import ConfigError
from grpoflow.tasks.pipeline.errors import StageError
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.lock import WorkspaceBusy, WorkspaceLost

__all__ = [  # the CLI's public names, importable from here as before the commands moved to flows/cli_*.py
    "busy_cores",
    "cmd_compare",
    "cmd_continuous_skip",
    "cmd_continuous_status",
    "cmd_data_landed",
    "cmd_deploy",
    "cmd_resume",
    "cmd_run",
    "cmd_sync",
    "cmd_validate",
    "main",
    "preflight",
    "print_reruns",
    "print_summary",
    "quiet_stage_errors",
    "refuse_replacing",
    "timeline_rows",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpoflow", description="GRPO fine-tuning pipeline (Prefect + MLflow)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (
        ("run", cmd_run, "run the whole pipeline: data -> sft -> grpo -> eval -> export"),
        ("validate", cmd_validate, "load and check a config (imports the reward modules it names; runs no stage)"),
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
    p = sub.add_parser(
        "continuous-skip", help="set aside the continuous flow's unfinished cycle (one that fails every run)"
    )
    p.add_argument("source", metavar="SOURCE", help="the deployment's data source (a folder or s3://bucket/prefix)")
    p.add_argument("--reason", required=True, help="why, kept in the ledger beside each file it quarantines")
    p.add_argument("--state-dir", help="the deployment's state_dir, when it sets one")
    p.add_argument("--output-dir", help="the config's run.output_dir, when not the default 'runs'")
    p.set_defaults(fn=cmd_continuous_skip)
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
    except (ConfigError, WorkspaceBusy, WorkspaceLost) as e:  # WorkspaceLost: another process took it over
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
