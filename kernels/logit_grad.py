"""The gradient, with respect to one tile of logits, of the fused kernels' two outputs: log-prob and entropy.

For one row with logits z [V] (z = (h W^T + b) / T), p = softmax(z), lse = logsumexp(z), target y:

    logp = z_y - lse                  d logp / dz_v = onehot(y)_v - p_v
    H    = lse - sum_v p_v z_v        d H / dz_v    = -p_v (log p_v + H) = -p_v (z_v - lse + H)

With upstream gradients g (of logp) and g_H (of H), the gradient of the pre-temperature logits u = h W^T + b is

    G_v = dL / du_v = (1/T) [ g onehot(y)_v - p_v (g + g_H (z_v - lse + H)) ]

and dh = G W, dW = G^T h, db = sum_n G_n. The entropy is computed online in the forward pass from the same
sums as the logsumexp (running max m, s = sum e^(z-m), sum e^(z-m) z: H = lse - (sum e z) / s), so the
backward needs only lse and H per row. The chunked torch paths call :func:`logit_grad` per tile; the Triton
kernel (kernels/triton_logprobs.py, ``_grad_logits_kernel``) computes the same expression in registers.
"""

from __future__ import annotations

import torch


def logit_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    local_y: torch.Tensor,
    g_t: torch.Tensor,
    ent: torch.Tensor | None = None,
    ge_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """G = (1/T)[g onehot(y) - p (g + g_H (z - lse + H))] for a float32 logits tile z [n, c], overwriting z.

    ``lse`` [n] the rows' logsumexp over the whole vocabulary; ``local_y`` [n] the target's column within this
    tile (outside [0, c) when the target is in another tile); ``g_t`` = g / T [n]; ``ent`` (H) and ``ge_t`` =
    g_H / T [n] when the entropy has a gradient (both None otherwise: the log-prob term alone)."""
    log_p = z.sub_(lse[:, None])  # z - lse = log p
    if ent is None or ge_t is None:
        grad = log_p.exp_().mul_(-g_t[:, None])  # -p g/T
    else:
        coef = torch.addcmul(g_t[:, None], ge_t[:, None], log_p + ent[:, None])  # (g + g_H (log p + H)) / T
        grad = log_p.exp_().mul_(coef).neg_()
    c = z.shape[1]
    inside = (local_y >= 0) & (local_y < c)
    # + g onehot(y) / T at each row's target when it falls in this tile, by masked arithmetic: indexing the rows by
    # ``inside`` would be a nonzero, a device-to-host sync per tile
    grad.scatter_add_(1, local_y.clamp(0, c - 1)[:, None], torch.where(inside, g_t, 0.0).to(grad.dtype)[:, None])
    return grad
