"""One local mirror, two S3 endpoints holding the same bucket (a trial SeaweedFS/MinIO and production S3): the
mirror <cache_dir>/<bucket>/<key> does not name the endpoint, so a run on the other endpoint would take the
mirror's files (a checkpoint not uploaded yet) for its own and remove them. Two real SeaweedFS servers."""

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpoflow.tasks.config.storage import StorageConfig
from grpoflow.tasks.dataio.sources import fetch_s3_file
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.mirror import DEFAULT_ENDPOINT, MirrorEndpointError, claim_mirror
from grpoflow.tasks.storage.workspace import Workspace
from tests.servers import seaweedfs as _seaweedfs


@pytest.fixture(scope="module")
def other_seaweedfs(tmp_path_factory):
    """A second SeaweedFS server with a bucket of the same name as the ``seaweedfs`` fixture's."""
    with _seaweedfs(tmp_path_factory.mktemp("seaweedfs-b")) as server:
        yield server


def _use(monkeypatch, server) -> None:
    """Point the process at ``server``: its endpoint and credentials in the standard AWS variables."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)


def _checkpoint(ws: Workspace, step: int) -> None:
    folder = ws.stage_dir("grpo") / "checkpoints" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 100)
    (folder / "trainer_state.json").write_text("{}")


def test_a_run_on_another_endpoint_does_not_destroy_a_checkpoint_not_yet_uploaded(
    seaweedfs, other_seaweedfs, monkeypatch, tmp_path
):
    assert seaweedfs.bucket == other_seaweedfs.bucket and seaweedfs.endpoint != other_seaweedfs.endpoint
    location = f"s3://{seaweedfs.bucket}/runs/{uuid.uuid4().hex[:8]}/r1"
    storage = StorageConfig(cache_dir=str(tmp_path / "cache"))

    _use(monkeypatch, seaweedfs)  # endpoint A: checkpoint-1 uploaded, checkpoint-2 saved, then the run crashed
    ws = Workspace(location, storage)
    ws.begin("grpo", "k1")
    _checkpoint(ws, 1)
    ws.publish_checkpoint("grpo", "checkpoints", "checkpoint-1")
    _checkpoint(ws, 2)
    assert ws.unpublished("grpo", "checkpoints") == ["checkpoint-2"]

    _use(monkeypatch, other_seaweedfs)  # endpoint B, same bucket and key, same cache_dir: refused, touches nothing
    with pytest.raises(MirrorEndpointError) as e:
        Workspace(location, storage).begin("grpo", "k2")
    msg = str(e.value)
    assert str(tmp_path / "cache" / seaweedfs.bucket) in msg
    assert seaweedfs.endpoint in msg and other_seaweedfs.endpoint in msg and "cache_dir" in msg

    _use(monkeypatch, seaweedfs)  # back on A: the checkpoint is still there to upload
    again = Workspace(location, storage)
    assert again.unpublished("grpo", "checkpoints") == ["checkpoint-2"]


def test_a_data_file_of_another_endpoint_is_not_downloaded_into_the_mirror(
    seaweedfs, other_seaweedfs, monkeypatch, tmp_path
):
    key = f"data/{uuid.uuid4().hex[:8]}/train.jsonl"
    seaweedfs.client().put_object(Bucket=seaweedfs.bucket, Key=key, Body=b'{"q": "a"}\n')
    other_seaweedfs.client().put_object(Bucket=other_seaweedfs.bucket, Key=key, Body=b'{"q": "b"}\n')
    uri, storage = f"s3://{seaweedfs.bucket}/{key}", StorageConfig(cache_dir=str(tmp_path / "cache"))
    _use(monkeypatch, seaweedfs)
    assert fetch_s3_file(uri, storage).read_bytes() == b'{"q": "a"}\n'
    _use(monkeypatch, other_seaweedfs)
    with pytest.raises(MirrorEndpointError, match="storage.cache_dir"):
        fetch_s3_file(uri, storage)
    assert s3.S3Client(storage).local_path(uri).read_bytes() == b'{"q": "a"}\n'
    other = StorageConfig(cache_dir=str(tmp_path / "cache-b"))  # the way out: a mirror of its own
    assert fetch_s3_file(uri, other).read_bytes() == b'{"q": "b"}\n'


def test_an_older_mirror_is_adopted_and_the_record_holds_no_credentials(tmp_path):
    cache, uri = tmp_path / "cache", "s3://bkt/runs/r1"
    old = cache / "bkt" / "runs" / "r1" / "grpo" / "attempt.json"  # written by a grpoflow without the record
    old.parent.mkdir(parents=True)
    old.write_text("{}")
    path = claim_mirror(uri, cache, "HTTP://user:pw@Host:9000/")
    assert path == cache / ".bkt.endpoint" and path.read_text() == "http://host:9000\n" and old.read_text() == "{}"
    assert claim_mirror("s3://bkt/other", cache, "http://host:9000") == path  # the same endpoint, spelled otherwise
    with pytest.raises(MirrorEndpointError) as e:
        claim_mirror(uri, cache, None)
    assert str(e.value).startswith(f"{uri}: the local mirror {cache / 'bkt'} holds bucket 'bkt' of S3 endpoint ")
    assert "http://host:9000" in str(e.value) and DEFAULT_ENDPOINT in str(e.value) and "pw" not in str(e.value)
    assert claim_mirror("s3://other-bkt/x", cache, None).read_text() == f"{DEFAULT_ENDPOINT}\n"  # per bucket
    assert sorted(p.name for p in cache.iterdir()) == [".bkt.endpoint", ".other-bkt.endpoint", "bkt"]


def test_two_first_users_of_a_mirror_agree_on_one_endpoint(tmp_path):
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda i: _try_claim(cache, f"http://host-{i % 2}:9000"), range(16)))
    recorded = (cache / ".bkt.endpoint").read_text().strip()
    assert all(ok == (where == recorded) for where, ok in outcomes)
    assert sorted(p.name for p in cache.iterdir()) == [".bkt.endpoint"]  # no temp file left


def _try_claim(cache, where: str) -> tuple[str, bool]:
    try:
        claim_mirror("s3://bkt/r", cache, where)
        return where, True
    except MirrorEndpointError:
        return where, False


def test_one_server_spelled_another_way_is_the_same_endpoint(tmp_path):
    """Loopback spellings and default ports name one server; another port or host is another endpoint. A record an
    older grpoflow wrote (127.0.0.1, not normalised) is read the same way."""
    cache = tmp_path / "cache"
    (cache).mkdir()
    (cache / ".bkt.endpoint").write_text("http://127.0.0.1:8333\n")  # an older grpoflow's record
    for same in ("http://localhost:8333", "http://[::1]:8333/", "HTTP://LOCALHOST:8333"):
        claim_mirror("s3://bkt/r", cache, same)
    for other in ("http://localhost:8334", "http://10.0.0.5:8333", "https://localhost:8333"):
        with pytest.raises(MirrorEndpointError):
            claim_mirror("s3://bkt/r", cache, other)
    claim_mirror("s3://aws-bkt/r", cache, "https://s3.eu-west-1.amazonaws.com:443")
    claim_mirror("s3://aws-bkt/r", cache, "https://S3.eu-west-1.amazonaws.com")  # the default port, left out


def test_a_folder_in_a_buckets_mirror_names_its_s3_uri(tmp_path):
    from grpoflow.tasks.storage.mirror import mirrored_uri

    claim_mirror("s3://bkt/runs/r1", tmp_path / "cache", "http://127.0.0.1:8333")
    run = tmp_path / "cache" / "bkt" / "runs" / "r1"
    run.mkdir(parents=True)
    assert mirrored_uri(run) == "s3://bkt/runs/r1"
    assert mirrored_uri(run / "grpo") == "s3://bkt/runs/r1/grpo"
    assert mirrored_uri(tmp_path / "cache" / "bkt") == "s3://bkt"
    assert mirrored_uri(tmp_path / "cache" / "other" / "r1") is None  # no record for bucket 'other'
    assert mirrored_uri(tmp_path / "runs" / "r1") is None
