"""The transformers generation backend: KV-cached sampling on the training model itself (the interface every
backend has is in types.py; the vLLM backend is vllm_engine.py; backend.py picks one).

``sample`` draws tokens with transformers' logits processors (repetition penalty, temperature, top-k, top-p,
min-p) and ``torch.multinomial``, as ``model.generate`` does for the same seed, but over a plain loop of the
model's forward with a DynamicCache: none of generate's per-step machinery, and rows that have emitted EOS leave
the batch and the cache. Its sampler log-probs are log_softmax(raw_logits / temperature) of the chosen tokens, the
same definition the trainer uses, so their gap to the trainer's log-probs measures numerical drift (padding, KV
cache), not a different distribution. A completion ends at (and includes) the first EOS token: finish_reason
"stop"; otherwise it was cut at max_new_tokens: "length".
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from grpoflow.tasks.generation.kv_cache import decode_cache
from grpoflow.tasks.generation.static_decode import CompiledDecoder
from grpoflow.tasks.generation.types import Generation, SamplingParams, left_pad, torch_threads
from grpoflow.tasks.generation.warpers import logits_warpers
from grpoflow.tasks.model.device import model_device
from grpoflow.tasks.model.lora import lora_merged, unwrap

log = logging.getLogger(__name__)


class TransformersGenerator:
    """Samples with :func:`sample` (this module's KV-cached loop, not ``model.generate``) in chunks of ``batch_size``
    sequences.

    ``merge_lora``: a peft model generates with its LoRA layers merged on the side
    (grpoflow.tasks.model.lora.lora_merged: one matmul per layer instead of three; measured 1.36 s -> 0.93 s
    for 128 x 32 tokens on the default tiny model). ``threads``: torch threads while generating
    (decoding is many small ops: on 2 cores 1 thread beats 2, while training prefers 2). ``compiled``: decode
    through :class:`grpoflow.tasks.generation.static_decode.CompiledDecoder` (``compile_mode``: torch.compile's
    mode) instead of :func:`sample`: the same tokens for row seeds and greedy, see static_decode.py."""

    name = "transformers"
    separate_engine = False  # samples with the training weights themselves: no off-policy drift to correct
    weights_key = None  # nothing to sync: generation runs on the training model

    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int = 64,
        *,
        merge_lora: bool = True,
        threads: int | None = None,
        compiled: bool = False,
        compile_mode: str | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.merge_lora = merge_lora
        self.threads = threads
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        # generation.compile: one compiled static-shape step, reused for the whole run (static_decode.py)
        self.decoder = CompiledDecoder(compile_mode) if compiled else None

    def sync_weights(self, model) -> None:
        self.model = model  # generation runs on the training model itself: nothing to copy

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, row_seeds: list[int] | None = None
    ) -> Generation:
        """``n`` completions of each prompt, prompt-major. ``row_seeds`` (one per completion): each is sampled
        with its own generator, so a completion does not depend on the batch that drew it (distributed GRPO)."""
        expanded = [p for p in prompts for _ in range(n)]
        if row_seeds is not None and len(row_seeds) != len(expanded):
            raise ValueError(f"row_seeds: {len(row_seeds)} seeds for {len(expanded)} completions")
        out = Generation()
        was_training = self.model.training
        self.model.eval()
        merged = lora_merged(self.model) if self.merge_lora else nullcontext()
        try:
            with merged, torch_threads(self.threads):
                for start in range(0, len(expanded), self.batch_size):
                    seeds = None if row_seeds is None else row_seeds[start : start + self.batch_size]
                    out.extend(self._generate_chunk(expanded[start : start + self.batch_size], params, seeds))
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, prompts: list[list[int]], p: SamplingParams, seeds: list[int] | None) -> Generation:
        unique, rows = distinct_prompts(prompts)  # GRPO's group of n completions shares one prompt: one prefill
        ids, mask = left_pad(unique, self.pad_id)
        device = model_device(self.model)
        ids, mask = ids.to(device), mask.to(device)
        decode = sample if self.decoder is None else self.decoder.sample
        tokens, logps, lengths, stopped = decode(
            self.model, ids, mask, p, self.eos_id, seeds, prompt_rows=torch.tensor(rows, device=device)
        )
        gen = Generation()
        for row, row_lp, n, stop in zip(tokens.tolist(), logps.tolist(), lengths.tolist(), stopped.tolist()):
            gen.completion_ids.append(row[:n])
            gen.logprobs.append(row_lp[:n])
            gen.finish_reasons.append("stop" if stop else "length")
        return gen


def distinct_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(the distinct prompts in order of first appearance, each row's index into them)."""
    index: dict[tuple[int, ...], int] = {}
    rows = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(k) for k in index], rows


