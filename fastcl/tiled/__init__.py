"""The tiled path: every objective without ever holding the N×M similarity matrix.

Anchor rows are processed in chunks of R rows (:mod:`.driver`). A chunk's R×M cosines
``s_ij = (q_i·k_j)/(‖q_i‖‖k_j‖)``, from the raw inputs and their norms, become logits and the
row losses, and — the loss being the last op of the graph — the gradient at once:

    ∂L/∂l_ij = (p_ij − 1[j = i]) / N,      p = softmax over the row's kept columns
    ∂L/∂s_ij = ∂L/∂l_ij · g'(s_ij)          (1/τ; focal: 2s/τ on the positive, (2s+m)/τ else)
    G'_ij    = ∂L/∂s_ij / (‖q_i‖‖k_j‖)
    u_q = G' K,   u_k += G'ᵀ Q_chunk        (two GEMMs on the raw inputs)
    ∂L/∂x = u − x̂ (x̂·u)                     (the chain through the L2 normalization)

Backward only scales the stored gradients by the incoming scalar. Peak extra memory is the
chunk's R×M buffers (R from a memory budget) plus the N×d and M×d gradients. Rooms:
:mod:`.engine` (the engine contract, the PyTorch engine), :mod:`.driver` (the chunk loop and
the gradients, Matryoshka's widths included), :mod:`.autograd` (the Function and the custom
op, one backward), :mod:`.noise` (DCLR's noise update); here, a spec's loss on them.
"""

from __future__ import annotations

import torch

from .. import common, layout
from ..common import accumulate_dtype
from ..spec import Epilogue, LossSpec
from . import driver
from .autograd import TiledContrastive, contrastive_loss, tiled_contrastive_op  # noqa: F401
from .driver import (DEFAULT_MEMORY_BUDGET, MIN_CHUNK_ROWS, _norms, _tangent_,  # noqa: F401
                     chunk_rows, contrastive_forward, matmul_dtype,
                     rows_per_chunk)
from .engine import TORCH, Chunk, Engine, _layout_drops, engine_for, torch_width  # noqa: F401
from .noise import _noise_step, dclr_noise, noise_update  # noqa: F401


def spec_loss(spec: LossSpec, anchors, positives, negatives=None):
    """The fused paths' loss of ``spec`` (:func:`fastcl.spec.build_spec`) on checked
    embeddings: the candidate blocks (DCLR's noise drawn and updated here), then the driver
    on the spec's engine. Matryoshka is one pass over every width where the engine takes
    them (the torch engine), else a call per width (the Triton kernels take one width)."""
    engine = engine_for(spec.backend)
    xs = (anchors, positives, negatives, spec.anchor_candidates)
    if spec.matryoshka is not None and engine.name != "torch":
        return sum(w * _terms(spec, engine, *cut) for w, cut in spec.matryoshka.prefixes(*xs))
    return _terms(spec, engine, *xs, spec.matryoshka)


def _terms(spec: LossSpec, engine: Engine, anchors, positives, negatives, cands, widths=None):
    logits, mask, offset = spec.logits, spec.mask, spec.anchor_offset
    tau = logits.learnable
    # the side inputs' unit rows (teacher, guide): in the GEMM dtype on the Triton engine
    side_dtype = (accumulate_dtype(anchors.dtype) if engine.name == "torch"
                  else driver.matmul_dtype(anchors.dtype, anchors.device))
    blocks = [positives] + ([] if negatives is None else [negatives])
    if spec.noise is not None:
        z = dclr_noise(spec.noise, anchors, positives, formulation=spec.formulation, engine=engine,
                       chunk_size=spec.chunk_size)
        # Z is not rescaled before its update (a step of lr is not scale-free); as loss
        # candidates its rows only enter through cosines
        blocks.append(common.shrink_huge_rows(z).to(anchors.dtype))
    fields = dict(spec.row_fields(), hard_negative_weight=logits.hard_negative_weight,
                  phi=None if mask is None else mask.phi,
                  complementary=None if mask is None else mask.complementary,
                  formulation=spec.formulation, anchor_offset=offset, matryoshka=widths)
    if spec.soft is not None and spec.soft.teacher is not None:
        fields.update(teacher=tuple(common.unit(x, side_dtype) for x in spec.soft.teacher),
                      teacher_temperature=spec.soft.teacher_temperature,
                      distill_weight=spec.soft.distill_weight)
    if spec.two_directions:
        # ½(L→ + L←): the positives against the anchor candidates, focal and (symmetric) the
        # transposed mask there; negatives, w and Z belong to the forward direction only
        n, n_pos = anchors.shape[0], positives.shape[0]
        flip = mask is not None and mask.reverse
        reverse = Epilogue(**spec.row_fields(), phi=mask.phi if flip else None,
                           complementary=mask.complementary[::-1] if flip else None,
                           matryoshka=widths,
                           anchor_offset=offset if cands.shape[0] == n_pos else 0)
        forward = contrastive_loss(Epilogue(**fields), anchors, *blocks, engine=engine, tau=tau)
        return 0.5 * (forward + contrastive_loss(reverse, positives[offset:offset + n], cands,
                                                 engine=engine, tau=tau))
    if spec.ruled:
        rows, blocks, ep = _ruled_inputs(spec, fields, anchors, positives, negatives, blocks, cands,
                                         side_dtype)
        return contrastive_loss(ep, rows, *blocks, engine=engine, tau=tau)
    return contrastive_loss(Epilogue(**fields), anchors, *blocks, engine=engine, tau=tau)


