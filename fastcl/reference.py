"""The reference objectives: the most literal PyTorch, full N×M matrices, a cross-entropy per row.

This module is the oracle that every fast path is tested against and benchmarked
with. It favours being obviously right over being fast or lean: each function
builds the whole similarity matrix and lets autograd differentiate it. Inputs are
not checked here; the public functions in :mod:`fastcl` check them and dispatch.
It imports only torch and :mod:`fastcl.common` (the numerics, noise draw and ESCL
relative difference every path shares), and only the tests, the benchmarks and
``backend="reference"`` import it.

Notation (``shared/methods.md``): anchors ``h`` (N×d), candidates ``k`` (M×d),
``s_ij = cos(h_i, k_j)``, temperature ``τ``, the positive of anchor i in column i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import (EPS, accumulate_dtype, draw_noise, noise_count, project_out_radial,  # noqa: F401
                     relative_difference, safe_direction, shrink_huge_rows, wide)
from .layout import guide_threshold, keep_twin_ties
from .spec import SYMMETRIC, Logits, LossSpec, Mask, Noise, Rules
from .common import (ESCL_MARGINS, ESCL_RD, ESCL_WEIGHT, FOCAL_M, NOISE_LR, NOISE_RATIO, NOISE_STD,
                     NOISE_STEPS, PHI, TEMPERATURE)


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """``x̂ = x / max(‖x‖, EPS)`` formed in float32 or wider (in float16 EPS itself rounds to
    0, and a zero row would be 0/0), then returned in x's dtype for the product. Rows too
    large to square (float32 max-abs ≳ 1e19: ‖x‖ = inf, x̂ = 0) are first multiplied by a
    power of two (:func:`fastcl.common.shrink_huge_rows`), which leaves x̂ as it is."""
    return F.normalize(shrink_huge_rows(wide(x)), dim=-1, eps=EPS).to(x.dtype)


def cosine_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``s_ij = x̂_i · ŷ_j`` (N×M): the product in the inputs' dtype, as a plain PyTorch loss
    computes it, returned in float32 or wider."""
    return wide(unit_rows(x) @ unit_rows(y).T)


def _at(cols: torch.Tensor, width: int) -> torch.Tensor:
    """(len(cols) × width) bool, True at ``[i, cols[i]]``."""
    return cols[:, None] == torch.arange(width, device=cols.device)[None, :]


def _released(logits, is_positive):
    """DCLR's released loss of a direction's logits (α already multiplied in): binary
    cross-entropy on the row softmax, the mean over all N·M entries."""
    probs = torch.softmax(logits, dim=1)
    # where the positive dominates, p_ii rounds to 1: BCE(p_ii, 1) is then written as
    # BCE(1 − p_ii, 0), the same value and gradient (torch's clamps are symmetric in
    # p ↔ 1 − p), with 1 − p_ii = σ(gap) the others' share, formed apart
    gap = _others_lse(logits, is_positive) - _positive_logit(logits, is_positive)
    flip = (gap < 0)[:, None] & is_positive
    entries = torch.where(is_positive, torch.sigmoid(torch.where(gap < 0, gap, -gap))[:, None],
                          probs)
    return F.binary_cross_entropy(entries, (is_positive & ~flip).to(entries.dtype))


