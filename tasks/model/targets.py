"""LoRA target modules checked against the model's weight names before any stage, so that names peft would refuse
in the GRPO stage are named at validate. Read without importing torch or transformers (a `grpoflow run` starts its
servers while those import): the safetensors headers of a local folder or of a hub model in the cache, or, for
model.tiny, the modules of its architecture (:data:`TINY_LINEAR`)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

# the linear layers of model.tiny's architectures (transformers' Llama and Qwen2 decoders; tests/tasks/model/
# test_tiny.py checks them against a built model)
TINY_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def lora_target_problem(cfg) -> str | None:
    """Why model.lora.target_modules (a list of names) would match no module of the model: peft refused it in the
    GRPO stage, after SFT, without naming the key. None when every name matches, for 'all-linear' or a regex
    string, and when the weights' names are unknown here (a GGUF file, an alias, a hub model not in the cache)."""
    lora = cfg.model.lora
    if not lora.enabled or isinstance(lora.target_modules, str):  # SFT's LoRA too needs model.lora.enabled
        return None
    found = _linear_modules(cfg.model)
    if found is None:
        return None
    modules, where = found
    missing = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in modules)]
    if not missing:
        return None
    linear = sorted({n.rsplit(".", 1)[-1] for n in modules})
    return (
        f"model.lora.target_modules: {', '.join(map(repr, missing))} match no module of {where}; its linear layers "
        f"are {', '.join(linear)} (or set 'all-linear')"
    )


def _linear_modules(m) -> tuple[set[str], str] | None:
    """(the names of the modules holding a 2-D weight, where they were read) of ``m`` (a ModelConfig), or None."""
    if m.name == "tiny":
        return set(TINY_LINEAR), "model.tiny"
    folder = Path(m.name).expanduser()
    files = _safetensors_files(folder) if folder.is_dir() else _cached_safetensors(m.name, m.revision)
    if not files:
        return None
    modules: set[str] = set()
    try:
        for f in files:
            for name, info in _header(f).items():
                if name.endswith(".weight") and isinstance(info, dict) and len(info.get("shape", ())) == 2:
                    modules.add(name.removesuffix(".weight"))
    except (OSError, ValueError):
        return None
    return (modules, f"{m.name}'s weights") if modules else None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError):
            return []
    return sorted(folder.glob("*.safetensors"))


def _cached_safetensors(repo_id: str, revision: str | None) -> list[Path]:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return []
    for name in ("model.safetensors.index.json", "model.safetensors"):
        try:
            hit = try_to_load_from_cache(repo_id, name, revision=revision)
        except Exception:  # not a hub id (a GGUF path, an alias)
            return []
        if isinstance(hit, str):
            return _safetensors_files(Path(hit).parent)
    return []


def _header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets} (8 bytes of length, then
    the JSON): no tensor is read."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: a safetensors header of {n} bytes")
        return json.loads(f.read(n))
