"""The engine contract (:class:`Engine`) and the PyTorch engine's epilogue: one width's
cosines to row losses and ``H`` (:func:`torch_width`, which the driver's
:class:`~fastcl.tiled.driver._Widths` runs for the whole of d or each Matryoshka width), with
the pieces every width shares (:class:`_RowRules`, :func:`_focal_logits`,
:func:`_focal_slope`), and the GEMM helpers the driver uses."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..common import accumulate_dtype
from ..layout import PLAIN, column_blocks, column_groups, hardness_columns, visible_blocks
from ..spec import Epilogue


@functools.lru_cache(maxsize=None)
def _mixed(device_type: str, op: str) -> bool:
    """Whether torch's ``op`` writes float32 from 16-bit inputs on this device type: ``"mm"``
    with ``out_dtype``, ``"addmm"`` accumulating into a float32 buffer in place (cuBLAS with
    beta = 1)."""
    try:
        x = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        if op == "mm":
            return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, x, x, out_dtype=torch.float32, out=acc)
        return bool((acc == 3).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` written in ``acc``. 16-bit GEMMs write float32 directly where torch can; a
    CPU widens the operands (the same products and sums, and no slower there); elsewhere
    the product is rounded to 16 bits first (~3 significant digits: fine for the gradient
    GEMMs, too coarse for cosines at τ = 0.05 — the Triton kernels form those)."""
    if a.dtype == acc:
        return a @ b
    if _mixed(a.device.type, "mm"):
        return torch.mm(a, b, out_dtype=acc)
    if a.device.type == "cpu":
        return a.to(acc) @ b.to(acc)
    return (a @ b).to(acc)


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` the accumulator: in place (one GEMM with beta = 1) where
    torch can; else through a product the size of ``out``."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif _mixed(a.device.type, "addmm"):
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out += _mm(a, b, out.dtype)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` into the accumulator ``out`` (no new R×M allocation)."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    else:
        out.zero_()
        _accumulate_mm(out, a, b)


@dataclass
class Chunk:
    """What an engine sees of one chunk of anchor rows ``[r0, r1)``.

    Cosines are never formed from normalized copies: ``s_ij = (q_i·k_j) · inv_q_i · inv_k_j``
    with the raw inputs and their inverse norms, so neither an N×d nor an M×d copy is needed.
    """

    r0: int
    r1: int
    n: int                      # anchors in this call: the loss is their mean
    n_pos: int                  # rows of the positives block (the global batch)
    first_pos: int              # column of row r0's positive (anchor_offset + r0)
    q: torch.Tensor             # (R×d) raw anchor rows, matmul dtype
    keys: torch.Tensor          # (M×d) raw candidates, matmul dtype
    inv_q: torch.Tensor         # (R,) 1/max(‖q_i‖, eps), accumulate dtype
    inv_k: torch.Tensor         # (M,)
    ginv_k: torch.Tensor        # (M,) γ·c·inv_k (c: the smallest unclamped ‖k_j‖), H's column factor
    loss_out: torch.Tensor | None = None  # (R,) where the engine writes the row losses
    tau_out: torch.Tensor | None = None   # 0-dim: focal's Σ_{j off the positives} (∂ℓ_i/∂l_ij)·s_ij
    #                                       added (a learnable temperature's gradient reads it)
    comp_q: torch.Tensor | None = None   # (R×d_c) complementary anchors, normalized, matmul dtype
    comp_k: torch.Tensor | None = None   # (N×d_c) complementary positives, likewise