def _soft_cross_entropy(logits, is_positive, soft, anchor_offset):
    """Each row's ``ℓ_i = −Σ_j y_ij log p_ij`` against the soft target of ``soft``
    (:class:`fastcl.spec.Soft`), written out: ``K_i`` the row's kept entries (finite
    logits), ``P_i`` its positive, or with labels the kept columns ``j < N_b`` (the first
    block: the positives, or the anchors on a positive side) with
    ``labels[j] = labels[anchor_offset + i]``, and
    ``y = (1−ε)·1[P_i]/|P_i| + ε·1[K_i]/|K_i|``."""
    kept = ~torch.isneginf(logits)
    log_p = torch.log_softmax(logits, dim=1).masked_fill(~kept, 0.0)
    target = is_positive
    if soft.labels is not None:
        labels, n = soft.labels, logits.shape[0]
        same = torch.zeros_like(kept)
        same[:, :labels.shape[0]] = labels[None, :] == labels[anchor_offset:anchor_offset + n, None]
        target = (same & kept) | is_positive
    eps = soft.label_smoothing
    y = ((1 - eps) * target.to(log_p.dtype) / target.sum(dim=1, keepdim=True)
         + eps * kept.to(log_p.dtype) / kept.sum(dim=1, keepdim=True))
    if soft.teacher is not None:
        # q: the teacher's softmax over the row's kept documents (the first N_b + K columns)
        t_anchors, t_docs = soft.teacher
        width = t_docs.shape[0]
        t_logits = torch.full_like(log_p, float("-inf"))
        t_logits[:, :width] = (cosine_matrix(t_anchors, t_docs).to(log_p.dtype)
                               / soft.teacher_temperature).masked_fill(~kept[:, :width], float("-inf"))
        y = (1 - soft.distill_weight) * y + soft.distill_weight * torch.softmax(t_logits, dim=1)
    return -(y * log_p).sum(dim=1)


def _positive_logit(logits, is_positive):
    """Each row's logit at its positive (one per row; no boolean indexing, whose size the
    host would have to read)."""
    return logits.masked_fill(~is_positive, 0.0).sum(dim=1)


def _others_lse(logits, is_positive, *more):
    """``log Σ e^l`` over each row's entries other than its positive (one per row), and the
    columns of ``more`` (more blocks of the same rows); −inf for a row with none."""
    others = torch.cat([logits.masked_fill(is_positive, float("-inf")), *more], dim=1)
    empty = torch.isneginf(others).all(dim=1, keepdim=True)
    # an all −inf row's log-sum-exp has a NaN gradient: such a row takes log 1 = 0 instead,
    # then −inf below (its gradient is then 0)
    lse = torch.logsumexp(others.masked_fill(empty, 0.0), dim=1)
    return lse.masked_fill(empty[:, 0], float("-inf"))


def _cross_entropy(logits, is_positive, *more):
    """Each row's ``−log p_i = log Σ_j e^{l_j} − l_i`` (``i``: the row's positive) as
    ``softplus(log Σ_{j≠i} e^{l_j} − l_i) = log(1 + Σ_{j≠i} e^{l_j − l_i})``: where the
    positive dominates (a trained model's easy batches), the difference of two log-sum-exps
    keeps no digit of a loss below ``eps·|l_i|``, this keeps them all; its gradient on the
    positive is minus the others' share of the softmax, not ``p_ii − 1``. ``more``: more
    columns of the same softmax (blocks beside ``logits``)."""
    gap = _others_lse(logits, is_positive, *more) - _positive_logit(logits, is_positive)
    # log(e^gap + 1) exactly (F.softplus returns gap itself above 20, 2e-9 short)
    return torch.logaddexp(gap, torch.zeros_like(gap))


def _debiased(logits, is_positive, prior, temperature, *more):
    """Chuang et al.'s debiased loss of each row (``more``: more columns of its softmax):

    ``ℓ_i = −log(e^{l_ip} / (e^{l_ip} + N_g))``, ``N_g = max((Σ_{j≠p} e^{l_ij} − Q·τ⁺·e^{l_ip})
    / (1 − τ⁺), Q·e^{−1/τ})``, ``Q`` the row's kept others (finite logits), ``τ⁺ = prior``
    (a row each); every exponential times ``e^{−t_i}``, ``t_i`` the row's largest logit (no
    overflow; the ratio is the same). Gradients through the max: autograd's."""
    others = torch.cat([logits.masked_fill(is_positive, float("-inf")), *more], dim=1)
    positive = _positive_logit(logits, is_positive)
    count = torch.isfinite(others).sum(dim=1).to(positive.dtype)
    top = torch.maximum(positive, others.amax(dim=1)).detach()
    e_pos = torch.exp(positive - top)
    e_others = torch.exp(others - top[:, None]).sum(dim=1)
    n_g = torch.maximum((e_others - count * prior * e_pos) / (1 - prior),
                        count * torch.exp(-1.0 / temperature - top))
    return torch.log(e_pos + n_g) - (positive - top)


