"""Deployments on a real Prefect server (SQLite) with a real process worker: `grpoflow deploy` creates the pools
and deploys infra/prefect.yaml, `prefect deployment run grpo-pipeline/local` runs the micro pipeline into MLflow,
and `grpoflow data-landed` starts exactly one continuous cycle through the deployment trigger, which consumes the
new file once, warm-starts from the champion and logs its promotion decision; a second event consumes nothing."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow.tracking import MlflowClient

from grpoflow.flows.run_logs import FLOW_RUN_LOG_ENV
from tests.paths import MICRO, REPO

PREFECT = [str(Path(sys.executable).with_name("prefect"))]
GRPOFLOW = [sys.executable, "-m", "grpoflow.flows.cli"]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (twice: a Prefect worker exits on the second), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory):
    """A Prefect server on a free port (its own PREFECT_HOME and SQLite store); yields the environment of the
    processes that talk to it."""
    root = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    env = dict(
        os.environ,
        PREFECT_HOME=str(root / "home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_LOGGING_LEVEL="INFO",
        # the flow-run processes import this checkout (after a PYTHONPATH that maps the grpoflow namespace onto it)
        PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p),
        GRPOFLOW_PROGRESS="0",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    for key in FLOW_RUN_LOG_ENV:  # the flow runs must get these from infra/prefect.yaml, not from this process
        env.pop(key, None)
    log = open(root / "server.log", "w")
    cmd = [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(f"{env['PREFECT_API_URL']}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"prefect server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield env
    finally:
        stop(proc)
        log.close()


def run(cmd: list[str], env: dict, timeout: float = 300) -> str:
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def deployed(prefect_env, tmp_path_factory):
    """`grpoflow deploy` (pools + every deployment), then a process worker on grpoflow-process."""
    t0 = time.perf_counter()
    run([*GRPOFLOW, "deploy"], prefect_env)
    print(f"\ngrpoflow deploy: {time.perf_counter() - t0:.0f} s")
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    log = open(log_path, "w")
    cmd = [*PREFECT, "worker", "start", "--pool", "grpoflow-process", "--type", "process"]
    worker = subprocess.Popen(
        cmd, env=prefect_env, cwd=log_path.parent, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        yield dict(prefect_env, GRPOFLOW_TEST_WORKER_LOG=str(log_path))  # read by the tests of the worker's log
    finally:
        stop(worker)
        log.close()
        print(log_path.read_text()[-3000:])


def api(env: dict, method: str, path: str, body: dict | None = None):
    """One Prefect API call, retried on 429/502/503 as Prefect's own client does (its server answers 503 while its
    SQLite database is busy, seen under a loaded machine); the JSON body of the answer, None when it has none."""
    for attempt in range(6):
        r = httpx.request(method, env["PREFECT_API_URL"] + path, json=body, timeout=30)
        if r.status_code not in (429, 502, 503) or attempt == 5:
            break
        time.sleep(0.5 * 2**attempt)
    r.raise_for_status()
    return r.json() if r.content else None


def wait_for(env: dict, flow_run_id: str, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        fr = api(env, "GET", f"/flow_runs/{flow_run_id}")
        if fr["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return fr
        time.sleep(2)
    raise TimeoutError(f"flow run {flow_run_id} still {fr['state_type']} after {timeout} s")


def flow_runs(env: dict, deployment_id: str) -> list[dict]:
    body = {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC"}
    return api(env, "POST", "/flow_runs/filter", body)


def run_logs(env: dict, flow_run_id: str) -> str:
    body = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_DESC", "limit": 200}
    logs = api(env, "POST", "/logs/filter", body)
    return "\n".join(entry["message"] for entry in logs)


def wait_for_logger_line(env: dict, flow_run_id: str, logger: str, text: str, timeout: float = 60) -> list[str]:
    """The messages of the flow run's logs by loggers under ``logger``, once one of them contains ``text``."""
    body = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
    deadline = time.time() + timeout
    while True:
        lines = [e["message"] for e in api(env, "POST", "/logs/filter", body) if e["name"].startswith(logger)]
        if any(text in line for line in lines) or time.time() > deadline:
            assert any(text in line for line in lines), lines[-20:]
            return lines
        time.sleep(1)


