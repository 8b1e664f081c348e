"""What to say about records a journal keeps because their MLflow run, or the run's experiment, was deleted.

MLflow refuses every line of a deleted run ("must be in the 'active' state"); the journal keeps them
(tasks/tracking/refusal.py), since the run can be restored. The messages after that must say so: ``grpoflow sync``,
``grpoflow resume`` and the pipeline's model registration said the server "does not answer" (or showed MLflow's
400), which sent the user looking for an outage. Each note names the run (or experiment), how many records wait
where, the command that restores it and the sync that sends them, and the files to delete to drop them instead.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from mlflow.tracking import MlflowClient

from grpoflow.tasks.tracking.bounds import bounded
from grpoflow.tasks.tracking.journal import JOURNAL_DIR, Journal
from grpoflow.tasks.tracking.journal_store import redact_uri


def deleted_note(client: MlflowClient, journal: Journal, request_timeout_s: float = 10.0) -> str:
    """The note for ``journal``'s unsent records when its run or the run's experiment is deleted on ``client``'s
    server; "" when neither is (or the server does not say)."""
    from mlflow.exceptions import MlflowException

    rid = journal.run_id
    uri = redact_uri(client.tracking_uri)
    try:
        with bounded(request_timeout_s):  # one try each: a message must not wait minutes on MLflow's retries
            run = client.get_run(rid)
            exp = client.get_experiment(run.info.experiment_id)
    except MlflowException:
        return ""
    if exp.lifecycle_stage == "deleted":  # deleting an experiment deletes its runs too: restore the experiment
        what = f"The experiment {exp.experiment_id} ({exp.name!r}) of MLflow run {rid} is deleted"
        restore = f"mlflow experiments restore --experiment-id {exp.experiment_id}"
    elif run.info.lifecycle_stage == "deleted":
        what, restore = f"MLflow run {rid} is deleted", f"mlflow runs restore --run-id {rid}"
    else:
        return ""
    return (
        f"{what} in {uri}: {journal.pending_count()} records wait in {journal.path}. Restore it "
        f"(`MLFLOW_TRACKING_URI={shlex.quote(uri)} {restore}`), then `grpoflow sync {journal.folder.parent}` sends "
        f"them; or drop them: `rm -r {shlex.quote(str(journal.folder))}/{journal.name}.*`"
    )


def held_back(root: Path, client: MlflowClient, request_timeout_s: float = 10.0) -> list[str]:
    """The notes of the journals of the workspace at ``root`` whose unsent records belong to a deleted run."""
    notes = []
    for path in sorted((root / JOURNAL_DIR).glob("*.jsonl")):
        journal = Journal(path.parent, Journal.run_of(path), path.stem)
        if journal.pending_count() and (note := deleted_note(client, journal, request_timeout_s)):
            notes.append(note)
    return notes


def registration_skipped(root: Path, client: MlflowClient, flushed: bool, request_timeout_s: float = 10.0) -> str:
    """Why the pipeline's model is not registered, when records are still unsent at its end: the server does not
    answer (``flushed`` False: the pipeline run's own records did not go), a stage run is deleted, or a stage's
    journal still holds records for another reason (its last answer was an error)."""
    if not flushed:
        return "MLflow tracking does not answer: the model is not registered; `grpoflow resume` does it"
    if notes := held_back(root, client, request_timeout_s):
        return "the model is not registered: " + " ".join(notes) + " `grpoflow resume` then registers it"
    return (
        f"records of the stages are still unsent in {root / JOURNAL_DIR}: the model is not registered; "
        "`grpoflow resume` sends them and registers it"
    )
