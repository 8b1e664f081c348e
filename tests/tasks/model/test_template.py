"""Model folders the pipeline cannot use, refused before any stage: a folder without tokenizer files, and a chat
template that refuses a system turn (Gemma's raises "System role not supported") while data.system_prompt is set.
Real folders: a tiny model and its tokenizer saved as the pipeline saves them, the template edited in
tokenizer_config.json; the CLI's `validate` run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpoflow.tasks.config import TinyModelConfig, load_config
from grpoflow.tasks.model.sources import model_problem
from grpoflow.tasks.model.template import chat_template_problem
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer
from tests.paths import MICRO

# Gemma's way of refusing a system turn (its template raises before rendering anything)
NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-model")
    tok = train_tiny_tokenizer(["What is 1 + 2?", "<reasoning> 1 + 2 = 3 </reasoning> <answer> 3 </answer>"], 300)
    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    build_tiny_model(cfg, tok, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _copy(src: Path, dst: Path, drop: tuple[str, ...] = (), template: str | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in drop:
            (dst / f.name).write_bytes(f.read_bytes())
    if template is not None:
        tc = json.loads((dst / "tokenizer_config.json").read_text())
        tc["chat_template"] = template
        (dst / "tokenizer_config.json").write_text(json.dumps(tc))
        (dst / "chat_template.jinja").unlink(missing_ok=True)  # newer transformers save the template there
    return dst


def _validate(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "grpoflow.flows.cli", "validate", str(MICRO), *overrides]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_a_folder_without_tokenizer_files_is_refused_naming_them(model_dir, tmp_path):
    assert model_problem(str(model_dir)) is None
    bare = _copy(model_dir, tmp_path / "bare", drop=("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model"))
    problem = model_problem(str(bare))
    assert problem.startswith(f"{bare}: no tokenizer files (none of tokenizer.json") and "merges.txt" in problem
    res = _validate(tmp_path, f"model.name={bare}")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"grpoflow: model.name: {bare}: no tokenizer files" in res.stderr


def test_a_template_refusing_the_system_role_fails_at_load_naming_the_key(model_dir, tmp_path):
    gemma_like = _copy(model_dir, tmp_path / "gemma-like", template=NO_SYSTEM)
    cfg = load_config(str(MICRO), [f"model.name={gemma_like}"])
    assert cfg.data.system_prompt  # the micro config sets one: the case that fails
    problem = chat_template_problem(str(gemma_like), cfg.model, cfg.data.system_prompt)
    assert problem.startswith(f"model.name: {gemma_like}: its chat template refuses a system turn")
    assert "System role not supported" in problem and "data.system_prompt=null" in problem
    assert chat_template_problem(str(gemma_like), cfg.model, None) is None  # without one it renders
    assert chat_template_problem(str(model_dir), cfg.model, cfg.data.system_prompt) is None
    res = _validate(tmp_path, f"model.name={gemma_like}")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith(f"grpoflow: model.name: {gemma_like}: its chat template")
    assert _validate(tmp_path, f"model.name={gemma_like}", "data.system_prompt=null").returncode == 0
