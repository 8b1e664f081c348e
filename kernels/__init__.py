"""grpoflow.kernels: the Triton kernels (fused log-probabilities, the GRPO loss).

This folder installs as ``grpoflow.kernels``. When a process's working directory is the grpoflow checkout
(``python -m ...`` from the repo root, or a Prefect worker whose pull step cds there), the folder is also
reachable as the top-level name ``kernels``, which is Hugging Face's kernel-hub package that transformers and
bitsandbytes probe. Imported under that name, this module steps aside: it loads the real ``kernels`` from the
rest of sys.path when one is installed. Otherwise it stays an empty module without a version, which those probes
read as "no usable kernels package" (transformers imports an unversioned package to ask for its __version__, so
raising ImportError here would break `import transformers` itself); ``from kernels import get_kernel`` fails.
"""

from __future__ import annotations

if __name__ == "kernels":
    import importlib.util
    import sys
    from importlib.machinery import PathFinder
    from pathlib import Path

    _here = Path(__file__).resolve().parent.parent
    _rest = [p for p in sys.path if Path(p or ".").resolve() != _here]
    _spec = PathFinder.find_spec("kernels", _rest)
    if _spec is not None and _spec.loader is not None:
        _real = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _real  # the import statement returns what sys.modules holds once this body ends
        _spec.loader.exec_module(_real)
