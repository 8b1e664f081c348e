"""tasks/storage/s3.py against a real S3 server (SeaweedFS on 127.0.0.1): URIs, listing, transfers, folder sync, errors;
an S3 run workspace (tasks/storage/workspace.py) and s3:// data sources (tasks/dataio/sources.py)."""

import hashlib
import json
import os

import pandas as pd
import pytest

from grpoflow.tasks.config import ConfigError, StorageConfig, config_from_dict, load_config
from grpoflow.tasks.dataio.splits import load_split
from grpoflow.tasks.stages.data import prepare_data
from grpoflow.tasks.storage import s3
from grpoflow.tasks.storage.workspace import MANIFEST, Workspace
from tests.paths import FIXTURES
from tests.servers import free_port

MICRO = str(FIXTURES / "micro.yaml")


@pytest.fixture
def store(env, tmp_path):
    """S3 with the default settings and a cache folder of the test's own (the endpoint comes from the env)."""
    return s3.S3Client(StorageConfig(cache_dir=str(tmp_path / "cache")))


def _uri(server, *parts: str) -> str:
    return s3.join_uri(f"s3://{server.bucket}", *parts)


# ------------------------------------------------------------------------------------------ URIs
def test_uris():
    assert s3.is_s3_uri("s3://bkt/a") and not s3.is_s3_uri("/tmp/a") and not s3.is_s3_uri("S3:/x")
    assert s3.split_s3_uri("s3://my-bucket/runs/r1/data") == ("my-bucket", "runs/r1/data")
    assert s3.split_s3_uri("s3://my-bucket") == ("my-bucket", "")
    assert s3.join_uri("s3://b/runs/", "r1", "/data/") == "s3://b/runs/r1/data"
    for bad, why in [
        ("/tmp/x", "not an S3 URI"),
        ("s3:///key", "not a valid bucket name"),
        ("s3://Bad_Bucket/k", "not a valid bucket name"),
        ("s3://bkt/a//b", "empty path segment"),
    ]:
        with pytest.raises(ValueError, match=why) as e:
            s3.split_s3_uri(bad)
        assert repr(bad) in str(e.value)


def test_local_path_is_deterministic(tmp_path):
    assert s3.local_path("s3://bkt/runs/r1", tmp_path) == tmp_path.resolve() / "bkt" / "runs" / "r1"


# ------------------------------------------------------------------------------------------ objects
def test_round_trip_and_listing_over_pages(env, tmp_path, store):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for i in range(5):
        (src / ("sub" if i % 2 else "") / f"f{i}.txt").write_text(f"file {i}\n" * (i + 1))
    prefix = _uri(env, "roundtrip")
    store.upload_dir(src, prefix)
    listed = store.list_objects(prefix + "/", page_size=2)  # 3 pages of at most 2
    assert sorted(o["uri"] for o in listed) == sorted(
        f"{prefix}/{p.relative_to(src).as_posix()}" for p in src.rglob("*.txt")
    )
    by_name = {o["uri"].rsplit("/", 1)[1]: o for o in listed}
    assert by_name["f3.txt"]["size"] == len("file 3\n" * 4)
    assert by_name["f3.txt"]["etag"] == hashlib.md5(b"file 3\n" * 4).hexdigest()
    assert by_name["f3.txt"]["last_modified"].tzinfo is not None
    dst = tmp_path / "dst"
    got = store.download_dir(prefix, dst)
    assert len(got) == 5
    assert {p.relative_to(dst) for p in dst.rglob("*.txt")} == {p.relative_to(src) for p in src.rglob("*.txt")}
    assert all((dst / p.relative_to(src)).read_bytes() == p.read_bytes() for p in src.rglob("*.txt"))
    # a second sync transfers nothing; a changed file (same size) is noticed through its ETag
    assert store.upload_dir(src, prefix) == [] and store.download_dir(prefix, dst) == []
    (src / "f0.txt").write_text("FILE 0\n")
    assert store.upload_dir(src, prefix) == [f"{prefix}/f0.txt"]
    assert store.download_dir(prefix, dst) == [dst / "f0.txt"] and (dst / "f0.txt").read_text() == "FILE 0\n"
    # delete=True mirrors removals, both ways
    (src / "f4.txt").unlink()
    store.upload_dir(src, prefix, delete=True)
    assert not store.exists(f"{prefix}/f4.txt") and store.exists(f"{prefix}/f0.txt")
    store.download_dir(prefix, dst, delete=True)
    assert not (dst / "f4.txt").exists()
    # small JSON objects
    store.put_bytes(json.dumps({"a": [1, 2]}).encode(), _uri(env, "j.json"))
    assert store.get_json(_uri(env, "j.json")) == {"a": [1, 2]}
    assert store.get_json(_uri(env, "missing.json"), None) is None
    assert store.delete_prefix(prefix + "/") == 4 and store.list_objects(prefix + "/") == []