def _modulated(sim, is_positive, temperature, focal_m):
    """Logits from cosines: ``s/τ``, or focal ``s²/τ`` on the positive (``is_positive``; None:
    no column) and ``s(s+m)/τ`` elsewhere."""
    if focal_m is None:
        return sim / temperature
    focal = sim * (sim + focal_m)
    return (focal if is_positive is None else torch.where(is_positive, sim * sim, focal)) / temperature


def contrastive(spec: LossSpec, anchors, positives, negatives=None):
    """Every feature at once (:func:`fastcl.contrastive` states the math), from its spec.

    Candidates ``k = [h⁺ (N_pos rows); negatives (K rows); Z (K_z rows)]``, logits
    ``l_ij = s_ij/τ`` or, with ``focal_m``, ``s_ii²/τ`` on the positive and ``s_ij(s_ij+m)/τ``
    elsewhere; ``+ w`` at column ``N_pos + i``; α from the mask on the in-batch block;
    cross-entropy over the kept columns (``"released"``: the authors' BCE), block by block
    (:func:`_sides`).
    Matryoshka: the literal sum ``Σ_k w_k·L(x[:, :d_k])``.
    """
    xs = (anchors, positives, negatives, spec.anchor_candidates)
    if spec.matryoshka is not None:
        return sum(w * _one(spec, *cut) for w, cut in spec.matryoshka.prefixes(*xs))
    return _one(spec, *xs)


def _one(spec: LossSpec, anchors, positives, negatives, anchor_candidates):
    logits, mask, offset = spec.logits, spec.mask, spec.anchor_offset
    n_pos = positives.shape[0]
    blocks = [positives] + ([] if negatives is None else [negatives.to(positives.dtype)])
    if spec.noise is not None:
        z = spec.noise
        blocks.append(dclr_noise(anchors, positives, z.count, steps=z.steps, lr=z.lr, std=z.std,
                                 temperature=z.temperature, noise=z.start, generator=z.generator,
                                 formulation=spec.formulation).to(positives.dtype))
    candidates = torch.cat(blocks)
    keep = None
    if mask is not None:
        keep = dclr_weights(*mask.complementary, candidates.shape[0] - n_pos, phi=mask.phi,
                            temperature=logits.tau, formulation=spec.formulation,
                            anchor_offset=offset)
    return _sides(spec, anchors, positives, candidates, negatives, keep,
                  anchors if anchor_candidates is None else anchor_candidates)


