"""Fast checks of the continuous cycle's plain functions and of the deploy/data-landed commands' input errors (the
server-backed path is tests/flows/test_deployments.py)."""

import functools
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import yaml
from prefect.settings import PREFECT_API_URL, temporary_settings

from grpoflow.flows.cli import main
from grpoflow.tasks.config import ConfigError, load_config
from grpoflow.tasks.ops.continuous import check_continuous_config, check_file, cycle_config, gather
from grpoflow.tasks.ops.datasource import Ledger, list_source
from grpoflow.tasks.pipeline.errors import StageError
from tests.paths import MICRO

PREFECT_FILE = Path(__file__).parents[2] / "infra" / "prefect.yaml"


def test_continuous_config_needs_a_fixed_held_out_file():
    with pytest.raises(ConfigError, match="data.eval_source"):
        check_continuous_config(load_config(MICRO))
    check_continuous_config(load_config(MICRO, ["data.eval_source=heldout.jsonl"]))
    with pytest.raises(ConfigError, match="eval.enabled"):
        check_continuous_config(load_config(MICRO, ["data.eval_source=heldout.jsonl", "eval.enabled=false"]))


def test_cycle_config_trains_on_the_new_rows_from_the_champion(tmp_path):
    cfg = load_config(MICRO, [f"run.output_dir={tmp_path}", "data.eval_source=heldout.jsonl", "sft.enabled=true"])
    warm = cycle_config(cfg, "cycle-1", tmp_path / "train.jsonl", warm_start=str(tmp_path / "champion"))
    assert warm.data.source == str(tmp_path / "train.jsonl") and warm.data.eval_source == "heldout.jsonl"
    assert warm.run.name == "cycle-1" and not warm.sft.enabled
    # the champion is the config's: config.yaml, every stage key and `grpoflow resume` hold it
    assert warm.model.warm_start == str(tmp_path / "champion") and warm.model.name == cfg.model.name
    assert warm.tracking.uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"  # pinned: the store stays put
    cold = cycle_config(cfg, "cycle-1", tmp_path / "train.jsonl", warm_start=None)
    assert cold.sft.enabled and cold.model.warm_start is None  # no champion yet: SFT as configured


def test_gather_puts_every_format_into_one_jsonl(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"question": "What is 1 + 2?", "answer": "3"}) + "\n")
    (src / "b.csv").write_text("question,answer\nWhat is 2 + 2?,4\nWhat is 5 + 1?,6\n")
    path, rows, bad, *_ = gather(list_source(str(src)), tmp_path / "cycle" / "train.jsonl")
    assert bad == []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == 3 and [r["question"] for r in lines] == ["What is 1 + 2?", "What is 2 + 2?", "What is 5 + 1?"]


def test_gather_names_a_bad_file(tmp_path):
    (tmp_path / "bad.parquet").write_text("not parquet")
    _, rows, bad, *_ = gather(list_source(str(tmp_path)), tmp_path / "out" / "train.jsonl")
    assert rows == 0 and [f.name for f, _ in bad] == ["bad.parquet"] and "bad.parquet" in bad[0][1]


