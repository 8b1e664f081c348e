"""Against a real `mlflow server` on 127.0.0.1 (SQLite backend, --workers 1, artifacts served by it): the
pipeline logs over HTTP, the UI answers, the run's model is registered and the champion alias follows the
held-out accuracy."""

import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpoflow.flows.cli import main
from grpoflow.tasks.config import load_config
from grpoflow.tasks.tracking.registry import ACCURACY_TAG, paired_baseline, register_run_model
from tests.paths import MICRO


@pytest.fixture(scope="module")
def server(mlflow_server):
    return mlflow_server


def test_champion_alias_follows_accuracy(server, tmp_path):
    client = MlflowClient(server)
    exp = client.create_experiment("registry-test")
    runs = [client.create_run(exp).info.run_id for _ in range(4)]
    name = "grpoflow-registry-test"
    src = [f"{client.get_run(r).info.artifact_uri}/merged" for r in runs]
    first = register_run_model(client, name, "champion", src[0], runs[0], 0.30)
    better = register_run_model(client, name, "champion", src[1], runs[1], 0.50)
    worse = register_run_model(client, name, "champion", src[2], runs[2], 0.40)
    unknown = register_run_model(client, name, "champion", src[3], runs[3], None)
    assert (first.promoted, better.promoted, worse.promoted, unknown.promoted) == (True, True, False, False)
    champion = client.get_model_version_by_alias(name, "champion")
    assert champion.version == better.version and champion.tags[ACCURACY_TAG] == "0.500000"
    assert "does not beat" in client.get_model_version(name, worse.version).tags["champion_decision"]
    assert [v.run_id for v in client.search_model_versions(f"name='{name}'", order_by=["version_number ASC"])] == runs


def test_an_accuracy_from_another_held_out_set_does_not_move_the_champion(server, tmp_path):
    """A run measured on other held-out rows (another dataset, or eval.max_samples=8 of them): its accuracy is
    not comparable with the champion's and does not replace it, however high. Before, 5/8 = 62.5% on 8 rows beat
    45% on the full set and moved the alias. The same set compares as before; eval_set_id names the split's
    content, max_samples, the token budget and the accuracy reward."""
    from datasets import Dataset

    from grpoflow.tasks.tracking.registry import EVAL_SET_TAG, eval_set_id

    split = tmp_path / "eval"
    Dataset.from_list([{"question": "What is 1 + 1?", "answer": "2"}]).save_to_disk(str(split))
    full, eight = eval_set_id(str(split), None, 64, "correctness"), eval_set_id(str(split), 8, 64, "correctness")
    assert len({full, eight, eval_set_id(str(split), None, 32, "correctness")}) == 3
    assert eval_set_id(str(split), None, 64, "correctness") == full
    client = MlflowClient(server)
    exp = client.create_experiment("eval-set-registry-test")
    runs = [client.create_run(exp).info.run_id for _ in range(3)]
    name = "grpoflow-eval-set-test"
    src = [f"{client.get_run(r).info.artifact_uri}/merged" for r in runs]
    first = register_run_model(client, name, "champion", src[0], runs[0], 0.45, eval_set=full)
    other = register_run_model(client, name, "champion", src[1], runs[1], 0.625, eval_set=eight)
    same = register_run_model(client, name, "champion", src[2], runs[2], 0.50, eval_set=full)
    assert (first.promoted, other.promoted, same.promoted) == (True, False, True)
    assert "another held-out set" in other.reason and "not comparable" in other.reason
    assert client.get_model_version(name, other.version).tags[EVAL_SET_TAG] == eight