def _sides(spec: LossSpec, anchors, positives, candidates, negatives, keep, anchor_candidates):
    """One width's loss, written out block by block as sentence-transformers' MNRL and
    GISTEmbedLoss do: a score matrix per block with ``-inf`` where an entry is dropped (the
    layout's rules of :mod:`fastcl.layout`, DCLR's mask, the guide, the ids, the margin), the
    blocks side by side, one log-sum-exp per row (or one per side, averaged). InfoNCE's plain
    layout is the anchor side's documents and noise alone; ``symmetric`` is a layout, its mask
    transposed on the positive side (``spec.mask.reverse``); ``"released"`` (the plain layout
    only) is the authors' BCE (:func:`_released`)."""
    temperature, focal_m = spec.logits.tau, spec.logits.focal_m
    anchor_offset, layout, guide = spec.anchor_offset, spec.layout, spec.guide
    n, n_pos = anchors.shape[0], positives.shape[0]
    n_neg = 0 if negatives is None else negatives.shape[0]
    dev = anchors.device
    rows = torch.arange(n, device=dev)
    g = rows + anchor_offset                                 # each row's positive column
    # the anchors block: the row's own column (the whole batch's anchors, or these anchors)
    own_anchor = g if anchor_candidates.shape[0] == n_pos else rows
    own_positive = positives[anchor_offset:anchor_offset + n]
    documents = candidates[:n_pos + n_neg]                 # positives and negatives
    doc_group = torch.arange(n_pos + n_neg, device=dev) % n_pos

    # each side's guide rows, each block's guide rows and ids (None: off)
    g_anchors = g_own = g_documents = g_anchor_cands = doc_ids = anchor_ids = None
    if guide is not None:
        g_anchors, g_positives, g_negatives, g_anchor_cands = guide.embeddings
        g_own = g_positives[g]
        g_documents = g_positives if g_negatives is None else torch.cat([g_positives, g_negatives])
        gamma = torch.diagonal(cosine_matrix(g_anchors, g_positives), anchor_offset)
        theta = guide_threshold(gamma, guide.margin, guide.strategy)
        scored = [g_documents] + ([g_anchor_cands] if layout.scores_anchors else [])
        partners = [g_own] + ([g_anchors] if layout.positive_side else [])
        theta = keep_twin_ties(theta, gamma, [unit_rows(wide(x)) for x in partners],
                               torch.cat([unit_rows(wide(x)) for x in scored]),
                               (1, int(layout.scores_anchors)))[:, None]
    if spec.ids is not None:
        pos_ids, neg_ids, anchor_ids = spec.ids
        doc_ids = pos_ids if neg_ids is None else torch.cat([pos_ids, neg_ids])
        key = pos_ids[g][:, None]                          # the text of the row's positive

    def drop(scores, guide_rows, guide_cols, ids, protect):
        """``scores`` with the guide's false negatives and the duplicates set to -inf (the
        block's first columns of ``guide_cols`` and ``ids``), the entries in ``protect`` kept."""
        out = torch.zeros_like(scores, dtype=torch.bool)
        if guide is not None:
            out |= cosine_matrix(guide_rows, guide_cols[:scores.shape[1]]) > theta
        if spec.ids is not None:
            out |= ids[None, :scores.shape[1]] == key
        if protect is not None:
            out &= ~protect
        return scores.masked_fill(out, float("-inf"))

    # anchor side: documents (and the noise), then the anchors block
    sim = cosine_matrix(anchors, candidates)
    is_positive = _at(g, sim.shape[1])
    logits = _modulated(sim, is_positive, temperature, focal_m)
    margin = spec.false_negative_margin
    positive_cosine = sim[rows, g]

    def near(scores, cos, protect=None):
        """``scores`` less the false-negative margin's drops, ``s_ij > s_{i,p(i)} + m`` against
        row i's positive's cosine on either side, never at ``protect``."""
        if margin is None:
            return scores
        close = cos > (positive_cosine + margin)[:, None]
        return scores.masked_fill(close if protect is None else close & ~protect, float("-inf"))

    def block(side_rows, cols, guide_rows, guide_cols, ids, mine=None, dropped=None):
        """A block of scores past the first: the logits of ``side_rows`` against ``cols``
        (``mine``: the pair's own column, ``s²/τ`` with focal and never dropped), less the
        margin's, ``dropped``'s (the excluded own entries, the transposed mask), the guide's
        and the duplicates' drops."""
        cos = cosine_matrix(side_rows, cols)
        scores = near(_modulated(cos, mine, temperature, focal_m), cos, mine)
        if dropped is not None:
            scores = scores.masked_fill(dropped, float("-inf"))
        return drop(scores, guide_rows, guide_cols, ids, mine)
    if spec.logits.hard_negative_weight:
        logits = logits + spec.logits.hard_negative_weight * _at(g + n_pos, sim.shape[1]).to(logits.dtype)
    if spec.rules is not None and spec.rules.hardness is not None:
        hardness_mode, hardness_strength = spec.rules.hardness
        own = doc_group[None, :] == g[:, None]
        is_negative_block = torch.arange(n_pos + n_neg, device=dev)[None, :] >= n_pos
        where = {"in_batch_negatives": ~own,
                 "hard_negatives": own & is_negative_block,
                 "all_negatives": ~is_positive[:, :n_pos + n_neg]}[hardness_mode]
        penalty = torch.zeros_like(logits)
        penalty[:, :n_pos + n_neg] = torch.where(where, hardness_strength * sim[:, :n_pos + n_neg].detach(), 0.0)
        logits = logits + penalty
    if spec.formulation == "released":       # the plain layout only (build_spec's rule)
        return _released(logits if keep is None else logits * keep, is_positive)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    logits = near(logits, sim, is_positive)
    docs_part = drop(logits[:, :n_pos + n_neg], g_anchors, g_documents, doc_ids,
                     is_positive[:, :n_pos + n_neg])
    anchor_side = [docs_part, logits[:, n_pos + n_neg:]]   # the noise is never dropped
    own_anchor_col = _at(own_anchor, anchor_candidates.shape[0])
    if layout.anchor_to_anchors:
        anchor_side.append(block(anchors, anchor_candidates, g_anchors, g_anchor_cands, anchor_ids,
                                 dropped=own_anchor_col if layout.exclude_own else None))
    positive_logit = logits[rows, g]

    # positive side: the anchors block, then the documents
    positive_side = []
    if layout.positive_to_anchors:
        # the anchor's own column is the positive pair seen from the positive
        reverse = None
        if spec.mask is not None and spec.mask.reverse:    # symmetric: α'_ij = 1[cos(c⁺_i, c_j) < φ]
            c_anchors, c_positives = spec.mask.complementary
            reverse = ~dclr_weights(c_positives, c_anchors, 0, phi=spec.mask.phi,
                                    temperature=temperature)
        positive_side.append(block(own_positive, anchor_candidates, g_own, g_anchor_cands,
                                   anchor_ids, own_anchor_col, reverse))
    if layout.positive_to_positives or layout.positive_to_negatives:
        width = n_pos + (n_neg if layout.positive_to_negatives else 0)
        positive_side.append(block(own_positive, documents[:width], g_own, g_documents, doc_ids,
                                   dropped=(doc_group[None, :width] == g[:, None]
                                            if layout.exclude_own else None)))

    # the positive sits in the first block: its share of the softmax is formed apart
    # (_cross_entropy), the other blocks join its log-sum-exp
    anchor_pos = is_positive[:, :n_pos + n_neg]
    if spec.soft is not None:
        # each softmax its own target (a positive side only as two directions: its first
        # block the anchors, the positive there the row's own anchor)
        everything = torch.cat(anchor_side, dim=1)
        loss = _soft_cross_entropy(everything, _at(g, everything.shape[1]), spec.soft, anchor_offset)
        if positive_side:
            reverse = torch.cat(positive_side, dim=1)
            loss = 0.5 * (loss + _soft_cross_entropy(
                reverse, _at(own_anchor, reverse.shape[1]), spec.soft, anchor_offset))
        return loss.mean()
    if layout.joint or not positive_side:
        if spec.positive_prior is not None:       # one softmax a row (build_spec's rule)
            return _debiased(anchor_side[0], anchor_pos, spec.positive_prior, temperature,
                             *anchor_side[1:], *positive_side).mean()
        return _cross_entropy(anchor_side[0], anchor_pos, *anchor_side[1:], *positive_side).mean()
    lse_p = torch.logsumexp(torch.cat(positive_side, dim=1), dim=1)
    return (0.5 * _cross_entropy(anchor_side[0], anchor_pos, *anchor_side[1:])
            + 0.5 * (lse_p - positive_logit)).mean()


