"""A Hugging Face hub cache written by the tests, with the hub out of reach: the hub-id code paths (resolving a
revision, loading a model by id, registering an adapter on a hub base) run for real on local files."""

import hashlib
import os
from pathlib import Path

import huggingface_hub.constants


def write_hub_cache(cache: Path, repo_id: str, files: Path, ref: str = "main", repo_type: str = "model") -> str:
    """The files of the folder ``files`` (and its subfolders) as a commit of the hub model (or ``repo_type``
    dataset) ``repo_id`` in a hub cache at ``cache``, laid out as huggingface_hub downloads them: blobs named by
    content hash, the commit's snapshot of links to them, and refs/<ref> naming the commit (a second call moves the
    ref, as a push to the repo does). Returns the commit: 40 hex digits (a hash of the files), as a git commit id
    is."""
    repo = cache / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    names = sorted(f.relative_to(files).as_posix() for f in files.rglob("*") if f.is_file())
    commit = hashlib.sha1(b"".join(n.encode() + (files / n).read_bytes() for n in names)).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name in names:
        data = (files / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


def offline_hub(monkeypatch, cache: Path) -> dict[str, str]:
    """The hub is ``cache`` and out of reach: the environment a process started here would see, and the values
    huggingface_hub read from it when it was imported (before this test), which its functions consult. Returns
    the variables, for a subprocess's environment."""
    env = {"HF_HOME": str(cache.parent), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return env
