"""The GRPO policy loss for one micro-batch (TRL GRPOTrainer._compute_loss semantics).

Notation (docs/grpo.md): logp, old_logp, ref_logp [B, T]; mask m [B, T];
advantages A [B].

    log_w = logp - old_logp                           (token level)
          = sum_t m*(logp-old_logp) / max(1, sum_t m) (sequence level, GSPO; broadcast over t)
    w      = exp(log_w);  w_clip = clamp(w, 1-eps, 1+eps_high);  w = min(w, delta) if delta
    l      = -min(w*A, w_clip*A)                       (grpo, bnpo, dr_grpo, dapo, gspo; luspo: length-unbiased
                                                        sequence policy optimization, arXiv 2602.05261)
           = -sg(min(w, eps_high)) * A * logp          (cispo: clipped IS-weight policy optimization, MiniMax-M1,
                                                        arXiv 2506.13585; sg = stop-gradient; eps_high is a cap)
           = -sigmoid(tau*(w-1)) * 4/tau * A           (sapo: soft adaptive policy optimization, arXiv 2511.20347;
                                                        tau = sapo_temperature_pos if A > 0 else _neg)
           = -sg(phi(W)) * A * logp                    (vespo: variational sequence-level soft policy optimization,
                                                        arXiv 2602.10693; W = exp(sum_t m*clamp(logp-old)) per
                                                        sequence, times the sampler ratios when given;
                                                        phi(W) = exp(lam + k log W - lam W), (k, lam) by sign of A)
    l     *= opsm[b] = (A[b] >= 0) or mean_t m*(sampler_logp - sg(logp)) <= off_policy_mask_threshold
                                                       (off-policy sequence mask, DeepSeek-V3.2; NaN -> 0)
    l     *= H[b,t] >= quantile(H over m, 1 - top_entropy_quantile)     (train on high-entropy tokens only)
    l     *= is_ratio                                  (sampler correction, when given; not vespo: inside phi)
    kl     = exp(ref-logp) - (ref-logp) - 1            (k3; *= w when use_bias_correction_kl)
    l     += beta * kl
    loss   = aggregate(l, m) by loss_type:
      grpo/gspo/sapo : mean_b( sum_t m*l / max(1, sum_t m) ) / GA
      luspo     : mean_b( sum_t m*l ) / GA             (a sequence's tokens summed, not averaged)
      bnpo      : sum(m*l) / max(1, sum(m)) / GA
      dr_grpo   : sum(m*l) / (B * max_completion_length) / GA
      dapo/cispo/vespo : sum(m*l) / (max(1, N_round) / world * GA / steps_per_generation)
    loss  -= entropy_coef * sum(m'*H) / max(1, sum(m')) / GA   (entropy bonus, when entropy_coef is given;
                                                        m' = m times the high-entropy mask; tasks/grpo/regularizers.py)

The returned loss is what one micro-batch contributes to the gradient of an optimizer step
(the division by GA is inside), so the caller just sums backward() calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossSettings:
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    max_completion_length: int = 256
    gradient_accumulation_steps: int = 1
    steps_per_generation: int = 1
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    num_processes: int = 1  # the world size: dapo's N_round is the whole round's token count (all ranks)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    s: LossSettings,
    *,
    ref_logp: torch.Tensor | None = None,
    is_ratio: torch.Tensor | None = None,
    num_items_in_round: float | None = None,
    entropy: torch.Tensor | None = None,
    sampler_logp: torch.Tensor | None = None,
    entropy_coef: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and detached per-token tensors for metrics. ``entropy`` (the policy's, [B, T]) is
    needed when top_entropy_quantile < 1 or with the entropy bonus; ``sampler_logp`` is what the off-policy mask
    compares the policy with (the sampling engine's log-probs; default: old_logp). ``entropy_coef`` (None: no
    bonus) subtracts the bonus; extras then hold ``entropy_sum`` and ``entropy_tokens`` for its controller."""
    mask = mask.to(logp.dtype)
    old = logp.detach() if old_logp is None else old_logp
    log_ratio = logp - old  # [B, T]
    coef_1 = torch.exp(importance_log_weight(log_ratio, mask, s))
    adv = advantages.unsqueeze(1)  # [B, 1]
    kl = k3_kl(logp, ref_logp, coef_1, s)
    per_token, coef_1 = policy_term(logp, log_ratio, coef_1, adv, mask, is_ratio, s)
    if s.off_policy_mask_threshold is not None:
        per_token = per_token * off_policy_mask(adv, logp, sampler_logp if sampler_logp is not None else old, mask, s)
    entropy_mask = _entropy_mask(entropy, mask, s)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if is_ratio is not None and s.loss_type != "vespo":
        per_token = per_token * is_ratio
    if kl is not None:
        per_token = per_token + s.beta * kl
    per_token = per_token.expand_as(mask) if per_token.shape != mask.shape else per_token
    loss = aggregate_loss(per_token, mask, s, num_items_in_round)
    bonus = None
    if entropy_coef is not None:
        term, bonus = entropy_bonus(entropy, mask, entropy_mask, s.gradient_accumulation_steps)
        loss = loss - entropy_coef * term
    return loss, clip_metrics(coef_1, adv, mask, s, kl, bonus)