def test_multipart_upload_above_the_threshold(env, tmp_path, monkeypatch):
    store = s3.S3Client(StorageConfig(multipart_threshold_mb=5, multipart_chunksize_mb=5, cache_dir=str(tmp_path)))
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(11 * s3.MiB + 123))
    uri = _uri(env, "multipart", "big.bin")
    store.upload_file(big, uri)
    (obj,) = store.list_objects(uri)
    assert obj["size"] == big.stat().st_size
    assert obj["etag"].endswith("-3")  # three parts: 5 + 5 + 1 MiB
    assert obj["etag"] == s3.local_etag(big, obj["size"], 3, 5 * s3.MiB)  # S3's multipart ETag, computed locally
    assert store.same_content(big, obj)
    back = store.download_file(uri, tmp_path / "back.bin")
    assert back.read_bytes() == big.read_bytes()
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 1000)
    store.upload_file(small, _uri(env, "multipart", "small.bin"))
    assert "-" not in store.list_objects(_uri(env, "multipart", "small.bin"))[0]["etag"]  # one PUT below it


def test_markers_go_up_last_and_come_down_first(env, tmp_path, store):
    """A checkpoint folder is complete when its trainer_state.json is there: uploaded last, deleted first."""
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    for name in ("trainer_state.json", "a.bin", "z.bin"):
        (ckpt / name).write_text(name)
    prefix = _uri(env, "markers", "checkpoint-1")
    uploaded = store.upload_dir(ckpt, prefix, markers=("trainer_state.json",))
    assert [u.rsplit("/", 1)[1] for u in uploaded] == ["a.bin", "z.bin", "trainer_state.json"]


@pytest.mark.parametrize("evil", ["ws/../../escaped.txt", "ws/sub/../../../escaped.txt"])
def test_a_key_leading_outside_the_folder_is_refused_and_nothing_is_written(env, tmp_path, store, monkeypatch, evil):
    """A key with '..' below the pulled prefix: the pull refuses it with S3UnsafeKeyError naming it, writes no file
    anywhere (not even the sane one beside it) and deletes nothing. The key is put into the real server first;
    SeaweedFS refuses '..' segments itself (InvalidRequest), and other servers (or a bucket written through another
    gateway) may not, so then the real listing is served with the key added to it (the object's size and ETag are a
    real object's): the check runs on the listing, before any request for the key."""
    base = f"pull-{evil.count('..')}"
    store.client.put_object(Bucket=env.bucket, Key=f"{base}/ws/good.txt", Body=b"good")
    try:
        store.client.put_object(Bucket=env.bucket, Key=f"{base}/{evil}", Body=b"good")
    except Exception as e:  # noqa: BLE001 - SeaweedFS: InvalidRequest
        assert "InvalidRequest" in str(e), e
        real_list = store.list_objects

        def listing(prefix_uri, **kw):
            objects = real_list(prefix_uri, **kw)
            good = next(o for o in objects if o["uri"].endswith("/good.txt"))
            return [*objects, {**good, "uri": _uri(env, base, evil)}]

        monkeypatch.setattr(store, "list_objects", listing)
    dst = tmp_path / "a" / "b" / "mirror"
    dst.mkdir(parents=True)
    (dst / "kept.txt").write_text("local")
    with pytest.raises(s3.S3UnsafeKeyError) as err:
        store.download_dir(_uri(env, base, "ws"), dst, delete=True)
    assert evil.removeprefix("ws/") in str(err.value) and str(dst) in str(err.value)
    assert not list(tmp_path.rglob("escaped.txt")) and not (dst / "good.txt").exists()
    assert sorted(p.name for p in dst.iterdir()) == ["kept.txt"]  # the delete did not run either


