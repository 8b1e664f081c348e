"""The continuous flow's parameters checked before a cycle, with errors that name the deployment and the parameter.

A deployment's parameters live on the Prefect server, set by `grpoflow deploy` (flows/redeploy.py); a cycle that
reads a folder they name, and finds none, used to fail deep inside with ``FileNotFoundError: data source
'data/incoming': not a folder`` and several tracebacks in the worker log, leaving the user to guess which
deployment and which setting. Here each is checked first and a problem is one :class:`ParameterError` naming the
deployment (the flow run's, from prefect.runtime), the parameter, the working directory relative paths resolve
against, and the command that sets it; :func:`quiet_parameter_errors` keeps its traceback out of the log.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from grpoflow.tasks.config import ConfigError, PipelineConfig, load_run_config
from grpoflow.tasks.storage.s3 import is_s3_uri


class ParameterError(ConfigError):
    """A flow parameter the run cannot use; the message names the deployment and the parameter (no traceback
    needed: :func:`quiet_parameter_errors`)."""


def deployment_name() -> str | None:
    """FLOW/DEPLOYMENT of the current flow run, None outside a deployment run (or outside a flow run)."""
    from prefect.runtime import deployment, flow_run

    try:
        name = deployment.name
    except Exception:  # no API to ask (a flow called in-process without a server): not a deployment run
        return None
    return f"{flow_run.flow_name}/{name}" if name else None


def _problem(who: str | None, flow: str, what: str, key: str, example: str) -> ParameterError:
    where = f"deployment {who}" if who else f"flow {flow}"
    # no single quotes: Prefect logs the error as its repr, which would escape them
    fix = f"; set it with `grpoflow deploy -n {who} --param {key}={example}`" if who else ""
    return ParameterError(f"{where}: {what} (working directory {os.getcwd()}){fix}")


def continuous_config(
    config: str | None, overrides: list[str] | None, source: str | None, state_dir: str | None
) -> PipelineConfig:
    """The continuous flow's config, once its parameters are usable: ``source`` an existing folder (or an s3://
    prefix), ``state_dir`` a folder or not there yet (it is created), ``config``/``overrides`` a valid continuous
    config whose local held-out file (``data.eval_source``) exists. Raises :class:`ParameterError`."""
    from grpoflow.tasks.ops.continuous import check_continuous_config

    who, flow = deployment_name(), "grpo-continuous"
    if not source:
        raise _problem(who, flow, "parameter source is not set: it names the data folder (or s3://bucket/prefix)",
                       "source", "/data/incoming")  # fmt: skip
    if not is_s3_uri(source) and not Path(source).expanduser().is_dir():
        what = "is a file, not a folder" if Path(source).expanduser().exists() else "is not a folder"
        raise _problem(who, flow, f"parameter source={json.dumps(source)} {what}", "source", "/data/incoming")
    if state_dir and not is_s3_uri(state_dir):
        path = Path(state_dir).expanduser()
        if path.exists() and not path.is_dir():
            raise _problem(who, flow, f"parameter state_dir={json.dumps(state_dir)} is a file, not a folder",
                           "state_dir", "runs/continuous")  # fmt: skip
    try:
        cfg = load_run_config(config, overrides)
        check_continuous_config(cfg)
    except ConfigError as e:
        shown = f"parameters config={json.dumps(config)}, overrides={json.dumps(list(overrides or []))}"
        raise _problem(who, flow, f"{shown}: {e}", "overrides", '["key=value",...]') from None
    held_out = cfg.data.eval_source
    if held_out and not is_s3_uri(held_out) and not Path(held_out).expanduser().exists():
        from grpoflow.tasks.dataio.sources import looks_like_file  # imports datasets: only when needed

        if looks_like_file(held_out):
            what = f"data.eval_source={json.dumps(held_out)} (parameters config/overrides) is not a file"
            raise _problem(who, flow, what, "overrides", '["data.eval_source=/data/heldout.jsonl",...]')
    return cfg


class _NoTraceback(logging.Filter):
    """Drops the traceback of a :class:`ParameterError` from a log record: its message says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ParameterError):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_parameter_errors() -> None:
    """Prefect logs a failed flow run's exception with its traceback twice (the flow run's logger, then the engine's
    as the flow-run process exits): for a :class:`ParameterError` both keep just the message."""
    for name in ("prefect.flow_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTraceback) for f in logger.filters):
            logger.addFilter(_NoTraceback())
