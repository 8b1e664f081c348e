"""``allow_unsafe`` (the sandbox's rlimits mode, :mod:`sandbox`): whether this process may run untrusted programs
under its own uid, and the hardening before it does. Without namespaces a program keeps this process's uid, so the
mode is refused where that uid holds credentials a program could read (docs/rewards.md, "what allow_unsafe
exposes")."""

from __future__ import annotations

import os
import re
from pathlib import Path

_SECRET_NAME = re.compile(r"(^AWS_|^HF_|TOKEN|SECRET|PASSW|_KEY$|_KEY_|CREDENTIAL|^MLFLOW_TRACKING_)", re.IGNORECASE)
CREDENTIAL_FILES = (
    ".aws/credentials",
    ".aws/config",
    ".netrc",
    ".git-credentials",
    ".pypirc",
    ".docker/config.json",
    ".cache/huggingface/token",
    ".huggingface/token",
    ".config/gcloud/application_default_credentials.json",
    ".kube/config",
    ".ssh/id_rsa",
    ".ssh/id_ed25519",
    ".ssh/id_ecdsa",
)


def _ancestor_environs() -> list[dict[str, str]]:
    """The environments of this process and its ancestors that this uid can read (/proc/<pid>/environ holds the
    environment a process started with, whatever it changed since)."""
    out, pid = [], os.getpid()
    while pid > 1:
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            out.append(dict(kv.split("=", 1) for kv in raw.decode("utf-8", "replace").split("\0") if "=" in kv))
        except OSError:
            pass
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def unsafe_refusal(
    euid: int | None = None, environs: list[dict[str, str]] | None = None, home: Path | None = None
) -> str | None:
    """Why ``allow_unsafe`` (rlimits mode) must not run here, None when it may.

    As root it may: the program and the judge drop to uids of their own. Otherwise the program would keep this
    process's uid, so it may only where that uid holds nothing a program could steal: no credential-like variable
    (AWS_*, HF_*, *TOKEN*, *SECRET*, *PASSW*, *_KEY, MLFLOW_TRACKING_*) in the environment of this process or of
    any ancestor whose /proc/<pid>/environ it can read, and no readable credential file under ``home``
    (:data:`CREDENTIAL_FILES`, $AWS_SHARED_CREDENTIALS_FILE)."""
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        return None
    environs = [dict(os.environ), *_ancestor_environs()] if environs is None else environs
    home = Path(os.path.expanduser("~")) if home is None else home
    names = sorted({k for env in environs for k in env if _SECRET_NAME.search(k)})
    if names:
        return f"credential-like environment variables a program of this uid could read: {', '.join(names[:8])}"
    files = [home / f for f in CREDENTIAL_FILES]
    files += [Path(env["AWS_SHARED_CREDENTIALS_FILE"]) for env in environs if "AWS_SHARED_CREDENTIALS_FILE" in env]
    readable = [str(f) for f in files if f.is_file() and os.access(f, os.R_OK)]
    if readable:
        return f"credential files a program of this uid could read: {', '.join(readable)}"
    return None


def harden_for_unsafe() -> None:
    """Before rlimits-mode programs run as this process's uid (not root): PR_SET_DUMPABLE 0, so they cannot
    read this process's memory or /proc/<pid>/{environ,fd,mem} (it also turns off core dumps of the trainer)."""
    if os.geteuid() == 0:
        return
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
