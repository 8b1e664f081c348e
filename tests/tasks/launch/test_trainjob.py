"""distributed.launcher: trainjob without a cluster: the config keys and their errors, the TrainJob rendered from
infra/kubeflow/trainjob.yaml (its command is the local launch's torchrun command, and torchrun's own parser reads
the PET_* variables the torch-distributed runtime sets), and the reading of TrainJob and Pod status objects in the
shapes the Kubeflow Trainer v2 and Kubernetes APIs return. No Kubernetes API call is made here."""

from __future__ import annotations

import sys

import pytest
import yaml

from grpoflow.tasks.config import ConfigError, config_from_dict
from grpoflow.tasks.launch.torchrun import torchrun_command
from grpoflow.tasks.launch.trainjob import (
    GPU,
    JobState,
    failed_pods,
    failure_message,
    job_state,
    load_template,
    render,
    tracking_env_problem,
    trainjob_name,
    wait,
)
from grpoflow.tasks.stages.grpo import WORKER
from grpoflow.tasks.stages.grpo_trainjob import trainjob_command, trainjob_error
from tests.paths import REPO

TEMPLATE = REPO / "infra" / "kubeflow" / "trainjob.yaml"
S3 = {"run": {"output_dir": "s3://bucket/runs", "name": "Exp_1"}}


def trainjob_cfg(**distributed):
    return config_from_dict({**S3, "distributed": {"launcher": "trainjob", **distributed}})


# ---------------------------------------------------------------- config


