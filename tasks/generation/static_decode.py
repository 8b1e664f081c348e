"""A compiled, static-shape decode step for the transformers backend (``generation.compile``).

The eager loop (transformers_loop.py ``sample``) pays Python and kernel-launch overhead for every op of every layer
on every token, drops finished rows from the batch (new shapes each time) and syncs with the host twice a token.
Here one decode step -- the forward of the previous token, the logits processors, the draw, the log-prob and the
stop bookkeeping -- is a single ``torch.compile``'d function over tensors of fixed shapes:

- the KV cache is transformers' StaticCache sized for the bucketed prompt width plus ``max_new_tokens``
  (:func:`bucket_width`), so every step of a run sees the same shapes;
- the batch is bucketed to a power of two (:func:`bucket_rows`; extra rows repeat row 0 and are dropped), and a
  row that emitted EOS stays in the batch, masked (its later tokens are not recorded), instead of leaving it;
- the random draws are inputs: torch.multinomial(p, 1) is argmax(p / q) with q ~ Exp(1) drawn by
  ``exponential_`` (PyTorch's own algorithm for one sample), so the noise for ``k`` steps is drawn ahead in one
  call per row seed (a seed's stream is the same drawn in one block or step by step) and the loop checks whether
  every row stopped only every ``k`` steps: no host sync per token.

With ``row_seeds`` (each row its own generator) and greedy the tokens are those of the eager loop, the log-probs
equal to float tolerance (tested). With the global RNG the draws agree until the first row stops; after that the
eager loop draws only for the rows still going, this step for all of them, so the streams part (both are valid
samples of the same distribution).

The compiled function is built once per generator (:class:`CompiledDecoder`) and reused for the whole run; the
caches are kept per (rows, width) bucket. The model's parameters are graph inputs, so weights updated in place by
the optimizer (or swapped by lora_merged each round) are read afresh at every call (tested). Compile time and
recompiles are counted and logged apart from decoding time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grpoflow.tasks.generation.kv_cache import decode_cache
from grpoflow.tasks.generation.warpers import logits_warpers

if TYPE_CHECKING:
    from transformers import DynamicCache

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64  # graphs one code object may hold: every decoder's step shares the step's code (see below)
WIDTH_BUCKET = 32  # prompt widths round up to a multiple of this: few cache shapes, little wasted attention
STOP_CHECK_EVERY = 8  # steps between the host's checks that every row stopped (and noise drawn per block)


def bucket_width(width: int, step: int = WIDTH_BUCKET) -> int:
    """``width`` rounded up to a multiple of ``step`` (at least ``step``)."""
    return max(step, -(-width // step) * step)


def bucket_rows(rows: int) -> int:
    """The power of two at or above ``rows``: the batch sizes a run compiles for."""
    return 1 << max(rows - 1, 0).bit_length()


def exponential_noise(steps: int, rows: int, vocab: int, gens: list[torch.Generator] | None, device) -> torch.Tensor:
    """Exp(1) noise [steps, rows, vocab] for argmax(p / q) draws: from the global RNG in one call, or one call per
    row's generator (a generator's block is what ``steps`` single draws of [vocab] would give, so a row's tokens
    depend on its seed only)."""
    if gens is None:
        return torch.empty((steps, rows, vocab), device=device).exponential_()
    return torch.stack([torch.empty((steps, vocab), device=device).exponential_(generator=g) for g in gens], dim=1)


def choose(
    logits: torch.Tensor, scores: torch.Tensor, noise: torch.Tensor, greedy: bool, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its sampler log-prob log_softmax(logits / temperature) [B]) from warped ``scores``: argmax when
    greedy, else argmax(softmax(scores) / noise), which is torch.multinomial's draw for that noise."""
    if greedy:
        token = scores.argmax(-1)
    else:
        token = (torch.softmax(scores, dim=-1) / noise).argmax(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, token[:, None]).squeeze(1)
    return token, logp


