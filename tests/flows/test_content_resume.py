"""`grpoflow resume` sees content, not only the config: a run on a local .jsonl file whose file is then edited
reruns data and every later stage; an edited custom reward module, or a file of the user's it imports, reruns grpo
and eval, not data or sft. Before
the flow starts, resume prints why each stage reruns (tasks/pipeline/resume.py explain)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpoflow.tasks.dataio.splits import load_split
from tests.hub_cache import write_hub_cache
from tests.paths import MICRO

REWARD = (  # reads a helper module (keyed as its import) and a rubric file (keyed as grpo.reward_files)
    "import pathlib\n\nimport content_values\n\nRUBRIC = pathlib.Path(__file__).with_name('rubric.txt')\n\n"
    "def constant(prompts, completions, **columns):\n"
    "    bonus = 0.1 * len(RUBRIC.read_text().split())\n"
    "    return [content_values.VALUE + bonus for _ in completions]\n"
)
RUN = [
    "run.name=c",
    "data.eval_size=6",
    "sft.max_steps=2",
    "grpo.max_steps=1",
    "grpo.save_steps=1",
    "grpo.reward_funcs=[content_rewards:constant,correctness]",
    "eval.max_samples=2",
    "export.enabled=false",
]
STAGES = ("data", "sft", "grpo", "eval")


def _rows(n: int, offset: int = 0) -> str:
    return "".join(
        json.dumps({"question": f"What is {a} + {a + offset}?", "answer": str(2 * a + offset)}) + "\n" for a in range(n)
    )


def _finished_at(ws: Path) -> dict[str, float]:
    return {s: json.loads((ws / s / "manifest.json").read_text())["finished_at"] for s in STAGES}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("content_resume")
    (tmp / "content_rewards.py").write_text(REWARD)
    (tmp / "content_values.py").write_text("VALUE = 1.0\n")
    (tmp / "rubric.txt").write_text("exact\n")
    data = tmp / "train.jsonl"
    data.write_text(_rows(30))
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PREFECT_HOME=str(tmp / "prefect"),
    )
    out = tmp / "runs"
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={out}", *RUN]
    rubric = f"grpo.reward_files=[{tmp / 'rubric.txt'}]"
    res = subprocess.run([*cmd, f"data.source={data}", rubric], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"tmp": tmp, "data": data, "ws": out / "c", "env": env}


def _resume(ctx) -> str:
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "resume", str(ctx["ws"])]
    res = subprocess.run(cmd, env=ctx["env"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow
def test_an_edited_data_file_reruns_data_and_everything_after(ctx):
    before = _finished_at(ctx["ws"])
    ctx["data"].write_text(_rows(30, offset=1))  # other answers, the same file name
    out = _resume(ctx)
    after = _finished_at(ctx["ws"])
    assert [s for s in STAGES if after[s] != before[s]] == list(STAGES)
    assert "resume: data reruns: file: data.source train.jsonl changed (" in out
    assert "resume: sft reruns: upstream data reruns" in out
    assert "resume: grpo reruns: upstream sft reruns" in out


@pytest.mark.slow
def test_an_edited_file_the_reward_module_imports_reruns_grpo_not_data(ctx):
    before = _finished_at(ctx["ws"])
    (ctx["tmp"] / "content_values.py").write_text("VALUE = 0.5\n")  # the module itself is unchanged
    (ctx["tmp"] / "rubric.txt").write_text("exact and brief\n")  # a file it reads, named in grpo.reward_files
    out = _resume(ctx)
    after = _finished_at(ctx["ws"])
    assert [s for s in STAGES if after[s] != before[s]] == ["grpo", "eval"]
    assert "resume: grpo reruns: code: content_rewards (reward module, content_values.py) changed" in out
    assert f"resume: grpo reruns: file: grpo.reward_files {ctx['tmp'] / 'rubric.txt'} changed (size 6 -> 16" in out
    assert "resume: data reruns" not in out and "resume: sft reruns" not in out
    assert "resume: every stage is complete with its current key; nothing reruns" in _resume(ctx)


@pytest.mark.slow
def test_a_warm_started_run_resumes_from_its_folder_and_reruns_grpo_when_the_folder_changes(ctx):
    """model.warm_start (the continuous flow's champion, or a model a user exported): GRPO starts from it, the
    run's config.yaml says so, `grpoflow resume` starts from it again, and an edited folder reruns GRPO (not
    data). Before the config held it, the folder was a flow parameter only: a resume trained from model.name."""
    champion = ctx["tmp"] / "champion"
    shutil.copytree(ctx["ws"] / "base_model", champion)  # a full model folder with its tokenizer
    out = ctx["ws"].parent
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={out}", "run.name=w"]
    start = [f"data.source={ctx['data']}", f"model.warm_start={champion}", "sft.enabled=false", "grpo.max_steps=1"]
    res = subprocess.run([*cmd, *start, "eval.enabled=false", "export.enabled=false"], env=ctx["env"],
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    ws = out / "w"
    assert yaml.safe_load((ws / "config.yaml").read_text())["model"]["warm_start"] == str(champion)
    first = json.loads((ws / "grpo" / "manifest.json").read_text())
    assert first["summary"]["base_model"] == str(champion)
    assert "config.json" in first["fingerprint"]["content"]["model.warm_start"]
    data_done = json.loads((ws / "data" / "manifest.json").read_text())["finished_at"]

    (champion / "NOTES.md").write_text("another champion\n")
    said = _resume({**ctx, "ws": ws})
    assert "resume: grpo reruns: file: model.warm_start NOTES.md added" in said
    assert "resume: data reruns" not in said
    again = json.loads((ws / "grpo" / "manifest.json").read_text())
    assert again["finished_at"] != first["finished_at"] and again["summary"]["base_model"] == str(champion)
    assert json.loads((ws / "data" / "manifest.json").read_text())["finished_at"] == data_done


@pytest.mark.slow
def test_a_hub_model_is_pinned_to_its_commit_so_a_push_changes_nothing_of_the_run(ctx, tmp_path):
    """model.name a hub id (a hub cache written here, the hub offline): `grpoflow run` pins the default branch to
    the commit it names and config.yaml records it. After a push moves main (to files that do not even load), the
    run's own stages still load the pinned commit: `resume --from-stage grpo` retrains on it, and a `grpoflow run`
    of the same run.name, which asks for main again, is refused naming the revision change."""
    repo, cache = "grpoflow-test/micro-base", tmp_path / "hf" / "hub"
    commit = write_hub_cache(cache, repo, ctx["ws"] / "base_model")
    # the rows too: a hub dataset, read offline from the hub cache's snapshot at the commit the run pins
    dataset = "grpoflow-test/micro-rows"
    (tmp_path / "rows" / "data").mkdir(parents=True)
    shutil.copy(ctx["data"], tmp_path / "rows" / "data" / "train.jsonl")
    rows = write_hub_cache(cache, dataset, tmp_path / "rows", repo_type="dataset")
    env = {**ctx["env"], "HF_HOME": str(cache.parent), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = ctx["ws"].parent
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "run", str(MICRO), f"run.output_dir={out}", "run.name=hub",
           f"data.source={dataset}", f"model.name={repo}", "sft.enabled=false", "grpo.max_steps=1",
           "eval.enabled=false", "export.enabled=false"]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"grpoflow: model.revision: {repo} pinned to commit {commit} (its default branch now)" in res.stdout
    assert f"grpoflow: data.revision: {dataset} pinned to commit {rows} (its default branch now)" in res.stdout
    ws = out / "hub"
    recorded = yaml.safe_load((ws / "config.yaml").read_text())
    assert recorded["model"]["revision"] == commit and recorded["data"]["revision"] == rows
    first = json.loads((ws / "grpo" / "manifest.json").read_text())["finished_at"]

    (tmp_path / "pushed").mkdir()
    (tmp_path / "pushed" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    pushed = write_hub_cache(cache, repo, tmp_path / "pushed")
    (tmp_path / "rows2" / "data").mkdir(parents=True)
    (tmp_path / "rows2" / "data" / "train.jsonl").write_text('{"question": "pushed", "answer": "1"}\n')
    write_hub_cache(cache, dataset, tmp_path / "rows2", repo_type="dataset")
    again = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert again.returncode == 2, again.stderr[-3000:]
    assert f'config: model.revision "{commit}" -> "{pushed}"' in again.stderr
    res = subprocess.run([*cmd[:3], "resume", str(ws), "--from-stage", "grpo"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "pinned" not in res.stdout  # the recorded commit, as it is
    assert json.loads((ws / "grpo" / "manifest.json").read_text())["finished_at"] != first
    # the data stage rerun reads the pinned commit's rows, not the pushed ones
    res = subprocess.run([*cmd[:3], "resume", str(ws), "--from-stage", "data"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    questions = [r["question"] for r in load_split(ws / "data", "train")] + [
        r["question"] for r in load_split(ws / "data", "eval")
    ]
    assert len(questions) == 30 and "pushed" not in questions
