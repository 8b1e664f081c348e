"""What the tracking store refuses for good, and finding the refused item in a batch.

Only MLflow's answer 400 INVALID_PARAMETER_VALUE says an item can never be stored (a metric key with characters
MLflow refuses, a param logged again with another value). Every other failure is passing and retried with backoff:
401/403 (an expired token, a proxy), 404 and 409, 429 (rate limit), 5xx, connection errors and timeouts. Treating
every 4xx as permanent emptied the journal during a short auth or rate-limit outage.

One refused item must not cost the rest of a merged batch (up to 1000 metrics): :func:`send_splitting` halves a
refused batch until the refused items are alone, sends the others, and returns the refused ones for the caller to
count and log by key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
REFUSED_CODE = "INVALID_PARAMETER_VALUE"
# MLflow's answer (same code) for a run or experiment that was deleted: the run's state, not the item; a run
# deleted in the UI mid-stage can be restored (`mlflow runs restore`), so its records are kept, not dropped one by one
NOT_ACTIVE = "must be in the 'active' state"


def refused(exc: BaseException) -> bool:
    """True for MLflow's 400 INVALID_PARAMETER_VALUE about the item (a retry cannot fix it); False for anything
    else, a deleted run or experiment included."""
    from mlflow.exceptions import MlflowException

    if not isinstance(exc, MlflowException):
        return False
    try:
        return exc.error_code == REFUSED_CODE and exc.get_http_status_code() == 400 and NOT_ACTIVE not in str(exc)
    except Exception:
        return False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def send_splitting(send: Callable[[Sequence[T]], Any], items: Sequence[T]) -> list[tuple[T, str]]:
    """Send ``items`` with ``send``; when the store refuses them (:func:`refused`), send each half the same way.
    Returns the items refused alone, each with the store's reason. Any other error propagates (the caller retries
    the whole line later: what was sent already is sent again, which the store absorbs)."""
    if not items:
        return []
    try:
        send(items)
        return []
    except Exception as e:
        if not refused(e):
            raise
        if len(items) == 1:
            return [(items[0], first_line(e))]
    mid = len(items) // 2
    return send_splitting(send, items[:mid]) + send_splitting(send, items[mid:])
