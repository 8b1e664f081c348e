"""What a redeploy does with the parameters of deployments that already exist on the Prefect server.

`prefect deploy` replaces a deployment's parameters with the prefect.yaml's (plus ``--params``), so running
`grpoflow deploy` again silently threw away what a user had set, e.g. grpo-continuous/local's ``source`` pointed at
their data, and the next cycle failed on the yaml's placeholder folder. Here, before deploying, the parameters of
each selected deployment that exists are read from the server and written into a copy of the prefect.yaml that
`prefect deploy` then reads, so the deployment is created with them in one step (no window in which a trigger
could start a run with the yaml's defaults). ``--params``/``--param`` set keys over them, as Prefect sets them
over the yaml's; ``--reset-params`` deploys the yaml's parameters instead. :func:`plan` says per deployment
which it did ("kept", "reset", "new").
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from typing import Any

RESET_FLAG = "--reset-params"


@dataclass(frozen=True)
class Choice:
    """One deployment of a redeploy: ``name`` FLOW/DEPLOYMENT, the parameters it is deployed with (``parameters``,
    before ``--params``), and ``kind``: "new" (not on the server), "kept" (the server's) or "reset" (the yaml's)."""

    name: str
    kind: str
    parameters: dict[str, Any]
    given: dict[str, Any] | None  # --params/--param keys set over ``parameters`` (None: none given)

    def line(self, yaml_file: str) -> str:
        """What the user reads: which parameters the deployment now has, and why."""
        final = {**self.parameters, **(self.given or {})}
        given = f"; --params set {', '.join(self.given)}" if self.given else ""
        shown = json.dumps(final, sort_keys=True)
        if self.kind == "new":
            return f"{self.name}: new: parameters {shown}"
        if self.kind == "reset":
            return f"{self.name}: parameters reset to {yaml_file}'s{given}: {shown}"
        return f"{self.name}: kept parameters {shown}{given} ({RESET_FLAG} to restore {yaml_file}'s)"


def full_name(spec: dict) -> str:
    """FLOW/DEPLOYMENT of a prefect.yaml deployment: the flow named as its entry point's function (grpo_continuous
    -> grpo-continuous), which is how `prefect deploy -n` selects it."""
    return spec.get("entrypoint", "").rsplit(":", 1)[-1].replace("_", "-") + "/" + spec.get("name", "")


def _option_values(args: list[str], *options: str) -> list[str]:
    """The values of ``options`` in ``args`` (``--opt VALUE`` and ``--opt=VALUE`` forms)."""
    values = []
    for i, a in enumerate(args):
        for opt in options:
            if a == opt and i + 1 < len(args):
                values.append(args[i + 1])
            elif a.startswith(opt + "=") and opt.startswith("--"):
                values.append(a[len(opt) + 1 :])
    return values


def selected(deployments: list[dict], args: list[str]) -> list[dict]:
    """The deployments of the prefect.yaml that `prefect deploy ARGS` deploys: every one without ``-n``/``--name``,
    else those each name (FLOW/NAME, or NAME alone, ``*`` as a wildcard) matches."""
    names = _option_values(args, "-n", "--name")
    if not names:
        return list(deployments)

    def matches(spec: dict, pattern: str) -> bool:
        target = full_name(spec) if "/" in pattern else spec.get("name", "")
        return fnmatch.fnmatchcase(target, pattern) if "*" in pattern else target == pattern

    return [d for d in deployments if any(matches(d, n) for n in names)]


def given_parameters(args: list[str]) -> dict[str, Any] | None:
    """The keys ``--params JSON`` / ``--param KEY=VALUE`` set, None when neither is given (a value that is no
    JSON is kept as text, as Prefect does; a bad --params is Prefect's to report)."""
    params, param = _option_values(args, "--params"), _option_values(args, "--param")
    if not params and not param:
        return None
    given: dict[str, Any] = {}
    for text in params:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            given.update(value)
    for item in param:
        key, _, raw = item.partition("=")
        try:
            given[key] = json.loads(raw)
        except json.JSONDecodeError:
            given[key] = raw
    return given


def plan(
    specs: list[dict], existing: dict[str, dict[str, Any] | None], given: dict[str, Any] | None, reset: bool
) -> list[Choice]:
    """Per deployment being deployed: the server's parameters (``existing[name]``, None when it is not deployed)
    unless ``reset``; the yaml's when new or reset. ``given`` (--params) applies only when one deployment is
    deployed (Prefect ignores options for several)."""
    given = given if len(specs) == 1 else None
    out = []
    for spec in specs:
        name = full_name(spec)
        current = existing.get(name)
        if current is None:
            out.append(Choice(name, "new", dict(spec.get("parameters") or {}), given))
        elif reset:
            out.append(Choice(name, "reset", dict(spec.get("parameters") or {}), given))
        else:
            out.append(Choice(name, "kept", dict(current), given))
    return out


def with_parameters(config: dict, choices: list[Choice]) -> dict:
    """A copy of the prefect.yaml's content whose kept deployments carry their server parameters."""
    kept = {c.name: c.parameters for c in choices if c.kind == "kept"}
    deployments = [
        {**d, "parameters": kept[full_name(d)]} if full_name(d) in kept else d for d in config.get("deployments", [])
    ]
    return {**config, "deployments": deployments}


def server_parameters(names: list[str]) -> dict[str, dict[str, Any] | None]:
    """The current parameters of each deployment FLOW/NAME on the Prefect server (PREFECT_API_URL); None for one
    that does not exist."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    out: dict[str, dict[str, Any] | None] = {}
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                out[name] = dict(client.read_deployment_by_name(name).parameters or {})
            except ObjectNotFound:
                out[name] = None
    return out
