"""Alignment and uniformity (Wang & Isola, ICML 2020), on L2-normalized embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _validation as check
from .common import EPS, wide


def alignment(x: torch.Tensor, y: torch.Tensor, alpha: float = 2) -> torch.Tensor:
    r"""``ℓ_align = mean_i ‖x̂_i − ŷ_i‖^α`` over positive pairs (rows of x and y). Lower is better."""
    x = check.embeddings("x", x)
    y = check.embeddings("y", y, rows=x.shape[0], width=x.shape[1], like=x)
    alpha = check.positive("alpha", alpha)
    x, y = wide(x), wide(y)        # 16-bit norms overflow (fp16) or lose the small differences
    diff = F.normalize(x, dim=-1, eps=EPS) - F.normalize(y, dim=-1, eps=EPS)
    return diff.norm(dim=1).pow(alpha).mean()


def uniformity(x: torch.Tensor, t: float = 2) -> torch.Tensor:
    r"""``ℓ_uniform = log mean_{i<j} exp(−t ‖x̂_i − x̂_j‖²)`` over all distinct pairs. Lower is better."""
    x = check.embeddings("x", x)
    t = check.positive("t", t)
    if x.shape[0] < 2:
        raise ValueError(f"uniformity needs at least 2 rows in x, got {x.shape[0]}")
    sq = torch.pdist(F.normalize(wide(x), dim=-1, eps=EPS), p=2).pow(2)   # pdist: no 16-bit kernel
    # log-mean-exp, computed stably
    return torch.logsumexp(-t * sq, dim=0) - torch.log(torch.tensor(float(sq.numel()), dtype=sq.dtype))
