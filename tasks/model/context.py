"""What fits in the model's context: the length keys against max_position_embeddings, and the prompts that
grpo.max_prompt_length cuts.

Lengths past the context are refused, not clamped: a clamp would silently change the experiment the config
describes, and it is what TRL users meet already, since vLLM (TRL's generation engine) refuses a max_model_len
beyond the model's derived one. Refused twice: before any stage when the context is known from the config
(model.tiny) or a config.json on disk (a local folder, a cached hub model), with the keys' values; and again
in the GRPO stage once the model is loaded (a hub model downloaded by the stage, a GGUF converted by it), with
the longest prompt as fed (after the cut) in place of grpo.max_prompt_length.

    grpo.max_prompt_length + grpo.max_completion_length <= max_position_embeddings
    sft.max_length                                      <= max_position_embeddings

Prompts longer than grpo.max_prompt_length are left-truncated (as TRL does); :func:`tokenize_prompts` counts
them (rows, longest length), warns once and returns the counts for MLflow.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def context_problem(
    cfg: Any, context: int | None, where: str, sft: bool = True, prompt_tokens: int | None = None
) -> str | None:
    """Why the length keys of ``cfg`` (a PipelineConfig) do not fit a ``context`` of max_position_embeddings
    (read from ``where``); None when they do or the context is unknown. ``prompt_tokens``: the longest prompt
    as the GRPO stage feeds it (after the cut), checked in place of grpo.max_prompt_length."""
    if not context:
        return None
    g = cfg.grpo
    if prompt_tokens is not None and prompt_tokens + g.max_completion_length > context:
        return (
            f"the longest prompt ({prompt_tokens} tokens, grpo.max_prompt_length={g.max_prompt_length}) + "
            f"grpo.max_completion_length={g.max_completion_length} = {prompt_tokens + g.max_completion_length} "
            f"tokens, beyond the model's context of {context} (max_position_embeddings of {where}); lower them"
        )
    if prompt_tokens is None and g.max_prompt_length is not None:
        if g.max_prompt_length + g.max_completion_length > context:
            return (
                f"grpo.max_prompt_length + grpo.max_completion_length = {g.max_prompt_length} + "
                f"{g.max_completion_length} = {g.max_prompt_length + g.max_completion_length} tokens, beyond the "
                f"model's context of {context} (max_position_embeddings of {where}); lower them"
            )
    if g.max_completion_length >= context:
        return (
            f"grpo.max_completion_length = {g.max_completion_length} tokens, not below the model's context of "
            f"{context} (max_position_embeddings of {where}); lower it"
        )
    e = cfg.eval
    if e.enabled and e.max_new_tokens is not None and e.max_new_tokens >= context:
        return (
            f"eval.max_new_tokens = {e.max_new_tokens} tokens, not below the model's context of {context} "
            f"(max_position_embeddings of {where}); lower it (null: grpo.max_completion_length)"
        )
    if sft and cfg.sft.enabled and cfg.sft.max_length > context:
        return (
            f"sft.max_length = {cfg.sft.max_length} tokens, beyond the model's context of {context} "
            f"(max_position_embeddings of {where}); lower it"
        )
    return None


def config_context(model_config: Any) -> int | None:
    """max_position_embeddings of a transformers config (or its dict; a multimodal one: its text_config)."""
    get = model_config.get if isinstance(model_config, dict) else lambda k: getattr(model_config, k, None)
    value = get("max_position_embeddings")
    if value is None and (text := get("text_config")) is not None:
        return config_context(text)
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def known_context(cfg: Any) -> tuple[int, str] | None:
    """(context, where it was read) when it is known without loading anything: model.tiny, or a config.json of
    a local folder or of a hub model in the cache. None otherwise (the stages check after loading)."""
    name = cfg.model.name
    if name == "tiny":
        return cfg.model.tiny.max_position_embeddings, "model.tiny"
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json", revision=cfg.model.revision)
        except Exception:  # not a hub id at all (a GGUF path, an alias): unknown here
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        context = config_context(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    return (context, f"{name}'s config.json") if context else None


def tokenize_prompts(tokenizer, rows: list[dict], max_prompt_length: int | None) -> tuple[list[list[int]], dict]:
    """Chat-templated prompt ids, left-truncated to ``max_prompt_length`` (TRL's rule), and what the cut took:
    {"truncated_prompts": rows cut, "longest_prompt_tokens": the longest before the cut}. Warns once when any
    prompt was cut."""
    from grpoflow.tasks.model.loading import prompt_ids

    full = [prompt_ids(tokenizer, r["prompt"]) for r in rows]
    longest = max((len(p) for p in full), default=0)
    if max_prompt_length is None:
        return full, {"truncated_prompts": 0, "longest_prompt_tokens": longest}
    cut = sum(len(p) > max_prompt_length for p in full)
    if cut:
        log.warning(
            "grpo.max_prompt_length=%d cuts %d of %d prompts (the longest has %d tokens): their beginnings are "
            "dropped (left truncation, as TRL does); raise it to keep them whole",
            max_prompt_length,
            cut,
            len(full),
            longest,
        )
    ids = [p[-max_prompt_length:] if len(p) > max_prompt_length else p for p in full]
    return ids, {"truncated_prompts": cut, "longest_prompt_tokens": longest}