def _debiased(gap, count, prior, positive, inv_t):
    r"""Chuang et al.'s debiased row loss from ``gap = log Σ_{j≠p} e^{l_ij} − l_ip`` (the
    others' log-sum-exp less the positive's logit), the kept others ``Q = count`` and ``τ⁺ =
    prior``: ``ℓ = softplus(g)``, ``g = log N_g − l_ip = max(a, b)`` with

    .. math:: a = \mathrm{gap} + \log(1 − u) − \log(1 − τ⁺),\ u = Qτ⁺e^{−\mathrm{gap}};
              \quad b = \log Q − 1/τ − l_{ip}

    (``a = −∞`` where ``u ≥ 1``), every term in log space: nothing overflows where the
    positive dominates or a row keeps nothing (``Q = 0``: ℓ = 0). Returns ``(ℓ, f, ∂ℓ/∂l_ip)``
    with ``∂ℓ/∂l_ij = f·p̃_ij`` off the positive (p̃ the others' own softmax): the branch
    taken's subgradient, ``σ(g)/(1 − u)`` and ``−σ(g)/(1 − u)`` on ``a``, 0 and ``−σ(g)`` on
    ``b``."""
    q = count.to(gap.dtype)
    some = q > 0
    ninf = torch.full_like(gap, float("-inf"))
    log_u = torch.where(some, q.log() + prior.log() - gap, ninf)
    one_less_u = -torch.expm1(log_u)                          # 1 − u, no cancellation
    a = torch.where(log_u < 0, gap + torch.log(one_less_u.clamp_min(0)) - torch.log1p(-prior), ninf)
    b = torch.where(some, q.log() - inv_t - positive, ninf)
    g = torch.maximum(a, b)
    loss = torch.logaddexp(g, torch.zeros_like(g))
    sig = torch.sigmoid(g)
    on_a = some & (a >= b)
    slope = torch.where(on_a, sig / one_less_u.where(on_a, torch.ones_like(g)), torch.zeros_like(g))
    return loss, slope, torch.where(on_a, -slope, -sig)


