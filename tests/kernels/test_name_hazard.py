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


REPO = Path(__file__).resolve().parents[2]

FROM_THE_CHECKOUT = """
import importlib, importlib.util, json
found = {"kernels_origin": importlib.util.find_spec("kernels").origin}
import transformers
from transformers import PreTrainedModel  # modeling_utils, which reads is_kernels_available
from transformers.utils.import_utils import is_kernels_available
found["hf_kernels_available"] = is_kernels_available()
import bitsandbytes
hub = importlib.import_module("kernels")  # what `import kernels` gives from here
found["kernels_names"] = sorted(n for n in vars(hub) if not n.startswith("__"))
found["kernels_version"] = getattr(hub, "__version__", None)
import torch
import grpoflow.kernels as ours
from grpoflow.kernels.logprobs import token_logprobs
h, w = torch.randn(3, 8), torch.randn(11, 8)
logp, _ = token_logprobs(h, w, torch.tensor([1, 5, 10]))
found["ours"] = [ours.__name__, ours.__file__, tuple(logp.shape)]
print(json.dumps(found))
"""


def _probe(code: str, env: dict, *args: str):
    """Run ``code`` in a fresh interpreter with the repo root as working directory; its last line as JSON."""
    import json

    out = subprocess.run([sys.executable, *args, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_from_the_checkout_root_the_folder_reads_as_no_hf_kernels():
    """With the repo root as working directory (a worker's `python -m` there) `kernels` is this folder; transformers
    and bitsandbytes import, read it as no kernels package, and grpoflow.kernels works under its own name."""
    found = _probe(FROM_THE_CHECKOUT, dict(os.environ))
    assert found["kernels_origin"] == str(REPO / "kernels" / "__init__.py")  # the hazard is real from there
    assert found["hf_kernels_available"] is False
    assert found["kernels_names"] == [] and found["kernels_version"] is None  # no get_kernel, no kernelize...
    name, file, shape = found["ours"]
    assert name == "grpoflow.kernels" and Path(file).resolve() == REPO / "kernels" / "__init__.py" and shape == [3]


def test_with_hf_kernels_installed_safe_path_finds_it_from_the_checkout_root(tmp_path):
    """Hugging Face's `kernels` installed (a package with its dist-info) and the repo root as working directory:
    plain `python -c` finds this folder first (nothing steps aside at import); `python -P` (PYTHONSAFEPATH, what
    the kernels docstring advises) finds the installed one, which transformers then reports available."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("__version__ = '0.17.1'\ndef get_kernel(name):\n    return name\n")
    dist = site / "kernels-0.17.1.dist-info"  # what pip leaves: transformers reads the version from it
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.17.1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    probe = (
        "import json, kernels\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "import grpoflow.kernels as ours\n"
        "print(json.dumps([kernels.__file__, is_kernels_available(), ours.__name__]))\n"
    )
    shadowed, _, _ = _probe(probe, env)
    assert shadowed == str(REPO / "kernels" / "__init__.py")
    hub, available, ours = _probe(probe, env, "-P")
    assert hub == str(site / "kernels" / "__init__.py") and available is True and ours == "grpoflow.kernels"