def rows_with_gradient(advantages: torch.Tensor, s: LossSettings, entropy_bonus: bool) -> torch.Tensor:
    """[B] bool: the rows whose log-probs :func:`grpo_loss` can give a gradient (the others need only their values,
    for the metrics: batch.selected_logprobs computes them without a backward).

    Every policy term above is a product with the row's advantage A (-min(wA, w_clip A), -sg(.) A logp,
    -sigmoid(.) 4/tau A, -sg(phi) A logp), and what follows multiplies it by masks and weights that carry no
    gradient and sums it with constant normalizers. So a row with A = 0 exactly (a group whose rewards are all
    equal) gets a zero gradient, unless a term without A applies: the KL (beta > 0) or the entropy bonus; then
    every row may get one.

        trains[b] = A[b] != 0     (beta == 0 and no entropy bonus)
                  = True          (otherwise)"""
    if s.beta != 0.0 or entropy_bonus:
        return torch.ones(advantages.shape, dtype=torch.bool, device=advantages.device)
    return advantages != 0


def importance_log_weight(log_ratio: torch.Tensor, mask: torch.Tensor, s: LossSettings) -> torch.Tensor:
    """log_w: the token-level log ratio [B, T] as it is, or at sequence level (importance_sampling_level
    "sequence", or gspo) its masked mean per sequence [B, 1]:

        log_w[b] = sum_t m*(logp - old_logp) / max(1, sum_t m)"""
    if s.importance_sampling_level == "sequence" or s.loss_type == "gspo":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    return log_ratio


def k3_kl(
    logp: torch.Tensor, ref_logp: torch.Tensor | None, coef_1: torch.Tensor, s: LossSettings
) -> torch.Tensor | None:
    """The per-token k3 estimate of KL(policy || reference):

        d = ref_logp - logp;  kl = exp(d) - d - 1;  kl *= w  (use_bias_correction_kl)
    w is the ratio before any delta cap; None when beta == 0."""
    if s.beta == 0.0:
        return None
    if ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    if s.use_bias_correction_kl:
        kl = kl * coef_1
    return kl


