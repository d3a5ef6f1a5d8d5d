"""The reference objectives: the most literal PyTorch, full N×M matrices, ``F.cross_entropy``.

This module is the oracle that every fast path is tested against and benchmarked
with. It favours being obviously right over being fast or lean: each function
builds the whole similarity matrix and lets autograd differentiate it. Inputs are
not checked here; the public functions in :mod:`fastcl` check them and dispatch.

Notation (``shared/methods.md``): anchors ``h`` (N×d), candidates ``k`` (M×d),
``s_ij = cos(h_i, k_j)``, temperature ``τ``, the positive of anchor i in column i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-12  # ĥ = h / max(‖h‖, EPS), as F.normalize


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Losses are computed in float64 for float64 inputs and in float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(accumulate_dtype(x.dtype))


def cosine_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``s_ij = x̂_i · ŷ_j`` (N×M), float32 or wider."""
    return wide(F.normalize(x, dim=-1, eps=EPS) @ F.normalize(y, dim=-1, eps=EPS).T)


def row_cosine(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``cos(x_i, y_i)`` for each row, with each norm clamped at EPS, in float32 or wider
    (16-bit norms and dots lose small differences, and overflow in fp16 at norms ≈ 256).
    Autograd keeps only x, y and per-row scalars (no normalized N×d copies, unlike
    F.cosine_similarity)."""
    x, y = wide(x), wide(y)
    norms = (torch.linalg.vector_norm(x, dim=-1).clamp_min(EPS)
             * torch.linalg.vector_norm(y, dim=-1).clamp_min(EPS))
    return wide(torch.einsum("nd,nd->n", x, y) / norms)


def _labels(n: int, device, offset: int = 0) -> torch.Tensor:
    """Anchor i's positive column: ``offset + i`` (the anchors may be a slice of the batch)."""
    return torch.arange(n, device=device) + offset


def _at(n: int, columns: int, first: int, device) -> torch.Tensor:
    """(n × columns) bool, True at ``[i, first + i]``."""
    out = torch.zeros(n, columns, dtype=torch.bool, device=device)
    out[torch.arange(n, device=device), torch.arange(n, device=device) + first] = True
    return out


def _candidates(positives, negatives):
    return positives if negatives is None else torch.cat([positives, negatives.to(positives.dtype)])


def infonce(anchors, positives, negatives=None, *, temperature=0.05,
            hard_negative_weight=0.0, symmetric=False, anchor_offset=0):
    """SimCSE InfoNCE: ``mean_i[−l_ii + log Σ_j exp(l_ij)]``, ``l = s/τ``, ``k = [h⁺; h⁻]``.

    ``hard_negative_weight`` ``w`` is a log-weight on anchor i's own hard negative
    (column N+i). ``symmetric`` averages with the reverse direction, positives as
    anchors against the anchors as candidates. With ``anchor_offset`` the anchors are rows
    ``[offset, offset+n)`` of the batch that ``positives`` (and ``negatives``) cover.
    """
    n, n_pos = anchors.shape[0], positives.shape[0]
    logits = cosine_matrix(anchors, _candidates(positives, negatives)) / temperature
    if hard_negative_weight:
        own_negative = _at(n, logits.shape[1], n_pos + anchor_offset, logits.device)
        logits = logits + hard_negative_weight * own_negative
    loss = F.cross_entropy(logits, _labels(n, logits.device, anchor_offset))
    if symmetric:
        reverse = cosine_matrix(positives, anchors) / temperature
        loss = 0.5 * (loss + F.cross_entropy(reverse, _labels(n, logits.device)))
    return loss


def focal_infonce(anchors, positives, negatives=None, *, temperature=0.05, m=0.3,
                  anchor_offset=0):
    """Focal-InfoNCE: positive logit ``s²/τ``, negative logits ``s(s+m)/τ``, then cross-entropy."""
    n = anchors.shape[0]
    sim = cosine_matrix(anchors, _candidates(positives, negatives))
    is_positive = _at(n, sim.shape[1], anchor_offset, sim.device)
    logits = torch.where(is_positive, sim * sim, sim * (sim + m)) / temperature
    return F.cross_entropy(logits, _labels(n, sim.device, anchor_offset))


def draw_noise(num, dim, *, std=1.0, generator=None, device=None) -> torch.Tensor:
    """DCLR's initial noise negatives: ``Z ∈ R^{num×dim}``, entries ``N(0, std²)``, drawn in float32."""
    return torch.randn(num, dim, generator=generator, device=device, dtype=torch.float32) * std


def noise_count(noise_ratio, n, formulation="paper") -> int:
    """``K = round(noise_ratio · N)``; the released code truncates: ``int(N · noise_ratio)``."""
    return int(n * noise_ratio) if formulation == "released" else int(round(noise_ratio * n))


def dclr_noise(anchors, positives, num, *, steps=4, lr=1e-3, std=1.0, temperature=0.05,
               noise=None, generator=None, formulation="paper", anchor_offset=0):
    """DCLR's noise negatives, improved by ``steps`` normalized gradient-ascent steps.

    ``L_U = mean_i[−s(h_i, h⁺_i)/τ_u + log Σ_j exp(cos(h_i, z_j)/τ_u)]`` with h, h⁺ detached;
    each step ``z_j ← z_j + lr · g_j/‖g_j‖``, ``g = ∂L_U/∂Z`` (a row with g_j = 0 stays put).
    ``formulation="released"``: the step's loss is the cross-entropy over ``[h⁺; Z]`` (the
    in-batch columns join the log-sum-exp), and a row with g_j = 0 becomes 0 (0/0 is NaN
    there, which the code then zeroes). Written as the released code does it: an autograd
    graph per step.
    """
    h = wide(anchors.detach())
    h_pos = positives.detach().to(h.dtype)
    z = (draw_noise(num, h.shape[1], std=std, generator=generator, device=h.device)
         if noise is None else noise.detach()).to(h.dtype).clone()
    for _ in range(steps):
        z.requires_grad_(True)
        with torch.enable_grad():
            if formulation == "released":
                logits = cosine_matrix(h, torch.cat([h_pos, z])) / temperature
                loss = F.cross_entropy(logits, _labels(h.shape[0], h.device, anchor_offset))
            else:
                positive = row_cosine(h, h_pos) / temperature
                loss = (-positive + torch.logsumexp(cosine_matrix(h, z) / temperature, dim=1)).mean()
            (grad,) = torch.autograd.grad(loss, z)
        norm = grad.norm(dim=1, keepdim=True)
        step = torch.where(norm > 0, grad / norm.clamp_min(torch.finfo(grad.dtype).tiny), 0.0)
        z = z.detach() + lr * step
        if formulation == "released":
            z = z.masked_fill(norm == 0, 0.0)
    return z.detach()


def dclr_weights(c_anchors, c_positives, num_noise, *, phi, temperature, formulation="paper",
                 anchor_offset=0):
    """DCLR's instance weights α (N×(N+K)), 0 for dropped in-batch negatives.

    Paper: ``α_ij = 1[cos(c_i, c⁺_j) < φ]`` on in-batch columns, 1 on the positive and on
    noise columns. Released code: the test written ``cos/τ ≤ 20·φ``, and noise columns get a
    complementary cosine of 0, so φ < 0 drops every one of them.
    """
    cos = cosine_matrix(c_anchors, c_positives)
    keep = (cos / temperature <= 20 * phi) if formulation == "released" else (cos < phi)
    keep = keep | _at(keep.shape[0], keep.shape[1], anchor_offset, keep.device)
    keep_noise = formulation != "released" or phi >= 0
    noise_cols = torch.full((keep.shape[0], num_noise), keep_noise, dtype=torch.bool, device=keep.device)
    return torch.cat([keep, noise_cols], dim=1)


def dclr_loss(anchors, positives, *, complementary=None, phi=0.9, noise=None, noise_ratio=1.0,
              noise_steps=4, noise_lr=1e-3, noise_std=1.0, noise_temperature=None,
              temperature=0.05, generator=None, formulation="paper", anchor_offset=0):
    """DCLR: InfoNCE against ``[h⁺; Z]`` where dropped in-batch negatives leave the denominator.

    ``L = mean_i[−l_ii + log Σ_j α_ij exp(l_ij)]``. ``formulation="released"`` instead
    multiplies logits by α and applies binary cross-entropy to the row softmax, averaged
    over all N·(N+K) entries, as the authors' released code does.
    """
    n = anchors.shape[0]
    num = (noise.shape[0] if noise is not None
           else noise_count(noise_ratio, positives.shape[0], formulation))
    z = dclr_noise(anchors, positives, num, steps=noise_steps, lr=noise_lr, std=noise_std,
                   temperature=temperature if noise_temperature is None else noise_temperature,
                   noise=noise, generator=generator, formulation=formulation,
                   anchor_offset=anchor_offset)
    logits = cosine_matrix(anchors, torch.cat([positives, z.to(positives.dtype)])) / temperature
    labels = _labels(n, logits.device, anchor_offset)
    if complementary is None:
        keep = torch.ones_like(logits, dtype=torch.bool)
    else:
        keep = dclr_weights(*complementary, num, phi=phi, temperature=temperature,
                            formulation=formulation, anchor_offset=anchor_offset)
    if formulation == "released":
        probs = torch.softmax(logits * keep, dim=1)
        return F.binary_cross_entropy(probs, F.one_hot(labels, logits.shape[1]).to(probs.dtype))
    return F.cross_entropy(logits.masked_fill(~keep, float("-inf")), labels)


def relative_difference(anchors, positives, sensitive, *, temperature=0.05, rd="softplus",
                        margins=(0.1, 0.3)):
    """ESCL's relative-difference term (a reconstruction; see ``escl_loss``)."""
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


def escl_loss(anchors, positives, sensitive, *, temperature=0.05, weight=2.5e-3, rd="softplus",
              margins=(0.1, 0.3), anchor_offset=0):
    """ESCL: ``InfoNCE(h, h⁺) + λ · L_RD(h, h⁺, h⁻)``, ``h⁻`` the high-dropout view."""
    own_positives = positives[anchor_offset:anchor_offset + anchors.shape[0]]
    return (infonce(anchors, positives, temperature=temperature, anchor_offset=anchor_offset)
            + weight * relative_difference(anchors, own_positives, sensitive,
                                           temperature=temperature, rd=rd, margins=margins))