def test_a_run_from_the_champion_is_promoted_on_the_paired_comparison(server):
    """A run that started from the champion: the paired test decides, not the champion's recorded accuracy; the
    figures go on the version and the parent run; a champion that moved meanwhile is not replaced."""
    client = MlflowClient(server)
    exp = client.create_experiment("paired-registry-test")
    runs = [client.create_run(exp).info.run_id for _ in range(4)]
    name = "grpoflow-paired-test"
    src = [f"{client.get_run(r).info.artifact_uri}/merged" for r in runs]
    first = register_run_model(client, name, "champion", src[0], runs[0], 0.90)  # a high recorded figure
    cfg = load_config(MICRO)
    # measured side by side, the champion answers 10 of 40 rows, the candidate those and 8 more: p = 2/256
    rows = {"correct_before": [True] * 10 + [False] * 30, "correct_after": [True] * 18 + [False] * 22}
    ev = {"accuracy_after": 0.45, **rows}
    better = register_run_model(
        client, name, "champion", src[1], runs[1], 0.45, runs[1], None, paired_baseline(cfg, ev, first.version)
    )
    assert better.promoted and "8 rows gained, 0 lost" in better.reason  # 0.45 < 0.90 recorded: the tag is not used
    assert client.get_model_version_by_alias(name, "champion").version == better.version
    tags = client.get_model_version(name, better.version).tags
    assert (tags["promotion.b"], tags["promotion.c"], tags["promotion.decision"]) == ("8", "0", "promoted")
    assert float(tags["promotion.p_value"]) == pytest.approx(2 / 256) and tags["promotion.alpha"] == "0.05"
    assert tags["promotion.champion_version"] == first.version
    run_tags = client.get_run(runs[1]).data.tags
    assert run_tags["promotion.p_value"] == tags["promotion.p_value"] and run_tags["champion_decision"] == better.reason
    # 3 gained, 1 lost: noise; kept
    noisy = {"correct_before": [True] + [False] * 3, "correct_after": [False] + [True] * 3}
    kept = register_run_model(
        client, name, "champion", src[2], runs[2], 0.75, None, None, paired_baseline(cfg, noisy, better.version)
    )
    assert not kept.promoted and "within the held-out noise" in kept.reason
    assert client.get_model_version(name, kept.version).tags["promotion.decision"] == "kept the champion"
    # started from the old champion (first), which is no longer the alias holder: not compared with it, kept
    moved = register_run_model(
        client, name, "champion", src[3], runs[3], 0.45, None, None, paired_baseline(cfg, ev, first.version)
    )
    assert not moved.promoted and f"moved to version {better.version}" in moved.reason
    moved_tags = client.get_model_version(name, moved.version).tags
    assert moved_tags["promotion.b"] == "8" and moved_tags["promotion.decision"] == "kept the champion"
    assert client.get_model_version_by_alias(name, "champion").version == better.version
    assert paired_baseline(cfg, ev, None) is None and paired_baseline(cfg, {"accuracy_after": 0.5}, "1") is None


@pytest.mark.slow
def test_pipeline_logs_to_the_server_and_registers_its_model(server, tmp_path):
    out = tmp_path / "runs"
    args = ["run", str(MICRO), f"run.output_dir={out}", f"tracking.uri={server}", "tracking.experiment=server-e2e"]
    assert main([*args, "run.name=one"]) == 0
    assert main([*args, "run.name=two"]) == 0
    with urllib.request.urlopen(server + "/", timeout=10) as r:  # the UI
        assert r.status == 200 and b"<html" in r.read(2000).lower()
    client = MlflowClient(server)
    exp = client.get_experiment_by_name("server-e2e")
    parents = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(r.info.run_name for r in parents) == ["one", "two"]
    assert all(r.info.status == "FINISHED" for r in parents)
    assert not (out / "mlflow.db").exists()  # nothing went to the local default store
    versions = client.search_model_versions("name='grpoflow-tiny'", order_by=["version_number ASC"])
    assert len(versions) == 2
    champion = client.get_model_version_by_alias("grpoflow-tiny", "champion")
    acc = {v.version: float(v.tags[ACCURACY_TAG]) for v in versions}
    assert acc[champion.version] == max(acc.values())  # ties keep the first
    for p in parents:
        assert p.data.tags["registered_model"].startswith("grpoflow-tiny/")
        assert p.data.tags["champion_decision"]
    # the registered merged weights are real artifacts on the server
    files = {Path(f.path).name for f in client.list_artifacts(versions[0].run_id, "merged")}
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
