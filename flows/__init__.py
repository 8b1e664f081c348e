# the run's start-up is timed from here when the process itself started earlier (tasks/tracking/timeline.py)
from grpoflow.tasks.tracking import timeline as _timeline  # noqa: F401
