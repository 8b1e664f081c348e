"""Can vLLM serve this model here? Its import (in-process mode), the architectures it implements, and on the CPU the
head sizes its attention has kernels for; checked from the run config before any stage (:func:`config_problem`)
and from the loaded model when the GRPO stage picks its sampler (tasks/generation/backend.py). The engine itself
is tasks/generation/vllm_engine.py."""

from __future__ import annotations

import os

from grpoflow.tasks.model.lora import unwrap


def import_vllm():
    """Import vLLM in-process mode; raises whatever the import raises (ImportError, a broken torchvision...)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in this process
    import vllm

    return vllm


def import_problem() -> str | None:
    """Why vLLM does not import here (a sentence), or None when it does."""
    try:
        import_vllm()
        from vllm import ModelRegistry  # noqa: F401
        from vllm.platforms import current_platform  # noqa: F401
    except Exception as e:  # any import failure means "not available", with its reason
        first_line = str(e).splitlines()[0] if str(e) else ""
        return f"vllm does not import ({type(e).__name__}: {first_line})"
    return None


def unsupported_reason(architectures: list[str] | None, head_dim: int | None = None, load_in_4bit: bool = False):
    """Why vLLM cannot generate for this model here (a sentence), or None when it can."""
    if load_in_4bit:
        return "model.load_in_4bit: the engine cannot take weights merged into a 4-bit bitsandbytes base"
    if problem := import_problem():
        return problem
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    archs = architectures or []
    if not any(a in ModelRegistry.get_supported_archs() for a in archs):
        return f"vLLM has no implementation of {archs or 'this architecture'}"
    if current_platform.is_cpu() and head_dim is not None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            return f"vLLM's CPU attention has no kernel for head_dim={head_dim} (supported: {sizes})"
    return None


def config_problem(cfg) -> str | None:
    """Why ``generation.backend=vllm`` cannot work for this PipelineConfig, checked before any stage runs
    (None: it can, or the backend is not vllm). Reads the model's config only, never its weights; a model
    config that cannot be read here (a hub id offline) leaves the architecture check to the GRPO stage."""
    if cfg.generation.backend != "vllm":
        return None
    m = cfg.model
    if m.name == "tiny":
        archs = ["Qwen2ForCausalLM" if m.tiny.architecture == "qwen2" else "LlamaForCausalLM"]
        head_dim = config_head_dim(m.tiny)
    else:
        from grpoflow.tasks.model.sources import cached_model

        name = cached_model(m.name, m.cache_dir)
        if name is None:  # an alias or GGUF not converted yet: the GRPO stage checks the converted model
            return import_problem()
        try:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(name, revision=m.revision, trust_remote_code=m.trust_remote_code)
        except Exception:  # noqa: BLE001 - unreadable here: check the import now, the rest at the GRPO stage
            return import_problem()
        archs = list(getattr(hf, "architectures", None) or [])
        head_dim = config_head_dim(hf)
    return unsupported_reason(archs, head_dim, m.load_in_4bit)


def model_architectures(model) -> list[str]:
    base = unwrap(model)
    return list(getattr(base.config, "architectures", None) or [type(base).__name__])


def config_head_dim(config) -> int:
    """Attention head size of an HF config: its head_dim, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def model_head_dim(model) -> int:
    return config_head_dim(unwrap(model).config)
