"""Fixtures for tests/infra: the compose file, the work-pool templates and the Kubernetes manifests, parsed once
per session. This folder goes on sys.path so the test modules can import infra_files (pytest runs with
--import-mode=importlib, which does not add test folders to sys.path)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from infra_files import DOCKER, INFRA, REPO, read_env_file  # noqa: E402


@pytest.fixture(scope="session")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="session")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.fixture(scope="session")
def env_example() -> dict[str, str]:
    return read_env_file(DOCKER / ".env.example")


@pytest.fixture(scope="session")
def built_images(compose) -> dict[str, Path]:
    """image name -> Dockerfile, for every compose service that builds its image from this repository."""
    images = {}
    for name, svc in compose["services"].items():
        if "build" in svc:
            build = svc["build"]
            dockerfile = (DOCKER / build["context"] / build.get("dockerfile", "Dockerfile")).resolve()
            assert name and svc.get("image"), f"compose service {name}: a build needs an image name to tag"
            images[svc["image"]] = dockerfile
    return images


@pytest.fixture(scope="session")
def templates() -> dict[str, dict]:
    """work-pool template file name -> parsed JSON."""
    return {p.name: json.loads(p.read_text()) for p in sorted((INFRA / "work-pools").glob("*.json"))}


@pytest.fixture(scope="session")
def k8s_docs() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path, doc))
    return docs