def infonce(anchors, positives, negatives=None, *, temperature=TEMPERATURE,
            hard_negative_weight=0.0, symmetric=False, anchor_offset=0):
    """SimCSE InfoNCE: ``mean_i[−l_ii + log Σ_j exp(l_ij)]``, ``l = s/τ``, ``k = [h⁺; h⁻]``.

    ``hard_negative_weight`` ``w`` is a log-weight on anchor i's own hard negative
    (column N+i). ``symmetric`` averages with the reverse direction, positives as
    anchors against the anchors as candidates. With ``anchor_offset`` the anchors are rows
    ``[offset, offset+n)`` of the batch that ``positives`` (and ``negatives``) cover.
    """
    return contrastive(LossSpec(Logits(temperature, None, hard_negative_weight),
                                rules=Rules(SYMMETRIC, anchors) if symmetric else None,
                                anchor_offset=anchor_offset, backend="reference"),
                       anchors, positives, negatives)


def focal_infonce(anchors, positives, negatives=None, *, temperature=TEMPERATURE, m=FOCAL_M,
                  anchor_offset=0):
    """Focal-InfoNCE: positive logit ``s²/τ``, negative logits ``s(s+m)/τ``, then cross-entropy."""
    return contrastive(LossSpec(Logits(temperature, m), anchor_offset=anchor_offset,
                                backend="reference"), anchors, positives, negatives)