def test_default_launcher_is_torchrun_and_leaves_the_section_unset():
    cfg = config_from_dict({})
    d = cfg.distributed
    assert d.launcher == "torchrun" and "trainjob" not in d.model_fields_set
    assert d.gpus_per_node == 1  # one GPU per process when a TrainJob is asked for
    assert config_from_dict(cfg.to_dict()).distributed == d  # the stages' round trip writes the defaults out
    tj = trainjob_cfg(nnodes=2, trainjob={"image": "x:1"})
    assert config_from_dict(tj.to_dict()).distributed.trainjob.image == "x:1"


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"distributed": {"launcher": "trainjob"}}, "distributed.launcher=trainjob needs run.output_dir on S3"),
        ({"distributed": {"trainjob": {"image": "x:1"}}}, "distributed.trainjob is set but distributed.launcher is"),
        ({**S3, "distributed": {"launcher": "trainjob", "nnodes": 2, "master_addr": "h"}}, "master_addr with launch"),
        ({**S3, "distributed": {"launcher": "trainjob", "nnodes": 2, "node_rank": 1}}, "node_rank with launcher"),
        ({**S3, "distributed": {"launcher": "kubectl"}}, "distributed.launcher"),
        ({**S3, "distributed": {"launcher": "trainjob", "trainjob": {"gpus": 2}}}, "distributed.trainjob.gpus"),
        ({**S3, "distributed": {"launcher": "trainjob", "trainjob": {"timeout_s": 0}}}, "trainjob.timeout_s"),
        ({**S3, "distributed": {"launcher": "trainjob", "trainjob": {"gpus_per_node": -1}}}, "gpus_per_node"),
    ],
)
def test_bad_trainjob_settings_name_the_key(raw, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        config_from_dict(raw)


# ---------------------------------------------------------------- rendering


def test_rendered_trainjob_runs_the_local_launch_command_on_n_nodes():
    cfg = trainjob_cfg(nnodes=3, nproc_per_node=4, trainjob={"image": "reg.example/grpoflow:0.1.0-gpu"})
    command = trainjob_command(cfg, "s3://bucket/runs/x/grpo/launch/spec.json")
    job = render(load_template(TEMPLATE), cfg.distributed, "grpo-x-1", command)
    trainer = job["spec"]["trainer"]
    # the very command a local launch builds, with the image's python instead of this interpreter
    local = torchrun_command(cfg.distributed, WORKER, ["s3://bucket/runs/x/grpo/launch/spec.json"])
    assert trainer["command"] == ["python", *local[1:]] and local[0] == sys.executable
    assert trainer["command"][3:5] == ["--nnodes=3", "--nproc_per_node=4"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (3, 4)
    assert trainer["image"] == "reg.example/grpoflow:0.1.0-gpu"
    assert trainer["resourcesPerNode"]["limits"][GPU] == 4
    assert job["metadata"]["name"] == "grpo-x-1" and job["metadata"]["namespace"] == "grpoflow"
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    template = yaml.safe_load(TEMPLATE.read_text())
    assert job["metadata"]["labels"] == template["metadata"]["labels"]  # the rest is kept as written
    assert trainer["env"] == template["spec"]["trainer"]["env"]
    assert template["spec"]["trainer"]["command"] == []  # the template itself is not modified


def test_gpus_per_node_overrides_and_zero_drops_the_gpu():
    t = load_template(TEMPLATE)
    two = render(t, trainjob_cfg(nnodes=2, nproc_per_node=4, trainjob={"gpus_per_node": 8}).distributed, "a", [])
    assert two["spec"]["trainer"]["resourcesPerNode"]["limits"][GPU] == 8
    cpu = render(t, trainjob_cfg(nnodes=2, nproc_per_node=2, trainjob={"gpus_per_node": 0}).distributed, "a", [])
    assert GPU not in cpu["spec"]["trainer"]["resourcesPerNode"]["limits"]
    assert cpu["spec"]["trainer"]["resourcesPerNode"]["limits"]["memory"] == "64Gi"


def test_torchrun_reads_the_pet_variables_the_runtime_sets(monkeypatch):
    """The rendered command, parsed by torchrun's own parser in a pod of node rank 1: nodes and processes from the
    command, node rank and master from PET_* exactly as the torch plugin sets them (master <name>-node-0-0.<name>,
    port 29400)."""
    from torch.distributed.run import config_from_args, parse_args

    cfg = trainjob_cfg(nnodes=2, nproc_per_node=2)
    command = render(load_template(TEMPLATE), cfg.distributed, "tj", trainjob_command(cfg, "s3://b/s.json"))
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1"}
    pet |= {"PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29400", "OMP_NUM_THREADS": "1"}
    for k, v in pet.items():
        monkeypatch.setenv(k, v)
    argv = command["spec"]["trainer"]["command"]
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    launch, entry, entry_args = config_from_args(parse_args(argv[3:]))
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (2, 2, 2)
    assert launch.rdzv_backend == "static" and launch.rdzv_configs["rank"] == 1
    assert launch.rdzv_endpoint == "tj-node-0-0.tj:29400"
    assert entry == sys.executable and entry_args == ["-u", "-m", WORKER, "s3://b/s.json"]


def test_template_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="distributed.trainjob.template: no file"):
        load_template(tmp_path / "missing.yaml")
    (tmp_path / "job.yaml").write_text("apiVersion: batch/v1\nkind: Job\n")
    with pytest.raises(ValueError, match="is not a TrainJob of apiVersion trainer.kubeflow.org/v1alpha1"):
        load_template(tmp_path / "job.yaml")
    doc = yaml.safe_load(TEMPLATE.read_text())
    doc["spec"]["trainer"]["env"].append({"name": "PET_NODE_RANK", "value": "0"})
    (tmp_path / "pet.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=r"sets \['PET_NODE_RANK'\] in spec.trainer.env"):
        load_template(tmp_path / "pet.yaml")


def test_names_are_rfc1035_labels_unique_per_attempt():
    import re

    a, b = trainjob_name("Exp_1 (big)", 1_800_000_000.0), trainjob_name("Exp_1 (big)", 1_800_000_000.5)
    assert a != b and a.startswith("grpo-exp-1-big-")
    long = trainjob_name("x" * 100, 1.0)
    for name in (a, b, long, trainjob_name("--", 0.0)):
        assert len(name) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name


# ---------------------------------------------------------------- status, in the shapes the API returns

CREATED = yaml.safe_load("""
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata: {name: tj, namespace: grpoflow}
status:
  jobsStatus:
    - {name: node, ready: 0, succeeded: 0, failed: 0, active: 2, suspended: 0}
""")
SUSPENDED = yaml.safe_load("""
status:
  conditions:
    - {type: Suspended, status: "True", reason: Suspended, message: TrainJob is suspended,
       lastTransitionTime: "2026-12-02T04:00:00Z"}
""")
COMPLETE = yaml.safe_load("""
status:
  conditions:
    - {type: Suspended, status: "False", reason: Resumed, message: TrainJob is resumed,
       lastTransitionTime: "2026-12-02T04:00:00Z"}
    - {type: Complete, status: "True", reason: AllJobsCompleted, message: jobset completed successfully,
       lastTransitionTime: "2026-12-02T05:00:00Z"}
  jobsStatus:
    - {name: node, ready: 0, succeeded: 1, failed: 0, active: 0, suspended: 0}
""")
FAILED = yaml.safe_load("""
status:
  conditions:
    - {type: Failed, status: "True", reason: FailedJobs, message: jobset failed due to one or more job failures,
       lastTransitionTime: "2026-12-02T05:00:00Z"}
  jobsStatus:
    - {name: node, ready: 0, succeeded: 0, failed: 1, active: 0, suspended: 0}
""")
DEADLINE = yaml.safe_load("""
status:
  conditions:
    - {type: Failed, status: "True", reason: DeadlineExceeded, message: TrainJob exceeded its activeDeadlineSeconds,
       lastTransitionTime: "2026-12-02T05:00:00Z"}
""")


def test_job_state_reads_the_terminal_conditions():
    assert job_state(CREATED) == JobState("running")
    assert job_state(SUSPENDED) == JobState("running", "Suspended", "TrainJob is suspended")
    assert job_state(COMPLETE) == JobState("complete", "AllJobsCompleted", "jobset completed successfully")
    assert job_state(FAILED) == JobState("failed", "FailedJobs", "jobset failed due to one or more job failures")
    assert job_state(DEADLINE).reason == "DeadlineExceeded" and job_state(DEADLINE).done
    not_true = {"status": {"conditions": [{**FAILED["status"]["conditions"][0], "status": "False"}]}}
    assert job_state(not_true).phase == "running"


PODS = yaml.safe_load("""
- metadata: {name: tj-node-0-0-abcde}
  status:
    phase: Running
    containerStatuses:
      - {name: node, restartCount: 0, state: {running: {startedAt: "2026-12-02T04:00:00Z"}}}
- metadata: {name: tj-node-0-1-fghij}
  status:
    phase: Failed
    containerStatuses:
      - name: node
        state: {terminated: {exitCode: 1, reason: Error, finishedAt: "2026-12-02T04:10:00Z"}}
- metadata: {name: tj-node-0-2-klmno}
  status:
    phase: Running
    containerStatuses:
      - name: node
        restartCount: 1
        state: {running: {startedAt: "2026-12-02T04:11:00Z"}}
        lastState: {terminated: {exitCode: 137, reason: OOMKilled}}
- metadata: {name: tj-node-0-3-pqrst}
  status:
    phase: Succeeded
    containerStatuses:
      - {name: node, state: {terminated: {exitCode: 0, reason: Completed}}}
- metadata: {name: tj-node-0-4-uvwxy}
  status: {phase: Pending}
""")


def test_failed_pods_are_the_failed_phase_and_the_nonzero_exits():
    assert failed_pods(PODS) == ["tj-node-0-1-fghij", "tj-node-0-2-klmno"]


def test_wait_polls_until_a_terminal_condition_and_times_out():
    """The poll loop over a sequence of real status objects, with a clock that advances by each sleep."""
    now = [0.0]
    seen = iter([CREATED, SUSPENDED, CREATED, COMPLETE])
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    state = wait(lambda: next(seen), timeout_s=100, poll_s=5, clock=lambda: now[0], sleep=sleep)
    assert state.phase == "complete" and slept == [5, 5, 5]
    with pytest.raises(TimeoutError, match="after 12 s"):
        wait(lambda: CREATED, timeout_s=12, poll_s=5, clock=lambda: now[0], sleep=sleep)


def rank_error(rank, user, lost_peer=False, t=1.0):
    return {
        "rank": rank,
        "time": t,
        "type": "ValueError" if user else "KeyError",
        "message": "reward returned inf" if user else "'x'",
        "user_error": user,
        "lost_peer": lost_peer,
        "traceback": "Traceback ...",
    }


def test_failure_names_the_rank_then_the_condition_and_pod_logs():
    state = job_state(FAILED)
    logs = {"tj-node-0-1-fghij": "step 1\n[rank3] ERROR rank 3 failed: reward returned inf\n"}
    text = failure_message("grpoflow", "tj", state, logs)
    assert text.startswith("TrainJob grpoflow/tj failed: FailedJobs: jobset failed due to one or more job failures")
    assert "--- last lines of pod tj-node-0-1-fghij ---\nstep 1\n[rank3] ERROR" in text
    user = trainjob_error("grpoflow", "tj", state, [rank_error(3, True)], logs, 4)
    assert isinstance(user, ValueError) and str(user).startswith("rank 3 of 4: reward returned inf\nTrainJob")
    bug = trainjob_error("grpoflow", "tj", state, [rank_error(0, False)], {}, 4)
    assert type(bug) is RuntimeError and "rank 0 of 4: KeyError" in str(bug)
    # no rank reported a cause of its own (killed, out of memory, a peer lost): an environment failure
    lost = trainjob_error("grpoflow", "tj", state, [rank_error(1, False, lost_peer=True)], logs, 4)
    assert isinstance(lost, ChildProcessError) and "ranks reported: rank 1: KeyError" in str(lost)
    assert "FailedJobs" in str(lost) and "tj-node-0-1-fghij" in str(lost)


def test_failed_pods_reads_what_the_kubernetes_client_serializes():
    """KubeTrainJobs hands failed_pods the client's own serialization of a V1PodList (camelCase keys, as the API)."""
    from kubernetes import client

    def pod(name, phase, exit_code=None):
        state = client.V1ContainerState(
            terminated=client.V1ContainerStateTerminated(exit_code=exit_code) if exit_code is not None else None,
            running=None if exit_code is not None else client.V1ContainerStateRunning(),
        )
        status = client.V1ContainerStatus(
            name="node", image="grpoflow:0.1.0-gpu", image_id="", ready=False, restart_count=0, state=state
        )
        return client.V1Pod(
            metadata=client.V1ObjectMeta(name=name), status=client.V1PodStatus(phase=phase, container_statuses=[status])
        )

    pods = client.V1PodList(items=[pod("a", "Running"), pod("b", "Failed", 1), pod("c", "Running", 137)])
    items = client.ApiClient().sanitize_for_serialization(pods)["items"]
    assert items[1]["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 1
    assert failed_pods(items) == ["b", "c"]


def test_wait_retries_a_failing_read_then_gives_up():
    now, calls = [0.0], []

    def flaky():
        calls.append(1)
        if len(calls) in (2, 3):
            raise ConnectionResetError("API server restarting")
        return COMPLETE if len(calls) == 4 else CREATED

    state = wait(flaky, 100, 1, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert state.phase == "complete" and len(calls) == 4

    def down():
        raise ConnectionRefusedError("no API server")

    with pytest.raises(ConnectionRefusedError):
        wait(down, 100, 1, clock=lambda: now[0], sleep=lambda s: None, max_read_errors=3)


def test_pods_get_the_real_tracking_uri_or_the_launch_fails_first(monkeypatch):
    """A tracking URI with credentials reaches the launch spec redacted: the template must give the pods the real
    one (from a Secret, or the same value); a URI without credentials needs nothing from the pods' environment."""
    doc = yaml.safe_load(TEMPLATE.read_text())  # sets MLFLOW_TRACKING_URI=http://mlflow:5000 as a value
    assert tracking_env_problem(doc, "http://mlflow:5000") is None
    assert tracking_env_problem(doc, "http://elsewhere:5000") is None  # the spec carries it whole
    problem = tracking_env_problem(doc, "https://***@mlflow.example.com")
    assert "sets MLFLOW_TRACKING_URI to 'http://mlflow:5000'" in problem and "https://***@mlflow.example.com" in problem
    env = doc["spec"]["trainer"]["env"]
    uri = next(e for e in env if e["name"] == "MLFLOW_TRACKING_URI")
    uri["value"] = "https://tok@mlflow.example.com"
    assert tracking_env_problem(doc, "https://***@mlflow.example.com") is None
    uri.pop("value")
    uri["valueFrom"] = {"secretKeyRef": {"name": "mlflow", "key": "uri"}}
    assert tracking_env_problem(doc, "https://***@mlflow.example.com") is None
    env.remove(uri)
    assert "set MLFLOW_TRACKING_URI in spec.trainer.env from a Secret" in tracking_env_problem(
        doc, "https://***@mlflow.example.com"
    )


def test_a_worker_without_the_real_uri_says_where_to_set_it(monkeypatch, tmp_path):
    from grpoflow.tasks.launch.dist import Comm
    from grpoflow.tasks.stages.grpo_worker import rank_tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = {"run_id": "r1", "tracking_uri": "https://***@mlflow.example.com"}
    with pytest.raises(ValueError, match=r"needs the real URI in \$MLFLOW_TRACKING_URI"):
        rank_tracker(None, spec, Comm(), None)


class _Kube:
    """The two calls :func:`stop_earlier_trainjob` makes, over a dict of live TrainJobs (no API server here)."""

    def __init__(self, live):
        self.live, self.deleted = set(live), []

    def read(self, name):
        if name not in self.live:
            raise RuntimeError(f"(404) Reason: Not Found: trainjobs {name}")
        return {"metadata": {"name": name}}

    def delete(self, name):
        self.live.discard(name)
        self.deleted.append(name)


def test_a_resume_deletes_the_trainjob_an_earlier_attempt_left_running(tmp_path):
    """The launcher pod evicted mid-job: its TrainJob's pods go on training. The resume's stage deletes that job
    before creating its own, found by the record the earlier attempt wrote; none, or one already gone, is left."""
    import json

    from grpoflow.tasks.stages.grpo_trainjob import JOB_RECORD, stop_earlier_trainjob
    from grpoflow.tasks.storage.workspace import Workspace

    ws = Workspace(tmp_path / "run")
    kube = _Kube({"r-grpo-1", "other-run"})
    assert stop_earlier_trainjob(kube, ws) is None and kube.deleted == []  # first attempt: no record
    ws.store.write(JOB_RECORD, json.dumps({"namespace": "ml", "name": "r-grpo-1"}).encode())
    assert stop_earlier_trainjob(kube, ws) == "r-grpo-1" and kube.deleted == ["r-grpo-1"]
    assert stop_earlier_trainjob(kube, ws) is None and kube.live == {"other-run"}  # gone: nothing more
