"""DCLR's noise negatives on the fused paths: the draw, then the normalized gradient ascent
through the driver (:func:`noise_update`)."""

from __future__ import annotations

import math

import torch

from .. import _validation, common
from ..common import (EPS, accumulate_dtype, autocast_off, huge_row_limit, project_out_radial,
                      safe_direction, shrink_huge_rows)
from ..spec import Epilogue
from .driver import DEFAULT_MEMORY_BUDGET, _norms, _tangent_, contrastive_forward
from .engine import TORCH, Engine


def dclr_noise(noise, anchors, positives, *, formulation="paper", engine: Engine = TORCH,
               chunk_size=None):
    """DCLR's noise negatives (:class:`fastcl.spec.Noise`) on the fused paths: drawn (or the
    given start), then :func:`noise_update`."""
    with common.autocast_off(anchors.device):
        # whether Z can have rows too large to square, where that is known without reading Z:
        # drawn, its entries are std·N(0, 1), and no normal draw of torch's reaches NORMAL_MAX;
        # given, this call's scan of its inputs has cleared it
        z = noise.start
        if z is None:
            z = common.draw_noise(noise.count, anchors.shape[1], std=noise.std,
                                  generator=noise.generator, device=anchors.device)
            limit = common.huge_row_limit(z.dtype, z.shape[1])
            huge = None if noise.std * common.NORMAL_MAX > limit else False
        else:
            huge = False if _validation.inputs_read() else None
        return noise_update(anchors, z, steps=noise.steps, lr=noise.lr,
                            temperature=noise.temperature, chunk_size=chunk_size, engine=engine,
                            positives=positives if formulation == "released" else None,
                            huge_rows=huge)


@torch.no_grad()
def noise_update(anchors, noise, *, steps, lr, temperature, chunk_size=None, engine: Engine = TORCH,
                 positives=None, huge_rows=None):
    """DCLR's normalized gradient ascent on the noise, chunked, without an autograd graph.

    Paper (``positives=None``): ``L_U``'s positive term does not depend on Z, so ``∂L_U/∂Z``
    is the candidate gradient of a positive-free InfoNCE of the anchors against Z. Released
    code (``positives`` given): the step's loss is the cross-entropy over ``[h⁺; Z]``. Each
    step is one pass of the driver asking for Z's gradient alone, then ``z_j += lr ·
    g_j/‖g_j‖`` (a row with ``g_j = 0`` stays put; released: it becomes 0), the direction
    formed as :func:`fastcl.common.safe_direction` does (g ≈ 1e-25 squares to 0 in float32)
    after one more projection onto z_j's tangent space
    (:func:`fastcl.common.project_out_radial`: at d = 1 the chain rule's rounding residual
    would otherwise be a full step). Rows of Z too large to square are rescaled for the
    driver only (``huge_rows``: whether Z has them, if the caller knows; None: the input
    checks decide). The anchors' norms are taken once for the ``steps`` passes.
    """
    z = noise.detach().to(accumulate_dtype(anchors.dtype)).clone()
    if steps == 0 or z.shape[0] == 0:
        return z
    released = positives is not None
    # (Z's columns of the softmax are the same whichever h⁺ column is taken apart: column i)
    ep = Epilogue(temperature, positives=released, chunk_size=chunk_size)
    fixed = (positives.detach(),) if released else ()
    # the scan of inputs decides, as for the embeddings (one host read; none when the input
    # checks are off, which leave rows too large to square as they are)
    huge = bool(huge_rows)
    if huge_rows is None and _validation._CHECK_FINITE and not z.is_meta:
        amax = torch.linalg.vector_norm(z, ord=float("inf"), dim=1)
        huge = bool((amax > huge_row_limit(z.dtype, z.shape[1])).any())
    anchors = anchors.detach()
    step = engine.noise_step or _noise_step   # the engine's fused step, if any
    columns = z.shape[0] + (fixed[0].shape[0] if released else 0)
    if _noise_may_underflow(temperature, columns, z.dtype):
        with autocast_off(anchors.device):
            for _ in range(steps):
                _scaled_noise_step(anchors, fixed[0] if released else None, z, lr, temperature,
                                   chunk_size, huge)
        return z
    with autocast_off(anchors.device):
        anchor_norms = _norms(anchors, accumulate_dtype(anchors.dtype))
        for _ in range(steps):
            z_in = z.to(anchors.dtype)
            if huge:
                z_in = shrink_huge_rows(z_in)
            _, (*_, raw) = contrastive_forward(ep, anchors, (*fixed, z_in),
                                               need=(False,) * (1 + len(fixed)) + (True,),
                                               engine=engine, anchor_norms=anchor_norms,
                                               raw_candidates=True)
            first = raw[1].shape[0] - z.shape[0]     # the released step's h⁺ rows come first
            step(*(x[first:] for x in raw), z, lr, released)
    return z