def policy_term(
    logp: torch.Tensor,
    log_ratio: torch.Tensor,
    coef_1: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    is_ratio: torch.Tensor | None,
    s: LossSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the per-token policy term l before masks, weights and the KL; the ratio w the clip metrics read, capped at
    delta when set), by loss_type:

        cispo  : l = -sg(min(w, eps_high)) * A * logp
        sapo   : l = -sigmoid(tau*(w-1)) * 4/tau * A,  tau = sapo_temperature_pos if A > 0 else _neg
        vespo  : l = -sg(phi(W)) * A * logp            (phi: gamma_weights)
        others : w_clip = clamp(w, 1-eps, 1+eps_high);  w = min(w, delta) if delta;  l = -min(w*A, w_clip*A)"""
    if s.loss_type == "cispo":
        return -torch.clamp(coef_1, max=s.epsilon_high).detach() * adv * logp, coef_1
    if s.loss_type == "sapo":
        tau = torch.where(adv > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        return -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * adv, coef_1
    if s.loss_type == "vespo":
        phi = gamma_weights(adv, log_ratio, mask, is_ratio, s)
        return -phi * adv * logp, coef_1
    coef_2 = torch.clamp(coef_1, 1 - s.epsilon, 1 + s.epsilon_high)
    if s.delta is not None:
        coef_1 = torch.clamp(coef_1, max=s.delta)
    return -torch.min(coef_1 * adv, coef_2 * adv), coef_1


def _entropy_mask(entropy: torch.Tensor | None, mask: torch.Tensor, s: LossSettings) -> torch.Tensor | None:
    """The high-entropy token mask when top_entropy_quantile < 1 (:func:`high_entropy_mask` at quantile
    1 - top_entropy_quantile), else None: every token trains."""
    if s.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the policy's per-token entropy")
        return high_entropy_mask(entropy, mask, 1 - s.top_entropy_quantile)
    return None


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, s: LossSettings, num_items_in_round: float | None
) -> torch.Tensor:
    """The micro-batch's loss from per-token losses l [B, T] by loss_type (GA = gradient_accumulation_steps):

        grpo/gspo/sapo   : mean_b( sum_t m*l / max(1, sum_t m) ) / GA
        luspo            : mean_b( sum_t m*l ) / GA
        bnpo             : sum(m*l) / max(1, sum(m)) / GA
        dr_grpo          : sum(m*l) / (B * max_completion_length) / GA
        dapo/cispo/vespo : sum(m*l) / (max(1, N_round) / world * GA / steps_per_generation)
    N_round: ``num_items_in_round``, the round's active tokens on all ranks (world = num_processes)."""
    ga = s.gradient_accumulation_steps
    if s.loss_type in ("grpo", "gspo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    if s.loss_type == "luspo":
        return (per_token * mask).sum(-1).mean() / ga
    if s.loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / ga
    if s.loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * s.max_completion_length) / ga
    if s.loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_round is None:
            raise ValueError(f"loss_type={s.loss_type} needs num_items_in_round (active tokens of the round)")
        normalizer = max(1.0, float(num_items_in_round)) / s.num_processes * ga / s.steps_per_generation
        return (per_token * mask).sum() / normalizer
    raise ValueError(f"unknown loss_type {s.loss_type!r}")


