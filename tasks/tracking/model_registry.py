"""The exported merged model as an MLflow model: the transformers flavour, a LoggedModel of the run's experiment.

``log_merged_model`` writes the merged folder with ``mlflow.transformers.save_model`` (task text-generation, explicit
pip requirements, a signature with generation params and an input example, ``return_full_text: False`` so an answer
holds the completion only), uploads it as the artifacts of a LoggedModel produced by the export run (linked to the
run as an output), and returns what the registry needs (tasks/tracking/registry.py registers that location under
the model's name; the champion alias loads with ``mlflow.pyfunc.load_model("models:/NAME@champion")``). The
adapter and GGUF files stay plain artifacts of the export run.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)
REQUIREMENTS = ("mlflow", "transformers", "torch", "tokenizers", "safetensors")


@dataclass(frozen=True)
class LoggedMerged:
    model_id: str
    source: str  # the model's artifact location: what a registered version points at


def pip_requirements() -> list[str]:
    """The packages that load and run the model, pinned to the versions here (local build tags dropped)."""
    from importlib.metadata import version

    return [f"{p}=={version(p).split('+')[0]}" for p in REQUIREMENTS]


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


def log_merged_model(
    client: MlflowClient, run_id: str, merged_dir: str, name: str, example_prompt: str, max_new_tokens: int
) -> LoggedMerged:
    """Save ``merged_dir`` as an MLflow transformers model and log it as a LoggedModel output of ``run_id``."""
    import mlflow.transformers
    from mlflow.entities import LoggedModelOutput

    exp = client.get_run(run_id).info.experiment_id
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        mlflow.transformers.save_model(
            transformers_model=str(merged_dir),
            path=str(path),
            task="text-generation",
            pip_requirements=pip_requirements(),
            signature=signature(max_new_tokens),
            input_example=[example_prompt],
            model_config={"return_full_text": False, "max_new_tokens": max_new_tokens, "do_sample": False},
        )
        model = client.create_logged_model(exp, name=name, source_run_id=run_id, model_type="transformers")
        client.log_model_artifacts(model.model_id, str(path))
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
    log.info("MLflow model %s (%s) logged for run %s", name, model.model_id, run_id)
    return LoggedMerged(model.model_id, client.get_logged_model(model.model_id).artifact_location)