def dclr_noise(anchors, positives, num, *, steps=NOISE_STEPS, lr=NOISE_LR, std=NOISE_STD,
               temperature=TEMPERATURE,
               noise=None, generator=None, formulation="paper"):
    """DCLR's noise negatives, improved by ``steps`` normalized gradient-ascent steps.

    ``L_U = mean_i[−s(h_i, h⁺_i)/τ_u + log Σ_j exp(cos(h_i, z_j)/τ_u)]`` with h, h⁺ detached;
    each step ``z_j ← z_j + lr · g_j/‖g_j‖``, ``g = ∂L_U/∂Z`` (a row with g_j = 0 stays put).
    ``formulation="released"``: the step's loss is the cross-entropy over ``[h⁺; Z]`` (the
    in-batch columns join the log-sum-exp), and a row with g_j = 0 becomes 0 (0/0 is NaN
    there, which the code then zeroes). An autograd graph per step, as the released code
    (also under ``torch.inference_mode``, where the step runs outside it), of
    ``Σ_ij w_ij l_ij`` with the softmax's ``p_ij`` as constant weights, each column's scaled
    by its largest: ``g_j`` up to a positive factor, so the same step, and every row with
    ``g_j ≠ 0`` gets its direction (the exact update moves every row by ``lr``), also where
    each of its ``p_ij`` underflows (float32: a cosine gap ≥ 103·τ_u).
    ``g/‖g‖`` is formed from ``g/max|g|`` (in float32 ‖g‖² is 0 for g ≈ 1e-25), after the
    gradient's rounding residual along z is projected out (the exact gradient is orthogonal
    to z; at d = 1 it is 0): :func:`fastcl.common.safe_direction`,
    :func:`fastcl.common.project_out_radial`.
    """
    h = wide(anchors.detach())
    h_pos = positives.detach().to(h.dtype)
    z = (draw_noise(num, h.shape[1], std=std, generator=generator, device=h.device)
         if noise is None else noise.detach()).to(h.dtype).clone()
    if torch.is_inference_mode_enabled():
        # inference tensors cannot enter an autograd graph: the update runs on normal copies
        with torch.inference_mode(False):
            z = dclr_noise(h.clone(), h_pos.clone(), num, steps=steps, lr=lr,
                           temperature=temperature, noise=z.clone(), formulation=formulation)
        return z.clone()
    for _ in range(steps):
        z.requires_grad_(True)
        with torch.enable_grad():
            # ∂L_U/∂z_j = (1/N) Σ_i p_ij ∂l_ij/∂z_j, p the row softmax over Z (the paper's
            # positive term is constant in Z) or over [h⁺; Z] (released): each column's p_ij
            # scaled by 1/max_i p_ij, which leaves the direction and keeps the far rows' in
            # range (in float32 a row 103·τ_u below every anchor's top logit has p = 0)
            logits = cosine_matrix(h, z if formulation != "released" else torch.cat([h_pos, z]))
            logits = logits / temperature
            log_p = torch.log_softmax(logits.detach(), dim=1)[:, -z.shape[0]:]
            weight = torch.exp(log_p - log_p.amax(dim=0, keepdim=True))
            (grad,) = torch.autograd.grad((weight * logits[:, -z.shape[0]:]).sum(), z)
        step, zero = safe_direction(project_out_radial(grad, z.detach()))
        z = z.detach() + lr * step
        if formulation == "released":
            z = z.masked_fill(zero[:, None], 0.0)
    return z.detach()


