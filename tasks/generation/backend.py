"""Choosing the generation backend for ``generation.backend`` (auto | vllm | transformers), logged with the
reason."""

from __future__ import annotations

import logging

from grpoflow.tasks.generation.transformers_loop import TransformersGenerator

log = logging.getLogger(__name__)


def choose_backend(requested: str, vllm_problem: str | None) -> tuple[str, str]:
    """(backend, why) for generation.backend = auto | vllm | transformers.

    ``vllm_problem`` is why vLLM cannot serve the model here (None: it can). auto takes vLLM when it
    can; an explicit ``vllm`` that cannot is an error naming the reason, never a silent fallback."""
    if requested == "transformers":
        return "transformers", "generation.backend=transformers"
    if vllm_problem is None:
        return "vllm", "generation.backend=vllm" if requested == "vllm" else "auto: vLLM imports and supports the model"
    if requested == "vllm":
        raise ValueError(f"generation.backend=vllm: {vllm_problem}")
    return "transformers", f"auto: {vllm_problem}"


def compile_choice(requested: str, device_type: str) -> tuple[bool, str | None, str]:
    """(compile the decode step?, torch.compile mode, why) for generation.compile = auto | on | off.

    auto compiles on CUDA (CUDA graphs through mode "reduce-overhead" remove the per-token launch overhead that
    dominates small-batch decoding there) and not on CPU: there a compile costs 15-60 s cold (3 s from
    inductor's on-disk cache) per sampling setting and shape bucket, a default run compiles several (GRPO's rounds,
    the eval's greedy and pass@k passes, a smaller last chunk), and the compiled step decodes the default tiny
    model's 128 rows 1.6x faster, so a default run's ~30 s of decoding saves ~11 s: less than the compiles
    (measured: docs/generation.md, benchmarks/RESULTS.md)."""
    mode = "reduce-overhead" if device_type == "cuda" else None
    if requested == "on":
        return True, mode, "generation.compile=on"
    if requested == "off":
        return False, None, "generation.compile=off"
    if device_type == "cuda":
        return True, mode, "auto: CUDA, compiled with CUDA graphs"
    return False, None, f"auto: {device_type}, where compiling costs more than it saves in a default run"


def make_generator(
    cfg,
    model,
    tokenizer,
    *,
    model_path: str,
    dtype: str = "float32",
    load_in_4bit: bool = False,
    max_model_len: int = 1024,
    seed: int = 0,
    revision: str | None = None,
):
    """Pick the generation backend for ``cfg`` (a GenerationConfig), log which one and why, build it.

    The vLLM engine starts from ``model_path`` (the model as trained from; ``revision``: its hub commit) and then
    follows ``model``'s weights in memory."""
    problem = None
    if cfg.backend != "transformers":
        from grpoflow.tasks.generation.vllm_support import model_architectures, model_head_dim, unsupported_reason

        problem = unsupported_reason(model_architectures(model), model_head_dim(model), load_in_4bit)
    backend, why = choose_backend(cfg.backend, problem)
    log.info("generation backend: %s (%s)", backend, why)
    if backend == "transformers":
        from grpoflow.tasks.model.device import model_device

        compiled, mode, why_compile = compile_choice(cfg.compile, model_device(model).type)
        log.info("generation.compile: %s (%s)", "on" if compiled else "off", why_compile)
        return TransformersGenerator(
            model,
            tokenizer,
            cfg.batch_size,
            merge_lora=cfg.merge_lora,
            threads=cfg.torch_threads,
            compile_mode=mode if compiled else None,
            compiled=compiled,
        )
    from grpoflow.tasks.generation.vllm_engine import VLLMGenerator

    return VLLMGenerator(
        model, tokenizer, model_path, cfg, dtype=dtype, max_model_len=max_model_len, seed=seed, revision=revision
    )
