"""`grpoflow deploy` and `grpoflow data-landed`: the Prefect server side of deployments, for a user.

deploy: create the work pools of POOLS when they are missing (the docker and kubernetes pools with their GPU base
job templates from infra/work-pools/; the process pool with Prefect's default), then run
`prefect deploy --prefect-file infra/prefect.yaml` from the checkout (``--all`` unless names are given); the
deployments' entry points are module:function paths of the installed package (grpoflow.flows.deployment:...).
A redeploy keeps each existing deployment's parameters unless ``--reset-params`` (flows/redeploy.py).

data-landed: emit the ``grpoflow.data.landed`` event for a file, folder or s3:// prefix; the trigger of
grpo-continuous/local matches it and starts a continuous cycle. Both need PREFECT_API_URL (a Prefect server).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from grpoflow.tasks.config import ConfigError

PREFECT_YAML = Path("infra") / "prefect.yaml"
# The work pools every part of the repo agrees on (infra/prefect.yaml, docker/, tests/infra):
# name -> (worker type, its GPU base job template under infra/work-pools/, or None for Prefect's default)
POOLS: dict[str, tuple[str, str | None]] = {
    "grpoflow-process": ("process", None),
    "grpoflow-docker-gpu": ("docker", "docker-gpu.json"),
    "grpoflow-k8s-gpu": ("kubernetes", "kubernetes-gpu.json"),
}
EVENT = "grpoflow.data.landed"


def project_root() -> Path:
    """The grpoflow checkout that deployments are made from: the working directory when it holds infra/prefect.yaml,
    else the source tree of an editable install. A wheel install has neither: deploy from a checkout."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / PREFECT_YAML).is_file():
            return root
    raise ConfigError(
        f"{PREFECT_YAML}: not found in {Path.cwd()}; `grpoflow deploy` deploys the repository's infra/prefect.yaml, "
        "so run it from a checkout of grpoflow"
    )


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError(
            "PREFECT_API_URL: not set; start a server (prefect server start) and "
            "`export PREFECT_API_URL=http://127.0.0.1:4200/api`"
        )
    from grpoflow.tasks.tracking.reach import unreachable

    # checked now: unchecked, deploy fails in a raw httpx traceback and data-landed reports an event as emitted
    # that its background worker then drops
    if why := unreachable(url.rstrip("/") + "/health"):
        raise ConfigError(f"PREFECT_API_URL: the Prefect server {url} does not answer ({why}); start it or fix the URL")
    return url


def _prefect(*args: str) -> list[str]:
    """The prefect CLI of this interpreter's environment."""
    exe = Path(sys.executable).with_name("prefect")
    return [str(exe) if exe.exists() else "prefect", *args]


def ensure_pools(pools: dict[str, tuple[str, str | None]] = POOLS) -> list[str]:
    """Create the work pools that do not exist yet (through the API: one `prefect` CLI start costs seconds);
    returns the names created."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

    created = []
    with get_client(sync_client=True) as client:
        for name, (kind, template_file) in pools.items():
            try:
                client.read_work_pool(name)
                continue
            except ObjectNotFound:
                pass
            if template_file is None:  # Prefect's default for the type, as `prefect work-pool create --type` uses
                template = asyncio.run(get_default_base_job_template_for_infrastructure_type(kind)) or {}
            else:
                path = project_root() / "infra" / "work-pools" / template_file
                try:
                    template = json.loads(path.read_text())
                except (OSError, json.JSONDecodeError) as e:
                    raise ConfigError(f"{path}: the base job template of work pool {name}: {e}") from None
            client.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=template))
            created.append(name)
    return created


def deploy(extra: list[str]) -> int:
    """Pools, then `prefect deploy` of infra/prefect.yaml from the repo root (local pull steps use $PWD).

    A deployment that exists keeps its parameters unless ``--reset-params`` is given (flows/redeploy.py): they are
    deployed from a copy of the prefect.yaml that carries them. One line per deployment says which it got."""
    import tempfile

    import yaml

    from grpoflow.flows import redeploy

    _api_url()
    for name in ensure_pools():
        print(f"created work pool {name} ({POOLS[name][0]})")
    reset = redeploy.RESET_FLAG in extra
    extra = [a for a in extra if a != redeploy.RESET_FLAG]
    args = list(extra) if any(a in ("-n", "--name") or a.startswith("--name=") for a in extra) else ["--all", *extra]
    root = project_root()
    prefect_file = root / PREFECT_YAML
    try:
        config = yaml.safe_load(prefect_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{prefect_file}: cannot read: {e}") from None
    specs = redeploy.selected(config.get("deployments") or [], args)
    existing = redeploy.server_parameters([redeploy.full_name(s) for s in specs])
    choices = redeploy.plan(specs, existing, redeploy.given_parameters(args), reset)
    env = dict(os.environ, PWD=str(root))
    with tempfile.TemporaryDirectory(prefix="grpoflow-deploy-") as tmp:
        if any(c.kind == "kept" for c in choices):  # the server's parameters, in the file prefect deploy reads
            prefect_file = Path(tmp) / "prefect.yaml"
            prefect_file.write_text(yaml.safe_dump(redeploy.with_parameters(config, choices), sort_keys=False))
        cmd = _prefect("deploy", "--prefect-file", str(prefect_file), *args)
        code = subprocess.run(cmd, cwd=root, env=env).returncode
    if code == 0:
        for choice in choices:
            print(choice.line(str(PREFECT_YAML)))
    return code


def resource_id(path: str) -> str:
    """The event's resource id: grpoflow.data.<absolute path or s3 URI>."""
    return "grpoflow.data." + (path if path.startswith("s3://") else str(Path(path).expanduser().resolve()))


def emit_data_landed(path: str) -> str:
    """Emit ``grpoflow.data.landed`` for ``path`` and wait until it is sent; returns the event id."""
    if not path.startswith("s3://") and not Path(path).expanduser().exists():
        raise ConfigError(f"data-landed: {path!r} does not exist")
    _api_url()
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    event = emit_event(EVENT, resource={"prefect.resource.id": resource_id(path), "grpoflow.path": path})
    if event is None:
        raise RuntimeError("prefect did not emit the event (is PREFECT_API_URL a reachable Prefect server?)")
    EventsWorker.drain_all()  # the event goes out on a background thread: wait for it before the process exits
    return str(event.id)
