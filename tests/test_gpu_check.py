"""benchmarks/gpu_check.py in its CPU mode, as the GPU machine would run it: from the bare tree (grpoflow not
installed: its import finder removed), with none of the packages that machine lacks (vLLM, Prefect, MLflow,
datasets, bitsandbytes, boto3: importing them fails), the Triton kernel under the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PRELUDE = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
for name in ("vllm", "prefect", "mlflow", "datasets", "bitsandbytes", "boto3"):
    sys.modules[name] = None
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_check_cpu_mode_from_the_bare_tree(tmp_path):
    out = tmp_path / "check.json"
    script = REPO / "benchmarks" / "gpu_check.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", PRELUDE, str(script), "--device", "cpu", "--small", "--out", str(out)]
    res = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    k = report["kernel"]
    for case in ("naive", "triton", "chunked"):
        assert k[case]["logp_max_err"] < 1e-5 and k[case]["dh_rel_err"] < 1e-5, (case, k[case])
        assert k[case]["seconds"] > 0
    assert "skipped" in k["trl_chunked"] or k["trl_chunked"]["logp_max_err"] < 1e-5  # TRL needs datasets
    assert "skipped" in k["liger"] or k["liger"]["seconds"] > 0
    for case, steps in (("tiny", 2), ("qwen", 1)):
        g = report["grpo"][case]
        assert g["steps"] == steps and g["all_on_device"] and g["tokens_per_second"] > 0, (case, g)
    assert "grpo on cpu" in res.stdout and "wrote" in res.stdout