def dclr_weights(c_anchors, c_positives, num_noise, *, phi, temperature, formulation="paper",
                 anchor_offset=0):
    """DCLR's instance weights α (N×(N_pos+K)), 0 for dropped in-batch negatives.

    Paper: ``α_ij = 1[cos(c_i, c⁺_j) < φ]`` on in-batch columns, 1 on the positive and on
    the K columns after them (noise, or any extra negatives). Released code: the test
    written ``cos/τ ≤ 20·φ``, and noise columns get a complementary cosine of 0, so φ < 0
    drops every one of them.
    """
    cos = cosine_matrix(c_anchors, c_positives)
    keep = (cos / temperature <= 20 * phi) if formulation == "released" else (cos < phi)
    keep = keep | _at(torch.arange(keep.shape[0], device=keep.device) + anchor_offset, keep.shape[1])
    keep_noise = formulation != "released" or phi >= 0
    noise_cols = torch.full((keep.shape[0], num_noise), keep_noise, dtype=torch.bool, device=keep.device)
    return torch.cat([keep, noise_cols], dim=1)


def dclr_loss(anchors, positives, *, complementary=None, phi=PHI, noise=None, noise_ratio=NOISE_RATIO,
              noise_steps=NOISE_STEPS, noise_lr=NOISE_LR, noise_std=NOISE_STD,
              noise_temperature=None, temperature=TEMPERATURE, generator=None, formulation="paper", anchor_offset=0):
    """DCLR: InfoNCE against ``[h⁺; Z]`` where dropped in-batch negatives leave the denominator.

    ``L = mean_i[−l_ii + log Σ_j α_ij exp(l_ij)]``. ``formulation="released"`` instead
    multiplies logits by α and applies binary cross-entropy to the row softmax, averaged
    over all N·(N+K) entries, as the authors' released code does.
    """
    count = noise.shape[0] if noise is not None else noise_count(noise_ratio, positives.shape[0],
                                                                 formulation)
    settings = Noise(count, noise, noise_steps, noise_lr, noise_std,
                     temperature if noise_temperature is None else noise_temperature, generator)
    return contrastive(LossSpec(Logits(temperature),
                                None if complementary is None else Mask(complementary, phi),
                                settings if noise is not None or count else None,
                                formulation=formulation, anchor_offset=anchor_offset,
                                backend="reference"), anchors, positives)


def escl_loss(anchors, positives, sensitive, *, temperature=TEMPERATURE, weight=ESCL_WEIGHT,
              rd=ESCL_RD, margins=ESCL_MARGINS, anchor_offset=0):
    """ESCL: ``InfoNCE(h, h⁺) + λ · L_RD(h, h⁺, h⁻)``, ``h⁻`` the high-dropout view."""
    own_positives = positives[anchor_offset:anchor_offset + anchors.shape[0]]
    return (infonce(anchors, positives, temperature=temperature, anchor_offset=anchor_offset)
            + weight * relative_difference(anchors, own_positives, sensitive,
                                           temperature=temperature, rd=rd, margins=margins))
