"""Tensors of one generation round and the policy log-prob forward pass.

Layout: the prompt is left-padded to P, the completion right-padded to C, so the hidden state
at position P-1+t predicts completion token t for every row:

    input_ids = [pad.. prompt | completion ..pad]          # [B, P+C]
    logp[b, t] = log p(completion[b, t] | prefix)         # [B, C], from hidden[:, P-1 : P+C-1]

The lm_head is never applied to the whole sequence: the hidden states of the completion
positions go through kernels.token_logprobs (fused, tiled over the vocabulary) with the head weight.

Rows with the same prompt (GRPO's group of n completions) share its forward pass: each distinct prompt runs once,
its KV cache and last hidden state are indexed out to its rows (autograd sums their gradients back), and the
completions run over that cache (:func:`shared_prompt_hidden`). The same hidden states up to float rounding, with
n-1 of every n prompt forwards and backwards saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from grpoflow.kernels.logprobs import token_logprobs, triton_available
from grpoflow.tasks.generation.types import left_pad
from grpoflow.tasks.model.loading import backbone_and_head


@dataclass
class RoundTensors:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded
    completion_mask: torch.Tensor  # [B, C] 1 on real tokens (EOS included); 0 rows when masked out
    sampler_logp: torch.Tensor  # [B, C] the sampler's log-probs (NaN on padding)
    truncated: torch.Tensor  # [B] bool: no EOS within max_completion_length

    def select(self, idx: torch.Tensor) -> RoundTensors:
        return RoundTensors(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))

    def to(self, device: torch.device | str) -> RoundTensors:
        return RoundTensors(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def build_round(
    prompts: list[list[int]],
    completions: list[list[int]],
    sampler_logps: list[list[float]],
    finish_reasons: list[str],
    pad_id: int,
    mask_truncated: bool,
) -> RoundTensors:
    p_ids, p_mask = left_pad(prompts, pad_id)
    width = max(1, max(len(c) for c in completions))
    c_ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(completions), width), dtype=torch.long)
    s_lp = torch.full((len(completions), width), float("nan"))
    for i, (c, lp) in enumerate(zip(completions, sampler_logps)):
        c_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        c_mask[i, : len(c)] = 1
        s_lp[i, : len(lp)] = torch.tensor(lp)
    truncated = torch.tensor([r != "stop" for r in finish_reasons])
    if mask_truncated:
        c_mask = c_mask * (~truncated).long().unsqueeze(1)
    return RoundTensors(p_ids, p_mask, c_ids, c_mask, s_lp, truncated)


PromptGroups = tuple[torch.Tensor, torch.Tensor]  # (one row index per distinct prompt [U], each row's prompt [B])
# (the completion positions whose log-prob needs a gradient, those that need only its value): flat indices into
# [B * C], on the model's device (head_positions)
HeadRows = tuple[torch.Tensor, torch.Tensor]
FIND = "find"  # PolicyLogProbs.forward's groups: find the rows sharing a prompt on the device


class PolicyLogProbs(torch.nn.Module):
    """The log-prob path of a causal LM as one module: ``forward`` runs the backbone and the fused head kernel.

    This is the module a distributed run wraps (DistributedDataParallel, or FSDP2's root): every parameter
    that takes part in the loss, the head weight included, is used inside its ``forward``, so the wrapper sees the
    whole computation. Calling the backbone and ``head.weight`` from outside the wrapped module would bypass it:
    under DDP the head's gradient is not averaged, under FSDP2 the head is still sharded when used."""

    def __init__(self, model: torch.nn.Module, share_prompts: bool = True):
        super().__init__()
        self.model = model
        self.share_prompts = share_prompts  # rows with one prompt share its forward (shared_prompt_hidden)

    def forward(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        temperature: float,
        compute_entropy: bool = False,
        impl: str = "auto",
        entropy_grad: bool = False,
        lengths: torch.Tensor | None = None,
        chunk_rows: int = 0,
        groups: PromptGroups | None | str = FIND,
        head_rows: HeadRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``groups``: the rows sharing a prompt, as :func:`host_prompt_groups` gives them (None: no two rows do), or
        FIND to find them here with :func:`prompt_groups` (torch.unique and a read of its size: a device-to-host sync
        per forward). The length-sorted chunks (``chunk_rows``) find their own.

        ``head_rows`` (:func:`head_positions`; None: every position): the head computes only the positions it names,
        as :func:`selected_logprobs` does; the others hold 0."""
        args = (temperature, compute_entropy, impl, entropy_grad)
        if not chunk_rows or lengths is None:
            return self._logprobs(prompt_ids, prompt_mask, completion_ids, *args, groups, head_rows)
        # length-sorted chunks, each cut to its own longest prompt and completion, padded back to [B, C]
        P, C = prompt_ids.shape[1], completion_ids.shape[1]
        order = torch.argsort(lengths, stable=True)
        code = None if head_rows is None else position_codes(head_rows, completion_ids.shape)
        logps, entropies = [], []
        for rows in order.split(chunk_rows):
            p = max(1, int(prompt_mask[rows].sum(1).max()))  # left-padded: the real tokens are the last p columns
            c = max(1, int(lengths[rows].max()))
            sub = None if code is None else code_positions(code[rows, :c])
            lp, ent = self._logprobs(
                prompt_ids[rows, P - p :], prompt_mask[rows, P - p :], completion_ids[rows, :c], *args, FIND, sub
            )
            logps.append(torch.nn.functional.pad(lp, (0, C - c)))
            entropies.append(None if ent is None else torch.nn.functional.pad(ent, (0, C - c)))
        back = torch.argsort(order)
        entropy = None if entropies[0] is None else torch.cat(entropies)[back]
        return torch.cat(logps)[back], entropy

    def _logprobs(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        temperature: float,
        compute_entropy: bool,
        impl: str,
        entropy_grad: bool,
        groups: PromptGroups | None | str,
        head_rows: HeadRows | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        backbone, head = backbone_and_head(self.model)
        P, C = prompt_ids.shape[1], completion_ids.shape[1]
        if not (self.share_prompts and can_share(backbone)):
            groups = None
        elif isinstance(groups, str):
            groups = prompt_groups(prompt_ids, prompt_mask)
        if groups is not None:
            h = shared_prompt_hidden(backbone, prompt_ids, prompt_mask, completion_ids, *groups)  # [B, C, D]
        else:
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
            hidden = backbone(input_ids=input_ids, attention_mask=attn, use_cache=False).last_hidden_state
            h = hidden[:, P - 1 : P + C - 1]  # [B, C, D]
        bias = getattr(head, "bias", None)
        kw = {"compute_entropy": compute_entropy, "impl": impl, "entropy_grad": entropy_grad}
        if head_rows is not None:
            return selected_logprobs(h, head.weight, completion_ids, head_rows, temperature, bias, **kw)
        return token_logprobs(h, head.weight, completion_ids, temperature, bias, **kw)


def head_positions(mask: torch.Tensor, trains: torch.Tensor | None, device: torch.device | str) -> HeadRows:
    """Which completion positions of a micro-batch the head computes, from host tensors (no device-to-host sync):
    the real tokens (``mask`` [B, C] on the CPU) of the rows that train (``trains`` [B] bool on the CPU, from
    loss.rows_with_gradient; None: none does, as in a no-grad pass), then those of the rows that do not.

        grad = {b*C + t : mask[b, t] and trains[b]},   free = {b*C + t : mask[b, t] and not trains[b]}

    Sent to ``device`` without blocking. Padding and masked-out rows are in neither: every caller masks them."""
    m = mask.bool()
    trains = torch.zeros(m.shape[0], dtype=torch.bool) if trains is None else trains.bool()
    grad = (m & trains.unsqueeze(1)).flatten().nonzero().squeeze(1)
    free = (m & ~trains.unsqueeze(1)).flatten().nonzero().squeeze(1)
    return grad.to(device, non_blocking=True), free.to(device, non_blocking=True)


def selected_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rows: HeadRows,
    temperature: float,
    bias: torch.Tensor | None = None,
    *,
    compute_entropy: bool = False,
    impl: str = "auto",
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.token_logprobs of hidden ``h`` [B, C, D] at the positions ``rows`` names only, [B, C] with 0 elsewhere:

        grad positions: token_logprobs(h[grad], W, y[grad])   forward + backward: 4NVD for a frozen head
        free positions: the same under no_grad                 forward only: 2NVD, nothing kept for a backward
        others        : 0                                      nothing computed

    The loss gives a free position's log-prob no gradient (loss.rows_with_gradient), so the gradients are those of
    the full computation; a padded position costs nothing. With no grad position the result still depends on ``h``
    and ``weight`` (an empty slice's sum), so a backward runs and every parameter gets its (zero) gradient, as
    distributed wrappers expect."""
    B, C, D = h.shape
    flat_h, flat_y = h.reshape(-1, D), targets.reshape(-1)
    grad, free = rows
    logp = torch.zeros(B * C, dtype=torch.float32, device=h.device)
    ent = torch.zeros_like(logp) if compute_entropy or entropy_grad else None

    def run(idx: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        # expand_rows: a gather whose backward adds each row's gradient without atomics on either device
        return token_logprobs(expand_rows(flat_h, idx), weight, flat_y.index_select(0, idx), temperature, bias, **kw)

    if grad.numel():
        lp, e = run(grad, compute_entropy=compute_entropy, impl=impl, entropy_grad=entropy_grad)
        logp = logp.index_copy(0, grad, lp)
        ent = ent if ent is None else ent.index_copy(0, grad, e)
    elif torch.is_grad_enabled():  # zero gradients for h and the head, so that a backward still runs
        logp = logp + (flat_h.reshape(-1)[:0].sum() + weight.reshape(-1)[:0].sum()).float()
    if free.numel():
        with torch.no_grad():
            lp, e = run(free, compute_entropy=compute_entropy or entropy_grad, impl=impl)
        logp = logp.index_copy(0, free, lp)
        ent = ent if ent is None else ent.index_copy(0, free, e)
    return logp.view(B, C), None if ent is None else ent.view(B, C)


def position_codes(rows: HeadRows, shape: torch.Size) -> torch.Tensor:
    """[B, C] int8: 2 at ``rows``' grad positions, 1 at its free ones, 0 elsewhere (to cut chunks of rows from)."""
    code = torch.zeros(shape.numel(), dtype=torch.int8, device=rows[0].device)
    return code.index_fill(0, rows[0], 2).index_fill(0, rows[1], 1).view(shape)


def code_positions(code: torch.Tensor) -> HeadRows:
    """The HeadRows of a [b, c] block of :func:`position_codes` (a nonzero each: a sync, as the chunked pass has)."""
    flat = code.reshape(-1)
    return (flat == 2).nonzero().squeeze(1), (flat == 1).nonzero().squeeze(1)


def prompt_keys(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[int]:
    """Each row's key: the first row with the same prompt (ids and mask), from one read of the prompts to the host
    (a round's, once per round), so that :func:`host_prompt_groups` finds any subset's groups without the device."""
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(tuple(row), i) for i, row in enumerate(torch.cat([prompt_ids, prompt_mask], 1).tolist())]


def host_prompt_groups(keys: list[int], device: torch.device) -> PromptGroups | None:
    """:func:`prompt_groups` of rows with prompt ``keys`` (:func:`prompt_keys`), computed on the host and sent to
    ``device`` (no device-to-host sync): the distinct prompts in order of first appearance; None when no two rows
    share one."""
    distinct: dict[int, int] = {}
    first, inverse = [], []
    for i, key in enumerate(keys):
        if key not in distinct:
            distinct[key] = len(first)
            first.append(i)
        inverse.append(distinct[key])
    if len(first) == len(keys):
        return None
    send = lambda x: torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)  # noqa: E731
    return send(first), send(inverse)


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(one row index per distinct prompt [U], each row's prompt among them [B]); None when no two rows share one."""
    _, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    U = int(inverse.max()) + 1 if inverse.numel() else 0
    if U == prompt_ids.shape[0]:
        return None
    rows = torch.arange(inverse.numel(), device=inverse.device)
    first = torch.full((U,), inverse.numel(), dtype=torch.long, device=inverse.device).scatter_reduce(
        0, inverse, rows, reduce="amin"
    )
    return first, inverse


def can_share(backbone) -> bool:
    """A backbone whose prompt forward can hand its KV cache to the completions: transformers' DynamicCache of
    plain full-attention layers, and no gradient checkpointing (which turns the cache off)."""
    if getattr(backbone, "is_gradient_checkpointing", False) or getattr(backbone, "gradient_checkpointing", False):
        return False
    from transformers.cache_utils import DynamicCache, DynamicLayer

    try:
        cache = DynamicCache(config=backbone.config)
    except Exception:  # a model whose config DynamicCache cannot read: no sharing
        return False
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


def shared_prompt_hidden(
    backbone,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    first: torch.Tensor,
    inverse: torch.Tensor,
) -> torch.Tensor:
    """The hidden states [B, C, D] that predict each completion token, with each distinct prompt run once.

    The distinct prompts ``prompt_ids[first]`` [U, P] run through the backbone with a DynamicCache; their keys and
    values and the last prompt position's hidden state are indexed out to the B rows (``inverse``), and the
    completion tokens but the last [B, C-1] run over that cache. Row b's hidden states are then
    [h(prompt)[P-1], h(completion)[0 .. C-2]], what the full sequence [B, P+C] gives at positions P-1 .. P+C-2
    (positions P .. P+C-2 for the completion tokens, as the full pass's). Prompt FLOPs: U/B of the full pass's."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=backbone.config)
    ids, mask = prompt_ids[first], prompt_mask[first]
    out = backbone(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    last = expand_rows(out.last_hidden_state[:, -1:], inverse)  # [B, 1, D]
    C = completion_ids.shape[1]
    if C == 1:
        return last
    for layer in cache.layers:  # differentiable: each prompt's gradient is the sum over its rows
        layer.keys, layer.values = expand_rows(layer.keys, inverse), expand_rows(layer.values, inverse)
    attn = torch.cat([prompt_mask, prompt_mask.new_ones((prompt_mask.shape[0], C - 1))], dim=1)
    rest = backbone(input_ids=completion_ids[:, :-1], attention_mask=attn, past_key_values=cache, use_cache=True)
    return torch.cat([last, rest.last_hidden_state], dim=1)


def expand_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` along dim 0, with a backward that sums each source row's gradients in the same order every run.

    Which op that is depends on the device (torch's list of nondeterministic ops, torch.use_deterministic_algorithms):
    on CPU, advanced indexing's backward (index_put_ with accumulate) adds rows with parallel atomic float adds once
    the tensor passes the grain size, while index_select's (index_add_) adds them in row order; on CUDA it is the
    other way round (index_add_ uses atomics, index_put_ with accumulate sorts the indices first)."""
    return x[index] if x.device.type == "cuda" else x.index_select(0, index)


def check_logprob_impl(impl: str, device: torch.device) -> None:
    """Refuse grpo.logprob_impl=triton on a device the Triton kernels cannot run on (anything but CUDA, unless
    TRITON_INTERPRET=1 runs them on CPU, as the kernel tests do), or where triton is not installed."""
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"grpo.logprob_impl=triton needs a CUDA device, but GRPO runs on {device} (run.device); "
            "use grpo.logprob_impl: auto or chunked"
        )
    if impl == "triton" and not triton_available():
        raise ValueError(
            "grpo.logprob_impl=triton needs the triton package, which is not installed (pyproject installs it on "
            "Linux only); use grpo.logprob_impl: auto or chunked"
        )


def completion_lengths(batch: RoundTensors) -> torch.Tensor:
    """[B] tokens of each completion: its mask's count, or the round's width C for a row whose mask was zeroed
    because it was truncated (mask_truncated_completions: it ran to max_completion_length, the widest)."""
    n = batch.completion_mask.sum(1)
    return torch.where((n == 0) & batch.truncated, batch.completion_ids.shape[1], n)


def root_logprobs(
    root: torch.nn.Module,
    batch: RoundTensors,
    temperature: float,
    compute_entropy: bool = False,
    impl: str = "auto",
    entropy_grad: bool = False,
    chunk_rows: int = 0,
    groups: PromptGroups | None | str = FIND,
    head_rows: HeadRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, C] (and entropy) of ``batch``'s completions through ``root``: a
    :class:`PolicyLogProbs` or the distributed wrapper around one; ``groups`` and ``head_rows`` as its forward
    takes them.

    ``chunk_rows`` > 0 (grpo.logprob_chunk_rows): the rows sorted by completion length, ``chunk_rows`` at a time,
    each chunk cut to its longest prompt and completion instead of the round's widths; the positions past a row's
    length hold 0 (masked out by every caller). Same values up to float rounding: RoPE positions shift with the
    cut left padding, by the same amount for every token of a row, which attention does not see."""
    lengths = completion_lengths(batch) if chunk_rows else None
    return root(
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        temperature,
        compute_entropy,
        impl,
        entropy_grad,
        lengths,
        chunk_rows,
        groups,
        head_rows,
    )


def policy_logprobs(
    model,
    batch: RoundTensors,
    temperature: float,
    compute_entropy: bool = False,
    impl: str = "auto",
    entropy_grad: bool = False,
    chunk_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, C] (and entropy, without gradient) of the completion tokens under ``model``.

    ``impl`` picks the kernels.token_logprobs implementation (tests and benchmarks compare them).
    ``entropy_grad`` (the entropy bonus): the entropy carries its gradient, dH/dz = -p (log p + H), formed inside
    the same fused kernels (no [tokens, vocabulary] tensor). ``chunk_rows``: as in :func:`root_logprobs`."""
    return root_logprobs(PolicyLogProbs(model), batch, temperature, compute_entropy, impl, entropy_grad, chunk_rows)
