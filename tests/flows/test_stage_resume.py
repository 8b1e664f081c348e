"""`grpoflow resume`: stages whose manifest holds their current key are skipped, GRPO continues from its
newest checkpoint, a changed setting reruns its stage and every later one, one MLflow parent run throughout."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from grpoflow.flows.cli import main
from grpoflow.flows.stages import PIPELINE
from grpoflow.tasks.config import load_config
from grpoflow.tasks.pipeline import fingerprint
from grpoflow.tasks.storage.workspace import Workspace
from tests.paths import MICRO

SLOW_REWARD = """
import time

def slow_length(prompts, completions, **columns):
    time.sleep(0.5)  # keeps each GRPO step long enough to be killed after the first checkpoint
    return [float(len(c[0]["content"]) % 7) for c in completions]
"""
RUN = [
    "run.name=r",
    "sft.max_steps=4",
    "grpo.max_steps=4",
    "grpo.save_steps=1",
    "grpo.reward_funcs=[slow_reward:slow_length,correctness]",
    "eval.max_samples=4",
]


STAGES = PIPELINE.names


# ------------------------------------------------------------------------------------------ keys
def _cfg(*overrides: str):
    return load_config(str(MICRO), list(overrides))


def stage_keys(cfg) -> dict[str, str]:
    return fingerprint.stage_keys(PIPELINE, cfg)


def test_keys_are_deterministic_and_distinct():
    keys = stage_keys(_cfg())
    assert keys == stage_keys(_cfg())
    assert len(set(keys.values())) == len(keys)
    assert all(len(k) == 64 for k in keys.values())


@pytest.mark.parametrize(
    ("override", "changed"),
    [
        ("run.seed=4", set(STAGES) | {"base_model"}),
        ("data.arithmetic.train_size=150", set(STAGES) | {"base_model"}),
        ("model.lora.r=8", {"sft", "grpo", "eval", "export"}),
        ("sft.learning_rate=0.01", {"sft", "grpo", "eval", "export"}),
        ("grpo.max_steps=5", {"grpo", "eval", "export"}),
        ("grpo.learning_rate=0.002", {"grpo", "eval", "export"}),
        ("grpo.temperature=0.5", {"grpo", "eval", "export"}),
        ("generation.backend=transformers", {"grpo", "eval", "export"}),
        ("eval.max_samples=3", {"eval"}),
        ("eval.max_new_tokens=9", {"eval", "export"}),
        ("export.verify_prompts=1", {"export"}),
        ("distributed.nproc_per_node=2", {"grpo", "eval", "export"}),  # the world size sets the round's rows
        ("distributed.seed_by_row=true", {"grpo", "eval", "export"}),
        ("distributed.backend=gloo", {"grpo", "eval", "export"}),  # another all-reduce: another sum order
        # thread counts and batch sizes change the order of float sums, so the sampled tokens (measured)
        ("run.torch_threads=2", {"sft", "grpo", "eval", "export"}),
        ("generation.torch_threads=1", {"grpo", "eval", "export"}),
        ("generation.batch_size=3", {"grpo", "eval", "export"}),
    ],
)
def test_a_change_propagates_downstream(override, changed):
    before, after = stage_keys(_cfg()), stage_keys(_cfg(override))
    assert {s for s in before if before[s] != after[s]} == changed


@pytest.mark.parametrize(
    "override",
    [
        "run.name=other",
        "run.output_dir=/elsewhere",
        "grpo.save_steps=7",
        "grpo.logging_steps=3",
        "grpo.log_completions=false",
        "grpo.resume=never",
        "sft.logging_steps=5",
        "tracking.experiment=x",
        "tracking.uri=sqlite:///x.db",
        "storage.cache_dir=/elsewhere",
        "storage.endpoint_url=http://127.0.0.1:9000",
        "distributed.timeout_s=30",
        "distributed.master_port=29555",
    ],
)
def test_logging_only_keys_do_not_change_any_key(override):
    assert stage_keys(_cfg(override)) == stage_keys(_cfg())


def test_where_the_processes_run_is_not_what_they_compute():
    cfg = _cfg()
    # model_copy: a trainjob launcher is validated to need an S3 run; the key only reads the values
    trainjob = cfg.distributed.trainjob.model_copy(update={"namespace": "other"})
    dist = cfg.distributed.model_copy(update={"launcher": "trainjob", "trainjob": trainjob})
    assert stage_keys(cfg.model_copy(update={"distributed": dist})) == stage_keys(cfg)
    two = _cfg("distributed.nproc_per_node=2")
    assert stage_keys(_cfg("distributed.nproc_per_node=2", "distributed.strategy=fsdp2")) != stage_keys(two)


def test_grpo_hangs_off_data_when_sft_is_disabled():
    on, off = stage_keys(_cfg()), stage_keys(_cfg("sft.enabled=false"))
    assert on["data"] == off["data"] and on["grpo"] != off["grpo"]
    # with sft disabled, sft settings no longer reach grpo
    assert stage_keys(_cfg("sft.enabled=false", "sft.learning_rate=0.01"))["grpo"] == off["grpo"]


def test_a_warm_start_keys_grpo_and_later_by_its_folder_and_its_files(tmp_path):
    """model.warm_start (the folder GRPO starts from: the continuous flow's champion) is in the keys of grpo and
    every stage after it, by its path and its files' content; data and the tiny base model keep theirs (sft's
    changes too, but it does not run with a warm start)."""
    start = tmp_path / "champion"
    start.mkdir()
    (start / "config.json").write_text("{}")
    off = stage_keys(_cfg("sft.enabled=false"))
    warm = stage_keys(_cfg("sft.enabled=false", f"model.warm_start={start}"))
    assert {s for s in off if off[s] != warm[s]} == {"sft", "grpo", "eval", "export"}  # sft: never runs with it
    (start / "model.safetensors").write_bytes(b"other weights")  # the same folder, other files
    edited = stage_keys(_cfg("sft.enabled=false", f"model.warm_start={start}"))
    assert {s for s in warm if warm[s] != edited[s]} == {"sft", "grpo", "eval", "export"}
    fp = fingerprint.fingerprints(PIPELINE, _cfg("sft.enabled=false", f"model.warm_start={start}"))["grpo"]
    assert set(fp["content"]["model.warm_start"]) == {"config.json", "model.safetensors"}


def test_the_files_the_rewards_read_key_grpo_and_eval_by_their_content(tmp_path):
    """grpo.reward_files (a rubric, a word list the custom rewards read): a file by its path, a folder by each of
    its files; an edit reruns grpo and everything after it, not data or sft; a path that is gone is named."""
    rubric, words = tmp_path / "rubric.txt", tmp_path / "words"
    rubric.write_text("be exact\n")
    words.mkdir()
    (words / "a.txt").write_text("alpha\n")
    given = f"grpo.reward_files=[{rubric},{words}]"
    plain, keyed = stage_keys(_cfg()), stage_keys(_cfg(given))
    assert {s for s in plain if plain[s] != keyed[s]} == {"grpo", "eval", "export"}
    fp = fingerprint.fingerprints(PIPELINE, _cfg(given))
    assert set(fp["grpo"]["content"]["grpo.reward_files"]) == {str(rubric), f"{words}/a.txt"}
    assert fp["eval"]["content"]["grpo.reward_files"] == fp["grpo"]["content"]["grpo.reward_files"]
    rubric.write_text("be exact, and brief\n")
    edited = stage_keys(_cfg(given))
    assert {s for s in keyed if keyed[s] != edited[s]} == {"grpo", "eval", "export"}
    (words / "b.txt").write_text("beta\n")  # a file added to the folder
    assert stage_keys(_cfg(given))["grpo"] != edited["grpo"]
    (words / "b.txt").unlink()
    assert stage_keys(_cfg(given)) == edited
    rubric.unlink()
    with pytest.raises(ValueError, match=r"grpo.reward_files: .*rubric.txt: no such file or folder \(looked at "):
        stage_keys(_cfg(given))


def test_the_flow_parameter_init_model_becomes_the_configs_warm_start(tmp_path):
    """grpo_pipeline(init_model=...) puts the folder into the config (and SFT off), so config.yaml, the keys and a
    later `grpoflow resume` hold it; a config that names another warm start is refused, naming both."""
    from grpoflow.flows.pipeline import with_warm_start
    from grpoflow.tasks.config import ConfigError

    cfg = _cfg()
    assert cfg.sft.enabled and with_warm_start(cfg, None) is cfg
    warm = with_warm_start(cfg, str(tmp_path / "a"))
    assert warm.model.warm_start == str(tmp_path / "a") and not warm.sft.enabled
    assert with_warm_start(warm, str(tmp_path / "a")) is warm
    with pytest.raises(ConfigError, match=r"init_model=.*/b: the config's model.warm_start is .*/a; give one"):
        with_warm_start(warm, str(tmp_path / "b"))


def test_workspace_attempts_clear_files_of_another_key(tmp_path):
    ws = Workspace(tmp_path)
    ws.begin("grpo", "k1")
    (ws.stage_dir("grpo") / "checkpoints").mkdir()
    ws.begin("grpo", "k1")  # same key: a killed attempt keeps its checkpoints
    assert (tmp_path / "grpo" / "checkpoints").is_dir()
    ws.publish("grpo", "k1", {"steps": 3, "model_path": "p"})
    assert ws.completed("grpo", "k1") == {"steps": 3, "model_path": "p"}
    assert ws.completed("grpo", "k2") is None
    ws.begin("grpo", "k2")
    assert not (tmp_path / "grpo" / "checkpoints").exists() and ws.read_manifest("grpo") is None


def test_resume_errors(tmp_path, capsys):
    assert main(["resume", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text(MICRO.read_text())
    assert main(["resume", str(tmp_path), "--from-stage", "train"]) == 2
    assert "unknown stage 'train'" in capsys.readouterr().err


def test_resume_and_sync_refuse_a_folder_with_another_tools_config_yaml(tmp_path, capsys):
    """RUN_DIR holding a config.yaml that grpoflow did not write (and no stage record): no run. `grpoflow resume`
    and `grpoflow sync` exit 2 naming the file, and the folder is left byte for byte (no lock file either)."""
    files = {"config.yaml": b"model: resnet50\nepochs: 3\n", "data/notes.txt": b"mine", "export/model.bin": b"w"}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    for args in (["resume", str(tmp_path)], ["resume", str(tmp_path), "--from-stage", "data"], ["sync", str(tmp_path)]):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert f"{tmp_path / 'config.yaml'} is no config grpoflow wrote" in err and "epochs" in err, err
        assert {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files


# ------------------------------------------------------------------------------- the real CLI
def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "grpoflow.flows.cli", *args]


def _finished_at(ws: Path) -> dict[str, float]:
    return {s: json.loads((ws / s / "manifest.json").read_text())["finished_at"] for s in STAGES}


def _resume(ctx, *args: str) -> str:
    res = subprocess.run(_cli("resume", str(ctx["ws"]), *args), env=ctx["env"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr


def _one_parent(out: Path):
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("grpoflow").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return parents[0], children


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """A run killed (SIGKILL) in GRPO after its first checkpoint, then `grpoflow resume`d."""
    tmp = tmp_path_factory.mktemp("stage_resume")
    (tmp / "slow_reward.py").write_text(SLOW_REWARD)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PREFECT_HOME=str(tmp / "prefect"),
    )
    out = tmp / "runs"
    ws = out / "r"
    # its own process group: SIGKILL reaches the flow and whatever it started (Prefect's server)
    proc = subprocess.Popen(
        _cli("run", str(MICRO), f"run.output_dir={out}", *RUN),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while not (ws / "grpo" / "checkpoints" / "checkpoint-1").is_dir() and proc.poll() is None:
        assert time.time() < deadline, "no GRPO checkpoint in 10 minutes"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (ws / "grpo" / "manifest.json").exists()
    killed = {s: json.loads((ws / s / "manifest.json").read_text())["finished_at"] for s in ("data", "sft")}
    parent_id = json.loads((ws / "run.json").read_text())["mlflow_run_id"]
    c = {"out": out, "ws": ws, "env": env, "killed": killed, "parent_id": parent_id}
    c["stderr"] = _resume(c)
    return c


@pytest.mark.slow
def test_sigkill_in_grpo_then_resume(ctx):
    ws, err = ctx["ws"], ctx["stderr"]
    after = _finished_at(ws)
    assert {s: after[s] for s in ("data", "sft")} == ctx["killed"]  # not recomputed
    assert "stage data: complete (key" in err and "stage sft: complete (key" in err
    assert "resumed GRPO from" in err
    assert json.loads((ws / "grpo" / "manifest.json").read_text())["summary"]["steps"] == 4
    parent, children = _one_parent(ctx["out"])
    assert parent.info.run_id == ctx["parent_id"]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["grpoflow.resumes"] == "1"
    stages = [(r.data.tags["grpoflow.stage"], r.info.status) for r in children]
    # one MLflow run per stage: the resume reopened the killed grpo run and finished it (docs/tracking.md)
    assert sorted(stages) == sorted((s, "FINISHED") for s in STAGES)
    grpo = next(r for r in children if r.data.tags["grpoflow.stage"] == "grpo")
    assert grpo.data.tags["grpoflow.stage_resumes"] == "1"


@pytest.mark.slow
def test_resume_from_stage_eval_recomputes_eval_and_export(ctx):
    ws = ctx["ws"]
    before = _finished_at(ws)
    err = _resume(ctx, "--from-stage", "eval")
    after = _finished_at(ws)
    assert [s for s in STAGES if after[s] != before[s]] == ["eval", "export"]
    assert "stage grpo: complete (key" in err and "resumed GRPO" not in err
    parent, _ = _one_parent(ctx["out"])
    assert parent.info.run_id == ctx["parent_id"] and parent.info.status == "FINISHED"


@pytest.mark.slow
def test_changed_grpo_setting_reruns_grpo_and_later(ctx):
    ws = ctx["ws"]
    before = _finished_at(ws)
    err = _resume(ctx, "grpo.learning_rate=0.002")
    after = _finished_at(ws)
    assert [s for s in STAGES if after[s] != before[s]] == ["grpo", "eval", "export"]
    assert "resumed GRPO" not in err  # the old checkpoints belong to another key: removed, not resumed
    assert json.loads((ws / "grpo" / "manifest.json").read_text())["summary"]["steps"] == 4
    parent, _ = _one_parent(ctx["out"])
    assert parent.info.run_id == ctx["parent_id"] and parent.info.status == "FINISHED"
    assert parent.data.tags["config_changed.grpo.learning_rate"] == "0.002"


@pytest.mark.slow
def test_raised_max_steps_trains_on_from_the_last_step(ctx):
    ws = ctx["ws"]
    res = subprocess.run(
        _cli("resume", str(ws), "grpo.max_steps=6"), env=ctx["env"], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resume: grpo continues from its finished attempt" in res.stdout
    assert "resume: grpo reruns: config: grpo.max_steps 4 -> 6" in res.stdout
    assert "resumed GRPO from" in res.stderr and "checkpoint-4 (step 4)" in res.stderr
    assert "stage grpo: replacing its finished results" in res.stderr
    assert "continuing from its checkpoints" in res.stderr
    assert json.loads((ws / "grpo" / "manifest.json").read_text())["summary"]["steps"] == 6
    steps = [json.loads(line)["step"] for line in (ws / "grpo" / "history.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # the history of the first four steps came with the checkpoint


@pytest.mark.slow
def test_two_resumes_at_once_the_second_is_refused_naming_the_first(ctx):
    ws = ctx["ws"]
    first = subprocess.Popen(
        _cli("resume", str(ws), "--from-stage", "eval"), env=ctx["env"], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lock = ws / ".grpoflow.lock"
    deadline = time.time() + 120
    while not (lock.is_file() and lock.read_text()) and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    t0 = time.time()
    second = subprocess.run(_cli("resume", str(ws)), env=ctx["env"], capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"workspace {ws} is in use by pid {first.pid} on host " in second.stderr
    assert "(grpoflow resume)" in second.stderr and time.time() - t0 < 30
    assert first.wait(timeout=600) == 0, first.stderr.read()[-3000:]
    assert lock.read_text() == ""  # released at the end


@pytest.mark.slow
def test_run_onto_an_existing_run_with_another_config_is_refused(ctx):
    ws, out = ctx["ws"], ctx["out"]
    before = _finished_at(ws)
    run = [*_cli("run", str(MICRO), f"run.output_dir={out}", *RUN), "grpo.learning_rate=0.5"]
    res = subprocess.run(run, env=ctx["env"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "run.name 'r': a run with another config exists at" in res.stderr
    assert "grpo: replaces its finished results of" in res.stderr and "grpo.learning_rate" in res.stderr
    assert "eval: replaces" in res.stderr and "data:" not in res.stderr
    assert f"grpoflow resume {ws} key=value" in res.stderr and "--force" in res.stderr
    assert _finished_at(ws) == before  # nothing touched
