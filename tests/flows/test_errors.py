"""The error contract, through the CLI as a user runs it: an error found inside a stage (bad data, a reward
returning inf) ends with one `grpoflow: <stage>: <cause>` line naming the file line or the function, exit 1,
no traceback on the terminal, the traceback in <workspace>/logs/<stage>.error.log, and the earlier stages
complete."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import MICRO

INF_REWARD = """
def inf_reward(prompts, completions, **columns):
    return [float("inf")] * len(completions)
"""


def _run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PREFECT_HOME=str(tmp_path / "prefect"),
    )
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={tmp_path / 'runs'}"]
    return subprocess.run([*cmd, *overrides], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bad_data_row_fails_the_data_stage_in_one_line(tmp_path):
    rows = [{"question": "What is 1 + 2?", "answer": "3"}] * 5 + [{"question": "", "answer": "4"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = _run(tmp_path, f"data.source={data}", "data.format=qa", "run.name=bad")
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"grpoflow: data: {data} line 6: question is empty"), last
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    log = tmp_path / "runs" / "bad" / "logs" / "data.error.log"
    assert f"`grpoflow resume {tmp_path / 'runs' / 'bad'}`" in last and str(log) in last
    assert "Traceback" in log.read_text() and "ValueError" in log.read_text()


@pytest.mark.slow
def test_a_reward_returning_inf_fails_grpo_naming_it_and_keeps_sft(tmp_path):
    (tmp_path / "bad_reward.py").write_text(INF_REWARD)
    res = _run(tmp_path, "grpo.reward_funcs=[bad_reward:inf_reward]", "run.name=inf", "sft.max_steps=2")
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("grpoflow: grpo: reward 'inf_reward' returned inf for completion 0"), last
    assert "Traceback" not in res.stderr
    ws = tmp_path / "runs" / "inf"
    assert (ws / "sft" / "manifest.json").is_file() and not (ws / "grpo" / "manifest.json").exists()
    assert "RewardError" in (ws / "logs" / "grpo.error.log").read_text()


def test_validate_refuses_a_bad_data_file_or_model_folder_before_any_stage(tmp_path):
    """A data file whose head does not parse, or names no answer column, and a model path that is no model
    folder: exit 2 from `grpoflow validate` with one line naming the key, file and line; no workspace made."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "What is 1 + 2?", "answer": "3"}\n{"question": "What is 2 + 2?" "answer": "4"}\n')
    env = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "prefect"))
    base = [sys.executable, "-m", "grpoflow.flows.cli", "validate", str(MICRO), f"run.output_dir={tmp_path / 'runs'}"]
    cases = {
        f"data.source={data}": f"grpoflow: data.source: data file '{data}' line 2: not a JSON object",
        f"data.eval_source={data.with_name('held_out.csv')}": "grpoflow: data.eval_source: data file not found",
        f"model.name={tmp_path}": f"grpoflow: model.name: {tmp_path}: a folder without config.json",
        # a warm start that is no model folder, or that asks for SFT too (GRPO starts from the folder)
        f"model.warm_start={tmp_path / 'nope'} sft.enabled=false": (
            f"grpoflow: model.warm_start: {tmp_path / 'nope'}: no such model folder"
        ),
        f"model.warm_start={tmp_path} sft.enabled=true": f"  <root>: model.warm_start={tmp_path}: GRPO starts",
        "model.warm_start=s3://models/champion sft.enabled=false": "  model.warm_start: a local model folder",
        # a file the rewards read, keyed by its content: it must be there
        f"grpo.reward_files=[{tmp_path / 'rubric.txt'}]": (
            f"grpoflow: grpo.reward_files: {tmp_path / 'rubric.txt'}: no such file or folder (looked at "
        ),
    }
    for override, want in cases.items():
        res = subprocess.run([*base, *override.split()], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 2, (override, res.stderr[-2000:])
        lines = res.stderr.strip().splitlines()
        assert lines[-1].startswith(want), (override, lines[-1])
        assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ issue 27: the error contract, finished
NONE_REWARD = """
def none_reward(prompts, completions, **columns):
    return [None] * len(completions)
"""
HANGING_REWARD = """
import os, time
from pathlib import Path

CALLS = 0


def stuck_reward(prompts, completions, **columns):
    global CALLS
    CALLS += 1
    if CALLS > 2 and os.environ.get("REWARD_HANGS") == "1":  # the third round: after checkpoint-2
        Path("hung_at").write_text(repr(time.time()))
        time.sleep(3600)
    return [float(len(c[0]["content"]) % 3) for c in completions]
"""
SHORT = ("sft.enabled=false", "eval.enabled=false", "export.enabled=false")  # only data and GRPO run


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PREFECT_HOME=str(tmp_path / "prefect"),
        HF_HOME=str(tmp_path / "hf"),  # an empty cache: nothing of the machine's is found
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra)
    return env


