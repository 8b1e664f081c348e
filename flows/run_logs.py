"""grpoflow's own log lines in a flow run's Prefect logs (the UI's flow-run page).

Prefect sends to its API only its own loggers and those PREFECT_LOGGING_EXTRA_LOGGERS names, and it reads that
setting once, when it sets up logging as it is imported: setting it inside a flow is too late. So the flow-run
process must start with it in its environment: the deployments' job variables (infra/prefect.yaml), the GPU
pools' templates (infra/work-pools/), the compose workers (docker/compose.yaml) and `grpoflow run` (flows/cli_env.py,
before anything imports Prefect) all carry :data:`FLOW_RUN_LOG_ENV`; tests/infra checks that they agree.
"""

from __future__ import annotations

import logging

# the `grpoflow` logger tree goes to the flow run's logs; a grpoflow line logged outside a run's context (the
# tracking sender's thread, the CLI before the flow starts) stays on the console instead of raising a warning
FLOW_RUN_LOG_ENV = {
    "PREFECT_LOGGING_EXTRA_LOGGERS": "grpoflow",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}


def show_grpoflow_info() -> None:
    """Let grpoflow's INFO lines (a stage running or skipped, the evaluation table) through in a flow-run process:
    Prefect's logging config leaves the root logger, whose level the grpoflow tree inherits, at WARNING. Called at
    the start of each deployed flow; a level set already on the ``grpoflow`` logger stays."""
    root = logging.getLogger("grpoflow")
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
