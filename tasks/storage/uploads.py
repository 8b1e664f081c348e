"""Uploads to S3 that outlive an outage of the endpoint: retried with exponential backoff for a bounded time.

:func:`retry_outage` runs one upload in the calling thread, retrying a failed attempt (an :class:`~s3.S3Error`
other than refused credentials) after 1, 2, 4, ... seconds (at most ``backoff_cap_s``) until it succeeds or
``budget_s`` seconds have passed since the start of its first failed attempt; then it raises
:class:`StorageOutage`, naming the endpoint, the time waited and the last error. Each attempt runs under
:func:`~s3.bounded_attempt`: one try per request (no botocore retries on top of ours) and timeouts that shrink with
the budget left, so the stage fails within the budget plus a few seconds (s3.attempt_limits), whether the endpoint
refuses connections or accepts them and never answers.

:class:`UploadQueue` runs such uploads in order on one background thread, so training goes on during an outage:
``submit`` queues a job (a checkpoint's upload) and returns at once while fewer than ``max_pending`` are waiting,
else it waits for the oldest (and logs that it does). The first job whose outage outlasts the budget stops the
queue; the next ``submit`` or ``drain`` in the training thread raises its :class:`StorageOutage`, which also
names the last job whose upload finished (the last checkpoint safely on S3; a job's clean-up after its upload, such
as pruning older checkpoints, does not count against it). While the endpoint does not answer a
warning says so every ``warn_every_s`` ("S3 endpoint X unreachable for 12 s, 2 checkpoint(s) queued"), and
another when it is back.

:func:`drain_on_sigterm` makes a SIGTERM (a scheduler stopping the pod, torchrun stopping the ranks) wait for the
queued uploads, each within the budget, before the process exits, so checkpoints saved before the signal are on S3.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from grpoflow.tasks.storage.s3 import S3AccessError, S3Error, bounded_attempt

log = logging.getLogger(__name__)


class StorageOutage(S3Error):
    """An upload to S3 kept failing for longer than storage.outage_budget_s."""


def backoff_s(attempt: int, cap_s: float) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1, 2, ...): min(2 ** (attempt - 1), cap_s)."""
    return min(2.0 ** (attempt - 1), cap_s)


def retryable(exc: BaseException) -> bool:
    """Whether an upload failure may pass with time: any S3 error but refused or missing credentials."""
    return isinstance(exc, S3Error) and not isinstance(exc, (S3AccessError, StorageOutage))


