"""Whether a tracking server answers: one GET with a short timeout (the CLI's preflight and the parent run's
open use it). Any HTTP answer, even 404 behind a proxy, counts as reachable; MLflow's client keeps its own
retries for errors later in the run."""

from __future__ import annotations

import urllib.error
import urllib.request

from grpoflow.tasks.config.secrets import redact, without_userinfo

PROBE_TIMEOUT_S = 5.0


def unreachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``url`` gives no HTTP answer within ``timeout`` seconds (refused, no route, timed out, DNS); None when
    any HTTP status comes back."""
    try:
        with urllib.request.urlopen(urllib.request.Request(without_userinfo(url), method="GET"), timeout=timeout):
            return None
    except urllib.error.HTTPError:  # an answer: the server is there
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason


def tracking_problem(uri: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """An http(s) tracking URI whose server does not answer GET <uri>/health within ``timeout`` seconds."""
    if not uri.lower().startswith(("http://", "https://")):
        return None
    why = unreachable(uri.rstrip("/") + "/health", timeout)
    if why is None:
        return None
    return (
        f"MLflow tracking server {redact(uri)} does not answer ({why}); start it, or fix tracking.uri / "
        "$MLFLOW_TRACKING_URI (unset both to track in <output_dir>/mlflow.db)"
    )