def test_confined_refuses_absolute_and_dot_names(tmp_path):
    assert s3.confined(tmp_path, "a/b.txt", "s3://b/a/b.txt") == tmp_path / "a" / "b.txt"
    for name in ("/etc/passwd", "a/./b", "..", "a/../../b"):
        with pytest.raises(s3.S3UnsafeKeyError, match="resolves outside"):
            s3.confined(tmp_path, name, f"s3://b/{name}")
    (tmp_path / "link").symlink_to(tmp_path.parent)
    with pytest.raises(s3.S3UnsafeKeyError):
        s3.confined(tmp_path, "link/x", "s3://b/link/x")


# ------------------------------------------------------------------------------------------ errors
def test_missing_key_and_bucket_name_the_uri(env, tmp_path, store):
    missing = _uri(env, "no", "such.json")
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such object at {env.endpoint}"):
        store.download_file(missing, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(s3.S3NotFoundError, match="no such object"):
        store.get_json(missing)
    with pytest.raises(s3.S3NoSuchBucketError, match="bucket 'no-such-bucket' does not exist"):
        store.download_file("s3://no-such-bucket/k.json", tmp_path / "x")
    with pytest.raises(s3.S3NoSuchBucketError, match="s3://no-such-bucket/runs: bucket 'no-such-bucket'"):
        store.list_objects("s3://no-such-bucket/runs")
    with pytest.raises(s3.S3NoSuchBucketError):
        store.upload_file(MICRO, "s3://no-such-bucket/micro.yaml")


def _no_credentials(monkeypatch, tmp_path) -> None:
    """No AWS credentials anywhere boto3 looks: environment, shared files, instance metadata."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_wrong_and_missing_credentials(env, monkeypatch, tmp_path, store):
    uri = _uri(env, "x.json")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(PermissionError, match=f"{uri}: access denied by {env.endpoint}.*check the credentials"):
        store.list_objects(uri)
    _no_credentials(monkeypatch, tmp_path)
    with pytest.raises(s3.S3AccessError, match=f"{uri}: no AWS credentials.*AWS_ACCESS_KEY_ID"):
        store.get_json(uri)


def test_the_stage_key_of_an_s3_data_file_names_it_when_s3_refuses(env, monkeypatch, tmp_path):
    """The data stage's key digests data.source on S3 before anything else reads it: missing credentials or a dead
    endpoint is an S3Error naming the URI (one line from the CLI), not botocore's bare "Unable to locate
    credentials" with a traceback."""
    from grpoflow.tasks.storage.content import s3_digest

    uri = _uri(env, "digest", "train.jsonl")
    s3.S3Client().put_bytes(b'{"q": 1}\n', uri)
    key = uri.split("/", 3)[3]
    assert s3_digest(uri, StorageConfig()) == {key: {"size": 9, "etag": hashlib.md5(b'{"q": 1}\n').hexdigest()}}
    assert list(s3_digest(uri.rsplit("/", 1)[0], StorageConfig())) == [key]  # a prefix: its objects
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(s3.S3Error, match=f"{uri}: cannot reach the S3 endpoint {dead}"):
        s3_digest(uri, StorageConfig(endpoint_url=dead, max_attempts=1))
    _no_credentials(monkeypatch, tmp_path)
    with pytest.raises(s3.S3AccessError, match=f"{uri}: no AWS credentials"):
        s3_digest(uri, StorageConfig())


def test_unreachable_endpoint_names_it(env, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    store = s3.S3Client(StorageConfig(endpoint_url=dead, max_attempts=2))
    with pytest.raises(s3.S3Error, match=f"s3://bkt/k: cannot reach the S3 endpoint {dead}"):
        store.get_json("s3://bkt/k")


# ------------------------------------------------------------------------------------------ config
def test_storage_section_and_credentials_are_rejected_in_config():
    cfg = load_config(MICRO, ["storage.endpoint_url=http://127.0.0.1:9000", "storage.multipart_threshold_mb=8"])
    assert cfg.storage.endpoint_url == "http://127.0.0.1:9000" and cfg.storage.multipart_threshold_mb == 8
    for override, key in [
        ("storage.aws_secret_access_key=abc", "storage.aws_secret_access_key"),
        ("storage.aws_access_key_id=AKIA", "storage.aws_access_key_id"),
        ("tracking.password=abc", "tracking.password"),
        ("data.token=abc", "data.token"),
    ]:
        with pytest.raises(ConfigError, match=f"{key}: credentials do not belong in the config"):
            load_config(MICRO, [override])
    with pytest.raises(ConfigError, match="tracking.uri: holds a user:password in the URI"):
        load_config(MICRO, ["tracking.uri=http://me:secret@127.0.0.1:5000"])
    with pytest.raises(ConfigError, match="storage.multipart_threshold_mb"):
        load_config(MICRO, ["storage.multipart_threshold_mb=1"])


# ------------------------------------------------------------------------------------------ workspace
def _keys(prefix_uri: str) -> set[str]:
    return {o["uri"][len(prefix_uri) + 1 :] for o in s3.S3Client().list_objects(prefix_uri + "/")}


def test_s3_workspace_publishes_files_then_the_manifest(env, tmp_path, monkeypatch, store):
    uri = _uri(env, "ws-unit", "r1")
    ws = Workspace(uri, StorageConfig(cache_dir=str(tmp_path / "c1")))
    assert ws.location == uri and ws.root == (tmp_path / "c1").resolve() / env.bucket / "ws-unit" / "r1"
    ws.begin("grpo", "k1")
    ckpt = ws.stage_dir("grpo") / "checkpoints" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    for name in ("model.safetensors", "trainer_state.pt", "trainer_state.json"):
        (ckpt / name).write_text(name)
    ws.push("grpo", "checkpoints")  # what GRPO does after each checkpoint
    assert _keys(f"{uri}/grpo") == {"attempt.json", *(f"checkpoints/checkpoint-1/{n}" for n in os.listdir(ckpt))}

    # another machine (an empty cache): the same key pulls the killed attempt's checkpoint
    ws2 = Workspace(uri, StorageConfig(cache_dir=str(tmp_path / "c2")))
    ws2.begin("grpo", "k1")
    assert (ws2.root / "grpo/checkpoints/checkpoint-1/trainer_state.json").read_text() == "trainer_state.json"
    final = ws2.stage_dir("grpo") / "final"
    final.mkdir()
    (final / "adapter.safetensors").write_bytes(b"w" * 100)
    (final / "config.json").write_text("{}")
    summary = {"model_path": str(final), "steps": 2}

    # a crash in the middle of the upload publishes nothing: the manifest goes up last
    client = s3.s3_client(ws2.store.settings)  # the client the workspace's transfers use (one per settings)
    order: list[str] = []

    def put(params, **kw):  # every PutObject the workspace sends, before it goes out
        uri = f"s3://{params['Bucket']}/{params['Key']}"
        if crash and uri.endswith("/final/config.json"):
            raise OSError("injected crash")
        order.append(uri)

    crash = True
    client.meta.events.register("before-parameter-build.s3.PutObject", put)
    try:
        with pytest.raises(OSError, match="injected crash"):
            ws2.publish("grpo", "k1", summary)
        assert ws2.read_manifest("grpo") is None and ws2.completed("grpo", "k1") is None
        assert "final/adapter.safetensors" in _keys(f"{uri}/grpo")  # the file that made it before the crash

        crash = False
        order.clear()
        ws2.publish("grpo", "k1", summary)
    finally:
        client.meta.events.unregister("before-parameter-build.s3.PutObject", put)
    # the retry uploads only what is missing, then the manifest (with key and summary), once
    assert order == [f"{uri}/grpo/final/config.json", f"{uri}/grpo/{MANIFEST}"]

    # the stored summary's paths follow the workspace into any cache
    ws3 = Workspace(uri, StorageConfig(cache_dir=str(tmp_path / "c3")))
    assert ws3.completed("grpo", "k1") == {"model_path": str(ws3.root / "grpo" / "final"), "steps": 2}
    assert ws3.completed("grpo", "k2") is None
    assert not (ws3.root / "grpo").exists()  # reading a manifest pulls nothing
    ws3.fetch(("grpo",))
    assert (ws3.root / "grpo/final/adapter.safetensors").read_bytes() == b"w" * 100
    assert json.loads((ws3.root / "grpo" / MANIFEST).read_text()) == ws2.read_manifest("grpo")
    mtime = (ws3.root / "grpo/final/adapter.safetensors").stat().st_mtime_ns
    ws3.fetch(("grpo",))  # the local copy is the published one: nothing moves
    assert (ws3.root / "grpo/final/adapter.safetensors").stat().st_mtime_ns == mtime

    # run-level files; forgetting; a new key empties the stage on S3 and locally
    ws3.write_text("run.json", '{"a": 1}')
    assert Workspace(uri, StorageConfig(cache_dir=str(tmp_path / "c4"))).read_text("run.json") == '{"a": 1}'
    assert ws3.read_text("config.yaml") is None
    ws3.forget(("grpo",))
    assert ws.read_manifest("grpo") is None and "attempt.json" in _keys(f"{uri}/grpo")
    ws3.begin("grpo", "k2")
    assert _keys(f"{uri}/grpo") == {"attempt.json"} and os.listdir(ws3.root / "grpo") == ["attempt.json"]
    assert store.get_json(f"{uri}/grpo/attempt.json")["key"] == "k2"


def test_a_stage_rekeyed_from_an_empty_cache_is_still_pulled_whole(env, tmp_path):
    """A key rewritten (tasks/pipeline/legacy.py) by a machine whose mirror lacks the stage's files leaves no
    manifest in that mirror, so fetch still pulls them; the records on S3 hold the new key."""
    uri = _uri(env, "ws-rekey", "r1")
    ws = Workspace(uri, StorageConfig(cache_dir=str(tmp_path / "c1")))
    ws.begin("sft", "old", "old-c", {"n": 1})
    (ws.stage_dir("sft") / "model.safetensors").write_bytes(b"w")
    ws.publish("sft", "old", {"steps": 1}, record={"fingerprint": {"v": 1}})
    fresh = Workspace(uri, StorageConfig(cache_dir=str(tmp_path / "c2")))
    assert fresh.rekey("sft", ("old", "new"), ("old-c", "new-c"), {"fingerprint": {"v": 2}})
    assert not (fresh.root / "sft" / MANIFEST).exists() and not (fresh.root / "sft" / "attempt.json").exists()
    assert fresh.completed("sft", "new") == {"steps": 1} and fresh.read_manifest("sft")["fingerprint"] == {"v": 2}
    assert fresh.last_attempt("sft")["continues"] == "new-c" and fresh.last_attempt("sft")["key"] == "new"
    fresh.fetch(("sft",))
    assert (fresh.root / "sft" / "model.safetensors").read_bytes() == b"w"
    assert not fresh.rekey("sft", ("old", "new"), ("old-c", "new-c"), {"fingerprint": {"v": 2}})  # once
    assert ws.completed("sft", "new") == {"steps": 1}  # the first machine reads the new key from S3


def test_nodes_add_their_checkpoint_files_and_node_0_keeps_them(env, tmp_path):
    """A TrainJob's nodes, each with its own mirror: node 1 adds its shards (deleting nothing), node 0's push keeps
    them in the checkpoints it holds and removes a pruned checkpoint with every node's files."""
    uri = _uri(env, "ws-nodes", "r1")
    node0, node1 = (Workspace(uri, StorageConfig(cache_dir=str(tmp_path / f"n{i}"))) for i in (0, 1))
    for step in (1, 2):
        for ws, names in ((node1, ("rank1.pt", "dcp/__1_0.distcp")), (node0, ("rank0.pt", "trainer_state.json"))):
            for name in names:
                path = ws.stage_dir("grpo") / "checkpoints" / f"checkpoint-{step}" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"{name} {step}")
        node1.push_added("grpo", f"checkpoints/checkpoint-{step}")
        node0.push_merged("grpo", "checkpoints")
    both = {"rank0.pt", "trainer_state.json", "rank1.pt", "dcp/__1_0.distcp"}
    assert _keys(f"{uri}/grpo/checkpoints") == {f"checkpoint-{s}/{n}" for s in (1, 2) for n in both}
    (node0.root / "grpo" / "launch").mkdir()
    (node0.root / "grpo" / "launch" / "summary.json").write_text("{}")
    for path in sorted((node0.root / "grpo" / "checkpoints" / "checkpoint-1").iterdir()):
        path.unlink()  # pruned on node 0
    (node0.root / "grpo" / "checkpoints" / "checkpoint-1").rmdir()
    node0.push_merged("grpo")  # the worker's last push: the whole GRPO folder
    assert _keys(f"{uri}/grpo") == {"launch/summary.json", *(f"checkpoints/checkpoint-2/{n}" for n in both)}
    node0.push("grpo")  # a plain push mirrors node 0's folder: node 1's files go
    assert _keys(f"{uri}/grpo/checkpoints") == {"checkpoint-2/rank0.pt", "checkpoint-2/trainer_state.json"}


def test_local_workspace_summaries_follow_a_moved_folder(tmp_path):
    ws = Workspace(tmp_path / "a")
    ws.publish("sft", "k", {"model_path": str(ws.root / "sft" / "model"), "other": "/elsewhere/x"})
    (tmp_path / "a").rename(tmp_path / "b")
    moved = Workspace(tmp_path / "b")
    assert moved.completed("sft", "k") == {"model_path": str(moved.root / "sft" / "model"), "other": "/elsewhere/x"}


# ------------------------------------------------------------------------------------------ data
def test_data_sources_on_s3(env, tmp_path, store):
    rows = [json.loads(line) for line in (FIXTURES / "gsm8k_sample.jsonl").read_text().splitlines()]
    store.upload_file(FIXTURES / "gsm8k_sample.jsonl", _uri(env, "datasets", "gsm8k.jsonl"))
    pd.DataFrame(rows[:5]).to_csv(tmp_path / "eval.csv", index=False)
    store.upload_file(tmp_path / "eval.csv", _uri(env, "datasets", "eval.csv"))
    data = {"source": _uri(env, "datasets", "gsm8k.jsonl"), "eval_source": _uri(env, "datasets", "eval.csv")}
    cfg = config_from_dict({"data": data, "storage": {"cache_dir": str(tmp_path / "cache")}})
    ws = Workspace(tmp_path / "ws")
    summary = prepare_data(cfg, ws)
    # the 5 eval rows are rows of the source too: kept out of training (scored unseen)
    assert (summary["train_rows"], summary["eval_rows"], summary["format"]) == (len(rows) - 5, 5, "gsm8k")
    assert load_split(ws.root / "data", "eval")["question"] == [r["question"] for r in rows[:5]]
    assert load_split(ws.root / "data", "train")["question"] == [r["question"] for r in rows[5:]]
    assert (tmp_path / "cache" / env.bucket / "datasets" / "gsm8k.jsonl").is_file()

    missing = _uri(env, "datasets", "missing.jsonl")
    with pytest.raises(FileNotFoundError, match=f"data file not found: '{missing}'.*no such object"):
        prepare_data(config_from_dict({"data": {"source": missing}, "storage": cfg.storage.model_dump()}), ws)
    with pytest.raises(ValueError, match="unsupported suffix '.txt'"):
        prepare_data(config_from_dict({"data": {"source": _uri(env, "datasets", "x.txt")}}), ws)


def test_run_on_a_missing_bucket_fails_before_starting(env, tmp_path, capsys):
    from grpoflow.flows.cli import main

    args = ["run", MICRO, "run.output_dir=s3://no-such-bucket/runs", f"storage.cache_dir={tmp_path}"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"grpoflow: s3://no-such-bucket/runs: bucket 'no-such-bucket' does not exist at {env.endpoint}" in err
    out = tmp_path / "runs"  # a local workspace, its data file in a missing bucket: refused before anything starts
    args = ["run", MICRO, f"run.output_dir={out}", "run.name=d", "data.source=s3://no-such-bucket/train.jsonl"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"grpoflow: s3://no-such-bucket/train.jsonl: bucket 'no-such-bucket' does not exist at {env.endpoint}" in err
    assert not (out / "d").exists()


SKEWED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>RequestTimeTooSkewed</Code>'
    b"<Message>The difference between the request time and the current time is too large.</Message>"
    b"<RequestTime>20260101T000000Z</RequestTime><ServerTime>2026-01-01T01:00:00Z</ServerTime></Error>"
)


def test_clock_skew_is_named_not_reported_as_bad_credentials(monkeypatch):
    """A server that answers 403 RequestTimeTooSkewed (what AWS says to a machine whose clock is 15+ minutes off):
    the error names the clock and the fix, not the credentials."""
    import http.server
    import threading

    class Skewed(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(403)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SKEWED)))
            self.end_headers()
            self.wfile.write(SKEWED)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Skewed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "any")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "any")
    try:
        store = s3.S3Client(StorageConfig(endpoint_url=f"http://127.0.0.1:{server.server_port}", max_attempts=1))
        with pytest.raises(s3.S3ClockSkewError) as info:
            store.get_json("s3://bkt/k.json")
    finally:
        server.shutdown()
    msg = str(info.value)
    assert "s3://bkt/k.json" in msg and "RequestTimeTooSkewed" in msg and "ServerTime 2026-01-01T01:00:00Z" in msg
    assert "Sync the clock" in msg and "check the credentials" not in msg
    assert isinstance(info.value, PermissionError)  # still refused access: callers that exit 2 on it keep doing so