def wait_for_log(env: dict, flow_run_id: str, text: str, timeout: float = 60) -> str:
    """The flow run's logs once they contain ``text`` (logs reach the API after the final state: shipped in the
    background until the flow-run process exits)."""
    deadline = time.time() + timeout
    while text not in (logs := run_logs(env, flow_run_id)) and time.time() < deadline:
        time.sleep(1)
    assert text in logs, logs[-3000:]
    return logs


def arithmetic_rows(n: int, seed: int) -> str:
    rng = random.Random(seed)
    rows = [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(n)]
    return "".join(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n" for a, b in rows)


def test_deploy_pipeline_run_and_continuous_cycle(deployed, tmp_path):
    env = deployed
    listed = api(env, "POST", "/work_pools/filter", {})
    pools = {p["name"]: p["type"] for p in listed}
    assert pools == {"grpoflow-process": "process", "grpoflow-docker-gpu": "docker", "grpoflow-k8s-gpu": "kubernetes"}
    # the GPU pools got the GPU job templates of infra/work-pools/, not Prefect's defaults
    templates = {p["name"]: json.dumps(p["base_job_template"]) for p in listed}
    assert "nvidia.com/gpu" in templates["grpoflow-k8s-gpu"] and "tolerations" in templates["grpoflow-k8s-gpu"]
    assert "gpu_count" in templates["grpoflow-docker-gpu"] and "nvidia.com/gpu" not in templates["grpoflow-process"]
    names = ("grpo-pipeline/local", "grpo-pipeline/docker-gpu", "grpo-pipeline/k8s-gpu", "grpo-continuous/local")
    deps = {name: api(env, "GET", f"/deployments/name/{name}") for name in names}
    assert deps["grpo-pipeline/docker-gpu"]["job_variables"]["image"] == "grpoflow:0.1.0-gpu"
    assert deps["grpo-pipeline/k8s-gpu"]["work_pool_name"] == "grpoflow-k8s-gpu"
    continuous = deps["grpo-continuous/local"]
    assert [s["schedule"]["interval"] for s in continuous["schedules"]] == [3600.0]
    assert [s["active"] for s in continuous["schedules"]] == [False]  # declared, paused: the event does the work

    # 1. the pipeline deployment on the process worker, micro config, into a SQLite MLflow store
    out = tmp_path / "runs"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [f"run.output_dir={out}", "run.name=deployed", f"tracking.uri={uri}"]
    t0 = time.perf_counter()
    cmd = [*PREFECT, "deployment", "run", "grpo-pipeline/local", "--param", f"config={MICRO}"]
    text = run([*cmd, "--param", f"overrides={json.dumps(overrides)}"], env)
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", text)[1]
    fr = wait_for(env, flow_run_id)
    print(f"pipeline deployment run: {time.perf_counter() - t0:.0f} s")
    assert fr["state_type"] == "COMPLETED", run_logs(env, flow_run_id)[-3000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("grpoflow")
    (parent,) = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "FINISHED" and parent.info.run_name == "deployed"
    assert parent.data.tags["prefect_flow_run_id"] == flow_run_id
    assert {"accuracy_before", "accuracy_after"} <= set(parent.data.metrics)
    # grpoflow's own INFO lines reach the flow run's Prefect logs (infra/prefect.yaml's job env, flows/run_logs.py)
    wait_for_logger_line(env, flow_run_id, "grpoflow.", "stage grpo: running")
    champion = client.get_model_version_by_alias("grpoflow-tiny", "champion")

    # 2. continuous: point grpo-continuous/local at a folder, drop a file, emit the event
    incoming, state = tmp_path / "incoming", tmp_path / "state"
    incoming.mkdir()
    (tmp_path / "heldout.jsonl").write_text(arithmetic_rows(12, seed=1))
    params = {
        "config": str(MICRO),
        "overrides": [*overrides[:1], f"tracking.uri={uri}", f"data.eval_source={tmp_path / 'heldout.jsonl'}"],
        "source": str(incoming),
        "state_dir": str(state),
    }
    t0 = time.perf_counter()
    run([*GRPOFLOW, "deploy", "-n", "grpo-continuous/local", "--params", json.dumps(params)], env)
    print(f"grpoflow deploy -n grpo-continuous/local: {time.perf_counter() - t0:.0f} s")
    assert flow_runs(env, continuous["id"]) == []
    (incoming / "batch1.jsonl").write_text(arithmetic_rows(40, seed=2))
    t0 = time.perf_counter()
    run([*GRPOFLOW, "data-landed", str(incoming / "batch1.jsonl")], env)
    first = wait_until_runs(env, continuous["id"], 1)[0]
    first = wait_for(env, first["id"])
    print(f"continuous cycle (event -> completed): {time.perf_counter() - t0:.0f} s")
    logs = run_logs(env, first["id"])
    assert first["state_type"] == "COMPLETED", logs[-3000:]
    assert first["created_by"]["type"] == "AUTOMATION"  # started by the deployment trigger
    ledger = json.loads((state / "ledger.json").read_text())["consumed"]
    assert [e["name"] for e in ledger] == ["batch1.jsonl"]
    cycle = client.search_runs([exp.experiment_id], "tags.`grpoflow.continuous` = 'true'")
    assert len(cycle) == 1 and cycle[0].info.status == "FINISHED"
    tags = cycle[0].data.tags
    assert tags["continuous.warm_start"] == f"models:/grpoflow-tiny/{champion.version}"
    assert tags["continuous.files"] == "batch1.jsonl" and ledger[0]["mlflow_run_id"] == cycle[0].info.run_id
    # the champion folder is the cycle's config (model.warm_start): its config.yaml and GRPO key hold it, so a
    # `grpoflow resume` of the cycle's workspace starts from the champion again, not from model.name
    (cycle_ws,) = (state / "cycles").iterdir()
    warm_start = yaml.safe_load((cycle_ws / "config.yaml").read_text())["model"]["warm_start"]
    grpo = json.loads((cycle_ws / "grpo" / "manifest.json").read_text())
    assert warm_start.startswith(str(state)) and grpo["summary"]["base_model"] == warm_start
    assert "config.json" in grpo["fingerprint"]["content"]["model.warm_start"]
    version = tags["registered_model"].split("/")[-1]
    reason = client.get_model_version("grpoflow-tiny", version).tags["champion_decision"]
    assert reason in tags["continuous.decision"] and reason in wait_for_log(env, first["id"], "decision: ")
    now = client.get_model_version_by_alias("grpoflow-tiny", "champion").version
    assert now == (version if tags["continuous.decision"].startswith("promoted") else champion.version)

    # 3. the same event again, nothing new: a second run that consumes nothing
    t0 = time.perf_counter()
    run([*GRPOFLOW, "data-landed", str(incoming)], env)
    second = wait_for(env, wait_until_runs(env, continuous["id"], 2)[1]["id"])
    print(f"continuous cycle without new data: {time.perf_counter() - t0:.0f} s")
    assert second["state_type"] == "COMPLETED", run_logs(env, second["id"])[-3000:]
    wait_for_log(env, second["id"], "nothing to do")
    assert len(json.loads((state / "ledger.json").read_text())["consumed"]) == 1
    assert len(client.search_runs([exp.experiment_id], "tags.`grpoflow.continuous` = 'true'")) == 1
    assert len(flow_runs(env, continuous["id"])) == 2


def wait_until_runs(env: dict, deployment_id: str, n: int, timeout: float = 120) -> list[dict]:
    """The deployment's flow runs once there are ``n`` (the trigger's automation creates them)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        runs = flow_runs(env, deployment_id)
        if len(runs) >= n:
            time.sleep(3)  # a second run would show up now: the test checks there is exactly n
            runs = flow_runs(env, deployment_id)
            assert len(runs) == n, [r["name"] for r in runs]
            return runs
        time.sleep(1)
    raise TimeoutError(f"deployment {deployment_id}: {len(runs)} flow runs after {timeout} s, expected {n}")


# The improving cycle (issue 44 item 4), on the offline default config's tiny model. The weak champion: SFT for
# WEAK_SFT_STEPS steps, then one GRPO step at the warm-up's zero learning rate (so the registered model is the short
# SFT's). Measured 2026-12-05 on the 2-core host (one run; training is deterministic on one machine and thread count,
# another CPU gives another SFT model): champion 15% -> candidate 26% on the 100 held-out rows, 17 rows gained,
# 6 lost, McNemar p = 0.035 (promoted, but near alpha 0.05); the zero-LR cycle 26% -> 26%, b = c = 0, p = 1. The
# test took 4:46 (weak run 120 s, the improving cycle 108 s, the flat one 21 s). Outside the test (one `grpoflow
# run`, GRPO on all 700 rows): 500 SFT + 150 GRPO steps 15% -> 28% (b 19, c 6, p = 0.015), a wider margin for about
# 50 s more; 300 SFT + 60 GRPO steps 6% -> 7% (b 7, c 6, p = 1): too weak a champion for GRPO to gain on.
DEFAULT = REPO / "configs" / "default.yaml"
WEAK_SFT_STEPS = 500
IMPROVING_GRPO_STEPS = 100


def test_a_cycle_that_improves_promotes_and_one_that_does_not_keeps_the_champion(deployed, mlflow_server, tmp_path):
    """From a weak champion (a short SFT), a landed batch and a cycle of real GRPO steps: the cycle measures the
    champion and its candidate on the same 100 held-out rows and promotes on the paired McNemar test; a second
    landed batch and a cycle whose GRPO cannot move the model (one step, at the warm-up's zero learning rate) finds
    no difference and keeps the champion. Real Prefect server, process worker, events, real MLflow server."""
    from grpoflow.tasks.config import load_config
    from grpoflow.tasks.dataio.rows import generate_arithmetic

    env = deployed
    cfg = load_config(DEFAULT)
    train, held_out = generate_arithmetic(cfg.data.arithmetic, cfg.run.seed)  # the default run's 700 / 100 split
    heldout, incoming, state = tmp_path / "heldout.jsonl", tmp_path / "incoming", tmp_path / "state"
    heldout.write_text("".join(json.dumps(r) + "\n" for r in held_out))
    incoming.mkdir()
    name = "grpoflow-improves"
    common = [
        f"run.output_dir={tmp_path / 'runs'}",
        f"tracking.uri={mlflow_server}",
        "tracking.experiment=improves",
        f"tracking.registered_model={name}",
        f"data.eval_source={heldout}",
        "eval.pass_k=[]",  # greedy accuracy decides; no sampling
        # alpha 0.1, not the default 0.05: p measured 0.035 on this host, and another CPU trains another weak
        # champion; the test is of the decision's wiring and of a real gain, not of the default's strictness
        "tracking.promotion_alpha=0.1",
        "export.gguf=[]",
        "export.verify_prompts=0",
    ]
    client = MlflowClient(mlflow_server)

    # 1. the weak champion: a short SFT, registered as the first version (no champion yet: promoted as it is)
    t0 = time.perf_counter()
    weak = [f"sft.max_steps={WEAK_SFT_STEPS}", "grpo.max_steps=1", "run.name=weak"]
    run([*GRPOFLOW, "run", str(DEFAULT), *common, *weak], env, timeout=900)
    print(f"\nweak champion ({WEAK_SFT_STEPS} SFT steps): {time.perf_counter() - t0:.0f} s")
    weak_version = client.get_model_version_by_alias(name, "champion").version

    continuous = api(env, "GET", "/deployments/name/grpo-continuous/local")
    before = len(flow_runs(env, continuous["id"]))

    def cycle(batch: str, rows: list[dict], grpo: list[str]) -> dict:
        """Point the deployment at the folder with these GRPO settings, land ``batch``, signal it; the cycle's
        MLflow run tags once its flow run completed."""
        params = {
            "config": str(DEFAULT),
            "overrides": [*common, *grpo],
            "source": str(incoming),
            "state_dir": str(state),
        }
        run([*GRPOFLOW, "deploy", "-n", "grpo-continuous/local", "--params", json.dumps(params)], env)
        (incoming / batch).write_text("".join(json.dumps(r) + "\n" for r in rows))
        n = len(flow_runs(env, continuous["id"])) + 1
        t0 = time.perf_counter()
        run([*GRPOFLOW, "data-landed", str(incoming / batch)], env)
        fr = wait_for(env, wait_until_runs(env, continuous["id"], n)[-1]["id"], timeout=900)
        print(f"cycle on {batch} ({grpo}): {time.perf_counter() - t0:.0f} s")
        assert fr["state_type"] == "COMPLETED", run_logs(env, fr["id"])[-3000:]
        exp = client.get_experiment_by_name("improves")
        runs = client.search_runs([exp.experiment_id], f"tags.`continuous.files` = '{batch}'")
        assert len(runs) == 1
        print({k: v for k, v in runs[0].data.tags.items() if k.startswith("promotion.")})
        return runs[0].data.tags

    # 2. a batch and real GRPO from the weak champion: a gain the paired test accepts
    improving = cycle("batch1.jsonl", train[:300], [f"grpo.max_steps={IMPROVING_GRPO_STEPS}"])
    assert improving["continuous.warm_start"] == f"models:/{name}/{weak_version}"
    assert improving["promotion.champion_version"] == weak_version
    b, c, p = int(improving["promotion.b"]), int(improving["promotion.c"]), float(improving["promotion.p_value"])
    assert improving["promotion.rows"] == "100" and improving["promotion.alpha"] == "0.1"
    assert improving["promotion.decision"] == "promoted" and b > c and p < 0.1, improving
    gain = float(improving["promotion.accuracy_candidate"]) - float(improving["promotion.accuracy_champion"])
    assert gain == pytest.approx((b - c) / 100)  # the accuracies are the same rows' counts
    promoted = improving["registered_model"].split("/")[-1]
    assert client.get_model_version_by_alias(name, "champion").version == promoted != weak_version
    version_tags = client.get_model_version(name, promoted).tags
    assert {k: v for k, v in version_tags.items() if k.startswith("promotion.")} == {
        k: v for k, v in improving.items() if k.startswith("promotion.")
    }
    assert (
        improving["continuous.decision"].startswith("promoted")
        and f"{b} rows gained, {c} lost" in (improving["continuous.decision"])
    )

    # 3. another batch, and a cycle that cannot improve: the champion is kept
    flat = cycle("batch2.jsonl", train[300:400], ["grpo.max_steps=1"])
    assert flat["continuous.warm_start"] == f"models:/{name}/{promoted}"
    assert flat["promotion.decision"] == "kept the champion" and float(flat["promotion.p_value"]) >= 0.05, flat
    assert flat["continuous.decision"].startswith("kept the champion")
    assert client.get_model_version_by_alias(name, "champion").version == promoted
    ledger = json.loads((state / "ledger.json").read_text())["consumed"]
    assert [e["name"] for e in ledger] == ["batch1.jsonl", "batch2.jsonl"]
    assert len(flow_runs(env, continuous["id"])) == before + 2


CONTINUOUS = "grpo-continuous/local"


def deploy_continuous(env: dict, *args: str) -> tuple[dict, str]:
    """`grpoflow deploy -n grpo-continuous/local ARGS`: the deployment's parameters on the server after it, and the
    line the command printed about them."""
    out = run([*GRPOFLOW, "deploy", "-n", CONTINUOUS, *args], env)
    (line,) = [line for line in out.splitlines() if line.startswith(f"{CONTINUOUS}: ")]
    return api(env, "GET", f"/deployments/name/{CONTINUOUS}")["parameters"], line


def test_a_redeploy_keeps_the_parameters_unless_reset(prefect_env, tmp_path):
    """A redeploy without --params keeps what the user set (with --params or through the API) and says so;
    --reset-params restores infra/prefect.yaml's parameters."""
    import yaml

    env = prefect_env
    (spec,) = [d for d in yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())["deployments"]
               if d["entrypoint"].endswith(":grpo_continuous")]  # fmt: skip
    defaults = spec["parameters"]
    params, line = deploy_continuous(env, "--reset-params")  # new, or back to the yaml's if an earlier test set it
    assert params == defaults and line.startswith((f"{CONTINUOUS}: new: ", f"{CONTINUOUS}: parameters reset to "))

    mine = {"source": str(tmp_path / "incoming"), "state_dir": str(tmp_path / "state")}
    params, line = deploy_continuous(env, "--params", json.dumps(mine))
    assert params == {**defaults, **mine}  # --params sets its keys over the kept ones
    assert line.startswith(f"{CONTINUOUS}: kept parameters ") and "--params set source, state_dir" in line

    # parameters changed through the API (as the UI does), then a plain redeploy of everything
    dep = api(env, "GET", f"/deployments/name/{CONTINUOUS}")
    edited = {**params, "overrides": ["data.eval_source=/data/heldout.jsonl", "grpo.max_steps=5"]}
    api(env, "PATCH", f"/deployments/{dep['id']}", {"parameters": edited})
    out = run([*GRPOFLOW, "deploy"], env)
    after = api(env, "GET", f"/deployments/name/{CONTINUOUS}")
    assert after["parameters"] == edited and after["id"] == dep["id"]
    expected = (
        f"{CONTINUOUS}: kept parameters {json.dumps(edited, sort_keys=True)} "
        "(--reset-params to restore infra/prefect.yaml's)"
    )
    assert expected in out.splitlines(), out[-3000:]
    assert sum(line.startswith("grpo-pipeline/") for line in out.splitlines()) == 3  # one line per deployment
    assert [s["active"] for s in after["schedules"]] == [False]  # the rest of the yaml deployed as before

    params, line = deploy_continuous(env, "--reset-params")
    assert params == defaults and line.startswith(f"{CONTINUOUS}: parameters reset to infra/prefect.yaml's: ")


def test_a_cycle_whose_source_is_missing_fails_naming_the_deployment_and_parameter(deployed):
    """The yaml's default source (data/incoming, not in the checkout) on the process worker: the flow run fails
    with one error naming the deployment, the parameter and the working directory, and no traceback in the
    worker's log."""
    env = deployed
    assert not (REPO / "data" / "incoming").exists()
    params, _ = deploy_continuous(env, "--reset-params")  # what a redeploy used to do silently
    assert params["source"] == "data/incoming"
    log = Path(env["GRPOFLOW_TEST_WORKER_LOG"])
    start = log.stat().st_size
    text = run([*PREFECT, "deployment", "run", CONTINUOUS], env)
    fr = wait_for(env, re.search(r"UUID: ([0-9a-f-]{36})", text)[1])
    assert fr["state_type"] == "FAILED"
    message = f'deployment {CONTINUOUS}: parameter source="data/incoming" is not a folder (working directory {REPO})'
    logs = wait_for_log(env, fr["id"], message)
    assert f"{message}; set it with `grpoflow deploy -n {CONTINUOUS} --param source=/data/incoming`" in logs
    time.sleep(3)  # the flow-run process's last lines reach the worker's log
    worker_log = log.read_text()[start:]
    assert message in worker_log and "Traceback" not in worker_log, worker_log[-5000:]
    print(worker_log[-3000:])
