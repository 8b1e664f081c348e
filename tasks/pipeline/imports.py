"""The local source files a custom reward module runs: its own file and the helpers of its project it imports.

A reward module's stage key (tasks/pipeline/fingerprint.py) holds the digest of each file found here, so editing
a helper the module imports reruns grpo and eval, as editing the module itself does:

    imported_sources(module) = closure over "imports" from the module (and its parent packages' __init__.py),
                               kept to the module's own tree, less the module's own file
    imports(file)   = every module an import statement of the file names, at any depth (inside functions too):
                      ``import a.b`` -> a, a.b; ``from a.b import c`` -> a, a.b, a.b.c (c may be a submodule);
                      ``from .x import y`` -> resolved against the file's own package
    own tree        = the sys.path entry the module was found under (the folder of a top-level module, the
                      folder above its top-level package), less installed code: the standard library, any
                      site-packages or dist-packages folder (a virtualenv inside the project) and grpoflow
                      itself. A reward module that is itself installed (found in site-packages) is keyed by
                      its own file only: its package's version names the rest, and following an installed
                      package's imports could read thousands of files.

Nothing is imported or run: imports are read from the source (``ast``) and located as Python would find them on
sys.path (importlib's path finder; built-in and frozen modules are not files). An import that cannot be found is
skipped: running the reward reports it. Not seen: modules imported by a name computed at run time
(``importlib.import_module(name)``, ``__import__``) and data files the module reads.
"""

from __future__ import annotations

import ast
import importlib.machinery
import logging
import os
import site
import sys
import sysconfig
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

MAX_FILES = 2000  # a tree this large is not a reward module's helpers: keyed as far as here, with a warning


@cache
def _installed_roots() -> tuple[Path, ...]:
    """Folders of installed code: the standard library, site-packages (system, user, virtualenv), grpoflow."""
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= set(getattr(site, "getsitepackages", list)()) | {getattr(site, "getusersitepackages", str)()}
    paths.add(str(Path(__file__).resolve().parents[2]))  # grpoflow's own package: its version is not keyed
    return tuple(Path(p).resolve() for p in paths if p)


def _is_installed(path: Path) -> bool:
    path = path.resolve()
    return bool({"site-packages", "dist-packages"} & set(path.parts)) or any(
        path.is_relative_to(root) for root in _installed_roots()
    )


def _find(name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec Python's path-based import would find for ``name``, without importing anything (its parent
    packages included); None for a built-in or frozen module, or one that cannot be found."""
    parts = name.split(".")
    if parts[0] in sys.builtin_module_names or importlib.machinery.FrozenImporter.find_spec(parts[0]):
        return None
    try:
        spec = importlib.machinery.PathFinder.find_spec(parts[0])
        for i in range(1, len(parts)):
            if spec is None or spec.submodule_search_locations is None:
                return None
            where = list(spec.submodule_search_locations)
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), where)
    except Exception:  # noqa: BLE001 (a namespace package whose parent is not imported, a broken path hook): not found
        return None
    return spec


def _imported(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """The module names the import statements of ``tree`` (module ``name``) name, with their parent packages."""
    out: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                if node.level - 1 >= len(base):
                    continue  # beyond the top-level package: Python refuses it too
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod:
                continue
            targets = [mod] + [f"{mod}.{alias.name}" for alias in node.names if alias.name != "*"]
        for target in targets:
            parts = target.split(".")
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def imported_sources(module: str, origin: Path) -> dict[str, Path]:
    """{path relative to the module's root (posix): file} of every local source file the module (found at
    ``origin``) imports (the module docstring's closure), its own file left out; {} for an installed module."""
    parts = module.split(".")
    is_package = origin.name == "__init__.py"
    origin = Path(os.path.abspath(origin))
    root = origin.parents[len(parts) if is_package else len(parts) - 1]
    if _is_installed(root):
        return {}  # installed code: its version names it

    found: set[Path] = set()
    queue: list[tuple[str, Path, bool]] = [(module, origin, is_package)]
    for i in range(1, len(parts)):  # importing a.b.c runs a/__init__.py and a/b/__init__.py first
        init = root.joinpath(*parts[:i], "__init__.py")
        if init.is_file():
            queue.append((".".join(parts[:i]), init, True))
    seen_names: set[str] = {module}
    while queue:
        name, path, pkg = queue.pop()
        if path in found:
            continue
        if len(found) >= MAX_FILES:
            log.warning("reward module %s: over %d local source files; the rest are not in its key", module, MAX_FILES)
            break
        found.add(path)
        try:
            tree = ast.parse(path.read_bytes(), str(path))
        except (SyntaxError, ValueError, OSError):
            continue  # keyed by its bytes; importing it reports the error
        for target in sorted(_imported(tree, name, pkg) - seen_names):
            seen_names.add(target)
            spec = _find(target)
            located = spec is not None and spec.origin and spec.has_location
            file = Path(os.path.abspath(spec.origin)) if located else None
            if file is None or not file.is_file() or not file.is_relative_to(root) or _is_installed(file):
                continue  # not found, not a file, outside the tree, or installed (a virtualenv inside the project)
            queue.append((target, file, spec.submodule_search_locations is not None))
    found.discard(origin)
    return dict(sorted((p.relative_to(root).as_posix(), p) for p in found))