class _Outage:
    """One outage of the endpoint as seen by the retries of one job: when it began, warnings, the budget."""

    def __init__(self, where: str, what: str, budget_s: float, warn_every_s: float, queued: Callable[[], int]):
        self.where, self.what, self.budget_s = where, what, budget_s
        self.warn_every_s, self.queued = warn_every_s, queued
        self.since: float | None = None
        self.warned = 0.0

    def failed(self, exc: BaseException, attempt: int, started: float) -> None:
        """Attempt ``attempt``, begun at ``started`` (time.monotonic()), failed with ``exc``."""
        now = time.monotonic()
        if self.since is None:
            self.since, self.warned = started, now  # the outage counts from the start of its first failed attempt
            log.warning(
                "S3 endpoint %s unreachable (%s); retrying %s for up to %.0f s (storage.outage_budget_s), "
                "%d checkpoint(s) queued; training goes on",
                self.where,
                exc,
                self.what,
                self.budget_s,
                self.queued(),
            )
        elif now - self.warned >= self.warn_every_s:
            self.warned = now
            log.warning(
                "S3 endpoint %s unreachable for %.0f s, %d checkpoint(s) queued", self.where, self.waited, self.queued()
            )
        if self.waited >= self.budget_s:
            raise StorageOutage(
                f"S3 endpoint {self.where} unreachable for {self.waited:.0f} s (storage.outage_budget_s="
                f"{self.budget_s:g}), after {attempt} attempt(s) of {self.what}; last error: {exc}"
            ) from None

    @property
    def waited(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def over(self) -> None:
        if self.since is not None:
            waited, queued = self.waited, self.queued()
            msg = "S3 endpoint %s answers again after %.0f s; %d checkpoint(s) queued"
            log.warning(msg, self.where, waited, queued)


def retry_outage(
    fn: Callable[[], None],
    where: str,
    what: str,
    budget_s: float,
    *,
    backoff_cap_s: float = 30.0,
    warn_every_s: float = 10.0,
    queued: Callable[[], int] = lambda: 0,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Run ``fn`` (an upload to the endpoint ``where``; ``what`` names it in messages), retried with exponential
    backoff while it fails with a :func:`retryable` error, until ``budget_s`` seconds have passed since its first
    failed attempt began: then :class:`StorageOutage`. Its S3 requests run under :func:`~s3.bounded_attempt`."""
    outage = _Outage(where, what, budget_s, warn_every_s, queued)
    attempt = 0
    while True:
        attempt += 1
        started = time.monotonic()
        try:
            with bounded_attempt(budget_s - outage.waited):
                fn()
        except Exception as e:
            if not retryable(e):
                raise
            outage.failed(e, attempt, started)
            sleep(min(backoff_s(attempt, backoff_cap_s), max(budget_s - outage.waited, 0.0) + 0.01))
            continue
        outage.over()
        return


class UploadQueue:
    """Jobs (uploads) run in submission order on one background thread, each under :func:`retry_outage`."""

    def __init__(
        self,
        where: str,
        budget_s: float,
        max_pending: int,
        *,
        backoff_cap_s: float = 30.0,
        done: list[str] | None = None,
    ):
        """``done``: what is already on S3 (the checkpoints a resumed stage started with), oldest first."""
        self.where, self.budget_s, self.max_pending, self.backoff_cap_s = where, budget_s, max_pending, backoff_cap_s
        self._jobs: deque[tuple[str, Callable[[], None], Callable[[], None] | None]] = deque()
        self._running: str | None = None
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.done: list[str] = list(done or [])  # names of the jobs that finished, in order
        self._thread = threading.Thread(target=self._work, name="s3-uploads", daemon=True)
        self._thread.start()

    def pending(self) -> list[str]:
        """Names of the jobs queued or running, oldest first."""
        with self._cond:
            return self.pending_locked()

    def submit(self, name: str, job: Callable[[], None], then: Callable[[], None] | None = None) -> None:
        """Queue ``job`` and, once it succeeded (``name`` counts as on S3 from then on), ``then`` (a clean-up such
        as pruning older checkpoints, retried the same way); wait first while ``max_pending`` jobs are pending (a
        log line says so). Raises the queue's :class:`StorageOutage` (or another upload error) once a job failed."""
        with self._cond:
            self._raise()
            if len(self.pending_locked()) >= self.max_pending:
                log.warning(
                    "%d checkpoint upload(s) to %s pending (storage.max_pending_uploads=%d): training waits for %s "
                    "to reach S3 before queuing %s",
                    len(self.pending_locked()),
                    self.where,
                    self.max_pending,
                    self.pending_locked()[0],
                    name,
                )
                self._cond.wait_for(lambda: self._error is not None or len(self.pending_locked()) < self.max_pending)
                self._raise()
            self._jobs.append((name, job, then))
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every queued job finished (each within the budget); raise the first failure."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or not self.pending_locked())
            self._raise()

    def pending_locked(self) -> list[str]:
        return ([self._running] if self._running else []) + [name for name, _, _ in self._jobs]

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs))
                name, job, then = self._jobs.popleft()
                self._running = name
            try:
                self._retry(job, f"the upload of {name}")
                with self._cond:
                    self.done.append(name)  # on S3 now, whatever becomes of the clean-up after it
                if then is not None:
                    self._retry(then, f"the clean-up after {name} (on S3)")
            except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
                with self._cond:
                    last = self.done[-1] if self.done else "none"
                    if isinstance(e, StorageOutage):
                        left = ", ".join(n for n in self.pending_locked() if n not in self.done) or "none"
                        e = StorageOutage(f"{e}; last checkpoint safely on S3: {last}; not uploaded: {left}")
                    self._error = e
                    self._running = None
                    self._jobs.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._running = None
                self._cond.notify_all()

    def _retry(self, fn: Callable[[], None], what: str) -> None:
        retry_outage(
            fn, self.where, what, self.budget_s, backoff_cap_s=self.backoff_cap_s, queued=lambda: len(self.pending())
        )


class Terminated(BaseException):
    """SIGTERM arrived inside :func:`drain_on_sigterm` (a BaseException, so no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def drain_on_sigterm(queue: UploadQueue) -> Iterator[None]:
    """Within the block, SIGTERM stops the block (:class:`Terminated`, raised in the main thread), waits for
    ``queue``'s pending uploads (each within its outage budget; a second SIGTERM meanwhile acts as before the block)
    and exits with status 143 (128 + SIGTERM), or hands the signal to the handler installed before when that is a
    Python function. The handler before is restored on leaving the block, so tests and the Prefect worker keep
    theirs. Outside the main thread (signals go to the main thread only) or where SIGTERM is ignored, nothing is
    installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        yield
        return

    def stop(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, previous)
        pending = queue.pending()
        log.warning(
            "SIGTERM: waiting for %d checkpoint upload(s) to %s before exiting (%s; each within "
            "storage.outage_budget_s=%g)",
            len(pending),
            queue.where,
            ", ".join(pending) or "none",
            queue.budget_s,
        )
        try:
            queue.drain()
            log.warning(
                "SIGTERM: checkpoint uploads done (%s on S3); exiting", queue.done[-1] if queue.done else "none"
            )
        finally:
            if callable(previous):
                previous(signal.SIGTERM, None)
            raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
