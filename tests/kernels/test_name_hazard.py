"""Our kernels live at ``grpoflow.kernels``: the project installs nothing named ``kernels`` (Hugging Face's library,
which transformers probes for), ``tasks`` or ``flows`` at the top of site-packages."""

import os
import subprocess
import sys
from pathlib import Path

PROBE = """
import importlib.util, json
found = {}
for name in ("kernels", "tasks", "flows", "grpoflow.kernels", "grpoflow.tasks", "grpoflow.flows"):
    spec = importlib.util.find_spec(name)
    found[name] = None if spec is None else str(spec.origin or list(spec.submodule_search_locations or []))
from transformers.utils import import_utils
found["hf_kernels_available"] = import_utils.is_kernels_available()
print(json.dumps(found))
"""


def test_only_grpoflow_is_importable_from_another_folder(tmp_path):
    import json

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    for ours in ("grpoflow.kernels", "grpoflow.tasks", "grpoflow.flows"):
        assert found[ours] is not None, ours
    for name in ("tasks", "flows"):
        assert found[name] is None, f"a top-level {name!r} is importable: {found[name]}"
    # Hugging Face's `kernels` may be installed; ours never answers to that name
    repo = str(Path(__file__).resolve().parents[2])
    assert found["kernels"] is None or not found["kernels"].startswith(repo), found["kernels"]
    if found["kernels"] is None:
        assert found["hf_kernels_available"] is False


def test_grpoflow_kernels_exports_no_hf_kernels_names():
    import grpoflow.kernels as ours

    for name in ("get_kernel", "use_kernel_forward_from_hub", "LayerRepository", "kernelize"):
        assert not hasattr(ours, name)