def _ruled_inputs(spec: LossSpec, fields, anchors, positives, negatives, blocks, cands,
                  guide_dtype):
    """The driver's inputs for a spec with :mod:`fastcl.layout`'s rules: the rows
    (``[anchors; own positives]`` with a positive side), the candidate blocks with the
    anchors block last, and the epilogue of ``fields`` with the column blocks, the guide's
    unit rows (in ``guide_dtype``) and thresholds (always in
    the accumulate dtype), the ids. (Epilogues are built whole, never
    ``dataclasses.replace``d: torch.compile before torch 2.6 breaks the graph there.)"""
    lay, hardness = spec.layout, None if spec.rules is None else spec.rules.hardness
    n, n_pos = anchors.shape[0], positives.shape[0]
    offset = spec.anchor_offset
    n_neg = 0 if negatives is None else negatives.shape[0]
    n_noise = sum(b.shape[0] for b in blocks) - n_pos - n_neg
    n_a = 0 if cands is None else cands.shape[0]
    own = positives[offset:offset + n]
    rows = torch.cat([anchors, own]) if lay.positive_side else anchors
    blocks = list(blocks) + ([cands] if n_a > 0 else [])
    guide = ids = None

    def columns(pos, neg, noise, anchor_block):
        """One entry a candidate column: the blocks ``[positives; negatives; noise; anchors]``
        there are (the noise's entries never read)."""
        return torch.cat([pos, *([neg] if n_neg > 0 else []), noise, *([anchor_block] if n_a > 0 else [])])
    if spec.guide is not None:
        acc = accumulate_dtype(anchors.dtype)
        unit = lambda x: common.unit(x, acc)  # noqa: E731
        g_anchors, g_positives, g_negatives, g_cands = spec.guide.embeddings
        u_anchors, u_positives = unit(g_anchors), unit(g_positives)
        u_own = u_positives[offset:offset + n]
        gamma = (u_anchors * u_own).sum(dim=1)
        theta = layout.guide_threshold(gamma, spec.guide.margin, spec.guide.strategy)
        g_rows = torch.cat([u_anchors, u_own]) if lay.positive_side else u_anchors
        u_neg, u_cands = (unit(x) if x is not None else None for x in (g_negatives, g_cands))
        g_cols = columns(u_positives, u_neg, u_anchors.new_zeros(n_noise, u_anchors.shape[1]), u_cands)
        theta = layout.keep_twin_ties(theta, gamma, [u_own] + ([u_anchors] if lay.positive_side else []),
                                      columns(u_positives, u_neg, u_anchors[:0], u_cands), (1, int(n_a > 0)))
        guide = (g_rows.to(guide_dtype), g_cols.to(guide_dtype), theta)
    if spec.ids is not None:
        pos_ids, neg_ids, anchor_ids = spec.ids
        ids = (columns(pos_ids, neg_ids, pos_ids.new_zeros(n_noise), anchor_ids), pos_ids[offset:offset + n])
    ep = Epilogue(**fields, layout=lay, blocks=(n_pos, n_neg, n_noise, n_a), hardness=hardness,
                  guide=guide, ids=ids)
    return rows, blocks, ep
