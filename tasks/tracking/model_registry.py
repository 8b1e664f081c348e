"""The exported model as an MLflow model: the transformers flavour, a LoggedModel of the run's experiment.

``log_merged_model`` writes the merged folder with ``mlflow.transformers.save_model`` (task text-generation, explicit
pip requirements, a signature with generation params and an input example, ``return_full_text: False`` so an answer
holds the completion only), uploads it as the artifacts of a LoggedModel produced by the export run (linked to the
run as an output), and returns what the registry needs (tasks/tracking/registry.py registers that location under
the model's name; the champion alias loads with ``mlflow.pyfunc.load_model("models:/NAME@champion")``).

``log_adapter_model`` does the same for an adapter-only export (``export.merged: false``): the base model with the
adapter applied (a peft ``PeftModel``) goes to ``mlflow.transformers.save_model``, which saves the adapter under
``peft/`` and, for the base,

- a hub id (``Qwen/Qwen2.5-0.5B-Instruct``): records the repo and the commit whose weights the adapter was applied
  to (resolved from the hub, or from the local hub cache offline), and loads the base and its tokenizer from the hub
  at that commit (the registered version holds the adapter only; tasks/tracking/hub_base.py says why grpoflow
  writes this reference rather than MLflow, and why the exported tokenizer must be the base's);
- a local folder (the tiny default model, an SFT checkpoint in the workspace): saves the base weights in the
  model, copied from the checkpoint (:func:`replace_base_weights` says why MLflow's own copy is not used); MLflow
  cannot name a local base any other way that another machine could load (its ``base_model_path`` option
  records this machine's absolute path).

Either way ``mlflow.pyfunc.load_model("models:/NAME/VERSION")`` (or ``mlflow.transformers.load_model``) loads
the base, applies the adapter and generates. A bare adapter folder registered as is would load with neither.
The GGUF files and the plain adapter/merged folders stay artifacts of the export run.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient

from grpoflow.tasks.tracking.hub_base import check_same_tokenizer, hub_commit, hub_snapshot, reference_hub_base

log = logging.getLogger(__name__)
REQUIREMENTS = ("mlflow", "transformers", "torch", "tokenizers", "safetensors")


@dataclass(frozen=True)
class LoggedExport:
    model_id: str
    source: str  # the model's artifact location: what a registered version points at


def pip_requirements(packages: tuple[str, ...] = REQUIREMENTS) -> list[str]:
    """The packages that load and run the model, pinned to the versions here (local build tags dropped)."""
    from importlib.metadata import version

    return [f"{p}=={version(p).split('+')[0]}" for p in packages]


def signature(max_new_tokens: int):
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema(
            [ParamSpec("max_new_tokens", "long", max_new_tokens), ParamSpec("do_sample", "boolean", False)]
        ),
    )


def save_transformers_model(
    transformers_model,
    path: Path,
    example_prompt: str,
    max_new_tokens: int,
    requirements: list[str],
    base_model_path: Path | None = None,
) -> None:
    """``mlflow.transformers.save_model`` of ``transformers_model`` (a checkpoint folder, or {"model", "tokenizer"})
    at ``path`` as a greedy text-generation model that answers with the completion only; ``base_model_path``: a
    PEFT model's base folder, referenced rather than saved."""
    import mlflow.transformers

    mlflow.transformers.save_model(
        transformers_model=transformers_model,
        path=str(path),
        task="text-generation",
        pip_requirements=requirements,
        signature=signature(max_new_tokens),
        input_example=[example_prompt],
        model_config={"return_full_text": False, "max_new_tokens": max_new_tokens, "do_sample": False},
        base_model_path=None if base_model_path is None else str(base_model_path),
    )


def log_merged_model(
    client: MlflowClient, run_id: str, merged_dir: str, name: str, example_prompt: str, max_new_tokens: int
) -> LoggedExport:
    """Save ``merged_dir`` as an MLflow transformers model and log it as a LoggedModel output of ``run_id``."""

    def save(path: Path) -> None:
        save_transformers_model(str(merged_dir), path, example_prompt, max_new_tokens, pip_requirements())

    return _log_model(client, run_id, name, save)


def log_adapter_model(
    client: MlflowClient,
    run_id: str,
    adapter_dir: str,
    base_model: str,
    name: str,
    example_prompt: str,
    max_new_tokens: int,
    revision: str | None = None,
) -> LoggedExport:
    """Save the adapter in ``adapter_dir`` on ``base_model`` (a hub id or a local folder: the module docstring says
    what is kept of each) as an MLflow transformers model with its peft adapter, and log it as a LoggedModel output
    of ``run_id``. The tokenizer is the one the export saved beside the adapter. ``revision``: the hub base's
    revision the run trained on (model.revision, a commit once pinned); None: the default branch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(adapter_dir) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"registry: no adapter_config.json in the exported adapter folder {adapter_dir}")
    local = Path(base_model).is_dir()
    try:
        commit = None if local else hub_commit(base_model, revision)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"registry: {e}") from e
    base = AutoModelForCausalLM.from_pretrained(base_model, revision=commit, dtype="auto")
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    if commit is not None:
        check_same_tokenizer(tokenizer, base_model, commit, adapter_dir)

    def save(path: Path) -> None:
        reqs = pip_requirements() + pip_requirements(("peft",))
        components = {"model": model, "tokenizer": tokenizer}
        if local:
            save_transformers_model(components, path, example_prompt, max_new_tokens, reqs)
            replace_base_weights(path, Path(base_model))
        else:
            snapshot = hub_snapshot(base_model, commit)
            save_transformers_model(components, path, example_prompt, max_new_tokens, reqs, snapshot)
            reference_hub_base(path, base_model, commit)

    return _log_model(client, run_id, name, save)


def replace_base_weights(path: Path, base_dir: Path) -> None:
    """Put the local base checkpoint's own files in the saved model's ``model/`` folder (its base weights).

    For a base it cannot name on the hub, mlflow 3.17 saves the base from the peft-wrapped model, whose LoRA
    layers are injected in place: the weights come out as ``q_proj.base_layer.weight``, ``q_proj.lora_A...``,
    which the base class does not know, so every adapted layer loaded back randomly initialised (transformers
    lists them as MISSING) and the adapter went onto noise. The checkpoint's files are what the base is."""
    target = path / "model"
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"registry: mlflow saved no base model folder at {target}")
    shutil.rmtree(target)
    target.mkdir()
    for f in base_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, target / f.name)


def _log_model(client: MlflowClient, run_id: str, name: str, save) -> LoggedExport:
    """``save(path)`` into a temporary folder, uploaded as a READY LoggedModel ``name`` produced by ``run_id``."""
    from mlflow.entities import LoggedModelOutput

    exp = client.get_run(run_id).info.experiment_id
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        save(path)
        model = client.create_logged_model(exp, name=name, source_run_id=run_id, model_type="transformers")
        client.log_model_artifacts(model.model_id, str(path))
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
    log.info("MLflow model %s (%s) logged for run %s", name, model.model_id, run_id)
    return LoggedExport(model.model_id, client.get_logged_model(model.model_id).artifact_location)