def entropy_bonus(
    entropy: torch.Tensor | None, mask: torch.Tensor, entropy_mask: torch.Tensor | None, ga: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(the bonus term, which the loss subtracts times entropy_coef; for its controller the detached entropy sum
    and the token count), over m' = m times the high-entropy mask when there is one:

        term = sum(m'*H) / max(1, sum(m')) / GA"""
    if entropy is None:
        raise ValueError("the entropy bonus needs the policy's per-token entropy")
    on = mask if entropy_mask is None else mask * entropy_mask
    bonus = ((entropy * on).sum().detach(), on.sum())
    return (entropy * on).sum() / on.sum().clamp(min=1.0) / ga, bonus


@torch.no_grad()
def clip_metrics(
    w: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    s: LossSettings,
    kl: torch.Tensor | None,
    bonus: tuple[torch.Tensor, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """grpo_loss's extras, [B, T] each: where the ratio w (delta-capped, as TRL's clip metrics use) is clipped,

        low = (w < 1 - eps) & (A < 0);  high = (w > 1 + eps_high) & (A > 0);  region = low | high
    plus the detached kl when beta > 0 and, with the entropy bonus, entropy_sum and entropy_tokens."""
    w = w.expand_as(mask)
    low = (w < 1 - s.epsilon) & (adv < 0)
    high = (w > 1 + s.epsilon_high) & (adv > 0)
    extras = {"is_low_clipped": low, "is_high_clipped": high, "is_region_clipped": low | high}
    if kl is not None:
        extras["kl"] = kl.detach().expand_as(mask)
    if bonus is not None:
        extras["entropy_sum"], extras["entropy_tokens"] = bonus
    return extras


@torch.no_grad()
def off_policy_mask(
    adv: torch.Tensor, logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, s: LossSettings
) -> torch.Tensor:
    """[B, 1]: 1 keeps a completion, 0 drops it. kl = nan_to_num(sampler_logp - logp, 0); a sequence is kept when
    A >= 0 or sum_t m*kl / max(1, sum_t m) <= off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence
    masking; an unscorable sampler token adds no evidence)."""
    kl = torch.nan_to_num(sampler_logp - logp, nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= s.off_policy_mask_threshold)).to(mask.dtype)


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """[B, T] bool: real tokens whose entropy is at least the q-quantile of the micro-batch's real tokens' entropies
    (all False when there is none)."""
    real = entropy[mask.bool()].float()
    if real.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    return ((entropy * mask) >= torch.quantile(real, q)) & mask.bool()


@torch.no_grad()
def gamma_weights(
    adv: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, is_ratio: torch.Tensor | None, s: LossSettings
) -> torch.Tensor:
    """VESPO's sequence weight phi(W) [B, 1], a constant (no gradient):

        log W = clamp( sum_t m * clamp(logp - old, -20, 20) + sum_t clamp(log is_ratio, log 1e-8, 20),
                       log 1e-8, 20 )
        phi   = exp(lam + k log W - lam W),  (k, lam) = (k_pos, lam_pos) if A >= 0 else (k_neg, lam_neg); phi(1) = 1
    (NaN or inf -> 0)."""
    floor = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(is_ratio), floor, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, floor, 20.0)
    pos = adv >= 0
    k = torch.where(pos, s.vespo_k_pos, s.vespo_k_neg)
    lam = torch.where(pos, s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.to(torch.float32)
    return float((x.float() * m).sum() / m.sum().clamp(min=1.0))


def importance_sampling_ratio(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_truncate",
    cap: float | None = 2.0,
    floor: float | None = None,
) -> torch.Tensor:
    """Truncated / masked importance sampling against the sampler's log-probs (TRL's vLLM correction).

    d[b,t] = m * (old_logp - sampler_logp), NaN (sampler could not score) -> 0, i.e. rho = 1
    token_*    : rho = exp(d)                      [B, T]
    sequence_* : rho = exp(sum_t d)                [B, 1]  (0.01 nats/token over 200 tokens is e^2)
    *_truncate : rho = clamp(rho, floor, cap)
    *_mask     : rho = 0 where rho < floor or rho > cap (no lower bound unless floor is set)
    """
    d = torch.nan_to_num((old_logp - sampler_logp) * mask.to(old_logp.dtype), nan=0.0)
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True)
    rho = torch.exp(d)
    if mode.endswith("truncate"):
        return torch.clamp(rho, min=floor, max=cap)
    if mode.endswith("mask"):
        lo = -math.inf if floor is None else floor
        hi = math.inf if cap is None else cap
        return rho.masked_fill((rho < lo) | (rho > hi), 0.0)
    raise ValueError(f"unknown importance sampling mode {mode!r}")


def correction_parts(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, is_ratio: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the sampler-correction metrics are made of, for some rows of a round: the ratios that weigh their
    tokens (rho[m] for token modes; one per row for sequence modes) and |old_logp - sampler_logp| over m where
    the sampler scored the token. Rows are independent, so a round's parts are its micro-batches' concatenated."""
    m = mask.bool()
    flat = is_ratio.flatten() if is_ratio.shape[1] == 1 else is_ratio[m]
    diff = (old_logp - sampler_logp).abs()[m]
    return flat, diff[~torch.isnan(diff)]


def correction_stats(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """sampling/importance_sampling_ratio/{min,mean,max} and sampling/sampling_logp_difference/{mean,max} of a
    round's correction_parts (TRL's names); 0 for an empty round."""
    flat = torch.cat([p[0].flatten() for p in parts]) if parts else torch.zeros(0)
    diff = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0)

    def agg(t: torch.Tensor, how: str) -> float:
        return getattr(t, how)().item() if t.numel() else 0.0

    return {
        "sampling/importance_sampling_ratio/min": agg(flat, "min"),
        "sampling/importance_sampling_ratio/mean": agg(flat, "mean"),
        "sampling/importance_sampling_ratio/max": agg(flat, "max"),
        "sampling/sampling_logp_difference/mean": agg(diff, "mean"),
        "sampling/sampling_logp_difference/max": agg(diff, "max"),
    }
