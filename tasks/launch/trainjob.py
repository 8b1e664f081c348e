"""Kubeflow Trainer (v2) TrainJobs: the GRPO stage on several nodes (``distributed.launcher: trainjob``).

A TrainJob (apiVersion trainer.kubeflow.org/v1alpha1) names a runtime (``torch-distributed``) and a trainer:
image, command, ``numNodes`` pods with ``numProcPerNode`` processes each, ``resourcesPerNode``. The runtime's torch
policy sets, in every pod, PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the pod's completion index),
PET_MASTER_ADDR (``<name>-node-0-0.<name>``) and PET_MASTER_PORT (29400), which torchrun reads for every option
its command line leaves out (tasks/launch/torchrun.py ``torchrun_command``). Its controller copies the JobSet's
terminal condition into ``status.conditions``: type Complete or Failed, status "True", with the JobSet's reason
and message (FailedJobs: "jobset failed due to one or more job failures", AllJobsCompleted, DeadlineExceeded...).

Pure, tested here: :func:`load_template`, :func:`render`, :func:`trainjob_name`, :func:`job_state`,
:func:`failed_pods`, :func:`failure_message`, :func:`tracking_env_problem`, :func:`wait` (the poll loop over a
status reader). Needs a cluster (not run here): :class:`KubeTrainJobs`, the ``kubernetes`` client calls (create,
read, delete, pod logs).
"""

from __future__ import annotations

import copy
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from grpoflow.tasks.config import DistributedConfig
from grpoflow.tasks.config.secrets import MASK, redact

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"
API_VERSION = f"{GROUP}/{VERSION}"
GPU = "nvidia.com/gpu"
# set by the torch-distributed runtime in every pod; the Trainer webhook refuses a TrainJob that sets them
RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
CONTAINER = "node"  # the trainer container of the runtime's replicated job "node"
POD_SELECTOR = "jobset.sigs.k8s.io/jobset-name"  # JobSet labels its pods with it; the JobSet is named as the TrainJob
KEY = "distributed.trainjob.template"


def load_template(path: str | Path) -> dict:
    """The TrainJob manifest at ``path``; a clear error naming the key when it is missing or not a TrainJob."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{KEY}: no file {str(p)!r} (relative paths resolve from {str(Path.cwd())!r})")
    doc = yaml.safe_load(p.read_text())
    if not isinstance(doc, dict) or doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
        raise ValueError(f"{KEY}: {str(p)!r} is not a {KIND} of apiVersion {API_VERSION}")
    trainer = (doc.get("spec") or {}).get("trainer")
    if not isinstance(trainer, dict):
        raise ValueError(f"{KEY}: {str(p)!r} has no spec.trainer")
    reserved = sorted({e.get("name") for e in trainer.get("env") or []} & set(RESERVED_ENV))
    if reserved:
        raise ValueError(f"{KEY}: {str(p)!r} sets {reserved} in spec.trainer.env; the torch runtime sets them")
    return doc


def trainjob_name(run_name: str, stamp: float) -> str:
    """``grpo-<run name>-<stamp in base 36>``: an RFC 1035 label (lower case, starts with a letter, at most 63
    characters), as the TrainJob webhook requires; the stamp makes each attempt's name new."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")
    n, digits = int(stamp * 1000), ""
    while n:
        n, r = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + digits
    tail = f"-{digits or '0'}"
    head = f"grpo-{slug}"[: 63 - len(tail)].rstrip("-")
    return head + tail


def render(template: dict, d: DistributedConfig, name: str, command: list[str]) -> dict:
    """The TrainJob to create: ``template`` with the name, namespace, runtime, image, command, node count,
    processes per node and GPUs per node of ``d`` (everything else kept as written)."""
    job = copy.deepcopy(template)
    t = d.trainjob
    job["metadata"] = {**(job.get("metadata") or {}), "name": name, "namespace": t.namespace}
    job["spec"]["runtimeRef"] = {**(job["spec"].get("runtimeRef") or {}), "name": t.runtime}
    trainer = job["spec"]["trainer"]
    trainer.update(image=t.image, command=list(command), numNodes=d.nnodes, numProcPerNode=d.nproc_per_node)
    trainer.pop("args", None)  # the command carries every argument
    resources = trainer.setdefault("resourcesPerNode", {})
    for kind in ("limits", "requests"):
        amounts = resources.get(kind)
        if kind == "limits" or (amounts and GPU in amounts):  # an extended resource: requests equal limits
            amounts = resources.setdefault(kind, {})
            amounts.pop(GPU, None)
            if d.gpus_per_node:
                amounts[GPU] = d.gpus_per_node
    return job


