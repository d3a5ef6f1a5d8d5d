"""DCLR's noise negatives on the fused paths: the draw, then the normalized gradient ascent
through the driver (:func:`noise_update`)."""

from __future__ import annotations

import torch

from .. import _validation, common
from ..common import (accumulate_dtype, autocast_off, huge_row_limit, project_out_radial,
                      safe_direction, shrink_huge_rows)
from ..spec import Epilogue
from .driver import _norms, _tangent_, contrastive_forward
from .engine import TORCH, Engine


def dclr_noise(noise, anchors, positives, *, formulation="paper", anchor_offset=0,
               engine: Engine = TORCH, chunk_size=None):
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
                            anchor_offset=anchor_offset, huge_rows=huge)


@torch.no_grad()
def noise_update(anchors, noise, *, steps, lr, temperature, chunk_size=None, engine: Engine = TORCH,
                 positives=None, anchor_offset=0, huge_rows=None):
    """DCLR's normalized gradient ascent on the noise, chunked, without an autograd graph.

    Paper (``positives=None``): ``L_U``'s positive term does not depend on Z, so ``∂L_U/∂Z``
    is the candidate gradient of a positive-free InfoNCE of the anchors against Z. Released
    code (``positives`` given): the step's loss is the cross-entropy over ``[h⁺; Z]``, so the
    in-batch columns join the log-sum-exp. Either way each step is one pass of the shared
    driver asking for Z's gradient alone, then ``z_j += lr · g_j/‖g_j‖``, a step of length
    exactly lr. A row with ``g_j = 0`` stays put (paper) or becomes 0 (released: its 0/0 is
    NaN, then zeroed).

    The direction is formed from ``g_j/max|g_j|`` (:func:`fastcl.common.safe_direction`): a
    row of a far-away noise vector can have g ≈ 1e-25, whose squared norm is 0 in float32.
    The gradient is first projected once more onto the tangent space of z_j
    (:func:`fastcl.common.project_out_radial`), which removes the chain rule's rounding
    residual along z_j: at d = 1 every cosine is ±1 whatever z, g is exactly 0, and that
    residual would otherwise become a full step. Rows of Z too large to square are rescaled
    for the driver (:func:`fastcl.common.shrink_huge_rows`; the direction of g_j does not
    depend on z_j's length); the step is taken on Z itself. ``huge_rows``: whether Z has such
    rows, if the caller knows; None: the input checks decide (one host read when they are
    on, none when off).

    The anchors' norms are taken once for the ``steps`` passes (each pass of the driver
    would take them again).
    """
    z = noise.detach().to(accumulate_dtype(anchors.dtype)).clone()
    if steps == 0 or z.shape[0] == 0:
        return z
    released = positives is not None
    ep = Epilogue(temperature, positives=released, chunk_size=chunk_size,
                  anchor_offset=anchor_offset if released else 0)
    fixed = (positives.detach(),) if released else ()
    # the scan of inputs decides, as for the embeddings (one host read; none when the input
    # checks are off, which leave rows too large to square as they are)
    huge = bool(huge_rows)
    if huge_rows is None and _validation._CHECK_FINITE and not z.is_meta:
        amax = torch.linalg.vector_norm(z, ord=float("inf"), dim=1)
        huge = bool((amax > huge_row_limit(z.dtype, z.shape[1])).any())
    anchors = anchors.detach()
    step = engine.noise_step or _noise_step   # the engine's fused step, if any
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
