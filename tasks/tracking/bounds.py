"""Every HTTP request the tracking sender makes ends within its bound: one try, no longer than
``tracking.request_timeout_s`` (an artifact transfer: MLflow's own timeout, MLFLOW_HTTP_REQUEST_TIMEOUT, 120 s by
default, since a big upload may take that long to be answered), and never past the sender's deadline (the end of
``grpoflow sync --timeout``, of resume's replay, of a stage's close within ``tracking.flush_timeout_s``).

Why here: artifact, table and model lines go through MlflowClient, whose requests (its REST store's and its HTTP
artifact repository's) read MLflow's retry settings (MLFLOW_HTTP_REQUEST_MAX_RETRIES, 7 with a backoff factor of 2:
minutes) and timeout from the environment at each call. Setting those variables would change every MLflow call of
the process, a stage's run creation and the model registration included, from another thread. Instead the sender
thread marks itself (:func:`bounded`, a thread-local) and MLflow's one function that opens every such request
(``mlflow.utils.rest_utils._get_http_response_with_retries``, 3.4 to 3.17) is wrapped once to apply the bound to the
marked thread only; other threads' requests are left as they are. The sender does its own backoff, so one try is
what it wants.

Not bounded here: an artifact store the client writes to directly (``--no-serve-artifacts`` with s3://..., boto3's
own retries); the sender still stops between lines at its deadline.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)
_bound = threading.local()  # .limits: (request_timeout_s, deadline as time.monotonic()) while a sender sends
_installed = threading.Lock()
ARTIFACT_PATH = "/mlflow-artifacts/"  # an artifact transfer through the tracking server (its time is the file's)


class OutOfTime(TimeoutError):
    """The sender's deadline passed before a request could start: the line stays in the journal."""


@contextlib.contextmanager
def bounded(request_timeout_s: float, deadline: float = math.inf) -> Iterator[None]:
    """MLflow HTTP requests made by this thread within the block: one try each, ``request_timeout_s`` at most (an
    artifact transfer: MLflow's timeout), none past ``deadline`` (time.monotonic())."""
    _install()
    prev = getattr(_bound, "limits", None)
    _bound.limits = (request_timeout_s, deadline)
    try:
        yield
    finally:
        _bound.limits = prev


def _install() -> None:
    """Wrap MLflow's request function (once per process)."""
    from mlflow.utils import rest_utils

    with _installed:
        original = getattr(rest_utils, "_get_http_response_with_retries", None)
        if original is None:
            log.warning("MLflow has no rest_utils._get_http_response_with_retries: the sender keeps MLflow's retries")
            return
        if not getattr(original, "grpoflow_bounded", False):
            rest_utils._get_http_response_with_retries = _wrap(original)


def _wrap(original):
    @functools.wraps(original)
    def request(method, url, max_retries, backoff_factor, backoff_jitter, retry_codes, *args, **kwargs):
        limits = getattr(_bound, "limits", None)
        if limits is None:  # not the sender: MLflow's own settings
            return original(method, url, max_retries, backoff_factor, backoff_jitter, retry_codes, *args, **kwargs)
        kwargs["timeout"] = request_timeout(url, kwargs.get("timeout"), *limits)
        return original(method, url, 0, 0, 0, retry_codes, *args, **kwargs)

    request.grpoflow_bounded = True
    return request


def request_timeout(url: str, given: float | None, request_timeout_s: float, deadline: float) -> float:
    """The timeout of one request to ``url``: ``request_timeout_s`` (an artifact transfer: ``given``, MLflow's), cut
    to the time left before ``deadline``; OutOfTime when none is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise OutOfTime(f"the sender's time ran out before {url}")
    own = given if ARTIFACT_PATH in url and given else request_timeout_s
    return max(min(own, left), 0.05)


def out_of_time(exc: BaseException) -> bool:
    """True when ``exc`` (MLflow wraps what a request raised) is, or came from, :class:`OutOfTime`."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OutOfTime):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
