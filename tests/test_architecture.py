"""The layout keeps its shape: the import contracts of pyproject.toml ([tool.importlinter]) hold, and the installed
wheel holds one namespace, grpoflow, with the configs inside it."""

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout
    for contract in (
        "Layers",
        "Kernels import nothing",
        "Only storage talks to S3",
        "Stages do not import each other",
        "Configuration imports no other",
        "No import cycles",
    ):
        assert contract in out.stdout, contract


def test_no_module_imports_the_old_top_level_names():
    """`from tasks...` would work in the repository (the working directory is on sys.path) and fail installed."""
    bad = []
    for folder in ("flows", "tasks", "kernels", "tests", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                s = line.strip()
                if s.startswith(
                    ("from tasks", "from flows", "from kernels", "import tasks", "import flows", "import kernels")
                ):
                    bad.append(f"{path.relative_to(REPO)}:{i}: {s}")
    assert not bad, bad


def test_task_tests_mirror_the_source_tree():
    """tests/tasks/<sub>/test_*.py sits in a folder that is a package tasks/<sub>/ (the tests mirror the source);
    directly in tests/tasks/ are only the tests of top-level modules."""
    tests = REPO / "tests" / "tasks"
    top_modules = {p.stem for p in (REPO / "tasks").glob("*.py")} - {"__init__"}
    files = sorted(tests.rglob("test_*.py"))
    bad = []
    for path in files:
        rel = path.relative_to(tests)
        if len(rel.parts) == 1:
            if not any(path.stem == f"test_{m}" or path.stem.startswith(f"test_{m}_") for m in top_modules):
                bad.append(f"tests/tasks/{rel}: directly in tests/tasks/ but tests no top-level tasks/ module")
        elif not (REPO / "tasks" / rel.parent / "__init__.py").is_file():
            bad.append(f"tests/tasks/{rel}: tasks/{rel.parent}/ is no package of the source tree")
    assert not bad, bad
    assert sum(len(p.relative_to(tests).parts) > 1 for p in files) > len(files) // 2  # mostly in subfolders


def test_stage_functions_read_like_recipes():
    """No function in tasks/stages is longer than 60 lines: each stage body is a short recipe (setup, train, save)
    over steps that each do one thing."""
    long = []
    for path in sorted((REPO / "tasks" / "stages").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1
                if lines > 60:
                    long.append(f"tasks/stages/{path.name}:{node.lineno} {node.name}: {lines} lines")
    assert not long, long


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's files (an in-tree build would leave build/ behind, whose stale
    modules a later build would pack)."""
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("grpoflow-*.whl")
    return whl


def test_wheel_installs_one_namespace_with_its_configs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == {"grpoflow"}, top
    for must in (
        "grpoflow/configs/default.yaml",
        "grpoflow/configs/gsm8k-qwen2.5-0.5b.yaml",
        "grpoflow/flows/cli.py",
        "grpoflow/tasks/stages/grpo.py",
        "grpoflow/kernels/triton_logprobs.py",
    ):
        assert must in names, must


def test_installed_wheel_validates_from_another_folder(wheel, tmp_path):
    """The wheel unpacked into a folder of its own (its dependencies from this environment) runs `grpoflow validate`
    from a folder with no configs/ in it; `import kernels` finds nothing of ours there."""
    target = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = "import grpoflow.flows.cli as c, importlib.util as u; print(c.__file__); print(u.find_spec('kernels'))"
    res = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cli_file, kernels_spec = res.stdout.split("\n")[:2]
    assert cli_file.startswith(str(target)), cli_file  # the installed copy, not the checkout
    assert kernels_spec == "None" or str(REPO) not in kernels_spec
    for args in (
        ["validate"],
        ["validate", "configs/gsm8k-qwen2.5-0.5b.yaml"],
        ["validate", "default", "grpo.beta=0.1"],
    ):
        res = subprocess.run(
            [sys.executable, "-m", "grpoflow.flows.cli", *args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0 and "config OK" in res.stdout, (args, res.stderr)
    res = subprocess.run(
        [sys.executable, "-m", "grpoflow.flows.cli", "validate", "nope.yaml"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "config file not found: nope.yaml" in res.stderr
    assert "default.yaml" in res.stderr  # the message lists the packaged configs


def test_the_workspace_does_not_know_where_its_files_are():
    """tasks/storage/workspace.py is written once against the Store interface (tasks/storage/store.py): no S3 URI
    test, no S3 client, no branch on a URI attribute; the store keeps the local-versus-S3 difference to itself."""
    text = (REPO / "tasks" / "storage" / "workspace.py").read_text()
    found = [word for word in ("is_s3_uri", ".uri", "S3Client", "s3.") if word in text]
    assert not found, f"tasks/storage/workspace.py names {found}"


STAGE_NAMES = {"data", "sft", "grpo", "eval", "export", "base_model"}
# the same words in another sense: a dataset split, TRL's config section, a loss_type
NOT_STAGES = {
    ("tasks/tracking/dataset_inputs.py", "eval"),  # the eval split's MLflow dataset context
    ("tasks/dataio/sources.py", "eval"),  # the prepared eval split's origin (split_origins)
    ("tasks/tracking/run_meta.py", "grpo"),  # TRL's keys map onto the config's grpo section
    ("tasks/grpo/loss.py", "grpo"),  # grpo.loss_type "grpo"
    ("tasks/pipeline/revision.py", "data"),  # the config's data section, whose hub dataset revision is pinned
}


def _stage_words(node: ast.AST) -> set[str]:
    values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {v.value for v in values if isinstance(v, ast.Constant) and v.value in STAGE_NAMES}


def test_no_stage_name_is_compared_or_tabled_below_the_stages():
    """Stages are declared once (tasks/pipeline/spec.py, a StageSpec beside each stage): no layer below
    tasks/stages compares a value with a stage's name or keys a table by one."""
    bad = []
    for path in sorted((REPO / "tasks").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("tasks/stages/", "tasks/ops/", "tasks/config/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                words = set().union(*(_stage_words(n) for n in (node.left, *node.comparators)))
            elif isinstance(node, ast.Dict):
                words = set().union(*(_stage_words(k) for k in node.keys if k is not None))
            else:
                continue
            bad += [f"{rel}:{node.lineno}: {w!r}" for w in words if (rel, w) not in NOT_STAGES]
    assert not bad, bad