def _row_counts(mask: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Each row's count of True, a block of rows at a time: a bool tensor's sum widens the
    whole of it to int64 first (8 bytes an entry, twice the R×M float32 buffer)."""
    return torch.cat([mask[i:i + block].sum(dim=1) for i in range(0, mask.shape[0], block)])


class _SoftTargets:
    """Soft targets (:class:`fastcl.spec.Soft`) on a chunk's anchor rows, from their logits
    (R×M, dropped entries −inf, the positive still in): ``y = a·1[P] + b·1[K]`` with
    ``a = (1−ε)/|P|``, ``b = ε/|K|`` (K: the kept entries; P: the positive, or with labels
    the kept positives-block columns of the row's label), and the row loss's extra term
    ``Σ_j y_ij (l_ip − l_ij) = (1−ε)(l_ip − Σ_P l/|P|) + ε(l_ip − Σ_K l/|K|)`` beside
    ``lse − l_ip``. Row sums only: a bool slice (K) and, with labels, an R×N_b one (P).
    With a teacher, ``y ← (1−λ)·y + λ·q`` and the extra term ``(1−λ)·… + λ·Σ_j q_ij
    (l_ip − l_ij)``, q the teacher's softmax over the kept documents (an R×(N_b+K) slice)."""

    def __init__(self, ep: Epilogue, c: Chunk, logits, n_pos: int, ar, diag):
        eps = ep.label_smoothing
        self.dead = torch.isneginf(logits)
        pos = logits[ar, diag]
        logits.masked_fill_(self.dead, 0.0)            # the kept entries' sum, then back
        count = (logits.shape[1] - _row_counts(self.dead)).to(logits.dtype)
        extra = eps * (pos - logits.sum(dim=1) / count)
        self.same = None
        if ep.labels is not None:
            self.same = ((ep.labels[None, :n_pos] == ep.labels[diag][:, None])
                         & ~self.dead[:, :n_pos]).to(logits.dtype)
            size = self.same.sum(dim=1)
            self.a = (1.0 - eps) / size
            extra = extra + (1.0 - eps) * (pos - torch.einsum("ij,ij->i", logits[:, :n_pos],
                                                              self.same) / size)
        else:
            self.a = torch.full_like(pos, 1.0 - eps)
        self.b, self.q = eps / count, None
        if ep.teacher is not None:
            lam = ep.distill_weight
            t_rows, t_docs = ep.teacher
            q = _mm(t_rows[c.r0:c.r1].to(c.q.dtype), t_docs.to(c.q.dtype).T, logits.dtype)
            width = q.shape[1]
            q.mul_(1.0 / ep.teacher_temperature).masked_fill_(self.dead[:, :width], float("-inf"))
            q = torch.softmax(q, dim=1).mul_(lam)
            extra = (1.0 - lam) * extra + (lam * pos - torch.einsum("ij,ij->i", logits[:, :width], q))
            self.a, self.b, self.q = (1.0 - lam) * self.a, (1.0 - lam) * self.b, q
        logits.masked_fill_(self.dead, float("-inf"))
        self.extra = extra

    def subtract(self, grad, ar, diag):
        """In place: ``p − y`` off the positive (the softmax ``p`` in ``grad``); returns
        ``y_ii``, the positive's target (its entry is the caller's: ``−q + (1 − y_ii)``, no
        cancellation when y_ii = 1)."""
        grad.sub_(self.b[:, None]).masked_fill_(self.dead, 0.0)
        if self.same is not None:
            grad[:, :self.same.shape[1]].addcmul_(self.same, self.a[:, None], value=-1.0)
        y_pos = self.a + self.b
        if self.q is not None:
            grad[:, :self.q.shape[1]].sub_(self.q)
            y_pos = y_pos + self.q[ar, diag]
        return y_pos


def _complementary_drop(ep: Epilogue, comp_q, comp_k, first_pos: int, acc: torch.dtype):
    """DCLR's mask on a chunk's anchor rows (R×N_b bool): the complementary model's cosine
    ≥ φ (the released code's ``cos/τ > 20φ``), never the positive (column first_pos + i)."""
    c_cos = _mm(comp_q, comp_k.T, acc)
    released = ep.formulation == "released"
    drop = (c_cos * (1.0 / ep.temperature) > 20 * ep.phi) if released else (c_cos >= ep.phi)
    drop.diagonal(first_pos).fill_(False)
    return drop


def _mirror_column(ep: Epilogue, c: Chunk) -> int | None:
    """The column of side 1's diagonal (each positive-side row's own anchor, in the anchors
    block): row R + i's is this + i; None without a positive side that scores the anchors."""
    if not (ep.paired and ep.layout.positive_to_anchors):
        return None
    n_pos, n_neg, n_noise, n_anchor = ep.blocks
    return n_pos + n_neg + n_noise + (c.first_pos if n_anchor == n_pos else c.r0)


def _layout_drops(ep: Epilogue, c: Chunk):
    """The entries a chunk's rows drop under :mod:`fastcl.layout`'s rules, (R'×M) bool with
    R' = 2R when the rows have a positive side (rows R + i), and where MNRL's hardness term
    applies to the anchor side, (R×M) bool or None."""
    n_pos, n_neg, n_noise, n_anchor = ep.blocks
    r, m, dev = c.r1 - c.r0, c.keys.shape[0], c.q.device
    block = column_blocks(n_pos, n_neg, n_noise, n_anchor, dev)
    group = column_groups(n_pos, n_neg, n_noise, n_anchor, dev)
    local = torch.arange(c.r0, c.r1, device=dev)
    g = local - c.r0 + c.first_pos                     # each row's positive column = its group
    own_anchor = g if n_anchor == n_pos else local     # its column in the anchors block
    cols = torch.arange(m, device=dev)
    anchors_block = (block == 3)[None, :]
    sides = []
    for side in range(2 if ep.paired else 1):
        drop = ~torch.isin(block, torch.tensor(visible_blocks(ep.layout or PLAIN, side), dtype=block.dtype,
                                                 device=dev))[None, :].expand(r, m)
        mine = anchors_block & (group[None, :] == own_anchor[:, None])
        if (ep.layout or PLAIN).exclude_own:
            own = mine if side == 0 else ((block <= 1)[None, :] & (group[None, :] == g[:, None]))
            drop = drop | own
        # the guide's filter and duplicates never drop the noise or the pair's own entry
        filtered = None
        if ep.guide is not None:
            guide_rows, guide_cols, theta = ep.guide
            first = side * c.n
            rows = guide_rows[first + c.r0:first + c.r1]
            filtered = _mm(rows, guide_cols.T, theta.dtype) > theta[c.r0:c.r1, None]
        if ep.ids is not None:
            col_ids, key = ep.ids
            same = col_ids[None, :] == key[c.r0:c.r1, None]
            filtered = same if filtered is None else filtered | same
        if filtered is not None:
            protect = (cols[None, :] == g[:, None]) if side == 0 else mine
            drop = drop | (filtered & ~protect & (block != 2)[None, :])
        sides.append(drop)
    hard = None
    if ep.hardness is not None and ep.hardness[1]:
        hard = hardness_columns(ep.hardness[0], block, group, g, g)
    return (sides[0] if len(sides) == 1 else torch.cat(sides)), hard


class _RowRules:
    """What a chunk's rows drop and weigh, the same at every Matryoshka width: DCLR's mask
    (R×N_b, the anchor side), :func:`_layout_drops`' masks (R'×M), MNRL's hardness columns
    (R×M, as a factor), and the column of the positive side's own anchor (focal gives it
    s²/τ: :func:`_focal_logits`); the false-negative margin, from each width's own cosines
    (:meth:`apply`)."""

    def __init__(self, ep: Epilogue, c: Chunk, acc: torch.dtype):
        self.r, self.ep = c.r1 - c.r0, ep
        self.comp_drop = None
        if ep.complementary is not None:
            self.comp_drop = _complementary_drop(ep, c.comp_q, c.comp_k, c.first_pos, acc)
        self.drop = self.hard = None
        if ep.sided:
            self.drop, hard = _layout_drops(ep, c)
            if hard is not None:      # as a factor, for an in-place addcmul at every width
                self.hard = hard.to(acc)
        self.mirror = _mirror_column(ep, c)

    def apply(self, logits, n_pos: int, cos, first: int) -> None:
        """In place on the logits: the false-negative margin's drops, the hard negative's
        log-weight ``w`` at column ``N_b + first + i``, MNRL's ``β·sg(s)`` on the hardness
        columns (``cos``: the rows' cosines), then the other drops (−inf; DCLR's released
        code: logit 0)."""
        r, ep = self.r, self.ep
        if ep.false_negative_margin is not None:
            self._margin(logits, cos, first)
        if ep.hard_negative_weight:
            logits[:r].diagonal(n_pos + first).add_(ep.hard_negative_weight)
        if self.hard is not None:
            logits[:r].addcmul_(cos[:r], self.hard, value=ep.hardness[1])
        if self.comp_drop is not None:
            fill = 0.0 if ep.formulation == "released" else float("-inf")
            logits[:r, :n_pos].masked_fill_(self.comp_drop, fill)
        if self.drop is not None:
            logits.masked_fill_(self.drop, float("-inf"))

    def _margin(self, logits, cos, first: int) -> None:
        """−inf where ``s_ij > s_{i,p(i)} + m`` (``logits`` still ``s/τ``, or with focal
        ``cos`` the cosines), the threshold of row i on both its sides; never the positive
        nor, on the positive side, its own anchor."""
        r, ep = self.r, self.ep
        x, m = (cos, ep.false_negative_margin) if ep.focal_m is not None else (
            logits, ep.false_negative_margin / ep.temperature)
        threshold = x[:r].diagonal(first) + m
        close = x > (threshold if x.shape[0] == r else threshold.repeat(2))[:, None]
        close[:r].diagonal(first).fill_(False)
        if self.mirror is not None:
            close[r:].diagonal(self.mirror).fill_(False)
        logits.masked_fill_(close, float("-inf"))


def _focal_logits(out, cos, ep: Epilogue, r: int, first: int, mirror: int | None):
    """Focal-InfoNCE's logits into ``out`` from the cosines ``cos`` (R'×M): ``s(s+m)/τ``, and
    ``s²/τ`` on each anchor-side row's positive (column ``first + i``) and on the positive
    side's own anchor (row R + i, column ``mirror + i``)."""
    inv_t = 1.0 / ep.temperature
    torch.add(cos, ep.focal_m, out=out).mul_(cos).mul_(inv_t)
    out[:r].diagonal(first).copy_(cos[:r].diagonal(first).square().mul_(inv_t))
    if mirror is not None:
        out[r:].diagonal(mirror).copy_(cos[r:].diagonal(mirror).square().mul_(inv_t))
    return out


def _focal_slope(cos, ep: Epilogue, r: int, first: int, mirror: int | None):
    """In place on the cosines: the focal logits' slope τ·g'(s), ``2s + m`` off the positives
    and ``2s`` on them (the positions of :func:`_focal_logits`' ``s²/τ``)."""
    slope = cos.mul_(2.0).add_(ep.focal_m)
    slope[:r].diagonal(first).sub_(ep.focal_m)
    if mirror is not None:
        slope[r:].diagonal(mirror).sub_(ep.focal_m)
    return slope


#: Where ``2·bound + ln M`` (:func:`_logit_bound`) stays below this, every softmax entry is a
#: normal float32 number, and a row's loss ``lse − l_ii`` is ``−log p_ii`` without its
#: log-sum-exp.
_EXACT_LOG_BOUND = 80.0


def _logit_bound(ep: Epilogue) -> float:
    """A bound on |logit| from the epilogue alone (cosines lie in [−1, 1]): 1/τ, (1 + |m|)/τ
    with focal modulation, plus the hard negative's |log-weight|."""
    slope = 1.0 + abs(ep.focal_m) if ep.focal_m is not None else 1.0
    return slope / ep.temperature + abs(ep.hard_negative_weight)


def torch_width(ep: Epilogue, weight: float, c: Chunk, dots, out, spare, cos, inv_q, inv_k, ginv_k, gain,
                rules: _RowRules, row_f, pos_g, row_c, col_c, want_grad: bool = True):
    r"""The PyTorch engine's epilogue of one width (one Matryoshka width, or the whole of d;
    the driver's :class:`~fastcl.tiled.driver._Widths`) on a chunk, from its prefix dot
    products ``dots`` (R'×M, kept; R' = 2R with a positive side, rows R + i):
    ``c.loss_out += w_k·L_k`` (each row's ℓ_i before the mean); ``row_f`` ← ``f`` (R') and
    ``pos_g`` ← ``g`` (R) with ``Ã^k = diag(f) H − δ·g`` (δ: each anchor-side row's positive,
    column ``first + i``); the radial sums ``Σ_j Ã_ij D_ij`` into ``row_c`` and ``Σ_i Ã_ij
    D_ij`` added to ``col_c`` (either None: not wanted). ``out`` and ``spare`` are free R'×M
    slices, ``cos`` (R'×M, with focal or MNRL's hardness) holds the cosines; ``rules``: the
    chunk's :class:`_RowRules`, shared by every width. H takes the column factor ``ginv_k``
    (``gain·inv_k``, capped in fp16: the driver's ``_column_factor``, which keeps H in a
    16-bit range; ``inv_k`` and ``gain`` = 1 with 32-bit GEMMs) and ``f`` the rest,
    1/(‖q‖τN·gain): inside H, 16 bits would flush it. Returns ``(H, free)``: the slice that
    holds H and the one left free (``(None, None)``, both free, without ``want_grad``).

    Every pass over the slice counts (they, not the GEMMs, bound the time): the softmax is
    one fused pass (its rows stay in cache), the row factor stays in ``f``, and the column
    factor is applied once, to H, before the radial product."""
    r, n_pos, first, row_loss = rules.r, c.n_pos, c.first_pos, c.loss_out
    inv_t = 1.0 / ep.temperature
    released, prior = ep.formulation == "released", ep.positive_prior
    joint = ep.paired and ep.layout.joint
    if cos is not None:
        torch.mul(dots, inv_q[:, None], out=cos).mul_(inv_k[None, :])
    if ep.focal_m is not None:
        pos_cos = cos[:r].diagonal(first).clone()
        logits = _focal_logits(spare, cos, ep, r, first, rules.mirror)
    else:
        logits = torch.mul(dots, (inv_q * inv_t)[:, None], out=spare).mul_(inv_k[None, :])
    rules.apply(logits, n_pos, cos, first)
    # the released code gives the other columns (DCLR's noise) a complementary cosine of 0,
    # so its test drops all of them when 0/τ > 20φ, i.e. φ < 0 (logit 0, no gradient)
    drop_rest = released and ep.complementary is not None and 0.0 > 20 * ep.phi
    if drop_rest:
        logits[:, n_pos:] = 0.0
    ar = torch.arange(r, device=logits.device)
    soft = _SoftTargets(ep, c, logits, n_pos, ar, ar + first) if ep.soft else None
    # the debiased loss counts each row's kept others Q (a row's one softmax: build_spec's rule)
    if prior is not None:
        kept = _row_counts(logits.gt(float("-inf")))
        kept = (kept[:r] + kept[r:] if joint else kept) - 1
    # Every row's own softmax, one fused pass. ℓ_i = lse_i − l_ii = −log p_ii where p_ii ≥
    # e^(−2·bound)/M cannot underflow (no positive side, no layout); else lse_i through the
    # row's largest logit, whose p ≥ 1/M. (Where the others' share q < 1/2: −log1p(−q).)
    exact = (ep.positives and not ep.sided and not released and prior is None
             and 2.0 * _logit_bound(ep) + math.log(logits.shape[1]) <= _EXACT_LOG_BOUND)
    if not exact:
        top = logits.amax(dim=1)
        pos = logits[:r].diagonal(first).clone() if ep.positives else 0.0   # (none: ℓ = lse)
    p = torch.ops.aten._softmax.out(logits, 1, False, out=out)
    # The others' share of each anchor row's softmax, q = Σ_{j≠i} p_ij = 1 − p_ii, summed with
    # the positive's entry taken out: where the positive dominates p_ii rounds to 1, and
    # −log p_ii and p_ii − 1 keep no digit; −log1p(−q) and −q keep them all. The
    # positive's entry of H is then 0, its whole term in g (below).
    if not exact:
        lse = top - p.amax(dim=1).log_()
    if ep.positives:
        p_pos = p[:r].diagonal(first).clone()
        p[:r].diagonal(first).zero_()
    q = p[:r].sum(dim=1)                          # (no positive: 1, and ℓ = lse)
    scale = 1.0                       # each row's softmax in the loss's: p_loss = scale·p
    if exact:
        near = -p_pos.log()
    else:
        if joint:
            # rows i and R + i share one softmax, log Σ_{both sides} e^l: each side's own
            # rescaled by e^(lse_side − lse). A positive side may drop every column (the
            # guide's filter): its row is 0/0 on its own, and nothing in the shared one.
            dead = torch.isneginf(top)
            p.masked_fill_(dead[:, None], 0.0)
            lse = lse.masked_fill(dead, float("-inf"))
            shared = torch.logaddexp(lse[:r], lse[r:])
            scale = torch.exp(lse - shared.repeat(2))
            q = scale[:r] * q + scale[r:] * (~dead[r:]).to(q.dtype)
            lse = shared
        near = lse[:r] - pos
        if ep.paired and not joint:
            # each side its own softmax: the mean of the two log-sum-exps
            scale = 0.5
            far = lse[r:] - pos
    loss = torch.where(q < 0.5, torch.neg(q).log1p_().neg_(), near)
    if prior is not None:
        # Chuang et al.'s row loss from gap = log Σ_{j≠i} e^l_ij − l_ii = log q − log p_ii;
        # off the positive ∂ℓ/∂l = f·p/q (p/q: the others' own softmax), on it ``q`` ← −∂ℓ/∂l_ii
        loss, f, pos_grad = _debiased(q.log() + near, kept, prior[c.r0:c.r1], pos, inv_t)
        ratio = torch.where(q > 0, f / q, torch.zeros_like(q))
        scale = scale * (ratio.repeat(2) if joint else ratio)
        q = -pos_grad
        row_loss += weight * loss
    elif released:
        # BCE on the softmax, mean over all N·M entries; log p and log(1−p) clamped at −100
        # as torch's binary_cross_entropy does (−log p_ii = loss; p's positive entry is 0 here)
        log_not = torch.neg(p, out=spare).log1p_().clamp_min_(-100.0)
        row_loss += weight * (loss.clamp_max(100.0) - log_not.sum(dim=1))
    elif ep.paired and not joint:
        row_loss += weight * 0.5 * (loss + far)
        q = 0.5 + 0.5 * q                  # 1 − 0.5·p_ii
    elif soft is not None:
        # soft targets: the extra term beside −log p_ii, p − y off the positive, and on it
        # p_ii − y_ii = −(q − (1 − y_ii))
        row_loss += weight * (loss + soft.extra)
        q = q - (1.0 - soft.subtract(p, ar, ar + first))
        p[:r].diagonal(first).zero_()
    else:
        row_loss += weight * loss
    if not want_grad:
        return None, None
    if released:
        # v_ij = p·∂BCE/∂p = p(p − y)/max(p(1 − p), 1e-12), the clamp of torch's BCE backward:
        # p/(1−p) off the positive, −1 on it (−p_ii·q/max(p_ii·q, 1e-12), q = 1 − p_ii);
        # ∂L/∂a = (v − p·Σ_j v)/(N·M), a = α·s/τ, on the positive v_ii·q − p_ii·Σ_{j≠i} v_j
        v = torch.neg(p, out=spare).add_(1.0).mul_(p).clamp_min_(1e-12).reciprocal_().mul_(p).mul_(p)
        v_others = v.sum(dim=1)
        v_pos = -(p_pos * q) / (p_pos * q).clamp_min(1e-12)
        p.mul_(-(v_others + v_pos)[:, None]).add_(v)      # the positive's entry stays 0
        q = p_pos * v_others - v_pos * q                  # −∂ℓ/∂a_ii
        if rules.comp_drop is not None:
            p[:, :n_pos].masked_fill_(rules.comp_drop, 0.0)
        if drop_rest:
            p[:, n_pos:] = 0.0
    # ∂L/∂s^k = w_k (p − δ) g'(s)/N: g'(s) = 1/τ, or with focal modulation (2s + m)/τ off
    # the positive (and the positive side's own anchor) and 2s/τ on them; MNRL's β·sg(s) has
    # no slope. The positive's p_loss − 1 = −q.
    base = inv_q * (weight * inv_t / (c.n * c.keys.shape[0] if released else c.n) / gain)
    row_f.copy_(base * scale)
    if ep.positives:
        pos_g.copy_(base[:r] * ginv_k[first:first + r] * q
                    * (1.0 if ep.focal_m is None else 2.0 * pos_cos))
    if ep.focal_m is not None:
        if c.tau_out is not None:
            # focal's Σ_{j off the positives} (∂ℓ_i/∂l_ij)·s_ij (∂L/∂τ reads it: the driver)
            off = torch.mul(p, cos, out=spare).sum(dim=1)
            if rules.mirror is not None:
                off[r:] -= p[r:].diagonal(rules.mirror) * cos[r:].diagonal(rules.mirror)
            c.tau_out += weight * (off * scale).sum()
        p.mul_(_focal_slope(cos, ep, r, first, rules.mirror))
    held = p.mul_(ginv_k[None, :])
    if row_c is None:
        return held, spare
    # the radial sums: Σ_j Ã_ij D_ij = f_i Σ_j H_ij D_ij − g_i D_ii, and by columns
    product = torch.mul(held, dots, out=spare)
    row_c.copy_(product.sum(dim=1).mul_(row_f))
    if col_c is not None:
        col_c += torch.mv(product.T, row_f)
    if ep.positives:
        pos_dots = pos_g * dots[:r].diagonal(first)
        row_c[:r] -= pos_dots
        if col_c is not None:
            col_c[first:first + r] -= pos_dots
    return held, spare


def _acc_and_cast_bytes(dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of an accumulate-dtype entry, and of its cast to the GEMM dtype (0 if none)."""
    acc = accumulate_dtype(dtype)
    return torch.finfo(acc).bits // 8, 0 if dtype == acc else torch.finfo(dtype).bits // 8


def _slices(ep: Epilogue) -> int:
    """The torch engine's R'×M slices of a chunk: D, a scratch slice and one H per width (the
    cosines too with focal or MNRL's hardness)."""
    widths = 1 if ep.matryoshka is None else len(ep.matryoshka[0])
    return 2 + widths + (ep.focal_m is not None or ep.hardness is not None)


def _torch_row_bytes(ep: Epilogue, dtype: torch.dtype, m: int, n_pos: int) -> int:
    """The torch engine's buffers per loss row: its accumulate-dtype slices (:func:`_slices`),
    each side's, B's cast to the GEMM dtype, the masks (the layout's, DCLR's R×N_b, the
    margin's and the debiased count's), the hardness factor, the guide's cosines while formed."""
    acc, cast = _acc_and_cast_bytes(dtype)
    sides = 2 if ep.paired else 1
    rules = m * (sides + acc * (ep.hardness is not None) + acc * (ep.guide is not None)) if ep.sided else 0
    rules += sides * m * ((ep.false_negative_margin is not None) + (ep.positive_prior is not None))
    mask = n_pos * (acc + 1) if ep.complementary is not None else 0
    return sides * m * (acc * _slices(ep) + cast) + rules + mask + _soft_bytes(ep, m, acc)


def _soft_bytes(ep: Epilogue, m: int, acc: int) -> int:
    """:class:`_SoftTargets`' buffers per row: the kept entries (bool), with labels the
    positives block's weights, with a teacher its softmax over the documents."""
    if not ep.soft:
        return 0
    return (m + (0 if ep.labels is None else ep.labels.shape[0] * (acc + 1))
            + (0 if ep.teacher is None else acc * ep.teacher[1].shape[0]))


@dataclass(frozen=True)
class Engine:
    """A chunk engine of the driver: ``chunk(ep, c, want_grad)`` writes each row's loss ℓ_i
    (before the mean) into ``c.loss_out`` and returns H, ``H_ij = ∂ℓ_i/∂s_ij · ginv_k_j``
    (matmul dtype; ``None`` if not ``want_grad``), the row factors ``inv_q_i/(N·c)`` left to
    the driver (inside H they sit near 1e-9, where fp16 flushes them); ``chunk`` None: the
    driver's :class:`~fastcl.tiled.driver._Widths` pass with :func:`torch_width` (the torch
    engine). ``row_bytes(ep, dtype, M, N_b)`` its buffers
    per anchor row; chunks are rounded to ``row_multiple`` rows; ``tangent`` and
    ``noise_step`` its fused chain rule and DCLR noise step (None: the driver's PyTorch ones,
    :func:`_tangent_` and :func:`_noise_step`)."""

    name: str
    chunk: Callable | None
    row_bytes: Callable
    row_multiple: int = 16
    tangent: Callable | None = None
    noise_step: Callable | None = None


TORCH = Engine("torch", None, _torch_row_bytes)


_TRITON: list = []


def engine_for(backend: str) -> Engine:
    """The engine of a resolved backend ("tiled": :data:`TORCH`; "triton": the kernels')."""
    if backend != "triton":
        return TORCH
    if not _TRITON:
        from ..kernels import contrastive as k
        _TRITON.append(Engine("triton", k.triton_chunk, k._row_bytes, k.ROW_MULTIPLE,
                              k.triton_tangent, k.triton_noise_step))
    return _TRITON[0]