def record(
    tokens: torch.Tensor,
    logps: torch.Tensor,
    lengths: torch.Tensor,
    stopped: torch.Tensor,
    token: torch.Tensor,
    logp: torch.Tensor,
    t: torch.Tensor,
    eos_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step ``t`` (a 0-d tensor, so it never specialises a compiled graph) written for the rows still going:
    their token and log-prob in column t, and for those that emitted ``eos_id`` length t + 1 and stopped."""
    live = ~stopped
    col = torch.arange(tokens.shape[1], device=tokens.device) == t  # [T]
    here = live[:, None] & col[None, :]
    tokens = torch.where(here, token[:, None], tokens)
    logps = torch.where(here, logp[:, None], logps)
    ended = live & (token == eos_id)
    lengths = torch.where(ended, t + 1, lengths)
    return tokens, logps, lengths, stopped | ended


def bucketed_prefill(
    model, config, ids: torch.Tensor, mask: torch.Tensor, prompt_rows: torch.Tensor, bucket: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
    """The prompts' forward, left-padded with ``pad`` more columns up to the bucketed width W (masked, so attention
    and positions see the same prompt), into a fresh cache: (ids, mask and positions [P, W], that cache, the
    prompt of each of the ``bucket`` batch rows (``prompt_rows``, then row 0 for the bucket's padding rows) and
    their float logits of the next token [bucket, V])."""
    ids = torch.nn.functional.pad(ids, (pad, 0), value=int(ids[0, 0]))
    mask = torch.nn.functional.pad(mask, (pad, 0), value=0)
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    pre = decode_cache(config, 0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=pre, logits_to_keep=1)
    batch_rows = torch.cat([prompt_rows, prompt_rows.new_zeros(bucket - prompt_rows.shape[0])])
    return ids, mask, position, pre, batch_rows, out.logits[:, -1].float()[batch_rows]


def fill_static_cache(cache, pre, rows: torch.Tensor, width: int) -> None:
    """Each batch row's prompt keys and values (``pre``'s, row ``rows[i]``) copied into the first ``width``
    positions of the StaticCache ``cache``, the rest zeroed: the cache a call reuses starts from its prompts only."""
    for static, layer in zip(cache.layers, pre.layers, strict=True):
        k, v = layer.keys[rows], layer.values[rows]
        if not static.is_initialized:
            static.lazy_initialization(k, v)
        static.keys.zero_()
        static.values.zero_()
        static.keys[:, :, :width] = k
        static.values[:, :, :width] = v
        static.cumulative_length.fill_(width)


def penalty_view(ids: torch.Tensor, rows: torch.Tensor, pad: int, steps: int) -> torch.Tensor:
    """The repetition penalty's view of each batch row [len(rows), W + steps] (W: the width of ``ids``): its
    prompt, with the bucket's extra ``pad`` columns and the ``steps`` not yet taken holding the row's last prompt
    token, which is already there, so they change no score."""
    last = ids[rows, -1:]
    return torch.cat([last.expand(rows.shape[0], pad), ids[rows, pad:], last.expand(rows.shape[0], steps)], dim=1)


ATTENTION = "grpoflow_decode"  # the attention implementation the compiled step runs the model with


def grouped_decode_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention for one new token without expanding the KV cache to every query head.

    With grouped-query attention (H query heads, Hkv < H key/value heads) transformers' sdpa path copies the whole
    cache ``H / Hkv`` times per layer per step (repeat_kv) whenever there is a mask; over a static cache that copy
    was most of the compiled step's time. For a single query position the ``g = H / Hkv`` heads sharing key/value
    head j (heads j*g .. j*g+g-1, repeat_kv's order) can instead be stacked as ``g`` query rows against that one
    head: the same dot products, no copy. Longer queries (the prefill) take transformers' path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, q, D = query.shape
    kv_heads = key.shape[1]
    if q != 1 or kv_heads == H:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scale = D**-0.5 if scaling is None else scaling
    scores = torch.matmul(query.reshape(B, kv_heads, H // kv_heads, D), key.transpose(-1, -2)) * scale
    if attention_mask is not None:  # sdpa_mask's: True where a position may be attended ([B, 1, 1, L])
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, grouped_decode_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextmanager
def decode_attention(config) -> Iterator[None]:
    """The model runs with :func:`grouped_decode_attention` inside (sdpa models only; others keep theirs)."""
    before = config._attn_implementation
    if before != "sdpa":
        yield
        return
    _register_attention()
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


@dataclass
class DecodeStats:
    """What compiling cost this generator: seconds spent in calls that compiled, the graphs compiled (the first
    of each shape bucket, then any recompile) and steps run."""

    compile_s: float = 0.0
    compiles: int = 0
    steps: int = 0


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledDecoder:
    """One compiled decode step for a model and sampling settings, reused for every call (see the module doc).

    ``compile_mode``: torch.compile's mode (None: the default; "reduce-overhead" on CUDA for CUDA graphs)."""

    def __init__(self, compile_mode: str | None = None, stop_every: int = STOP_CHECK_EVERY) -> None:
        self.compile_mode = compile_mode
        self.stop_every = stop_every
        self.stats = DecodeStats()
        self._steps: dict[tuple, object] = {}  # (greedy, temperature, warper key, eos) -> compiled step
        self._caches: dict[tuple[int, int, int], object] = {}  # (model id, rows, cache length) -> StaticCache

    def _step_fn(self, model, p, eos_id: int):
        """(the compiled step, the logits warpers it applies) for ``model`` and ``p``: built once per model and
        sampling settings, so a run (GRPO's rounds, the eval's greedy pass) compiles a handful of graphs."""
        greedy, temp = p.greedy, (1.0 if p.greedy else p.temperature)
        key = (greedy, temp, p.repetition_penalty, p.top_k, p.top_p, p.min_p, eos_id, id(model))
        found = self._steps.get(key)
        if found is None:
            warp = logits_warpers(p)

            def step(token, position, mask, cache_pos, cache, seqs, noise, tokens, logps, lengths, stopped, t):
                mask = mask.index_fill(1, cache_pos, 1)  # the previous token, at cache position cache_pos
                if warp:
                    seqs = seqs.index_copy(1, cache_pos, token[:, None])
                out = model(
                    input_ids=token[:, None],
                    attention_mask=mask,
                    position_ids=position,
                    past_key_values=cache,
                    cache_position=cache_pos,
                    use_cache=True,
                )
                logits = out.logits[:, -1].float()
                scores = warp(seqs, logits.clone()) if warp else logits
                token, logp = choose(logits, scores, noise, greedy, temp)
                tokens, logps, lengths, stopped = record(tokens, logps, lengths, stopped, token, logp, t, eos_id)
                return token, position + 1, mask, cache_pos + 1, seqs, tokens, logps, lengths, stopped

            # every key's step is a closure over the same code, and dynamo keeps at most recompile_limit graphs per
            # code object before silently running it eagerly: a run's sampling settings x shape buckets (and a
            # test session's models) stay well under this limit
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            found = self._steps[key] = (torch.compile(step, mode=self.compile_mode, dynamic=False), warp)
        return found

    def _cache(self, model, config, rows: int, length: int):
        """The StaticCache for this model and shape bucket, allocated once and refilled by every call (a fresh
        one per call would be a new input address each time: CUDA graphs re-record)."""
        from transformers import StaticCache

        key = (id(model), rows, length)  # the compiled step holds the model, so its id is not reused meanwhile
        if key not in self._caches:
            self._caches[key] = StaticCache(config=config, max_cache_len=length)
        return self._caches[key]

    @torch.no_grad()
    def sample(
        self,
        model,
        ids: torch.Tensor,
        mask: torch.Tensor,
        p,
        eos_id: int,
        seeds: list[int] | None = None,
        prompt_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """transformers_loop.sample's contract (same arguments, same returns) through the compiled step."""
        from grpoflow.tasks.model.lora import unwrap

        base = unwrap(model)
        dev = ids.device
        if prompt_rows is None:
            prompt_rows = torch.arange(ids.shape[0], device=dev)
        B, T = prompt_rows.shape[0], p.max_new_tokens
        Bb, W = bucket_rows(B), bucket_width(ids.shape[1])
        temp = 1.0 if p.greedy else p.temperature
        step, warp = self._step_fn(model, p, eos_id)
        pad = W - ids.shape[1]
        ids, mask, position, pre, rows, logits = bucketed_prefill(model, base.config, ids, mask, prompt_rows, Bb, pad)
        cache = self._cache(model, base.config, Bb, W + T)
        fill_static_cache(cache, pre, rows, W)
        mask = torch.cat([mask[rows], mask.new_zeros((Bb, T))], dim=1)
        position = position[rows, -1:] + 1
        seqs = penalty_view(ids, rows, pad, T)
        tokens = torch.zeros((Bb, T), dtype=torch.long, device=dev)
        logps = torch.zeros((Bb, T), device=dev)
        lengths = torch.full((Bb,), T, dtype=torch.long, device=dev)
        stopped = torch.zeros(Bb, dtype=torch.bool, device=dev)
        gens = None if seeds is None else [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        noise_block = self._noise_blocks(p.greedy, T, B, Bb, logits.shape[-1], gens, dev)
        noise = noise_block(0)
        scores = warp(seqs, logits.clone()) if warp else logits
        token, logp = choose(logits, scores, noise[0], p.greedy, temp)
        zero = torch.zeros((), dtype=torch.long, device=dev)
        tokens, logps, lengths, stopped = record(tokens, logps, lengths, stopped, token, logp, zero, eos_id)
        cache_pos = torch.tensor([W], device=dev)
        with decode_attention(base.config):
            self._loop(step, T, B, Bb, W, token, position, mask, cache_pos, cache, seqs, noise, noise_block,
                       tokens, logps, lengths, stopped)  # fmt: skip
        return tokens[:B], logps[:B], lengths[:B], stopped[:B]

    def _noise_blocks(
        self, greedy: bool, T: int, B: int, Bb: int, vocab: int, gens: list[torch.Generator] | None, device
    ) -> Callable[[int], torch.Tensor]:
        """noise_block(start): the Exp(1) noise [n, Bb, vocab] of steps start .. start + n - 1 (n = stop_every, or
        what is left of T), drawn for the B real rows (:func:`exponential_noise`) and 1 for the bucket's padding
        rows; all ones when greedy (no draw)."""

        def noise_block(start: int) -> torch.Tensor:
            n = min(self.stop_every, T - start)
            if greedy:
                return torch.ones((n, Bb, vocab), device=device)
            drawn = exponential_noise(n, B, vocab, gens, device)
            return torch.cat([drawn, drawn.new_ones((n, Bb - B, vocab))], dim=1)

        return noise_block

    def _loop(self, step, T, B, Bb, W, token, position, mask, cache_pos, cache, seqs, noise, noise_block, *state):
        """Steps 1 .. T-1 through the compiled ``step``; ``state`` (tokens, logps, lengths, stopped) in place."""
        tokens, logps, lengths, stopped = state
        dev = token.device
        for t in range(1, T):
            if t % self.stop_every == 0:
                if bool(stopped[:B].all()):
                    break
                noise = noise_block(t)
            before, t0 = _graphs(), time.perf_counter()
            token, position, mask, cache_pos, seqs, tokens, logps, lengths, stopped = step(
                token, position, mask, cache_pos, cache, seqs, noise[t % self.stop_every], tokens, logps, lengths,
                stopped, torch.tensor(t, device=dev),
            )  # fmt: skip
            self.stats.steps += 1
            if _graphs() > before:
                self.stats.compiles += _graphs() - before
                self.stats.compile_s += time.perf_counter() - t0
                log.info(
                    "generation.compile: compiled the decode step for %d rows x %d cache positions in %.1f s "
                    "(%d graphs so far)", Bb, W + T, time.perf_counter() - t0, self.stats.compiles,
                )  # fmt: skip
        for buf, new in zip(state, (tokens, logps, lengths, stopped), strict=True):
            buf.copy_(new)