@torch.no_grad()
def sample(
    model,
    ids: torch.Tensor,
    mask: torch.Tensor,
    p: SamplingParams,
    eos_id: int,
    seeds: list[int] | None = None,
    prompt_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode up to ``p.max_new_tokens`` tokens for each row of a left-padded batch, with a KV cache.

    ``prompt_rows`` (optional, [B]): row i continues prompt ``ids[prompt_rows[i]]``. Each distinct prompt is then
    prefilled once and its KV cache copied to its rows: GRPO's n completions of a prompt share one prefill (on the
    default tiny model the prompt's forward was half of decoding's matmul FLOPs).

    Returns tokens [B, T] and their sampler log-probs log_softmax(logits / temperature) [B, T] (valid up
    to each row's length), lengths [B] (EOS included) and stopped [B] (the row emitted EOS).

    What ``model.generate`` does, minus its per-step machinery, plus one thing it lacks: a row that has
    emitted EOS leaves the batch and the cache, so the steps after most completions ended cost only the
    rows still going (generate decodes every row until the last one ends). Sampling is generate's:
    transformers' logits processors, then softmax and torch.multinomial (argmax when greedy). With ``seeds`` (one
    per row) each row draws from its own torch.Generator: its tokens depend on its seed and its logits only."""
    base = unwrap(model)
    cache = decode_cache(base.config, p.max_new_tokens)  # written in place: no torch.cat of the whole cache per token
    compactable = all(hasattr(layer, "batch_select_indices") for layer in getattr(cache, "layers", [None]))
    if prompt_rows is not None and not compactable:  # a cache that cannot copy rows: prefill every row
        ids, mask, prompt_rows = ids[prompt_rows], mask[prompt_rows], None
    B, T = (ids.shape[0] if prompt_rows is None else prompt_rows.shape[0]), p.max_new_tokens
    warp = logits_warpers(p)
    temp = 1.0 if p.greedy else p.temperature
    dev = ids.device  # the model's: every buffer of the loop lives beside it
    tokens = torch.zeros((B, T), dtype=torch.long, device=dev)
    logps = torch.zeros((B, T), device=dev)
    lengths = torch.full((B,), T, dtype=torch.long, device=dev)
    stopped = torch.zeros(B, dtype=torch.bool, device=dev)
    ids, mask, position, logits = _prefill(model, ids, mask, cache, prompt_rows)
    rows = torch.arange(B, device=dev)  # batch row -> output row
    seqs = ids  # what the repetition penalty looks at
    gens = None if seeds is None else [torch.Generator(device=dev).manual_seed(s) for s in seeds]
    for t in range(T):
        scores = warp(seqs, logits.clone()) if warp else logits
        token = _draw(scores, p.greedy, gens, rows)
        ended = _record(tokens, logps, lengths, stopped, rows, token, logits, temp, t, eos_id)
        if t + 1 == T or bool(stopped[rows].all()):
            break
        if warp:
            seqs = torch.cat([seqs, token[:, None]], dim=1)
        if compactable and bool(ended.any()):  # finished rows leave the batch and the cache
            keep = (~stopped[rows]).nonzero().squeeze(1)
            for layer in cache.layers:
                layer.batch_select_indices(keep)
            rows, mask, position, token, seqs = rows[keep], mask[keep], position[keep], token[keep], seqs[keep]
        mask, position, logits = _next_logits(model, token, mask, position, cache)
    return tokens, logps, lengths, stopped


def _prefill(
    model, ids: torch.Tensor, mask: torch.Tensor, cache, prompt_rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts' forward into ``cache``: (ids, mask, the next token's positions [B, 1], its float logits [B, V])
    for every batch row; with ``prompt_rows`` each row gets its prompt's cache, ids, mask, positions and logits."""
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1].float()
    position = position[:, -1:] + 1
    if prompt_rows is not None:  # each row gets its prompt's cache, logits and positions
        for layer in cache.layers:
            layer.batch_select_indices(prompt_rows)
        ids, mask, position, logits = ids[prompt_rows], mask[prompt_rows], position[prompt_rows], logits[prompt_rows]
    return ids, mask, position, logits


def _draw(scores: torch.Tensor, greedy: bool, gens: list[torch.Generator] | None, rows: torch.Tensor) -> torch.Tensor:
    """One token per batch row [B] from warped ``scores``: argmax when greedy, else torch.multinomial of
    softmax(scores), from the global RNG or from each row's generator (``gens``, indexed by output row)."""
    if greedy:
        return scores.argmax(-1)
    if gens is None:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)
    probs = torch.softmax(scores, dim=-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=gens[r]) for i, r in enumerate(rows.tolist())])


def _record(
    tokens: torch.Tensor,
    logps: torch.Tensor,
    lengths: torch.Tensor,
    stopped: torch.Tensor,
    rows: torch.Tensor,
    token: torch.Tensor,
    logits: torch.Tensor,
    temp: float,
    t: int,
    eos_id: int,
) -> torch.Tensor:
    """Step ``t`` written in place for the batch rows still going (output rows ``rows``): their token and its
    sampler log-prob log_softmax(logits / temp)[token] in column t; those that emitted ``eos_id`` get length t + 1
    and stopped. Returns the batch rows that ended at this step [B] (bool)."""
    live = ~stopped[rows]
    tokens[rows[live], t] = token[live]
    logps[rows[live], t] = torch.log_softmax(logits[live] / temp, dim=-1).gather(-1, token[live, None]).squeeze(1)
    ended = live & (token == eos_id)
    lengths[rows[ended]] = t + 1
    stopped[rows[ended]] = True
    return ended


def _next_logits(
    model, token: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, cache
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step: the forward of ``token`` [B] at ``position`` [B, 1] against ``cache``; (the mask one
    column longer, the next positions, the next float logits [B, V])."""
    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
    out = model(
        input_ids=token[:, None], attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True
    )
    logits = out.logits[:, -1].float()
    return mask, position + 1, logits
