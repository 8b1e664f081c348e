"""A pipeline stage, declared once: :class:`StageSpec` holds everything the layers below the stages need to know
about one stage, and :class:`Pipeline` the stages in run order.

Each stage declares its SPEC beside its code (tasks/stages/data.py, sft.py, grpo.py, evaluate.py, export.py; the
tiny base model, a folder sft and grpo write and key separately, in tasks/stages/common.py), and
tasks/stages/__init__.py lists them in order. The stage shell (tasks/pipeline/shell.py), the keys
(tasks/pipeline/fingerprint.py), resume, the tracking of a stage run (tasks/tracking/run_meta.py, run_info.py)
and the flow read the specs they are handed; none of them names a stage. Adding a stage means writing its spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpoflow.tasks.config import PipelineConfig
from grpoflow.tasks.config.fingerprint import check_path

ContentReader = Callable[[PipelineConfig], dict[str, Any]]


def _no_stages(cfg: PipelineConfig) -> tuple[str, ...]:
    return ()


def _always(cfg: PipelineConfig) -> bool:
    return True


def _no_parts(cfg: PipelineConfig) -> tuple[str, ...]:
    return ()


def _nothing(cfg: PipelineConfig) -> dict[str, Any]:
    return {}


def _no_result(summary: dict[str, Any]) -> str:
    return ""


@dataclass(frozen=True)
class StageSpec:
    """One stage of the pipeline.

    name            its folder in the workspace, its MLflow run's ``stage`` tag, its key's name
    keys            dotted PipelineConfig paths whose values key it (``run.seed``, ``model.tiny``, ``grpo``);
                    checked against the config classes here, so a renamed field raises at import
    upstream        the stages whose keys its key includes (grpo: sft when sft.enabled, else data)
    enabled         whether a run of this config runs it (sft.enabled, eval.enabled, export.enabled)
    reads           content readers (tasks/pipeline/fingerprint.py): {label: digest} of what it reads besides its
                    upstream stages' folders (a data file, a local model folder, a custom reward module)
    writes          folders it writes that are keyed by their own spec (the tiny base model)
    extends         config fields (dotted) whose raise continues its last attempt instead of starting over
                    (grpo.max_steps: a finished GRPO trains on from its last checkpoint); any other change, or a
                    lowered value, starts over in an emptied folder
    prepares_splits whether its folder holds the prepared dataset splits the later stages read (data)
    splits          the prepared dataset splits it logs as MLflow inputs
    trains          whether it trains a model (system metrics are sampled, the model is logged as an output)
    description     its MLflow description, formatted with model, dataset, loss_type and lr
    param_sections  the config sections logged as its run's params (the first under bare names)
    name_parts      what its MLflow run name adds after "<stage>" (model, dataset, learning rate ...)
    params, tags    its extra run params and filter tags
    result          the sentence its description ends with, from its summary
    before, after   hooks on its MLflow run: before(tracker, cfg), after(tracker, cfg, ws, summary)
    """

    name: str
    keys: tuple[str, ...] = ()
    upstream: Callable[[PipelineConfig], tuple[str, ...]] = _no_stages
    enabled: Callable[[PipelineConfig], bool] = _always
    reads: tuple[ContentReader, ...] = ()
    writes: tuple[StageSpec, ...] = ()
    extends: tuple[str, ...] = ()
    prepares_splits: bool = False
    splits: tuple[str, ...] = ()
    trains: bool = False
    description: str = ""
    param_sections: tuple[str, ...] = ()
    name_parts: Callable[[PipelineConfig], tuple[str, ...]] = _no_parts
    params: Callable[[PipelineConfig], dict[str, Any]] = _nothing
    tags: Callable[[PipelineConfig], dict[str, Any]] = _nothing
    result: Callable[[dict[str, Any]], str] = _no_result
    before: Callable[..., None] | None = field(default=None, compare=False)
    after: Callable[..., None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for path in (*self.keys, *self.param_sections, *self.extends):
            try:
                check_path(path)
            except AttributeError as e:
                raise AttributeError(f"stage {self.name!r}: {e}") from None
        for path in self.extends:
            if not any(path == k or path.startswith(k + ".") for k in self.keys):
                raise AttributeError(f"stage {self.name!r}: extends {path!r} is not under one of its keys")


class Pipeline:
    """The stages in run order, and the folders they write that are keyed separately (``writes``)."""

    def __init__(self, specs: tuple[StageSpec, ...]):
        self.specs = tuple(specs)
        loose = {w.name: w for s in self.specs for w in s.writes}
        self.loose = tuple(loose.values())
        self.by_name = {s.name: s for s in (*self.specs, *self.loose)}

    @property
    def names(self) -> tuple[str, ...]:
        """The stages' names in run order (not the loose folders)."""
        return tuple(s.name for s in self.specs)

    def __getitem__(self, name: str) -> StageSpec:
        try:
            return self.by_name[name]
        except KeyError:
            raise ValueError(f"unknown stage {name!r}; expected one of {', '.join(self.names)}") from None

    def keyed(self) -> tuple[StageSpec, ...]:
        """Every spec with a key, upstream first: the stages, then the loose folders."""
        return (*self.specs, *self.loose)

    def stages_from(self, name: str) -> tuple[str, ...]:
        """``name`` and every stage after it."""
        if name not in self.names:
            raise ValueError(f"unknown stage {name!r}; expected one of {', '.join(self.names)}")
        return self.names[self.names.index(name) :]

    def splits_folder(self, name: str) -> str | None:
        """The folder of the stage before ``name`` that prepares the dataset splits, None when none runs before."""
        return next((s.name for s in self.specs[: self.names.index(name)] if s.prepares_splits), None)

    def before(self, name: str) -> tuple[str, ...]:
        """The stages that run before ``name``."""
        return self.names[: self.names.index(name)]
