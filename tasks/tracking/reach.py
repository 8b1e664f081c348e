"""Whether a tracking server answers: one GET with a short timeout (the CLI's preflight and the parent run's
open use it). Any HTTP answer, even 404 behind a proxy, counts as reachable; MLflow's client keeps its own
retries for errors later in the run."""

from __future__ import annotations

import urllib.error
import urllib.request

from grpoflow.tasks.config.secrets import redact, without_userinfo

PROBE_TIMEOUT_S = 5.0


def probe(url: str, timeout: float = PROBE_TIMEOUT_S, headers: dict[str, str] | None = None) -> tuple[int | None, str]:
    """One GET of ``url``: (its HTTP status, "") when the server answers, (None, why not) when it gives no answer
    within ``timeout`` seconds (refused, no route, timed out, DNS)."""
    request = urllib.request.Request(without_userinfo(url), method="GET", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, ""
    except urllib.error.HTTPError as e:  # an answer: the server is there
        return e.code, ""
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return None, (f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason)


def unreachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``url`` gives no HTTP answer within ``timeout`` seconds; None when any HTTP status comes back."""
    status, why = probe(url, timeout)
    return None if status is not None else why


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
