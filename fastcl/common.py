"""What every path shares: the numerics, DCLR's noise draw and count, ESCL's relative
difference, and each method's default hyper-parameters.

A leaf: it imports only torch. The reference (:mod:`fastcl.reference`), the fast paths
and the integrations all take these from here, so the oracle and the code it checks
agree on them by construction, and a default is changed in one place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# --- numerics ---------------------------------------------------------------------------

EPS = 1e-12  # ĥ = h / max(‖h‖, EPS), as F.normalize


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Losses are computed in float64 for float64 inputs and in float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its accumulate dtype (float32, or float64 for float64)."""
    return x.to(accumulate_dtype(x.dtype))


def row_cosine(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``cos(x_i, y_i)`` for each row, with each norm clamped at EPS, in float32 or wider
    (16-bit norms and dots lose small differences, and overflow in fp16 at norms ≈ 256).
    Autograd keeps only x, y and per-row scalars (no normalized N×d copies, unlike
    F.cosine_similarity)."""
    x, y = wide(x), wide(y)
    norms = (torch.linalg.vector_norm(x, dim=-1).clamp_min(EPS)
             * torch.linalg.vector_norm(y, dim=-1).clamp_min(EPS))
    return wide(torch.einsum("nd,nd->n", x, y) / norms)


# --- DCLR's noise negatives -------------------------------------------------------------

def draw_noise(num: int, dim: int, *, std: float = 1.0, generator: torch.Generator | None = None,
               device=None) -> torch.Tensor:
    """DCLR's initial noise negatives: ``Z ∈ R^{num×dim}``, entries ``N(0, std²)``, drawn in float32."""
    return torch.randn(num, dim, generator=generator, device=device, dtype=torch.float32) * std


def noise_count(noise_ratio: float, n: int, formulation: str = "paper") -> int:
    """``K = round(noise_ratio · N)``; the released code truncates: ``int(N · noise_ratio)``."""
    return int(n * noise_ratio) if formulation == "released" else int(round(noise_ratio * n))


# --- ESCL's relative difference ---------------------------------------------------------

def relative_difference(anchors: torch.Tensor, positives: torch.Tensor, sensitive: torch.Tensor, *,
                        temperature: float, rd: str = "softplus",
                        margins: tuple[float, float] = (0.1, 0.3)) -> torch.Tensor:
    """ESCL's relative-difference term, ``mean`` over rows and both views h' ∈ {h, h⁺}.

    ``rd="softplus"``: ``softplus((D^pos − D^neg(h'))/τ)`` with ``D = 1 − cos``;
    ``rd="margin"``: ``relu(Δ + a) + relu(−Δ − b)``, ``Δ = cos(h', h⁻) − cos(h, h⁺)``.
    It only pairs row i with row i (O(N·d)), so every backend computes it this way.
    """
    cos_pos = row_cosine(anchors, positives)
    terms = []
    for view in (anchors, positives):
        cos_neg = row_cosine(view, sensitive)
        if rd == "softplus":
            # Dist_pos − Dist_neg = (1 − cos_pos) − (1 − cos_neg)
            terms.append(F.softplus((cos_neg - cos_pos) / temperature))
        else:
            delta = cos_neg - cos_pos
            terms.append(F.relu(delta + margins[0]) + F.relu(-delta - margins[1]))
    return torch.stack(terms).mean()


# --- method defaults (the papers' settings) ---------------------------------------------

TEMPERATURE = 0.05          # τ, every method (SimCSE)
FOCAL_M = 0.3               # Focal-InfoNCE's m
PHI = 0.9                   # DCLR's φ (BERT)
PHI_ROBERTA = 0.85          # DCLR's φ for RoBERTa
NOISE_RATIO = 1.0           # DCLR: K = noise_ratio · N noise negatives (BERT)
NOISE_RATIO_ROBERTA = 2.5   # DCLR's noise ratio for RoBERTa
NOISE_STEPS = 4             # DCLR: k gradient-ascent steps
NOISE_LR = 1e-3             # DCLR: β
NOISE_STD = 1.0             # DCLR: Z ~ N(0, std²)
ESCL_WEIGHT = 2.5e-3        # ESCL's λ
ESCL_RD = "softplus"        # ESCL's relative-difference form
ESCL_MARGINS = (0.1, 0.3)   # ESCL's margins (a, b) for rd="margin"
SENSITIVE_DROPOUT = 0.45    # ESCL: dropout of the high-dropout "sensitive" view

# --- positive-view augmentations (fastcl.augment, --augment NAME[:rate]) -----------------

# The rate of each augmentation when --augment gives none: the share of a sentence's content
# tokens changed (cutoffs, deletion, the share shuffled) or of the embedding dimensions cut.
# feature_cutoff 0.2 and a full word_shuffle are the rates of ConSERT's released unsupervised
# recipe (feature cutoff 0.2 on one view, shuffle on the other); the other rates are fastcl's
# choice (0.1, SimCSE's smallest word-deletion rate).
AUGMENT_RATES = {"token_cutoff": 0.1, "span_cutoff": 0.1, "feature_cutoff": 0.2,
                 "word_shuffle": 1.0, "word_deletion": 0.1}
