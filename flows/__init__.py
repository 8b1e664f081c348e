# the run's start-up is timed from here when the process itself started earlier (tasks/runtime/timeline.py)
from grpoflow.tasks.runtime import timeline as _timeline  # noqa: F401
