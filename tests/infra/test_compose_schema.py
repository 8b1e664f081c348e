"""docker/compose.yaml against the Compose Specification's own JSON schema (vendored in tests/fixtures, source and
Apache-2.0 license in tests/fixtures/COMPOSE-SPEC-LICENSE), with the draft that the schema declares, so a key that
Compose would reject (a typo, a wrong type, a misplaced block) fails here without a Docker engine. Broken copies of
the file prove the check bites.

Then podman-compose (dev extra), a real Compose implementation, resolves the file per profile with --dry-run
(``config`` needs no podman binary then): the services it keeps must be the ones tests/infra's ``started`` helper
predicts, only the gpu profile may reserve a GPU, and the resolved, interpolated file (docker/.env.example's values)
is valid under the schema too."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import subprocess
import sys
from importlib.util import find_spec

import pytest
import yaml
from infra_files import COMPOSE_PROFILES, DOCKER, REPO, requests_gpu, started
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for

FIXTURES = REPO / "tests" / "fixtures"
SCHEMA = FIXTURES / "compose-spec.schema.json"
SCHEMA_LICENSE = FIXTURES / "COMPOSE-SPEC-LICENSE"


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(SCHEMA.read_text())


@pytest.fixture(scope="module")
def validator(schema) -> Validator:
    """A validator of the draft the schema's ``$schema`` names (an unknown draft fails rather than guessing)."""
    cls = validator_for(schema, default=None)
    assert cls is not None, f"{SCHEMA}: $schema {schema.get('$schema')!r} is no draft jsonschema knows"
    cls.check_schema(schema)
    return cls(schema)


def deepest(error: ValidationError) -> ValidationError:
    """For a oneOf/anyOf failure, the branch error deepest in the document (the first of equals): it names the key
    that is wrong (``...depends_on.postgres.condition``), not only the block that holds it (``...depends_on``)."""
    if not error.context:
        return error
    return max((deepest(e) for e in error.context), key=lambda e: len(e.absolute_path))


def describe(error: ValidationError) -> str:
    """``$.json.path: message`` for one error."""
    detail = deepest(error)
    return f"{detail.json_path}: {detail.message}"


def schema_errors(validator: Validator, doc: dict) -> list[str]:
    return sorted(describe(e) for e in validator.iter_errors(doc))


def test_the_vendored_schema_is_the_one_its_license_file_names(schema):
    """The schema file is the Compose Specification's, unedited: its sha256 is the digest the license file records
    for the upstream copy (a local edit to loosen the schema fails here)."""
    license_text = SCHEMA_LICENSE.read_text()
    recorded = re.search(r"sha256 ([0-9a-f]{64})", license_text)
    assert recorded, f"{SCHEMA_LICENSE}: no sha256 of the vendored schema"
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == recorded.group(1), f"{SCHEMA} differs from upstream"
    assert schema["title"] == "Compose Specification"
    assert "Apache License" in license_text and "Version 2.0" in license_text


def test_compose_file_is_valid_under_the_compose_spec(compose, validator):
    errors = schema_errors(validator, compose)
    assert not errors, f"{DOCKER / 'compose.yaml'} breaks the Compose Specification:\n" + "\n".join(errors)


def _set(doc: dict, path: list, value) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


GPU_DEVICE = ["services", "worker", "deploy", "resources", "reservations", "devices", 0]
BROKEN = {
    # capabilities must be a list (`capabilities: gpu` is a common slip: Compose refuses the file)
    "capabilities-not-a-list": (
        [*GPU_DEVICE, "capabilities"],
        "gpu",
        "$.services.worker.deploy.resources.reservations.devices[0].capabilities",
    ),
    "unknown-top-level-key": (["servics"], {"x": {"image": "busybox:1.37"}}, "$"),
    "depends-on-condition-typo": (
        ["services", "mlflow", "depends_on", "postgres", "condition"],
        "service_heathy",
        "$.services.mlflow.depends_on.postgres.condition",
    ),
    "profiles-not-a-list": (["services", "worker", "profiles"], "gpu", "$.services.worker.profiles"),
    "unknown-service-key": (["services", "worker-cpu", "shm-size"], "16gb", "$.services['worker-cpu']"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_copy_fails_and_the_error_names_its_path(compose, validator, case):
    path, value, where = BROKEN[case]
    broken = copy.deepcopy(compose)
    _set(broken, path, value)
    errors = schema_errors(validator, broken)
    assert errors, f"{case}: the schema accepted {path} = {value!r}"
    assert any(e.startswith(f"{where}: ") for e in errors), f"{case}: no error at {where}: {errors}"
    if where == "$" or path[-1] == "shm-size":
        assert any(repr(path[-1]) in e for e in errors), f"{case}: the error does not name the key: {errors}"


# ---------------------------------------------------------------- podman-compose


def resolve(*profiles: str) -> dict:
    """The file as podman-compose resolves it for ``--profile`` each of ``profiles``: anchors merged, variables
    interpolated from docker/.env.example only (a clean environment, so the caller's variables do not leak in),
    services outside the active profiles dropped. --dry-run: no podman binary is looked for or run."""
    args = [sys.executable, "-m", "podman_compose", "--dry-run", "--env-file", str(DOCKER / ".env.example")]
    args += ["-f", str(DOCKER / "compose.yaml"), *(a for p in profiles for a in ("--profile", p)), "config"]
    keep = ("PATH", "HOME", "PYTHONPATH")  # PYTHONPATH: where podman_compose may be found, as in this process
    env = {k: os.environ[k] for k in keep if k in os.environ}
    run = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"podman-compose config {profiles} failed ({run.returncode}):\n{run.stderr[-3000:]}"
    return yaml.safe_load(run.stdout)


needs_podman_compose = pytest.mark.skipif(
    find_spec("podman_compose") is None, reason="podman-compose (dev extra) is not installed"
)


@needs_podman_compose
@pytest.mark.parametrize("profiles", COMPOSE_PROFILES)
def test_podman_compose_resolves_each_profile_as_the_tests_assume(compose, validator, profiles):
    """podman-compose keeps the services ``started`` predicts for the profiles; of those, only the gpu profile's
    process worker reserves a GPU (so `--profile cpu up -d` works on a machine without one); and the resolved file
    still satisfies the Compose Specification."""
    resolved = resolve(*profiles)
    services = resolved["services"]
    label = " ".join(profiles) or "(none)"
    assert sorted(services) == sorted(started(compose, *profiles)), f"profiles {label}: podman-compose starts these"
    gpu = sorted(name for name, svc in services.items() if requests_gpu(svc))
    assert gpu == (["worker"] if "gpu" in profiles else []), f"profiles {label}: services reserving a GPU: {gpu}"
    errors = schema_errors(validator, resolved)
    assert not errors, f"profiles {label}: the resolved file breaks the Compose Specification:\n" + "\n".join(errors)