def _landed(src: Path) -> None:
    src.mkdir()
    (src / "good.jsonl").write_text(json.dumps({"question": "What is 1 + 2?", "answer": "3"}) + "\n")
    rows = [{"question": "What is 2 + 2?", "answer": "4"}, {"question": "What is 5 + 1?"}]
    (src / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_each_landed_file_is_checked_alone_and_a_bad_one_is_quarantined_by_its_own_line(tmp_path, capsys):
    src = tmp_path / "landing"
    _landed(src)
    cfg = load_config(MICRO, [f"run.output_dir={tmp_path}", "data.eval_source=heldout.jsonl"])
    files = list_source(str(src))
    path, rows, bad, changed, *_ = gather(files, tmp_path / "cycle" / "train.jsonl", check=partial(check_file, cfg=cfg))
    assert rows == 1 and changed == [] and json.loads(path.read_text())["question"] == "What is 1 + 2?"  # good trains
    ((file, error),) = bad
    assert file.name == "bad.jsonl" and error.startswith(f"{src / 'bad.jsonl'} line 2: answer is missing"), error

    ledger = Ledger(tmp_path / "state" / "ledger.json")
    ledger.quarantine(bad, cycle="cycle-1")
    ledger.record([f for f in files if f.name == "good.jsonl"], cycle="cycle-1")
    assert ledger.new_files(list_source(str(src))) == []  # not retried until it changes
    assert [e["name"] for e in ledger.quarantined()] == ["bad.jsonl"]
    status = ["continuous-status", str(src), "--state-dir", str(tmp_path / "state")]
    assert main(status) == 0
    out = capsys.readouterr().out
    assert "1 files consumed" in out and "quarantined: bad.jsonl (cycle cycle-1, " in out and "line 2" in out
    assert "waiting: 0 new files" in out

    (src / "bad.jsonl").write_text(json.dumps({"question": "What is 5 + 1?", "answer": "6"}) + "\n")  # fixed
    assert [f.name for f in ledger.new_files(list_source(str(src)))] == ["bad.jsonl"]
    assert main(status) == 0
    assert "waiting: 1 new files: bad.jsonl" in capsys.readouterr().out
    ledger.begin("cycle-2", [f for f in list_source(str(src)) if f.name == "bad.jsonl"], "3")  # then killed
    assert main(status) == 0
    out = capsys.readouterr().out
    assert "unfinished: cycle cycle-2 (champion version 3): bad.jsonl; the next run continues it" in out
    assert "waiting: 1 new files: bad.jsonl" in out and "1 files consumed" in out
    ledger.record([f for f in list_source(str(src)) if f.name == "bad.jsonl"], cycle="cycle-2")
    assert ledger.pending() is None and ledger.new_files(list_source(str(src))) == []
    assert check_file(list_source(str(src))[0], src / "bad.jsonl", cfg) is None


def test_an_unfinished_cycle_that_fails_every_run_can_be_set_aside(tmp_path, capsys):
    """`grpoflow continuous-skip`: the pending cycle's files are quarantined with the reason and the cycle ends, in
    one ledger write, so the next run trains newer files; refused while a cycle holds the state folder, and with no
    unfinished cycle (the ledger unchanged)."""
    from grpoflow.tasks.storage.lock import workspace_lock
    from grpoflow.tasks.storage.store import open_store

    src, state = tmp_path / "landing", tmp_path / "state"
    _landed(src)
    skip = ["continuous-skip", str(src), "--state-dir", str(state), "--reason", "OOM on every try"]
    assert main(skip) == 2
    assert "no unfinished cycle to set aside" in capsys.readouterr().err and not state.exists()
    ledger = Ledger(state / "ledger.json")
    files = list_source(str(src))
    ledger.begin("cycle-7", files, "2")
    before = (state / "ledger.json").read_bytes()
    with workspace_lock(open_store(str(state)), "grpo-continuous cycle"):  # a cycle under way, in another process
        res = subprocess.run([sys.executable, "-m", "grpoflow.flows.cli", *skip], capture_output=True, text=True)
    assert res.returncode == 2 and "grpo-continuous cycle" in res.stderr, res.stderr
    assert (state / "ledger.json").read_bytes() == before
    assert main(skip) == 0
    out = capsys.readouterr().out
    assert "set aside cycle cycle-7: quarantined bad.jsonl, good.jsonl" in out and "OOM on every try" in out
    assert ledger.pending() is None and ledger.new_files(list_source(str(src))) == []
    quarantined = {e["name"]: e for e in ledger.quarantined()}
    assert set(quarantined) == {"bad.jsonl", "good.jsonl"}
    good = quarantined["good.jsonl"]
    assert good["uri"] == str(src / "good.jsonl") and good["cycle"] == "cycle-7" and good["quarantined_at"]
    assert main(["continuous-status", str(src), "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert "quarantined: good.jsonl (cycle cycle-7, " in out and "continuous-skip: OOM on every try" in out
    assert "unfinished: cycle" not in out
    (src / "good.jsonl").write_text(json.dumps({"question": "What is 2 + 3?", "answer": "5"}) + "\n")  # landed anew
    assert [f.name for f in ledger.new_files(list_source(str(src)))] == ["good.jsonl"]


def test_commands_need_a_server_and_an_existing_path(tmp_path, capsys):
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert main(["data-landed", str(tmp_path)]) == 2
        assert main(["deploy"]) == 2
    assert "PREFECT_API_URL" in capsys.readouterr().err
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert main(["data-landed", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    # a server that does not answer: one line before anything (deploy raised httpx's traceback, data-landed
    # reported an event as emitted that its background worker then dropped)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert main(["data-landed", str(tmp_path)]) == 2
        assert main(["deploy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(
        line.startswith("grpoflow: PREFECT_API_URL: the Prefect server http://127.0.0.1:9/api does not answer")
        for line in err
    ), err


def test_prefect_yaml_declares_the_fixed_names():
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    from prefect.cli.deploy._config import _filter_matching_deploy_config
    from prefect.flows import load_flow_from_entrypoint

    deps = {(d["entrypoint"].rsplit(":", 1)[1], d["name"]): d for d in spec["deployments"]}
    for d in spec["deployments"]:  # module:function paths in the installed package: they load from any directory
        assert d["entrypoint"].startswith("grpoflow.flows.") and ".py" not in d["entrypoint"]
        flow = load_flow_from_entrypoint(d["entrypoint"], use_placeholder_flow=False)
        assert flow.name in ("grpo-pipeline", "grpo-continuous"), d["entrypoint"]
        # `grpoflow deploy -n FLOW/NAME` selects by the function after the colon: it must be the flow's name
        assert _filter_matching_deploy_config(f"{flow.name}/{d['name']}", spec["deployments"]) == [d]
    pools = {k: d["work_pool"]["name"] for k, d in deps.items()}
    assert pools == {
        ("grpo_pipeline", "local"): "grpoflow-process",
        ("grpo_pipeline", "docker-gpu"): "grpoflow-docker-gpu",
        ("grpo_pipeline", "k8s-gpu"): "grpoflow-k8s-gpu",
        ("grpo_continuous", "local"): "grpoflow-process",
    }
    for key in (("grpo_pipeline", "docker-gpu"), ("grpo_pipeline", "k8s-gpu")):
        assert deps[key]["work_pool"]["job_variables"]["image"] == "grpoflow:0.1.0-gpu"
        assert deps[key]["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/app"}}]
    (trigger,) = deps[("grpo_continuous", "local")]["triggers"]
    assert trigger["expect"] == ["grpoflow.data.landed"] and trigger["enabled"]


def test_a_redeploy_keeps_the_server_parameters_unless_reset():
    """flows/redeploy.py on the real infra/prefect.yaml: which deployments a `prefect deploy` argument list selects,
    and the parameters each is deployed with (the server's, the yaml's, --params over either)."""
    from grpoflow.flows import redeploy

    spec = yaml.safe_load(PREFECT_FILE.read_text())
    deployments = spec["deployments"]
    everything = [redeploy.full_name(d) for d in redeploy.selected(deployments, ["--all"])]
    assert everything == [
        "grpo-pipeline/local", "grpo-pipeline/docker-gpu", "grpo-pipeline/k8s-gpu", "grpo-continuous/local"
    ]  # fmt: skip
    (continuous,) = redeploy.selected(deployments, ["-n", "grpo-continuous/local", "--params", "{}"])
    assert [redeploy.full_name(d) for d in redeploy.selected(deployments, ["--name=grpo-pipeline/*"])] == everything[:3]
    assert redeploy.given_parameters(["-n", "x"]) is None
    given = redeploy.given_parameters(["--params", '{"source": "/data/in"}', "--param", "state_dir=s"])
    assert given == {"source": "/data/in", "state_dir": "s"}

    mine = {**continuous["parameters"], "source": "/data/in", "state_dir": "/data/state"}
    name = "grpo-continuous/local"
    (kept,) = redeploy.plan([continuous], {name: mine}, None, reset=False)
    assert kept.kind == "kept" and kept.parameters == mine
    assert kept.line("infra/prefect.yaml") == (
        f"{name}: kept parameters {json.dumps(mine, sort_keys=True)} (--reset-params to restore infra/prefect.yaml's)"
    )
    rewritten = redeploy.with_parameters(spec, [kept])  # the copy `prefect deploy` reads
    assert [d["parameters"] for d in rewritten["deployments"]][3] == mine
    assert rewritten["deployments"][:3] == deployments[:3] and spec["deployments"][3]["parameters"]["source"] == (
        "data/incoming"
    )  # the yaml's own content is untouched
    (over,) = redeploy.plan([continuous], {name: mine}, {"state_dir": "/other"}, reset=False)
    assert (
        over.kind == "kept" and "--params set state_dir" in over.line("y") and '"state_dir": "/other"' in over.line("y")
    )
    (reset,) = redeploy.plan([continuous], {name: mine}, None, reset=True)
    assert reset.kind == "reset" and reset.parameters == continuous["parameters"]
    assert reset.line("infra/prefect.yaml").startswith(f"{name}: parameters reset to infra/prefect.yaml's: ")
    assert redeploy.with_parameters(spec, [reset]) == spec
    (new,) = redeploy.plan([continuous], {name: None}, None, reset=False)
    assert new.kind == "new" and new.line("y").startswith(f"{name}: new: parameters ")
    # --params with several deployments: Prefect ignores it, so the plan does too
    choices = redeploy.plan(deployments, {n: {"config": "mine.yaml"} for n in everything}, {"config": "x"}, False)
    assert all(c.kind == "kept" and c.given is None for c in choices)


def test_continuous_parameters_are_checked_first_and_named(tmp_path, monkeypatch):
    """A parameter pointing at a missing folder or file fails in one ParameterError naming the parameter, its
    value and the working directory (outside a deployment run: the flow), with no traceback in Prefect's log."""
    import logging

    from grpoflow.flows.parameters import ParameterError, continuous_config, quiet_parameter_errors

    monkeypatch.chdir(tmp_path)
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    (tmp_path / "incoming").mkdir()
    (tmp_path / "a-file").write_text("")
    overrides = ["data.eval_source=heldout.jsonl"]
    where = f"(working directory {tmp_path})"
    with pytest.raises(ParameterError) as e:
        continuous_config(str(MICRO), overrides, "data/incoming", None)
    assert str(e.value) == f'flow grpo-continuous: parameter source="data/incoming" is not a folder {where}'
    with pytest.raises(ParameterError, match='parameter source="a-file" is a file, not a folder'):
        continuous_config(str(MICRO), overrides, "a-file", None)
    with pytest.raises(ParameterError, match='parameter state_dir="a-file" is a file, not a folder'):
        continuous_config(str(MICRO), overrides, "incoming", "a-file")
    with pytest.raises(ParameterError, match=r'data.eval_source="missing.jsonl" \(parameters config/overrides\)'):
        continuous_config(str(MICRO), ["data.eval_source=missing.jsonl"], "incoming", None)
    with pytest.raises(ParameterError, match='parameters config="nowhere.yaml", .*config file not found: nowhere'):
        continuous_config("nowhere.yaml", overrides, "incoming", None)
    with pytest.raises(ParameterError, match="parameter source is not set"):
        continuous_config(str(MICRO), overrides, None, None)
    cfg = continuous_config(str(MICRO), overrides, "incoming", "state")  # a state_dir not there yet is created
    assert cfg.data.eval_source == "heldout.jsonl"

    quiet_parameter_errors()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("prefect.flow_runs")
    logger.addHandler(handler)
    try:
        logger.error("Encountered exception during execution: %r", e.value, exc_info=e.value)
        logger.error("other", exc_info=ValueError("kept"))
    finally:
        logger.removeHandler(handler)
    assert records[0].exc_info is None and 'parameter source="data/incoming"' in records[0].getMessage()
    assert records[1].exc_info is not None  # other errors keep their traceback


FLAKY = """import os

def score(prompts, completions, **kw):
    if os.path.exists(os.environ["FLAKY_FLAG"]):
        return "not a list"  # the stage fails, as a crash would stop it
    return [1.0 for _ in completions]
"""


@pytest.mark.slow
def test_a_bad_file_is_quarantined_and_a_cycle_that_did_not_finish_is_continued(tmp_path, monkeypatch):
    """The flow in-process: the bad file is named by its own path and line and recorded as quarantined; the good
    one trains. The first cycle fails in GRPO, after its data stage: it stays pending in the ledger, and the next
    run continues that cycle (its workspace, its data stage skipped) on the same file, leaving a file landed since
    for the cycle after; then the good file is consumed and neither is offered again until it changes."""
    from grpoflow.flows.continuous import grpo_continuous

    src = tmp_path / "incoming"
    _landed(src)
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    (tmp_path / "flaky_rewards.py").write_text(FLAKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FLAKY_FLAG", str(tmp_path / "fail"))
    (tmp_path / "fail").touch()
    overrides = [
        f"run.output_dir={tmp_path / 'runs'}",
        f"data.eval_source={tmp_path / 'heldout.jsonl'}",
        "grpo.reward_funcs=[flaky_rewards:score,correctness]",
    ]
    run = functools.partial(grpo_continuous, str(MICRO), overrides, str(src), str(tmp_path / "state"))
    state = run(return_state=True)
    assert state.is_failed()
    with pytest.raises(StageError, match="grpo: .*returned str"):
        state.result()
    ledger = Ledger(tmp_path / "state" / "ledger.json")
    pending = ledger.pending()
    assert pending is not None and [f.split("|")[0] for f in pending["files"]] == ["good.jsonl"]
    assert [e["name"] for e in ledger.quarantined()] == ["bad.jsonl"]
    data_manifest = tmp_path / "state" / "cycles" / pending["cycle"] / "data" / "manifest.json"
    data_done = json.loads(data_manifest.read_text())["finished_at"]

    (src / "later.jsonl").write_text(json.dumps({"question": "What is 3 + 3?", "answer": "6"}) + "\n")
    (tmp_path / "fail").unlink()
    out = run()
    assert out["cycle"] == pending["cycle"] and out["consumed"] == ["good.jsonl"] and out["quarantined"] == []
    assert json.loads(data_manifest.read_text())["finished_at"] == data_done  # skipped: its key is the same
    assert ledger.pending() is None
    assert [f.name for f in ledger.new_files(list_source(str(src)))] == ["later.jsonl"]
    assert [e["name"] for e in ledger.quarantined()] == ["bad.jsonl"]
    assert [e["cycle"] for e in ledger.entries() if e["name"] == "good.jsonl"] == [pending["cycle"]]


@pytest.mark.slow
def test_a_cycle_keeps_its_state_on_s3(tmp_path, seaweedfs, monkeypatch):
    """An s3:// source with a local run.output_dir: the ledger and the cycle's workspace live under the source's
    hidden state prefix (no local folder named 's3:'), so a restarted worker pod sees what was consumed. A cycle
    whose data stage fails (here on the held-out file) consumes nothing there (it is pending there)."""
    from grpoflow.flows.continuous import grpo_continuous
    from grpoflow.tasks.storage import s3

    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    store = s3.S3Client()
    source = f"s3://{seaweedfs.bucket}/landing-{tmp_path.name}"
    store.put_bytes(json.dumps({"question": "What is 1 + 1?", "answer": "2"}).encode() + b"\n", f"{source}/new.jsonl")
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"prompt": "no question column"}) + "\n")
    overrides = [
        "run.output_dir=runs",
        f"data.eval_source={tmp_path / 'heldout.jsonl'}",
        f"storage.cache_dir={tmp_path / 'cache'}",
    ]
    state = grpo_continuous(config=str(MICRO), overrides=overrides, source=source, return_state=True)
    assert state.is_failed()
    with pytest.raises(StageError, match="data: .*'question': no row has it"):
        state.result()
    ledger = f"{source}/_grpoflow-continuous/ledger.json"
    assert Ledger(ledger).entries() == []  # consumed nothing; the cycle is pending, for the next run to continue
    assert [k.split("|")[0] for k in Ledger(ledger).pending()["files"]] == ["new.jsonl"]
    written = [o["uri"] for o in store.list_objects(f"{source}/_grpoflow-continuous/cycles/")]
    assert any(uri.endswith("/config.yaml") for uri in written), written  # the cycle's workspace, on S3
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "runs" / "continuous").exists()
    assert [f.name for f in Ledger(ledger).new_files(list_source(source))] == ["new.jsonl"]
    assert not store.exists(f"{source}/_grpoflow-continuous/.grpoflow.lease")  # the cycle's lease, released


def test_a_cycle_does_not_train_a_file_uploaded_again_with_another_etag(tmp_path, seaweedfs, monkeypatch, capsys):
    """The flow on an s3:// source: a file a cycle trained (its snapshot's sha256 in the ledger) is uploaded again
    in parts, which gives it another ETag. The next cycle fetches it, finds the same bytes, records it as the
    earlier entry was (consumed, naming it) and trains nothing: no pipeline, no workspace."""
    from grpoflow.flows.continuous import grpo_continuous
    from grpoflow.tasks.config import StorageConfig
    from grpoflow.tasks.storage import s3

    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    cache = str(tmp_path / "cache")
    store = s3.S3Client(StorageConfig(cache_dir=cache, multipart_threshold_mb=5, multipart_chunksize_mb=5))
    source = f"s3://{seaweedfs.bucket}/landing-again-{tmp_path.name}"
    rows = "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(170_000))
    batch = tmp_path / "batch.jsonl"
    batch.write_text(rows)
    store.put_bytes(batch.read_bytes(), f"{source}/batch.jsonl")
    ledger = Ledger(f"{source}/_grpoflow-continuous/ledger.json")
    trained = gather(list_source(source), tmp_path / "earlier" / "train.jsonl").files  # as the earlier cycle did
    ledger.record(trained, cycle="cycle-1")
    store.upload_file(batch, f"{source}/batch.jsonl")  # the same bytes, in parts: another ETag
    assert [f.name for f in ledger.new_files(list_source(source))] == ["batch.jsonl"]

    (tmp_path / "heldout.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    overrides = ["run.output_dir=runs", f"data.eval_source={tmp_path / 'heldout.jsonl'}", f"storage.cache_dir={cache}"]
    out = grpo_continuous(config=str(MICRO), overrides=overrides, source=source)
    assert out["consumed"] == [] and out["decision"] is None
    assert ledger.new_files(list_source(source)) == [] and ledger.pending() is None
    assert ledger.entries()[-1]["same_as"] == {"key": trained[0].key, "cycle": "cycle-1"}
    assert not store.list_objects(f"{source}/_grpoflow-continuous/cycles/")  # no workspace: nothing trained
    capsys.readouterr()
    assert main(["continuous-status", source]) == 0
    out = capsys.readouterr().out
    assert "1 files consumed (1 uploaded again with the same bytes, not trained again)" in out
    assert "waiting: 0 new files" in out


def test_a_champion_adapter_is_merged_onto_its_base(tmp_path):
    """A champion registered as a LoRA adapter becomes a plain model folder (base + B @ A) GRPO can start from."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpoflow.tasks.config import ModelConfig, PipelineConfig, TinyModelConfig
    from grpoflow.tasks.model.loading import add_lora
    from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer
    from grpoflow.tasks.ops.continuous import _merge_adapter

    tok = train_tiny_tokenizer(["What is 1 + 2?", "<answer>\n3\n</answer>"] * 10, 280)
    tiny = TinyModelConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    build_tiny_model(tiny, tok, seed=0).save_pretrained(tmp_path / "base")
    model = add_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), ModelConfig().lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(tmp_path / "adapter")
    tok.save_pretrained(tmp_path / "adapter")
    expected = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}

    out = _merge_adapter(tmp_path / "adapter", tmp_path / "merged", PipelineConfig())
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert not (out / "adapter_config.json").exists() and (out / "tokenizer.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    changed = [k for k in expected if not torch.equal(expected[k], base[k])]
    assert changed, "the adapter changed no weight: the test would prove nothing"
    for k in expected:
        torch.testing.assert_close(merged[k], expected[k])


class _Killed(BaseException):
    """A kill between the cycle's registration and its ledger write."""


def test_a_cycle_killed_after_its_model_was_promoted_is_recorded_not_trained_again(tmp_path, monkeypatch):
    """The first cycle registers and promotes its model, then is killed before the ledger records its files. The
    next run finds the champion moved by that very cycle: it records the files as trained by it, and trains
    nothing. Before, the champion's move read as "cannot continue" and the same files trained a second time in a
    new cycle, registering a second version of the same data."""
    from mlflow.tracking import MlflowClient

    from grpoflow.flows.continuous import grpo_continuous

    src = tmp_path / "incoming"
    src.mkdir()
    (src / "good.jsonl").write_text(json.dumps({"question": "What is 1 + 2?", "answer": "3"}) + "\n")
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    overrides = [f"run.output_dir={tmp_path / 'runs'}", f"data.eval_source={tmp_path / 'heldout.jsonl'}"]
    run = functools.partial(grpo_continuous, str(MICRO), overrides, str(src), str(tmp_path / "state"))
    real_record = Ledger.record

    def killed(self, files, **info):
        raise _Killed()

    monkeypatch.setattr(Ledger, "record", killed)
    with pytest.raises(_Killed):
        run()
    ledger = Ledger(tmp_path / "state" / "ledger.json")
    pending = ledger.pending()
    assert pending is not None and pending["champion"] is None
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (model,) = client.search_registered_models()
    assert [v.version for v in client.search_model_versions(f"name='{model.name}'")] == [1]

    monkeypatch.setattr(Ledger, "record", real_record)
    out = run()
    assert out["cycle"] == pending["cycle"] and out["consumed"] == ["good.jsonl"], out
    assert out["decision"] == f"promoted before the cycle was stopped: {model.name} version 1"
    assert ledger.pending() is None and [e["cycle"] for e in ledger.entries()] == [pending["cycle"]]
    assert [v.version for v in client.search_model_versions(f"name='{model.name}'")] == [1]  # nothing trained
    assert sorted(p.name for p in (tmp_path / "state" / "cycles").iterdir()) == [pending["cycle"]]


@pytest.mark.slow
def test_a_killed_cycle_that_started_from_the_champion_continues_from_it(tmp_path, monkeypatch):
    """Cycle 1 registers the champion. Cycle 2 starts from it and fails in GRPO; the next run continues cycle 2:
    the champion is downloaded again, and its bytes key GRPO as before (model.warm_start is keyed by content), so
    the data stage is skipped and GRPO's attempt keeps its key (its checkpoints would be continued), not
    restarted as another attempt."""
    from grpoflow.flows.continuous import grpo_continuous

    src = tmp_path / "incoming"
    src.mkdir()
    (src / "first.jsonl").write_text(json.dumps({"question": "What is 1 + 2?", "answer": "3"}) + "\n")
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    (tmp_path / "flaky_rewards.py").write_text(FLAKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FLAKY_FLAG", str(tmp_path / "fail"))
    overrides = [
        f"run.output_dir={tmp_path / 'runs'}",
        f"data.eval_source={tmp_path / 'heldout.jsonl'}",
        "grpo.reward_funcs=[flaky_rewards:score,correctness]",
    ]
    run = functools.partial(grpo_continuous, str(MICRO), overrides, str(src), str(tmp_path / "state"))
    first = run()
    assert "version 1" in first["decision"] and "promoted" in first["decision"], first

    (src / "second.jsonl").write_text(json.dumps({"question": "What is 3 + 3?", "answer": "6"}) + "\n")
    (tmp_path / "fail").touch()
    assert run(return_state=True).is_failed()
    pending = Ledger(tmp_path / "state" / "ledger.json").pending()
    assert pending is not None and pending["champion"] == "1"
    cycle = tmp_path / "state" / "cycles" / pending["cycle"]
    data_done = json.loads((cycle / "data" / "manifest.json").read_text())["finished_at"]
    grpo_key = json.loads((cycle / "grpo" / "attempt.json").read_text())["key"]
    config = yaml.safe_load((cycle / "config.yaml").read_text())
    assert config["model"]["warm_start"] and config["sft"]["enabled"] is False

    (tmp_path / "fail").unlink()
    out = run()
    assert out["cycle"] == pending["cycle"] and out["consumed"] == ["second.jsonl"], out
    assert json.loads((cycle / "data" / "manifest.json").read_text())["finished_at"] == data_done  # skipped
    assert json.loads((cycle / "grpo" / "attempt.json").read_text())["key"] == grpo_key  # the same attempt's key
    assert json.loads((cycle / "grpo" / "manifest.json").read_text())["stage"] == "grpo"  # and it finished
