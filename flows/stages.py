"""The pipeline's stages in run order: data -> sft -> grpo -> eval -> export.

Each stage declares its StageSpec beside its code (tasks/stages/*.py; tasks/pipeline/spec.py says what a spec
holds). Stages may not import each other (the ``stages`` import contract), so the order is declared here, above
them: the flow hands it to every stage task (the stage shell needs the upstream stages to compute a key and the
later ones to forget), and `grpoflow resume` explains with it what reruns.
"""

from __future__ import annotations

from grpoflow.tasks.pipeline.spec import Pipeline
from grpoflow.tasks.stages import data, evaluate, export, grpo, sft

PIPELINE = Pipeline((data.SPEC, sft.SPEC, grpo.SPEC, evaluate.SPEC, export.SPEC))
