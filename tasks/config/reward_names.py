"""The name each reward function logs under (``rewards/<name>/mean``), known from the config alone.

A name comes from the reward's spec, not from the imported function: a built-in's name, else the last attribute of
'package.module:attr.path'. So ``mymod:length_bonus = lambda ...`` logs ``rewards/length_bonus/...``, not
``rewards/<lambda>/...`` (MLflow refuses '<' and '>' and, before the journal bisected batches, that one key cost
every metric of its batch). Characters MLflow refuses in a key (anything but letters, digits, ``_ - . space :``
and ``/``, and ``/`` would add a level) become ``_``. Two rewards with the same name would log over each other:
the config is refused at load, naming both.
"""

from __future__ import annotations

import re

UNSAFE = re.compile(r"[^\w.\- ]+")


def reward_name(spec: str) -> str:
    """``spec``'s metric name: 'correctness' -> correctness; 'pkg.mod:Holder.score' -> score; '<lambda>' -> lambda."""
    name = spec.partition(":")[2].rsplit(".", 1)[-1] if ":" in spec else spec
    return UNSAFE.sub("_", name).strip("_. ") or "reward"


def check_reward_names(specs: list[str]) -> None:
    """Raise ValueError naming the specs when two of ``specs`` would log under the same name."""
    seen: dict[str, str] = {}
    for spec in specs:
        name = reward_name(spec)
        if name in seen:
            raise ValueError(
                f"reward_funcs: {seen[name]!r} and {spec!r} would both log as rewards/{name}/*; reward names (a "
                "built-in's name, else the function's attribute name) must be unique"
            )
        seen[name] = spec
