"""S3 URIs with '.', '..' or empty path segments are refused (tasks/storage/s3_uri.py, the config's run.output_dir,
data.source and data.eval_source): S3 keeps such a key as a name, but its local copy <cache_dir>/<bucket>/<key>
resolves elsewhere: into another run's mirror, or outside the cache folder."""

import pytest

from grpoflow.tasks.config import ConfigError, load_config
from grpoflow.tasks.storage import s3
from tests.paths import MICRO

BAD = {
    "s3://bkt/runs/../other": "'..' path segment",
    "s3://bkt/runs/..": "'..' path segment",
    "s3://bkt/../../etc": "'..' path segment",
    "s3://bkt/runs/./r1": "'.' path segment",
    "s3://bkt//runs": "empty path segment",
    "s3://bkt/runs//r1": "empty path segment",
}


@pytest.mark.parametrize("uri", BAD)
def test_dot_and_empty_segments_are_refused_naming_the_uri(uri, tmp_path):
    with pytest.raises(ValueError, match=BAD[uri]) as e:
        s3.split_s3_uri(uri)
    assert repr(uri) in str(e.value)
    with pytest.raises(ValueError, match=BAD[uri]):
        s3.local_path(uri, tmp_path)


def test_dots_inside_names_and_a_trailing_slash_are_fine(tmp_path):
    assert s3.split_s3_uri("s3://bkt/runs/") == ("bkt", "runs/")
    assert s3.split_s3_uri("s3://bkt/a.b/..c/x..y/.hidden") == ("bkt", "a.b/..c/x..y/.hidden")
    assert s3.local_path("s3://bkt/v1.2/data.jsonl", tmp_path) == tmp_path.resolve() / "bkt" / "v1.2" / "data.jsonl"


@pytest.mark.parametrize("key", ["run.output_dir", "data.source", "data.eval_source"])
@pytest.mark.parametrize("uri", ["s3://bkt/runs/../other/x.jsonl", "s3://bkt//x.jsonl"])
def test_the_config_refuses_them_naming_the_key_and_the_uri(key, uri):
    with pytest.raises(ConfigError) as e:
        load_config(str(MICRO), [f"{key}={uri}"])
    assert f"{key}: " in str(e.value) and uri in str(e.value)


def test_the_config_refuses_a_bad_bucket_name_too():
    with pytest.raises(ConfigError, match="run.output_dir: .*not a valid bucket name"):
        load_config(str(MICRO), ["run.output_dir=s3://Bad_Bucket/runs"])


def test_run_and_resume_refuse_them_in_one_line(capsys, tmp_path):
    from grpoflow.flows.cli import main

    uri = "s3://bkt/runs/../other"
    assert main(["run", str(MICRO), f"run.output_dir={uri}", f"storage.cache_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpoflow: invalid config:") and "run.output_dir: '..' path segment" in err and uri in err
    assert main(["resume", f"{uri}/r1", f"storage.cache_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"grpoflow: RUN_DIR: '{uri}/r1': '..' path segment in the key") and "\n" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written under the cache
