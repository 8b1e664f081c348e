"""Options every Prefect task of the pipeline must carry, checked on the task objects themselves so that a new task
without them fails here."""

import importlib
import pkgutil

import pytest
from prefect import Task
from prefect.cache_policies import NO_CACHE

import grpoflow.flows
import grpoflow.tasks.ops
import grpoflow.tasks.stages

PACKAGES = (grpoflow.tasks.stages, grpoflow.tasks.ops, grpoflow.flows)


def prefect_tasks() -> dict[str, Task]:
    """{module.attribute: task} of every Prefect task defined in the packages that hold the pipeline's tasks."""
    found = {}
    for package in PACKAGES:
        for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if isinstance(value, Task) and value.fn.__module__ == module.__name__:
                    found[f"{info.name}.{name}"] = value
    return found


def test_the_pipeline_tasks_are_found():
    names = {task.name for task in prefect_tasks().values()}
    assert {"prepare-data", "sft", "grpo", "evaluate", "export", "new-data-files", "champion"} <= names


@pytest.mark.parametrize("where", sorted(prefect_tasks()))
def test_every_task_opts_out_of_prefect_caching(where):
    """The pipeline has its own resume keys; Prefect's default policy would hash every input (the config, the
    stage table) on every call for a cache that is never persisted."""
    assert prefect_tasks()[where].cache_policy is NO_CACHE, f"{where}: set cache_policy=NO_CACHE on its @task"
