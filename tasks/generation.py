"""Generation backends: prompt token ids in, completions with the sampler's log-probs out.

One small interface (DESIGN.md "Generation backends"):

    generate(prompts: list[list[int]], n, params) -> Generation
        completions are prompt-major: prompt 0's n samples, then prompt 1's, ...
    sync_weights(model)   push trained weights into the engine (no-op when it is the model)

Backends: ``TransformersGenerator`` below and ``VLLMGenerator`` (tasks/vllm_engine.py: an in-process
vLLM engine that streams the trainer's weights in memory). ``make_generator`` picks one for
``generation.backend`` (auto | vllm | transformers) and logs which and why.

The transformers backend samples with ``model.generate`` on the training model itself. Its
sampler log-probs are log_softmax(raw_logits / temperature) of the chosen tokens, the same
definition the trainer uses, so their gap to the trainer's log-probs measures numerical drift
(padding, KV cache), not a different distribution. A completion ends at (and includes) the
first EOS token: finish_reason "stop"; otherwise it was cut at max_new_tokens: "length".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    greedy: bool = False

    @classmethod
    def from_grpo(cls, g) -> SamplingParams:
        return cls(
            max_new_tokens=g.max_completion_length,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            min_p=g.min_p,
            repetition_penalty=g.repetition_penalty,
        )


@dataclass
class Generation:
    completion_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    def extend(self, other: Generation) -> None:
        self.completion_ids += other.completion_ids
        self.logprobs += other.logprobs
        self.finish_reasons += other.finish_reasons


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


class TransformersGenerator:
    """Samples with ``model.generate`` in chunks of ``batch_size`` sequences."""

    name = "transformers"
    separate_engine = False  # samples with the training weights themselves: no off-policy drift to correct

    def __init__(self, model, tokenizer, batch_size: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def sync_weights(self, model) -> None:
        self.model = model  # generation runs on the training model itself: nothing to copy

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Generation:
        expanded = [p for p in prompts for _ in range(n)]
        out = Generation()
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(expanded), self.batch_size):
                out.extend(self._generate_chunk(expanded[start : start + self.batch_size], params))
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, prompts: list[list[int]], p: SamplingParams) -> Generation:
        ids, mask = left_pad(prompts, self.pad_id)
        kwargs = dict(max_new_tokens=p.max_new_tokens, repetition_penalty=p.repetition_penalty)
        if p.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0, min_p=p.min_p)
        res = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
            **kwargs,
        )
        new = res.sequences[:, ids.shape[1] :]  # [b, steps]
        temp = 1.0 if p.greedy else p.temperature
        logits = torch.stack(res.logits, dim=1).float() / temp  # [b, steps, V]
        lp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [b, steps]
        gen = Generation()
        for row, row_lp in zip(new.tolist(), lp.tolist()):
            if self.eos_id in row:
                end = row.index(self.eos_id) + 1
                reason = "stop"
            else:
                end, reason = len(row), "length"
            gen.completion_ids.append(row[:end])
            gen.logprobs.append(row_lp[:end])
            gen.finish_reasons.append(reason)
        return gen


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
):
    """Pick the generation backend for ``cfg`` (a GenerationConfig), log which one and why, build it.

    The vLLM engine starts from ``model_path`` (the model as trained from) and then follows
    ``model``'s weights in memory."""
    problem = None
    if cfg.backend != "transformers":
        from tasks.vllm_engine import model_architectures, model_head_dim, unsupported_reason

        problem = unsupported_reason(model_architectures(model), model_head_dim(model), load_in_4bit)
    backend, why = choose_backend(cfg.backend, problem)
    log.info("generation backend: %s (%s)", backend, why)
    if backend == "transformers":
        return TransformersGenerator(model, tokenizer, cfg.batch_size)
    from tasks.vllm_engine import VLLMGenerator

    return VLLMGenerator(model, tokenizer, model_path, cfg, dtype=dtype, max_model_len=max_model_len, seed=seed)