#: The widest logit range ``2/τ_u + ln M`` of DCLR's noise loss whose softmax entries stay
#: normal numbers (with room for the gradient's factors): float32's e^(−87) is its smallest.
_NOISE_SPREAD = {torch.float32: 80.0, torch.float64: 700.0}


def _noise_may_underflow(temperature: float, columns: int, dtype: torch.dtype) -> bool:
    """Whether a noise row's every softmax entry can underflow in ``dtype`` (a cosine gap of
    2 to the rows' top logits at τ_u below ~0.025 in float32), where the engines' update,
    whose gradient is formed from p itself, would leave the row in place (paper) or zero it
    (released): :func:`_scaled_noise_step` then takes the step."""
    return 2.0 / temperature + math.log(max(columns, 1)) > _NOISE_SPREAD.get(dtype, 80.0)


def _scaled_noise_step(anchors, positives, z, lr, temperature, chunk_size, huge):
    """One step of DCLR's noise update in place on ``z``, each row's direction formed from
    log-weights: ``g_j ∝ Σ_i p_ij ∂s_ij/∂z_j`` with ``p_ij = e^(l_ij − lse_i)`` scaled by
    ``1/max_i p_ij`` (the exact update's direction, which any positive factor leaves), so a
    row whose every p_ij underflows still moves by lr. Two chunked passes of torch ops:
    each anchor's log-sum-exp over ``[h⁺ (released); Z]``, then, Z's rows in chunks, the
    softmax over the anchors of ``l_ij − lse_i`` (column j's weights, their largest 1) and
    ``u_j = Σ_i w_ij ĥ_i``, then the chain rule through ẑ and the step as in
    :func:`_noise_step`."""
    acc = z.dtype
    unit = lambda x: torch.nn.functional.normalize(shrink_huge_rows(x.to(acc)), dim=1, eps=EPS)  # noqa: E731
    h = unit(anchors)
    z_in = shrink_huge_rows(z) if huge else z
    keys = torch.nn.functional.normalize(z_in, dim=1, eps=EPS)
    if positives is not None:
        keys = torch.cat([unit(positives), keys])
    n, m = h.shape[0], keys.shape[0]
    budget = DEFAULT_MEMORY_BUDGET.get(h.device.type, DEFAULT_MEMORY_BUDGET["cpu"])
    rows = chunk_size or max(1, budget // (2 * max(n, m) * h.element_size()))
    lse = torch.cat([torch.logsumexp(h[r:r + rows] @ keys.T / temperature, dim=1)
                     for r in range(0, n, rows)])
    z_hat = keys[m - z.shape[0]:]
    norm = _norms(z_in, acc)
    for r in range(0, z.shape[0], rows):
        w = torch.softmax(z_hat[r:r + rows] @ h.T / temperature - lse[None, :], dim=1)
        g = _tangent_(w @ h, z_in[r:r + rows], norm[r:r + rows], rows)
        direction, zero = safe_direction(project_out_radial(g, z_in[r:r + rows]))
        z[r:r + rows].add_(direction, alpha=lr)
        if positives is not None:
            z[r:r + rows].masked_fill_(zero[:, None], 0.0)


def _noise_step(u, x, norm, inv_x, z, lr, released):
    """One step of DCLR's noise update, in place on ``z`` (:func:`noise_update`), from
    :func:`contrastive_forward`'s ``raw_candidates`` of the noise rows: ``g`` = the chain rule
    through x̂ applied to ``u`` (:func:`_tangent_`), projected once more onto x's tangent
    space (:func:`fastcl.common.project_out_radial`), then ``z += lr·g/‖g‖``
    (:func:`fastcl.common.safe_direction`: a zero row's direction is 0, so it stays put;
    released: it becomes 0). ``inv_x``: unused here (the Triton engine's step reads it)."""
    g = _tangent_(u, x, norm, u.shape[0])
    direction, zero = safe_direction(project_out_radial(g.to(z.dtype), x))
    z.add_(direction, alpha=lr)
    if released:
        z.masked_fill_(zero[:, None], 0.0)      # (a mask, not an index: no host sync)
