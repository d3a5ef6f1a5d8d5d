"""What every path shares: the numerics, DCLR's noise draw and count, ESCL's relative
difference, and each method's default hyper-parameters.

A leaf: it imports only torch. The reference (:mod:`fastcl.reference`), the fast paths
and the integrations all take these from here, so the oracle and the code it checks
agree on them by construction, and a default is changed in one place.
"""

from __future__ import annotations

import contextlib
import math

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


def huge_row_limit(dtype: torch.dtype, dim: int) -> float:
    """The largest row max-abs ``a`` a chunk GEMM takes as is: ``‖x‖ ≤ √d·a ≤ √max / 2`` in
    the accumulate dtype, so that ‖x‖², every dot product of two such rows and the chain
    rule's ``Σ_j |∂ℓ/∂s_ij|·‖k_j‖ ≤ 2(2 + |m|)/τ · ‖k‖`` (with the bound on τ of
    :func:`fastcl._validation.temperature`) stay finite. float32: 2^63/√d ≈ 3.3e17 at d = 768."""
    return math.sqrt(torch.finfo(accumulate_dtype(dtype)).max / max(dim, 1)) / 2


def shrink_huge_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` with each row whose max-abs exceeds :func:`huge_row_limit` multiplied by the power
    of two that brings its max-abs into [2¹⁰, 2¹¹), the other rows unchanged.

    The product is exact (a power of two, kept a normal number), and a cosine — hence every
    loss here and alignment/uniformity — is invariant to a positive factor on a row, so the
    value is that of the unscaled rows and the gradient flows back through the factor. It
    only changes what the float arithmetic can hold: the squared norm of a float32 row of
    max-abs ≳ 1e19 is inf, and x/‖x‖ then 0. No host sync; always a new tensor (callers on
    the hot path test ``amax`` first). ``amax``: the rows' max-abs, if known."""
    if amax is None:
        amax = torch.linalg.vector_norm(x.detach(), ord=float("inf"), dim=1)
    amax = amax.to(accumulate_dtype(x.dtype))
    _, exponent = torch.frexp(amax)                  # amax = mantissa · 2^exponent, mantissa ∈ [½, 1)
    factor = torch.ldexp(torch.ones_like(amax), 11 - exponent)
    huge = amax > huge_row_limit(x.dtype, x.shape[-1])
    return x * torch.where(huge, factor, torch.ones_like(factor)).to(x.dtype)[:, None]


def safe_direction(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g_j/‖g_j‖ for each row, the bool mask of the rows with g_j = 0)``; a zero row's
    direction is 0.

    The norm is taken of ``g_j/max|g_j|``, whose entries lie in [−1, 1] with one of magnitude
    1, so its square neither underflows nor overflows: a float32 gradient row of entries
    ≈ 1e-25 has ‖g‖² ≈ 1e-50, which is 0 (or a subnormal that has lost its digits), and
    ``g/max(‖g‖, tiny)`` is then a step 1e10–1e13 times too long."""
    amax = torch.linalg.vector_norm(g, ord=float("inf"), dim=1, keepdim=True)
    zero = amax == 0
    scaled = g / amax.masked_fill(zero, 1.0)
    norm = torch.linalg.vector_norm(scaled, dim=1, keepdim=True)    # in [1, √d]
    return scaled / norm.masked_fill(zero, 1.0), zero.squeeze(1)


def project_out_radial(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g − x̂(x̂·g)`` with ``x̂ = x/‖x‖`` formed by division (rows with ‖x‖ ≤ EPS, where
    x̂ = x/EPS is linear and has no projection, unchanged), in g's dtype.

    The gradient of anything that depends on x only through x̂ is orthogonal to x; this is
    that projection applied once more, to the gradient as computed. It removes the rounding
    residual along x that the chain rule leaves — which :func:`safe_direction` would blow up
    to a full step where the exact gradient is 0, as it is at d = 1 (a cosine of ±1 does
    not change with x) — and at d = 1 gives an exact 0 (x̂ = ±1 exactly)."""
    x = x.to(g.dtype)
    x_hat, _ = safe_direction(x)
    radial = (x_hat * g).sum(dim=1, keepdim=True)
    radial = radial.masked_fill(torch.linalg.vector_norm(x, dim=1, keepdim=True) <= EPS, 0.0)
    return g - x_hat * radial


def unit(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x̂ = x / max(‖x‖, EPS)`` formed in x's accumulate dtype, returned in ``dtype``."""
    return F.normalize(wide(x), dim=1, eps=EPS).to(dtype)


def autocast_off(device) -> contextlib.AbstractContextManager:
    """A context without autocast for ``device``'s type (a no-op where autocast is off or the
    type has none, e.g. meta): the losses form their own GEMMs and reductions in the inputs'
    dtype (float32 or wider for the logits), and autocast would round them back to 16 bits."""
    device_type = torch.device(device).type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:        # a device type without autocast
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


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

#: Above every value a normal draw of torch's generators gives: they transform uniform
#: draws by Box–Muller, whose largest output is √(−2 ln u_min) < 9 (u_min = 2⁻⁵³).
NORMAL_MAX = 16.0


def draw_noise(num: int, dim: int, *, std: float = 1.0, generator: torch.Generator | None = None,
               device=None) -> torch.Tensor:
    """DCLR's initial noise negatives: ``Z ∈ R^{num×dim}``, entries ``N(0, std²)``, drawn in float32."""
    return torch.randn(num, dim, generator=generator, device=device, dtype=torch.float32) * std


def noise_count(noise_ratio: float, n: int, formulation: str = "paper") -> int:
    """``K = round(noise_ratio · N)``; the released code truncates: ``int(N · noise_ratio)``."""
    return int(n * noise_ratio) if formulation == "released" else int(round(noise_ratio * n))


# --- ESCL's relative difference ---------------------------------------------------------

def relative_difference(anchors: torch.Tensor, positives: torch.Tensor, sensitive: torch.Tensor, *,
                        temperature: float, rd: str, margins: tuple[float, float]) -> torch.Tensor:
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
