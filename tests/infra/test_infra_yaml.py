"""docker/compose.yaml and every YAML/JSON file in infra/: they parse, carry the keys their tools need, and agree
with each other and with the code: image names that a Dockerfile here builds (or pinned external ones), work pool
names and types, service names and ports behind the URLs the workers get, env variables the code and its
libraries read, secrets, volumes and networks. Each check compares two files, so an edit to one alone fails it."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from infra_files import (
    COMPOSE_PROFILES,
    DOCKER,
    INFRA,
    REPO,
    env_placeholders,
    interpolate,
    parse_dockerfile,
    requests_gpu,
    started,
)

from grpoflow.flows.operations import POOLS  # the pools `grpoflow deploy` creates, with their templates
from grpoflow.flows.run_logs import FLOW_RUN_LOG_ENV

EXTERNAL_IMAGE = re.compile(r"^(?:[a-z0-9.-]+(?::\d+)?/)?[a-z0-9._/-]+:(?=[^:]*\d)[A-Za-z0-9._-]+$")
WORKER_SERVICES = ("worker", "worker-cpu")


def check_image(image: str, built: dict, where: str) -> None:
    """An image is built by a Dockerfile here, or an external image pinned to a versioned tag (never latest)."""
    if image in built:
        return
    name = image.rsplit(":", 1)[0]
    assert name not in {b.rsplit(":", 1)[0] for b in built}, f"{where}: {image}: no Dockerfile builds this tag"
    assert EXTERNAL_IMAGE.match(image) and "latest" not in image, f"{where}: {image} is not a pinned image"


def template_placeholders(obj) -> set[str]:
    """Names in ``{{ name }}`` placeholders of a job configuration (Prefect's own ``prefect.*`` references aside)."""
    text = json.dumps(obj)
    return {m for m in re.findall(r"\{\{\s*([\w.\-$]+)\s*\}\}", text) if not m.startswith("prefect.")}


def library_reads(var: str) -> bool:
    """True if the library that owns the variable's prefix names it in its source (so a typo is caught)."""
    owners = {"PREFECT_": "prefect", "MLFLOW_": "mlflow", "AWS_": "botocore", "HF_": "huggingface_hub"}
    for prefix, pkg in owners.items():
        if var.startswith(prefix):
            spec = importlib.util.find_spec(pkg)
            assert spec and spec.submodule_search_locations, f"{pkg} is not installed"
            root = Path(next(iter(spec.submodule_search_locations)))
            files = [root / "environment_variables.py"] if pkg == "mlflow" else root.rglob("*.py")
            return any(var in f.read_text(errors="ignore") for f in files)
    return False


def code_reads(var: str) -> bool:
    for folder in ("flows", "tasks", "kernels"):
        for f in (REPO / folder).rglob("*.py"):
            if var in f.read_text():
                return True
    return False


# ---------------------------------------------------------------- compose


def test_compose_services_have_what_compose_needs(compose):
    assert compose.get("name") == "grpoflow"
    services = compose["services"]
    for name, svc in services.items():
        assert "image" in svc, f"compose service {name}: no image"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"compose service {name} depends on unknown service {dep}"
            condition = cond["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; {dep} has no healthcheck"
            if condition == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is a one-shot step: restart must be 'no'"
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith((".", "/")):
                if source != "/var/run/docker.sock":
                    assert (DOCKER / source).exists(), f"compose service {name}: bind-mount source {source} missing"
            else:
                assert source in (compose.get("volumes") or {}), f"compose service {name}: volume {source} undeclared"
        if "build" in svc:
            build = svc["build"]
            assert (DOCKER / build["context"] / build["dockerfile"]).is_file(), f"{name}: {build} has no Dockerfile"


@pytest.mark.parametrize("profiles", COMPOSE_PROFILES)
def test_only_the_gpu_profile_needs_a_gpu_and_each_worker_profile_brings_a_worker(compose, profiles):
    """`up -d` with the cpu profile (or none) must work on a machine without an NVIDIA GPU: none of the services it
    starts reserves one; the gpu profile's process worker does. Every service started waits only on services the
    same command starts (compose refuses a dependency outside the active profiles)."""
    services = started(compose, *profiles)
    gpu = sorted(name for name, svc in services.items() if requests_gpu(svc))
    if "gpu" in profiles:
        assert "worker" in gpu, f"profile gpu: the process worker reserves no GPU ({gpu})"
    else:
        assert gpu == [], f"profiles {profiles or '(none)'} start services that need a GPU: {gpu}"
    workers = [n for n, svc in services.items() if "grpoflow-process" in (svc.get("entrypoint") or [])]
    assert workers == ({"cpu": ["worker-cpu"], "gpu": ["worker"]}.get(profiles[0]) if profiles else []), workers
    for name, svc in services.items():
        missing = set(svc.get("depends_on") or {}) - set(services)
        assert not missing, f"{name} (profiles {profiles}) depends on {missing}, which that command does not start"


def test_every_dockerfile_is_built_by_compose(built_images):
    built = {p.name for p in built_images.values()}
    assert {p.name for p in DOCKER.glob("Dockerfile*")} == built


def test_compose_images_are_built_here_or_pinned(compose, built_images, pyproject):
    for name, svc in compose["services"].items():
        check_image(svc["image"], built_images, f"compose service {name}")
    version = pyproject["project"]["version"]
    for image in ("grpoflow:0.1.0-gpu", "grpoflow:0.1.0-cpu"):
        assert image in built_images, f"compose builds no {image}"
        assert image.split(":")[1].startswith(version + "-"), f"{image}: tag should carry the version {version}"
    assert built_images["grpoflow:0.1.0-gpu"].name == "Dockerfile.gpu"
    assert built_images["grpoflow:0.1.0-cpu"].name == "Dockerfile.cpu"


def test_published_ports_bind_to_localhost_and_match_what_services_listen_on(compose, env_example):
    assert env_example["BIND_ADDRESS"] == "127.0.0.1"
    published = 0
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            published += 1
            assert port.startswith("${BIND_ADDRESS:-127.0.0.1}:"), f"compose service {name}: {port} not on localhost"
            host_ip, _host_port, container_port = interpolate(port, {}).rsplit(":", 2)
            assert host_ip == "127.0.0.1"
            command = " ".join(svc.get("command") or []) if isinstance(svc.get("command"), list) else ""
            command += " " + " ".join(svc.get("entrypoint") or [])
            listens = re.findall(r"(?:--port[= ]|-s3\.port=)(\d+)", command)
            assert container_port in listens, (
                f"compose service {name}: publishes {container_port}, listens on {listens}"
            )
    assert published >= 3


def test_env_file_example_covers_every_variable_the_compose_file_reads(compose, env_example):
    text = (DOCKER / "compose.yaml").read_text()
    used = env_placeholders(text)
    for name, rest in used:
        assert rest.startswith(":-") or name in env_example, f"compose reads ${{{name}}}: add it to .env.example"
    unused = set(env_example) - {n for n, _ in used}
    assert not unused, f"docker/.env.example sets variables compose never reads: {unused}"


def test_real_env_file_is_not_committed():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=REPO)
    assert proc.returncode == 0, "docker/.env must be ignored by git (it holds the stack's passwords)"
    tracked = subprocess.run(["git", "ls-files", "docker/.env"], cwd=REPO, capture_output=True, text=True).stdout
    assert not tracked.strip()


def test_workers_get_the_endpoints_the_code_reads(compose, env_example):
    services = compose["services"]
    for name in WORKER_SERVICES:
        env = {k: interpolate(str(v), env_example) for k, v in services[name]["environment"].items()}
        for var in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID"):
            assert env.get(var), f"compose service {name} lacks {var}"
        for var, value in env.items():
            assert code_reads(var) or library_reads(var), f"compose service {name}: nothing reads {var}"
            if value.startswith("http"):
                url = urlparse(value)
                assert url.hostname in services, f"{name}: {var}={value} names no compose service"
                target = services[url.hostname]
                command = " ".join(target.get("command") or [])
                assert re.search(rf"(--port[= ]|-s3\.port=){url.port}\b", command), f"{name}: {var} port {url.port}"
    assert code_reads("MLFLOW_TRACKING_URI"), "the code no longer reads MLFLOW_TRACKING_URI: update the workers"


def test_compose_workers_poll_the_pools_that_prefect_init_creates(compose):
    init = (DOCKER / "prefect-init.sh").read_text()
    created = dict(re.findall(r"prefect work-pool create (\S+) --type (\S+)", init))
    for name, (kind, template) in POOLS.items():
        if kind != "kubernetes":
            assert created.get(name) == kind, f"prefect-init.sh does not create {name} as a {kind} pool"
        if template and kind == "docker":
            assert f"$WORK_POOLS_DIR/{template}" in init, f"prefect-init.sh: {name} without {template}"
    for name in (*WORKER_SERVICES, "docker-worker"):
        svc = compose["services"][name]
        args = (svc.get("entrypoint") or []) + (svc.get("command") or [])
        pool, kind = args[args.index("--pool") + 1], args[args.index("--type") + 1]
        assert POOLS.get(pool, (None,))[0] == kind, f"compose service {name}: pool {pool} of type {kind}"
        assert pool in created, f"compose service {name} polls {pool}, which prefect-init.sh never creates"
    mount = next(v for v in compose["services"]["prefect-init"]["volumes"] if "work-pools" in v)
    assert (DOCKER / mount.split(":")[0]).resolve() == INFRA / "work-pools"


# ---------------------------------------------------------------- work-pool templates


def test_each_pool_with_a_template_has_its_file(templates):
    wanted = {t for _, t in POOLS.values() if t}
    assert wanted == set(templates), f"infra/work-pools holds {set(templates)}, the pools need {wanted}"


@pytest.mark.parametrize("pool", [p for p, (_, t) in POOLS.items() if t])
def test_template_is_a_valid_prefect_base_job_template(pool, templates):
    kind, file = POOLS[pool]
    template = templates[file]
    assert set(template) == {"job_configuration", "variables"}
    props = template["variables"]["properties"]
    missing = template_placeholders(template["job_configuration"]) - set(props)
    assert not missing, f"{file}: job_configuration uses undeclared variables {missing}"
    for key, prop in props.items():
        assert "type" in prop or "anyOf" in prop or "$ref" in prop or "allOf" in prop, f"{file}: {key} has no type"
    # Prefect's own server-side validation of a work pool (what `prefect work-pool create` sends)
    from prefect.server.schemas.actions import WorkPoolCreate

    WorkPoolCreate(name=pool, type=kind, base_job_template=template)


def render(template: dict, **values) -> dict:
    """The job configuration with the variables' defaults (and ``values``) filled in, as a worker does."""
    from prefect.utilities.templating import apply_values

    props = template["variables"]["properties"]
    defaults = {k: v["default"] for k, v in props.items() if "default" in v}
    return apply_values(template["job_configuration"], {**defaults, **values})


def test_docker_template_requests_gpus_and_joins_the_compose_stack(templates, compose, built_images):
    job = render(templates["docker-gpu.json"])
    check_image(job["image"], built_images, "docker-gpu.json")
    assert job["image"] == "grpoflow:0.1.0-gpu"
    request = job["container_create_kwargs"]["device_requests"][0]
    assert request["driver"] == "nvidia" and request["capabilities"] == [["gpu"]] and request["count"] == -1
    assert (
        render(templates["docker-gpu.json"], gpu_count=2)["container_create_kwargs"]["device_requests"][0]["count"] == 2
    )
    assert job["container_create_kwargs"]["shm_size"]
    networks = {n.get("name", k) for k, n in compose["networks"].items()}
    assert set(job["networks"]) <= networks, f"docker-gpu.json joins {job['networks']}, compose defines {networks}"
    named = {v.get("name") for v in compose["volumes"].values() if v}
    for vol in job["volumes"]:
        source, target = vol.split(":")[:2]
        assert source in named, f"docker-gpu.json mounts volume {source}, which compose does not name"
        worker_targets = {v.split(":")[1] for v in compose["services"]["worker"]["volumes"]}
        assert target in worker_targets, f"docker-gpu.json mounts {target}; the process worker mounts {worker_targets}"


def test_docker_template_env_points_at_compose_services(templates, compose):
    env = templates["docker-gpu.json"]["variables"]["properties"]["env"]["default"]
    services = compose["services"]
    for var, value in env.items():
        assert code_reads(var) or library_reads(var), f"docker-gpu.json: nothing reads {var}"
        if value.startswith("http"):
            url = urlparse(value)
            command = " ".join(services[url.hostname].get("command") or [])
            assert re.search(rf"(--port[= ]|-s3\.port=){url.port}\b", command), f"docker-gpu.json: {var}={value}"
        block = re.fullmatch(r"\{\{ prefect\.blocks\.secret\.([\w-]+) \}\}", value)
        if block:
            saved = re.findall(r'\.save\("([\w-]+)"', (DOCKER / "prefect-init.sh").read_text())
            assert block.group(1) in saved, f"docker-gpu.json: Secret block {block.group(1)} is never saved"
    assert {"MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env)


def test_kubernetes_template_requests_gpus_on_gpu_nodes(templates, k8s_docs, built_images):
    template = templates["kubernetes-gpu.json"]
    job = render(template)
    manifest = job["job_manifest"]
    assert manifest["kind"] == "Job"
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    check_image(container["image"], built_images, "kubernetes-gpu.json")
    assert container["image"] == "grpoflow:0.1.0-gpu"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert (
        render(template, gpu_count=4)["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["resources"][
            "limits"
        ]["nvidia.com/gpu"]
        == 4
    )
    assert pod["nodeSelector"], "no GPU node selector"
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"]), pod["tolerations"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) <= set(volumes) and mounts.get("dshm") == "/dev/shm"
    # the pod's uid is the one the image creates
    uid = container["securityContext"]["runAsUser"]
    final = [i for i in parse_dockerfile(DOCKER / "Dockerfile.gpu") if i.keyword == "USER"]
    assert str(uid) == final[-1].args.split(":")[0], f"kubernetes-gpu.json runs as {uid}, the image as {final[-1]}"
    # namespace, secret and services exist in infra/k8s
    namespaces = {d["metadata"]["name"] for _, d in k8s_docs if d["kind"] == "Namespace"}
    assert job["namespace"] in namespaces, f"kubernetes-gpu.json runs jobs in {job['namespace']}, not {namespaces}"
    secrets = {d["metadata"]["name"]: d for _, d in k8s_docs if d["kind"] == "Secret"}
    secret = container["envFrom"][0]["secretRef"]["name"]
    assert secret in secrets, f"kubernetes-gpu.json reads Secret {secret}, infra/k8s has {set(secrets)}"
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secrets[secret]["stringData"])
    services = {d["metadata"]["name"]: d for _, d in k8s_docs if d["kind"] == "Service"}
    env = job["env"]
    assert {"MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL"} <= set(env)
    for var, value in env.items():
        assert code_reads(var) or library_reads(var), f"kubernetes-gpu.json: nothing reads {var}"
        if value.startswith("http"):
            url = urlparse(value)
            assert url.hostname in services, f"kubernetes-gpu.json: {var}={value}: no Service {url.hostname}"
            ports = [p["port"] for p in services[url.hostname]["spec"]["ports"]]
            assert url.port in ports, f"kubernetes-gpu.json: {var}={value}: Service ports {ports}"


# ---------------------------------------------------------------- Kubernetes manifests and Helm values


def test_k8s_manifests_are_complete_and_consistent(k8s_docs, built_images):
    files = {p.name for p in (INFRA / "k8s").glob("*.yaml")}
    kustomization = yaml.safe_load((INFRA / "k8s" / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == files - {"kustomization.yaml", "secrets.example.yaml"}
    renamed = {i["name"]: f"{i['name']}:{i['newTag']}" for i in kustomization.get("images", [])}
    for image in renamed.values():
        assert image in built_images, f"kustomization.yaml: {image} is not built by a Dockerfile here"
    docs = [(p, d) for p, d in k8s_docs if d.get("kind") != "Kustomization"]
    secrets = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Secret"}
    workloads = [d for _, d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    for path, doc in docs:
        assert doc.get("apiVersion") and doc["metadata"].get("name"), f"{path.name}: {doc.get('kind')} lacks keys"
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == kustomization["namespace"], f"{path.name}: {doc['kind']}"
    for wl in workloads:
        pod = wl["spec"]["template"]["spec"]
        for c in pod["containers"]:
            check_image(renamed.get(c["image"], c["image"]), built_images, f"{wl['kind']} {wl['metadata']['name']}")
            for ref in c.get("envFrom", []):
                assert ref["secretRef"]["name"] in secrets
            for e in c.get("env", []):
                key = (e.get("valueFrom") or {}).get("secretKeyRef")
                if key:
                    assert key["name"] in secrets, f"{wl['metadata']['name']}: Secret {key['name']} missing"
                    assert key["key"] in secrets[key["name"]]["stringData"], f"{key} missing"
    for _, svc in docs:
        if svc["kind"] != "Service":
            continue
        selector = svc["spec"]["selector"].items()
        match = [
            wl for wl in workloads if selector <= wl["spec"]["template"].get("metadata", {}).get("labels", {}).items()
        ]
        assert match, f"Service {svc['metadata']['name']} selects no workload"
        ports = {p.get("containerPort") for c in match[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {svc['metadata']['name']}: targetPort {p['targetPort']}"


def test_helm_worker_values_name_the_kubernetes_pool(built_images):
    values = yaml.safe_load((INFRA / "helm" / "prefect-worker-values.yaml").read_text())
    config = values["worker"]["config"]
    assert POOLS.get(config["workPool"], (None,))[0] == config["type"] == "kubernetes"
    template = POOLS[config["workPool"]][1]
    text = (INFRA / "helm" / "prefect-worker-values.yaml").read_text()
    assert f"--set-file worker.config.baseJobTemplate.configuration=infra/work-pools/{template}" in text
    image = f"{values['worker']['image']['repository']}:{values['worker']['image']['prefectTag']}"
    check_image(image, built_images, "prefect-worker-values.yaml")
    api = urlparse(values["worker"]["selfHostedServerApiConfig"]["apiUrl"])
    assert api.path == "/api" and api.port == 4200
    server = yaml.safe_load((INFRA / "helm" / "prefect-server-values.yaml").read_text())
    assert (
        server["server"]["image"]["prefectTag"].split("-")[0] == values["worker"]["image"]["prefectTag"].split("-")[0]
    )


# ---------------------------------------------------------------- infra/prefect.yaml


def test_prefect_yaml_deployments_use_pools_and_images_that_exist(templates, built_images):
    doc = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    deployments = doc.get("deployments") or []
    assert deployments, "infra/prefect.yaml has no deployments"
    for dep in deployments:
        pool = (dep.get("work_pool") or {}).get("name")
        assert pool in POOLS, f"deployment {dep.get('name')}: work pool {pool} is not one of {set(POOLS)}"
        _kind, template = POOLS[pool]
        job_vars = (dep.get("work_pool") or {}).get("job_variables") or {}
        if template:
            props = templates[template]["variables"]["properties"]
            unknown = set(job_vars) - set(props)
            assert not unknown, f"deployment {dep.get('name')}: job variables {unknown} are not in {template}"
        image = job_vars.get("image")
        if isinstance(image, str) and "{{" not in image:
            check_image(image, built_images, f"deployment {dep.get('name')}")


def test_every_flow_run_starts_with_grpoflow_logs_forwarded_to_prefect(templates, compose):
    """Prefect reads PREFECT_LOGGING_EXTRA_LOGGERS as the flow-run process starts: each deployment's flow runs get
    it from their job variables (process pool) or their pool template's env default (Docker, Kubernetes: a
    deployment env there would replace the MLflow and S3 endpoints), the compose workers pass theirs on."""
    doc = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    for dep in doc["deployments"]:
        pool = dep["work_pool"]["name"]
        _kind, template = POOLS[pool]
        job_env = (dep["work_pool"].get("job_variables") or {}).get("env")
        if template:
            assert job_env is None, f"deployment {dep['name']}: an env job variable replaces {template}'s env"
            env = templates[template]["variables"]["properties"]["env"]["default"]
        else:
            env = job_env or {}
        missing = {k: v for k, v in FLOW_RUN_LOG_ENV.items() if env.get(k) != v}
        assert not missing, f"deployment {dep['name']} ({pool}): its flow runs lack {missing}"
    for name in WORKER_SERVICES:
        env = compose["services"][name]["environment"]
        assert {k: env.get(k) for k in FLOW_RUN_LOG_ENV} == FLOW_RUN_LOG_ENV, f"compose service {name}"
    for var in FLOW_RUN_LOG_ENV:
        assert library_reads(var), f"Prefect no longer reads {var}"


# ---------------------------------------------------------------- Kubeflow Trainer TrainJob (distributed.launcher)


def test_trainjob_template_is_consistent_with_infra_and_the_config(k8s_docs, templates, built_images):
    from grpoflow.tasks.config.distributed import TrainJobConfig
    from grpoflow.tasks.launch.trainjob import GPU, RESERVED_ENV, load_template

    path = INFRA / "kubeflow" / "trainjob.yaml"
    job = load_template(path)  # a TrainJob of trainer.kubeflow.org/v1alpha1 with a trainer, no PET_* env
    defaults = TrainJobConfig()
    assert defaults.template == str(path.relative_to(REPO)), "distributed.trainjob.template default moved"
    # the flow-run pod reads it relative to /app, the checkout in the image: the build context must let it through
    allowed = [r.strip() for r in (REPO / ".dockerignore").read_text().splitlines() if r.startswith("!")]
    assert f"!{defaults.template}" in allowed, ".dockerignore keeps the TrainJob template out of the image"
    trainer = job["spec"]["trainer"]
    # the config's defaults are what the file says (the stage writes them over the file's values)
    assert (job["metadata"]["namespace"], trainer["image"], job["spec"]["runtimeRef"]["name"]) == (
        defaults.namespace,
        defaults.image,
        defaults.runtime,
    )
    check_image(trainer["image"], built_images, "trainjob.yaml")
    assert job["metadata"]["labels"].get("app.kubernetes.io/name") == "grpoflow"
    namespaces = {d["metadata"]["name"] for _, d in k8s_docs if d["kind"] == "Namespace"}
    assert job["metadata"]["namespace"] in namespaces, f"trainjob.yaml: namespace not in {namespaces}"
    limits = trainer["resourcesPerNode"]["limits"]
    assert GPU in limits and "memory" in limits, f"trainjob.yaml: limits {limits}"
    assert not set(trainer.get("resourcesPerNode", {}).get("requests", {})) - {"cpu", "memory"}
    # env: what the code or its libraries read; URLs reach Services of infra/k8s; secrets exist with their keys
    secrets = {d["metadata"]["name"]: d for _, d in k8s_docs if d["kind"] == "Secret"}
    services = {d["metadata"]["name"]: d for _, d in k8s_docs if d["kind"] == "Service"}
    env = {e["name"]: e for e in trainer["env"]}
    assert not set(env) & set(RESERVED_ENV)
    assert {"MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env)
    for var, e in env.items():
        assert code_reads(var) or library_reads(var), f"trainjob.yaml: nothing reads {var}"
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            assert ref["name"] in secrets, f"trainjob.yaml: {var} reads Secret {ref['name']}, not in infra/k8s"
            assert ref["key"] in secrets[ref["name"]]["stringData"], f"trainjob.yaml: {var}: key {ref['key']}"
        elif e["value"].startswith("http"):
            url = urlparse(e["value"])
            assert url.hostname in services, f"trainjob.yaml: {var}={e['value']}: no Service {url.hostname}"
            assert url.port in [p["port"] for p in services[url.hostname]["spec"]["ports"]], f"{var} port"
    # the same endpoints, image and S3 Secret as the flow-run pods of the Kubernetes work pool
    pool = templates["kubernetes-gpu.json"]["variables"]["properties"]
    for var, value in pool["env"]["default"].items():
        if var in FLOW_RUN_LOG_ENV:  # the flow run's Prefect logging: a TrainJob pod runs torchrun, no flow
            continue
        assert env[var].get("value") == value, f"trainjob.yaml {var} differs from kubernetes-gpu.json"
    assert pool["image"]["default"] == trainer["image"]
    assert {r["secretKeyRef"]["name"] for r in (e.get("valueFrom") for e in env.values()) if r} == {
        pool["s3_secret_name"]["default"]
    }


@pytest.mark.parametrize("n", [1, 2, 8])
def test_kubernetes_pool_gpu_count_reaches_the_container(templates, n):
    """One node, N GPUs: `job_variables: {gpu_count: N}` puts N nvidia.com/gpu in the flow-run container's limits
    and requests, where `distributed.nproc_per_node=N` then runs one process per GPU (docs/distributed.md)."""
    template = templates["kubernetes-gpu.json"]
    var = template["variables"]["properties"]["gpu_count"]
    assert var["type"] == "integer" and var["minimum"] == 1
    container = render(template, gpu_count=n)["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == n
    assert container["resources"]["requests"]["nvidia.com/gpu"] == n
    readme = (REPO / "README.md").read_text() + (INFRA / "README.md").read_text()
    assert "gpu_count" in readme and "distributed.nproc_per_node" in readme


def test_trainjob_rbac_grants_every_call_the_launcher_makes():
    """infra/kubeflow/rbac.yaml: the Role bound to the launcher's ServiceAccount allows each Kubernetes API call of
    KubeTrainJobs (read from its source, so a new call fails here until the Role grants it)."""
    from grpoflow.tasks.launch import trainjob

    needs = {
        "create_namespaced_custom_object": ("trainer.kubeflow.org", "trainjobs", "create"),
        "get_namespaced_custom_object": ("trainer.kubeflow.org", "trainjobs", "get"),
        "delete_namespaced_custom_object": ("trainer.kubeflow.org", "trainjobs", "delete"),
        "list_namespaced_pod": ("", "pods", "list"),
        "read_namespaced_pod_log": ("", "pods/log", "get"),
    }
    calls = set(re.findall(r"self\.(?:custom|core)\.(\w+)\(", Path(trainjob.__file__).read_text()))
    assert calls and calls <= set(needs), f"KubeTrainJobs calls {calls - set(needs)}: add them here and to rbac.yaml"
    docs = {d["kind"]: d for d in yaml.safe_load_all((INFRA / "kubeflow" / "rbac.yaml").read_text())}
    granted = {
        (group, res, verb)
        for rule in docs["Role"]["rules"]
        for group in rule["apiGroups"]
        for res in rule["resources"]
        for verb in rule["verbs"]
    }
    missing = {needs[c] for c in calls} - granted
    assert not missing, f"rbac.yaml grants no {missing}"
    assert trainjob.GROUP == "trainer.kubeflow.org" and trainjob.PLURAL == "trainjobs"
    binding, account = docs["RoleBinding"], docs["ServiceAccount"]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": account["metadata"]["namespace"]}
    ]
    from grpoflow.tasks.config.distributed import TrainJobConfig

    for doc in docs.values():
        assert doc["metadata"]["namespace"] == TrainJobConfig().namespace
