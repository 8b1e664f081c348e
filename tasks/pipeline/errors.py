"""The error a stage raises on the user's input (no heavy imports: the CLI catches it)."""

from __future__ import annotations


class StageError(Exception):
    """A stage failed on the user's input; the message names the cause, ``log_path`` holds the traceback."""

    def __init__(self, stage: str, message: str, log_path: str, workspace: str):
        super().__init__(stage, message, log_path, workspace)  # picklable: Prefect may copy it across threads
        self.stage, self.message, self.log_path, self.workspace = stage, message, log_path, workspace

    def __str__(self) -> str:
        return f"{self.stage}: {self.message}"

    def __repr__(self) -> str:  # what Prefect's failure lines print
        return f"StageError({self})"