def tracking_env_problem(template: dict, written_uri: str) -> str | None:
    """Why the pods of ``template`` could not log to the stage's MLflow run, or None when they can.

    The workers take the tracking URI from the launch spec (``written_uri``); when it carries credentials the spec
    holds it redacted (``***`` in place of the secret) and each worker needs the real URI in its own
    $MLFLOW_TRACKING_URI (tasks/config/secrets.py ``unredact``). The template then must set that variable in
    ``spec.trainer.env``, from a Secret (``valueFrom``, not checkable here) or as a value whose redaction is the
    spec's. A URI without credentials needs nothing from the pods' environment."""
    if MASK not in written_uri:
        return None
    env = {e.get("name"): e for e in (template["spec"]["trainer"].get("env") or [])}
    entry = env.get("MLFLOW_TRACKING_URI")
    if entry is None:
        return (
            f"the tracking URI {written_uri} carries credentials, which the launch spec does not hold; set "
            f"MLFLOW_TRACKING_URI in spec.trainer.env from a Secret (valueFrom.secretKeyRef) for the pods to log"
        )
    if "valueFrom" in entry:
        return None
    value = redact(str(entry.get("value") or ""))
    if value != written_uri:
        return (
            f"spec.trainer.env sets MLFLOW_TRACKING_URI to {value!r}, but the "
            f"stage's MLflow run is on {written_uri}; the pods would not reach it (set the same URI, from a Secret)"
        )
    return None


@dataclass(frozen=True)
class JobState:
    """Where a TrainJob is: running (incl. created, pending, suspended), complete or failed, and why."""

    phase: str  # running | complete | failed
    reason: str = ""
    message: str = ""

    @property
    def done(self) -> bool:
        return self.phase in ("complete", "failed")


def job_state(trainjob: dict) -> JobState:
    """The state of a TrainJob object (as the API returns it) from ``status.conditions`` (metav1.Condition: type,
    status "True" | "False" | "Unknown", reason, message): Failed wins over Complete; neither true = running."""
    conditions = (trainjob.get("status") or {}).get("conditions") or []
    true = {c.get("type"): c for c in conditions if c.get("status") == "True"}
    for kind, phase in (("Failed", "failed"), ("Complete", "complete")):
        if kind in true:
            return JobState(phase, true[kind].get("reason") or "", true[kind].get("message") or "")
    last = conditions[-1] if conditions else {}
    return JobState("running", last.get("reason") or "", last.get("message") or "")


def failed_pods(pods: list[dict]) -> list[str]:
    """Names of the pods (API objects as dicts) that failed: phase Failed, or a container terminated with a
    non-zero exit code (now or in its last run); in the order given."""
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        codes = [
            (state.get("terminated") or {}).get("exitCode")
            for cs in status.get("containerStatuses") or []
            for state in (cs.get("state") or {}, cs.get("lastState") or {})
        ]
        if status.get("phase") == "Failed" or any(c not in (None, 0) for c in codes):
            out.append(pod["metadata"]["name"])
    return out


def failure_message(namespace: str, name: str, state: JobState, logs: dict[str, str]) -> str:
    """What a failed TrainJob reports: its condition's reason and message, then each failed pod's last lines."""
    text = f"TrainJob {namespace}/{name} failed: {state.reason or 'no reason'}: {state.message or 'no message'}"
    for pod, tail in logs.items():
        text += f"\n--- last lines of pod {pod} ---\n{tail.rstrip()}"
    return text


def wait(
    read: Callable[[], dict],
    timeout_s: float,
    poll_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    max_read_errors: int = 5,
) -> JobState:
    """Read the TrainJob every ``poll_s`` until it completes or fails; TimeoutError past ``timeout_s``. A read that
    fails (the API server restarting, a network blip) is retried at the next poll; ``max_read_errors`` failures
    in a row raise the last one."""
    start, last, errors = clock(), None, 0
    while True:
        try:
            obj = read()
            errors = 0
        except Exception as e:
            errors += 1
            if errors >= max_read_errors:
                raise
            log.warning("TrainJob: reading its status failed (%d in a row): %s", errors, e)
            obj = None
        state = job_state(obj) if obj is not None else (last or JobState("running"))
        if state != last:
            log.info("TrainJob: %s %s %s", state.phase, state.reason, state.message)
            last = state
        if state.done:
            return state
        if clock() - start >= timeout_s:
            raise TimeoutError(f"TrainJob still {state.phase} after {timeout_s:.0f} s (distributed.trainjob.timeout_s)")
        sleep(poll_s)


class KubeTrainJobs:
    """The Kubernetes API calls of a TrainJob launch (kubernetes client: in-cluster config, else ~/.kube/config)."""

    def __init__(self, namespace: str):
        try:
            from kubernetes import client, config
        except ImportError as e:
            raise ValueError(
                "distributed.launcher=trainjob needs the Kubernetes client: pip install 'grpoflow[k8s]'"
            ) from e
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.namespace = namespace
        self.api = client.ApiClient()
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)

    def create(self, job: dict) -> dict:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, job)

    def read(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, propagation_policy="Foreground"
        )

    def failed_pod_logs(self, name: str, lines: int) -> dict[str, str]:
        """The last ``lines`` lines of each failed pod of TrainJob ``name`` (empty when none can be read)."""
        if lines <= 0:
            return {}
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{POD_SELECTOR}={name}")
        out = {}
        for pod in failed_pods(self.api.sanitize_for_serialization(pods).get("items") or []):
            try:
                out[pod] = self.core.read_namespaced_pod_log(pod, self.namespace, container=CONTAINER, tail_lines=lines)
            except Exception as e:  # logs are a courtesy: a pod already gone must not hide the failure
                out[pod] = f"(log unreadable: {e})"
        return out