def _cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run(
        [sys.executable, "-m", "grpoflow.flows.cli", *args],
        env=env or _env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line(res: subprocess.CompletedProcess, code: int) -> str:
    assert res.returncode == code, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr[-3000:]
    return res.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_reward_scoring_nothing_warns_and_cut_prompts_are_counted(tmp_path):
    """Cases 1 and 7 in one short run: a reward returning None for every completion is warned about by name
    and counted per round, the summary prints n/a instead of crashing; prompts cut by max_prompt_length are
    counted, warned once and logged."""
    import mlflow

    (tmp_path / "none_rewards.py").write_text(NONE_REWARD)
    run = ["run", str(MICRO), f"run.output_dir={tmp_path / 'runs'}", "run.name=none", *SHORT]
    overrides = ["grpo.reward_funcs=[none_rewards:none_reward]", "grpo.max_steps=1", "grpo.max_prompt_length=12"]
    res = _cli(tmp_path, *run, *overrides)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "reward 'none_reward' scored no completion of this round" in res.stderr
    assert res.stderr.count("grpo.max_prompt_length=12 cuts") == 1
    assert "reward n/a -> n/a" in res.stdout and "Traceback" not in res.stderr
    ws = tmp_path / "runs" / "none"
    summary = json.loads((ws / "grpo" / "manifest.json").read_text())["summary"]
    assert summary["truncated_prompts"] > 0 and summary["longest_prompt_tokens"] > 12
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    grpo_run = client.get_run(summary["mlflow_run_id"])
    assert grpo_run.data.metrics["rewards/none_reward/unscored_rounds"] == 1
    assert grpo_run.data.metrics["prompts/truncated_prompts"] == summary["truncated_prompts"]


@pytest.mark.slow
def test_a_hanging_reward_is_stopped_at_its_timeout_and_resume_continues(tmp_path):
    """Case 2: the third reward call sleeps an hour. The stage fails within the timeout plus a few seconds,
    naming the reward and the bound; checkpoint-2 is intact; `grpoflow resume` continues from it once the
    reward returns again."""
    import time

    (tmp_path / "stuck_rewards.py").write_text(HANGING_REWARD)
    ws = tmp_path / "runs" / "stuck"
    run = ["run", str(MICRO), f"run.output_dir={tmp_path / 'runs'}", "run.name=stuck", *SHORT]
    overrides = ["grpo.reward_funcs=[stuck_rewards:stuck_reward]", "grpo.max_steps=4", "grpo.reward_timeout=3"]
    res = _cli(tmp_path, *run, *overrides, env=_env(tmp_path, REWARD_HANGS="1"))
    ended = time.time()
    last = _one_line(res, 1)
    assert last.startswith("grpoflow: grpo: reward 'stuck_reward' did not return within grpo.reward_timeout_s=3 s")
    assert ended - float((tmp_path / "hung_at").read_text()) < 3 + 15  # the bound, then the exit
    checkpoints = ws / "grpo" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-2"]
    assert (ws / "data" / "manifest.json").is_file() and not (ws / "grpo" / "manifest.json").exists()
    res = _cli(tmp_path, "resume", str(ws))  # the fix: the reward returns again (same import path, same key)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed GRPO from" in res.stderr and "checkpoint-2 (step 2)" in res.stderr
    assert json.loads((ws / "grpo" / "manifest.json").read_text())["summary"]["steps"] == 4


def test_an_unreachable_tracking_server_fails_before_any_stage_in_seconds(tmp_path):
    """Case 3: MLFLOW_TRACKING_URI on a closed port: one line naming the URI, exit 2, no workspace, in seconds
    (the MLflow client alone retries for minutes)."""
    import time

    t0 = time.perf_counter()
    res = _cli(
        tmp_path,
        "run",
        str(MICRO),
        f"run.output_dir={tmp_path / 'runs'}",
        env=_env(tmp_path, MLFLOW_TRACKING_URI="http://127.0.0.1:9"),
    )
    last = _one_line(res, 2)
    assert last.startswith("grpoflow: MLFLOW_TRACKING_URI: MLflow tracking server http://127.0.0.1:9 does not answer")
    assert time.perf_counter() - t0 < 60  # the check itself: under PROBE_TIMEOUT_S; the rest is the CLI's start
    assert not (tmp_path / "runs").exists()


def test_the_tracking_probe_passes_a_real_server(mlflow_server):
    from grpoflow.tasks.tracking.reach import tracking_problem

    assert tracking_problem(mlflow_server) is None
    assert tracking_problem("sqlite:///x.db") is None and tracking_problem("databricks") is None
    assert "does not answer" in tracking_problem("http://127.0.0.1:9", timeout=2)


def test_an_uncached_hub_model_or_dataset_without_network_fails_before_any_stage(tmp_path):
    """Case 4, offline (HF_HUB_OFFLINE=1) and with the hub unreachable (HF_ENDPOINT on a closed port): the key,
    the id, the cache folder looked in and the ways out, exit 2, no workspace."""
    base = ["run", str(MICRO), f"run.output_dir={tmp_path / 'runs'}"]
    cache = tmp_path / "hf" / "hub"
    offline = _env(tmp_path, HF_HUB_OFFLINE="1")
    unreachable = _env(tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        unreachable.pop(var, None)
    for env, why in ((offline, "HF_HUB_OFFLINE is set"), (unreachable, "the hub http://127.0.0.1:9 does not answer")):
        last = _one_line(_cli(tmp_path, *base, "model.name=Qwen/Qwen2.5-0.5B-Instruct", env=env), 2)
        assert last.startswith(
            "grpoflow: model.name: 'Qwen/Qwen2.5-0.5B-Instruct' is a Hugging Face model id not in the local cache "
            f"(looked in {cache}) and {why}"
        ), last
        assert "a local model folder" in last and "HF_HUB_OFFLINE=1" in last
        last = _one_line(_cli(tmp_path, *base, "data.source=openai/gsm8k", "data.subset=main", env=env), 2)
        assert last.startswith("grpoflow: data.source: 'openai/gsm8k' is a Hugging Face dataset id"), last
        assert "--repo-type dataset" in last
    assert not (tmp_path / "runs").exists()


def test_a_row_without_the_question_field_passes_the_pre_stage_check(tmp_path):
    """Case 5 before any stage: a first row without 'question' no longer fails the file (the data stage skips or
    names that row: tests/tasks/stages/test_data.py); a file where no row has it is refused saying so."""
    partial = tmp_path / "partial.jsonl"
    partial.write_text(
        '{"answer": "#### 5"}\n{"question": "q1", "answer": "#### 5"}\n{"question": "q2", "answer": "#### 6"}\n'
    )
    absent = tmp_path / "absent.jsonl"
    absent.write_text('{"answer": "#### 5"}\n' * 3)
    base = ["validate", str(MICRO), f"run.output_dir={tmp_path / 'runs'}", "data.on_invalid_row=skip"]
    res = _cli(tmp_path, *base, f"data.source={partial}")
    assert res.returncode == 0 and "config OK" in res.stdout, res.stderr[-2000:]
    last = _one_line(_cli(tmp_path, *base, f"data.source={absent}"), 2)
    assert last == (
        f"grpoflow: data.source: data file '{absent}': data.question_field 'question': no row has it; its rows have "
        "['answer']"
    )


def test_compare_of_a_missing_folder_and_an_output_dir_under_a_file_fail_in_one_line(tmp_path):
    """Cases 8 and 9, and an unknown run id against a real store."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    missing = tmp_path / "runs" / "nope"
    env = _env(tmp_path, MLFLOW_TRACKING_URI=store)
    last = _one_line(_cli(tmp_path, "compare", str(missing), str(missing), env=env), 2)
    assert last == f"grpoflow: {missing}: no such run workspace folder (looked at {missing})"
    last = _one_line(_cli(tmp_path, "compare", "0" * 32, "1" * 32, env=env), 2)
    assert last.startswith(f"grpoflow: compare: {'0' * 32}: "), last
    down = _env(tmp_path, MLFLOW_TRACKING_URI="http://127.0.0.1:9")  # no minutes of the client's retries
    last = _one_line(_cli(tmp_path, "compare", "0" * 32, "1" * 32, env=down, timeout=60), 2)
    assert last.startswith("grpoflow: MLflow tracking server http://127.0.0.1:9 does not answer"), last
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    last = _one_line(_cli(tmp_path, "run", str(MICRO), f"run.output_dir={blocker / 'runs'}"), 2)
    want = f"grpoflow: run.output_dir: {blocker / 'runs'} lies under {blocker}, which is a file; a run workspace"
    assert last == want + " needs a folder there"


def test_a_read_only_output_dir_is_refused_at_load_naming_it(tmp_path):
    """A folder the process cannot write (here: owned by root, mode 555, the CLI run as nobody when the tests run as
    root, whom permission bits do not stop): exit 2 before any work, naming the folder, not a PermissionError
    traceback from the first stage."""
    import stat
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="grpoflow-ro-"))  # outside pytest's 0700 root, for nobody to reach
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        out = locked / "runs"
        cmd = [sys.executable, "-m", "grpoflow.flows.cli", "validate", str(MICRO), f"run.output_dir={out}"]
        if os.geteuid() == 0:
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        env = _env(tmp_path, HOME=str(base), PYTHONDONTWRITEBYTECODE="1")
        res = subprocess.run(cmd, env=env, cwd=base, capture_output=True, text=True, timeout=300)
        last = _one_line(res, 2)
        assert last.startswith(f"grpoflow: run.output_dir: {out} is not writable (it would be made inside {locked})")
        assert "Permission denied" in last, last
        assert not out.exists()
    finally:
        locked.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_run_into_a_folder_of_other_files_is_refused_and_deletes_nothing(tmp_path):
    """run.output_dir/run.name naming an existing folder that is no grpoflow run (a project with data/ and eval/
    folders): refused before any stage, naming the folder and a file in it; a stage would empty its data/."""
    proj = tmp_path / "runs" / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "notes.txt").write_text("mine")
    (proj / "README.md").write_text("my project")
    env = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "prefect"))
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={tmp_path / 'runs'}"]
    proc = subprocess.Popen(
        [*cmd, "run.name=proj"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 300
        while proc.poll() is None and (proj / "data" / "notes.txt").exists() and time.time() < deadline:
            time.sleep(0.5)
        assert (proj / "data" / "notes.txt").read_text() == "mine"
        assert proc.wait(timeout=60) == 2
        err = proc.stderr.read()
        assert f"{proj} holds files of no grpoflow run" in err and "README.md" in err, err[-2000:]
        assert not (proj / "config.yaml").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


FOREIGN_CONFIG = b"model: resnet50\nepochs: 3\n"


def _foreign_folder(path: Path) -> dict[str, bytes]:
    """A folder of another tool that happens to hold a config.yaml of its own (not grpoflow's), and a data/ folder."""
    files = {"config.yaml": FOREIGN_CONFIG, "data/notes.txt": b"mine", "eval/scores.csv": b"a,b\n1,2\n"}
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return files


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("force", [False, True])
def test_run_into_a_folder_with_another_tools_config_yaml_is_refused_and_deletes_nothing(tmp_path, force):
    """A folder whose config.yaml is not one grpoflow wrote (`model: resnet50`) and that holds no stage record is
    no run: `grpoflow run` refuses it (with or without --force) before the lock, naming the file; every file is
    left byte for byte and nothing is added (no lock file, no config.yaml rewritten)."""
    proj = tmp_path / "runs" / "proj"
    files = _foreign_folder(proj)
    env = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "prefect"))
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={tmp_path / 'runs'}"]
    cmd += ["run.name=proj", *(["--force"] if force else [])]
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert f"{proj / 'config.yaml'} is no config grpoflow wrote" in last and "epochs" in last, last
    assert "Traceback" not in res.stderr
    assert _files(proj) == files


def test_the_local_copy_of_an_s3_run_is_refused_as_a_run_folder_of_its_own(tmp_path):
    """<storage.cache_dir>/<bucket>/<key> holds an S3 run's local copy: `grpoflow resume` of that folder, or a
    `grpoflow run` whose output_dir is in it, would run a local pipeline beside the S3 run's own (whose next pull
    deletes what it made). Both are refused naming the S3 URI to use; nothing in the folder changes."""
    from grpoflow.tasks.storage.mirror import claim_mirror

    cache = tmp_path / "cache"
    claim_mirror("s3://bkt/runs/r1", cache, "http://127.0.0.1:8333")
    copy = cache / "bkt" / "runs" / "r1"
    copy.mkdir(parents=True)
    shutil.copy(MICRO, copy / "config.yaml")
    before = _files(copy)
    env = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "prefect"))
    resume = [sys.executable, "-m", "grpoflow.flows.cli", "resume", str(copy)]
    run = [
        sys.executable,
        "-m",
        "grpoflow.flows.cli",
        "run",
        str(MICRO),
        f"run.output_dir={copy.parent}",
        "run.name=r1",
    ]
    for cmd in (resume, run):
        res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert res.returncode == 2, res.stderr[-3000:]
        last = res.stderr.strip().splitlines()[-1]
        assert "is the local copy of the S3 workspace s3://bkt/runs/r1" in last, last
        assert "grpoflow resume s3://bkt/runs/r1" in last and "Traceback" not in res.stderr
    assert _files(copy) == before
