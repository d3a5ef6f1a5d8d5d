"""Alignment and uniformity (Wang & Isola, ICML 2020), on L2-normalized embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _validation as check
from .common import EPS, autocast_off, wide

#: Pairs (entries of the Gram block) uniformity forms at once.
_UNIFORMITY_BLOCK = 2**22


@check.one_host_read
def alignment(x: torch.Tensor, y: torch.Tensor, alpha: float = 2) -> torch.Tensor:
    r"""``ℓ_align = mean_i ‖x̂_i − ŷ_i‖^α`` over positive pairs (rows of x and y). Lower is better."""
    x = check.embeddings("x", x, scale_free=True)
    y = check.embeddings("y", y, rows=x.shape[0], width=x.shape[1], like=x, like_name="x",
                         scale_free=True)
    alpha = check.positive("alpha", alpha)
    check.read_inputs()
    with autocast_off(x.device):
        x, y = wide(x), wide(y)    # 16-bit norms overflow (fp16) or lose the small differences
        diff = F.normalize(x, dim=-1, eps=EPS) - F.normalize(y, dim=-1, eps=EPS)
        return diff.norm(dim=1).pow(alpha).mean()


@check.one_host_read
def uniformity(x: torch.Tensor, t: float = 2) -> torch.Tensor:
    r"""``ℓ_uniform = log mean_{i<j} exp(−t ‖x̂_i − x̂_j‖²)`` over all distinct pairs. Lower is better.

    ``‖x̂_i − x̂_j‖² = ‖x̂_i‖² + ‖x̂_j‖² − 2 x̂_i·x̂_j`` from Gram blocks of at most 2²² pairs
    (clamped at 0, where rounding makes a duplicate pair negative), reduced by a stable
    log-sum-exp: ordinary differentiable ops, so it can be differentiated twice (a gradient
    penalty), which ``torch.pdist`` cannot."""
    x = check.embeddings("x", x, scale_free=True)
    t = check.positive("t", t)
    n = x.shape[0]
    if n < 2:
        raise ValueError(f"uniformity needs at least 2 rows in x, got {n}")
    check.read_inputs()
    with autocast_off(x.device):
        u = F.normalize(wide(x), dim=-1, eps=EPS)
        sq_norm = (u * u).sum(dim=1)
        rows = max(1, _UNIFORMITY_BLOCK // n)
        parts = []
        for r0 in range(0, n - 1, rows):
            r1 = min(n - 1, r0 + rows)
            # pairs (i, j), r0 ≤ i < r1, j > i: column c of the block is j = r0 + 1 + c
            sq = (sq_norm[r0:r1, None] + sq_norm[None, r0 + 1:]
                  - 2.0 * (u[r0:r1] @ u[r0 + 1:].T)).clamp_min(0.0)
            upper = (torch.arange(n - r0 - 1, device=u.device)[None, :]
                     >= torch.arange(r1 - r0, device=u.device)[:, None])
            parts.append(torch.logsumexp((-t * sq).masked_fill(~upper, -math.inf).flatten(), dim=0))
        lse = torch.logsumexp(torch.stack(parts), dim=0)
        return lse - math.log(n * (n - 1) / 2)
