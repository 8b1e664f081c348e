"""Readers for the container and infrastructure checks (tests/infra): Dockerfile parsing, compose-style env
interpolation, the services a compose profile starts and which of them reserve a GPU, and the repo's paths (the
work pools are flows/operations.py's POOLS). Everything here reads files or parsed dicts; nothing runs Docker."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
INFRA = REPO / "infra"
# the `--profile` sets the READMEs give: none, the CPU worker, the GPU worker, the GPU worker with the Docker pool
COMPOSE_PROFILES = [(), ("cpu",), ("gpu",), ("gpu", "docker")]


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # continuation lines joined with spaces
    stage: int  # index of the FROM it belongs to
    line: int  # 1-based line where it starts


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, backslash continuations joined, each tagged with its stage."""
    out: list[Instruction] = []
    stage, buf, start = -1, "", 0
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = no
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, " ".join(args.split()), stage, start))
        buf = ""
    return out


def dockerfiles() -> list[Path]:
    return sorted(DOCKER.glob("Dockerfile*"))


def env_placeholders(text: str) -> list[tuple[str, str]]:
    """Compose interpolations ``${NAME}``, ``${NAME:-default}``, ``${NAME:?message}`` as (name, operator+rest);
    ``$${...}`` is an escaped dollar for the container's shell and is skipped."""
    return [(m.group(1), m.group(2) or "") for m in re.finditer(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)([^}]*)\}", text)]


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path}: line without '=': {line!r}"
            env[key.strip()] = value.strip()
    return env


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's interpolation of ``${NAME:-default}`` / ``${NAME}`` / ``${NAME:?msg}`` with ``env``."""

    def sub(m: re.Match) -> str:
        name, rest = m.group(1), m.group(2) or ""
        if name in env:
            return env[name]
        return rest[2:] if rest.startswith(":-") else ""

    return re.sub(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)([^}]*)\}", sub, value).replace("$$", "$")


def requests_gpu(svc: dict) -> bool:
    """A compose service that asks Docker for GPUs: device reservations, the nvidia runtime or ``gpus``."""
    devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    return bool(
        svc.get("gpus") or svc.get("runtime") == "nvidia"
        or any(d.get("driver") == "nvidia" or "gpu" in (d.get("capabilities") or []) for d in devices)
    )  # fmt: skip


def started(compose: dict, *profiles: str) -> dict[str, dict]:
    """The services `docker compose --profile P ... up -d` starts: those in no profile or in one of ``profiles``."""
    return {n: s for n, s in compose["services"].items() if not s.get("profiles") or set(s["profiles"]) & set(profiles)}
