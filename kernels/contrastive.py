"""Fused Triton kernels for the contrastive family (InfoNCE, focal, DCLR, noise update),
and their launches.

The driver in :mod:`fastcl.tiled` walks anchor rows in chunks of R; for each chunk this
module replaces the PyTorch epilogue with two kernels:

``_similarity_kernel``  a grid of R×128 tiles: s = (q·kᵀ)·inv‖q‖·inv‖k‖ accumulated over d
                        in BLOCK_D steps (fp32), the logit transform (temperature, focal,
                        hard-negative log-weight), the DCLR mask computed in the tile from the
                        complementary embeddings, :mod:`fastcl.layout`'s rules (RULES: the
                        blocks each side of a row scores and its drops from the column
                        index, MNRL's hardness term, the text ids; GUIDE: GIST's guide
                        cosines, a second tile product, against each row's threshold; TEACHER:
                        the distillation teacher's cosines, a second product in the guide's
                        slots, stored after the chunk's R×M), and each tile's (max, Σexp) of
                        its rows.
                        It stores either ``e = exp(l − tile max)`` in the GEMM dtype (where
                        the gradient needs nothing but the softmax: InfoNCE, hard negatives,
                        the paper's DCLR, the noise update) or the fp32 cosines (focal needs
                        s for its slope, the released DCLR needs to know what was dropped).
``_row_kernel``         one program per anchor row (the pattern of a fused cross-entropy):
                        combines the tile partials into the row log-sum-exp, writes the row
                        loss, and turns the stored row into the gradient in place —
                        ``H_ij = ∂ℓ_i/∂s_ij · c·inv‖k_j‖`` — in one pass (two for the released
                        DCLR, whose BCE needs Σ_j first). With RULES the chunk's rows are
                        ``[anchors; their positives]`` when a layout has a positive side:
                        rows i and R/2 + i share one log-sum-exp (joint) or each keep
                        their own (per direction).

Besides, once a call or a step: ``_row_finish_kernel`` (the bounded design's rows from the
tiles' sums), ``_tangent_kernel`` (the chain rule through the normalization, dq and dk) and
``_noise_step_kernel`` (a step of DCLR's noise update from the candidates' accumulator).

The two gradient GEMMs ``H K`` and ``Hᵀ(w⊙Q)`` then run on the raw inputs (cuBLAS on a
GPU), with the row weights ``w_i = inv‖q_i‖ / (N·c)`` applied outside the 16-bit buffer:
kept inside, they put G′ near 1e-9, where fp16 flushes it to zero. Partials per column tile
rather than one program per row block: a tile grid keeps every SM busy at any chunk size
(the split-softmax idea of flash-decoding). No atomics: results are bit-identical run to run.

A flag set (:data:`fastcl.kernels.configs.VARIANTS`) and the launch's mode reach the kernels
as one constexpr, ``FLAGS`` (a bit each: ``FOCAL & FLAGS``); the layout's rules as one
integer, ``rules``. Launch sizes and autotune lists are in :mod:`fastcl.kernels.configs`.

Offsets that scale with R·M or M·d are formed in int64: a chunk of R·M ≥ 2³¹ entries is
reachable with a large ``chunk_size``.
"""

# (no `from __future__ import annotations`: Triton 3.1 finds a kernel's constexpr
# parameters by their annotation objects, and its interpreter misses them as strings)
import functools

import numpy as np
import torch
import triton
import triton.language as tl

from fastcl.common import EPS
from fastcl.layout import PLAIN, visible_blocks

from . import configs
from .configs import INTERPRET


#: A cosine never exceeds 1: this value in the stored s marks a dropped in-batch negative.
#: A constexpr: a plain module global cannot be read inside a jitted function.
DROPPED = tl.constexpr(4.0)

#: The positive column of a row that has none (the positive side of a paired row): no
#: column index and no ``n_pos + column`` ever equals it.
NO_POSITIVE = tl.constexpr(-(2**30))

#: Bits of the kernels' constexpr ``FLAGS``: the flag set (``configs.VARIANTS``), then the
#: launch's mode (what the similarity kernel stores, the bounded design, the gradient).
#: Tested as ``FOCAL & FLAGS`` (the constexpr first: the interpreter passes FLAGS as an int).
FOCAL = tl.constexpr(1)
HARD = tl.constexpr(2)
MASK = tl.constexpr(4)
RELEASED = tl.constexpr(8)
POSITIVES = tl.constexpr(16)
RULES = tl.constexpr(32)
GUIDE = tl.constexpr(64)
STORE_EXP = tl.constexpr(128)
BOUNDED = tl.constexpr(256)
WANT_GRAD = tl.constexpr(512)
MARGIN = tl.constexpr(1024)            # the false-negative margin (a flag of the set)
PRIOR = tl.constexpr(2048)             # the debiased row loss (a flag of the set)
SOFT = tl.constexpr(4096)              # soft targets (a flag of the set; the row kernel's)
TEACHER = tl.constexpr(8192)           # the teacher's softmax in the soft target (with SOFT)
_BITS = dict(FOCAL=FOCAL, HARD=HARD, MASK=MASK, RELEASED=RELEASED, POSITIVES=POSITIVES,
             RULES=RULES, GUIDE=GUIDE, STORE_EXP=STORE_EXP, BOUNDED=BOUNDED, WANT_GRAD=WANT_GRAD,
             MARGIN=MARGIN, PRIOR=PRIOR, SOFT=SOFT, TEACHER=TEACHER)

#: The kernels' ``rules`` (:mod:`fastcl.layout`'s rules of a chunk, one integer): the blocks
#: each side scores (4 bits a side: positives, negatives, noise, anchors), then these bits,
#: then MNRL's hardness mode (2 bits: 1 in-batch negatives, 2 hard negatives, 3 all).
VIS_BITS = tl.constexpr(4)
EXCLUDE_OWN = tl.constexpr(1 << 8)    # MNRL's self and own-document exclusions
NEG_GROUPED = tl.constexpr(1 << 9)    # negative j belongs to group j mod N_b (K a multiple of N_b)
HAS_IDS = tl.constexpr(1 << 10)       # duplicate masking: compare the text ids
PAIRED = tl.constexpr(1 << 11)        # rows [anchors; their positives], R_half each
JOINT = tl.constexpr(1 << 12)         # paired rows share one softmax
HARD_SHIFT = tl.constexpr(13)

@triton.jit
def _not(b):
    """Logical not of a boolean tile (``~b`` builds an all-ones int1 constant, which the
    interpreter of Triton 3.1, the floor, cannot make)."""
    return b == 0


@triton.jit
def _bce_v(p, is_pos):
    """v = p·∂BCE/∂p = p(p − y)/max(p(1 − p), 1e-12), the clamp torch's binary_cross_entropy
    backward applies: p/(1−p) off the positive and −1 on it, finite where p rounds to 1."""
    return tl.where(is_pos, p * (p - 1.0), p * p) / tl.maximum(p * (1.0 - p), 1e-12)


@triton.jit
def _bce_log_not(p):
    """log(1 − p) = log1p(−p), clamped at −100 as torch's BCE (p = 1 gives −100)."""
    not_p = 1.0 - p                          # exact for p ≥ 0.5
    log_not = tl.where(p <= 0.5, _log1p(-tl.minimum(p, 0.5)), tl.log(tl.maximum(not_p, 1e-30)))
    return tl.where(not_p > 0.0, tl.maximum(log_not, -100.0), -100.0)


@triton.jit
def _logits(s, is_pos, cols, rows_g, n_pos, inv_t, focal_m, hard_w, FLAGS: tl.constexpr):
    """l = s/τ, or focal s²/τ (positive) and s(s+m)/τ (negatives); + w on column N+i."""
    if FOCAL & FLAGS:
        l = tl.where(is_pos, s * s, s * (s + focal_m)) * inv_t
    else:
        l = s * inv_t
    if HARD & FLAGS:
        l = tl.where(cols[None, :] == n_pos + rows_g[:, None], l + hard_w, l)
    return l


@triton.jit
def _rule_rows(rows, R_half, first_pos, anchor_base, FLAGS: tl.constexpr):
    """Each chunk row's positive column ``rows_g`` (its global anchor index), and with RULES
    what :mod:`fastcl.layout` needs of it: its side (the rows are ``[anchors; their
    positives]`` when paired, R_half each; the positive side has no positive column), its
    index within the side, its group ``g`` (= its positive's column) and its own column's
    group in the anchors block (without RULES: stand-ins, never read)."""
    if RULES & FLAGS:
        side1 = rows >= R_half
        i = tl.where(side1, rows - R_half, rows)
        g = first_pos + i
        own = anchor_base + i
        rows_g = tl.where(side1, NO_POSITIVE, g)
    else:
        rows_g = first_pos + rows
        side1, i, g, own = rows < 0, rows, rows_g, rows_g
    return rows_g, side1, i, g, own


@triton.jit
def _rule_columns(cols, n_pos, n_neg, n_noise, rules):
    """Each column's block (0 positives, 1 negatives, 2 noise, 3 anchors) and group
    (``fastcl.layout.column_groups``: −1 for noise and ungrouped negatives)."""
    first_noise = n_pos + n_neg
    first_anchor = first_noise + n_noise
    block = ((cols >= n_pos).to(tl.int32) + (cols >= first_noise).to(tl.int32)
             + (cols >= first_anchor).to(tl.int32))
    neg_group = tl.where((rules & NEG_GROUPED) != 0, (cols - n_pos) % n_pos, -1)
    group = tl.where(block == 0, cols,
                     tl.where(block == 1, neg_group, tl.where(block == 3, cols - first_anchor, -1)))
    return block, group


@triton.jit
def _rule_masks(side1, g, own_anchor, cols, block, group, rules):
    """The index rules of a tile (``fastcl.tiled._layout_drops``): the entries the layout
    drops (blocks a side does not score; with EXCLUDE_OWN the anchor side's own anchor
    column and the positive side's own documents), the entries the guide and the ids may not
    drop (the positive on the anchor side, the own anchor on the positive side), MNRL's
    hardness columns (anchor side; mode 1 in-batch negatives, 2 hard negatives, 3 all) and
    the positive side's own anchor (its mirror: focal takes s² there)."""
    side = side1[:, None]
    vis = tl.where(side, (rules >> VIS_BITS) & 15, rules & 15)
    drop = ((vis >> block[None, :]) & 1) == 0
    own_group = group[None, :] == g[:, None]
    docs = (block <= 1)[None, :]
    mine = (block == 3)[None, :] & (group[None, :] == own_anchor[:, None])
    drop = drop | (tl.where(side, docs & own_group, mine) & ((rules & EXCLUDE_OWN) != 0))
    protect = tl.where(side, mine, cols[None, :] == g[:, None])
    hard_mode = (rules >> HARD_SHIFT) & 3
    hard = tl.where(hard_mode == 1, docs & _not(own_group),
                    tl.where(hard_mode == 2, (block == 1)[None, :] & own_group,
                             docs & (cols[None, :] != g[:, None])))
    hard = hard & (hard_mode > 0) & _not(side)
    return drop, protect, hard, side & mine


@triton.jit
def _tile_dot(a_ptr, b_ptr, a_start, b_start, a_rows, b_rows, K, stride_a, stride_b,
              BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """a[a_start : +BLOCK_R] · b[b_start : +BLOCK_M]ᵀ for one tile (rows past ``a_rows`` /
    ``b_rows`` read as 0), accumulated in fp32 over K in BLOCK_D steps, like a matmul: K
    (the embedding width, 384–4096) is too wide to keep a row block resident. fp32 inputs
    get exact products (TF32 would move cosines by ~1e-3, logits by ~0.02); 16-bit inputs
    use the tensor cores whatever the precision says."""
    ra = tl.arange(0, BLOCK_R)
    rb = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_D)
    # the tile's base in int64 (M·d can pass 2³¹); offsets inside the tile stay int32
    a_ptr += a_start.to(tl.int64) * stride_a
    b_ptr += b_start.to(tl.int64) * stride_b
    a_ok = (a_start + ra) < a_rows
    b_ok = (b_start + rb) < b_rows
    acc = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_D):
        k_ok = (k0 + kk) < K
        a = tl.load(a_ptr + ra[:, None] * stride_a + (k0 + kk)[None, :],
                    mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rb[:, None] * stride_b + (k0 + kk)[None, :],
                    mask=b_ok[:, None] & k_ok[None, :], other=0.0)
        if a.dtype == tl.float32:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="tf32")
    return acc


@triton.jit
def _tile_ptrs(ptr, stride, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
    """Pointers to this program's R×M tile of a row-major buffer: an int64 tile base (R·M
    can pass 2³¹), int32 offsets inside the tile."""
    base = ptr + (tl.program_id(0) * BLOCK_R).to(tl.int64) * stride + tl.program_id(1) * BLOCK_M
    return base + tl.arange(0, BLOCK_R)[:, None] * stride + tl.arange(0, BLOCK_M)[None, :]


@triton.jit
def _positive(cols, rows_g, FLAGS: tl.constexpr):
    """Where column j holds row i's positive (j = i); nowhere for DCLR's noise loss."""
    if POSITIVES & FLAGS:
        is_pos = cols[None, :] == rows_g[:, None]
    else:
        is_pos = cols[None, :] < 0
    return is_pos


@triton.jit
def _similarity_kernel(
    q_ptr, k_ptr, inv_q_ptr, inv_k_ptr, cq_ptr, ck_ptr, t_ptr, part_max_ptr, part_sum_ptr,
    pos_ptr, ginv_k_ptr, theta_ptr, col_ids_ptr, row_ids_ptr,
    R, M, D, DC, n_ck, first_pos, n_pos, R_half, anchor_base, n_neg, n_noise, rules,
    stride_q, stride_k, stride_cq, stride_ck,
    inv_t, focal_m, hard_w, phi, bound, hard_beta,
    FLAGS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Tile (program_id(0), program_id(1)) of the R×M chunk, R×128: cosines, logits, the
    DCLR mask, the stored tile (t, R×M) and its rows' partials (R × ⌈M/128⌉).

    BOUNDED (every logit at most ``bound``): the tile stores the gradient's numerator
    ``E_ij = exp(l_ij − B) · ∂l_ij/∂s_ij · ginv_k_j`` in the GEMM dtype with the positive's
    entry 0, and each row's ``Σ_{j≠i} exp(l_ij − B)``; the diagonal tiles write the positive's
    logit and ``∂l_ii/∂s_ii · ginv_k_i`` (``pos_ptr``, then ``pos_ptr + R``). Nothing else
    reads the tile before the gradient GEMMs: ``H = E/Z − δ·(1 − p_ii)·slope·ginv``, with Z
    and p_ii per row (``_row_finish_kernel``). Else the (max, Σexp) partials of each tile,
    for the row kernel. TEACHER (never beside MASK or GUIDE: it takes their slots ``cq``,
    ``ck``, ``DC``, ``n_ck``): the teacher's cosines ``cos(t_i, t_j)`` of its unit rows, for
    the columns ``j < n_ck`` (its N_b + K documents), stored R × n_ck after the R×M tile."""
    pid_m = tl.program_id(1)
    T = tl.cdiv(M, BLOCK_M)
    row0 = tl.program_id(0) * BLOCK_R
    rows = row0 + tl.arange(0, BLOCK_R)
    col0 = pid_m * BLOCK_M
    cols = col0 + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    col_ok = cols < M
    rows_g, side1, i_side, g, own_anchor = _rule_rows(rows, R_half, first_pos, anchor_base, FLAGS)
    acc = _tile_dot(q_ptr, k_ptr, row0, col0, R, M, D, stride_q, stride_k,
                    BLOCK_R, BLOCK_M, BLOCK_D)
    inv_q = tl.load(inv_q_ptr + rows, mask=row_ok, other=0.0)
    inv_k = tl.load(inv_k_ptr + cols, mask=col_ok, other=0.0)
    s = acc * inv_q[:, None] * inv_k[None, :]

    is_pos = _positive(cols, rows_g, FLAGS)
    l = _logits(s, is_pos, cols, rows_g, n_pos, inv_t, focal_m, hard_w, FLAGS)
    # Without the mask the positives are written before e exists, so that l need not stay
    # live beside it (the mask never drops a positive; with it, that order costs registers)
    if (POSITIVES & FLAGS) and not ((MASK | RULES | MARGIN) & FLAGS):
        _store_positive(l, s, is_pos, ginv_k_ptr, cols, col_ok, rows, rows_g, row_ok, row0, col0,
                        first_pos, R, M, pos_ptr, inv_t, FLAGS, BLOCK_R, BLOCK_M)

    if MASK & FLAGS:
        # the complementary model's cosine, in the same tile: no N×M mask ever exists
        in_batch = cols < n_pos
        cacc = _tile_dot(cq_ptr, ck_ptr, row0, col0, R, n_ck, DC, stride_cq, stride_ck,
                         BLOCK_R, BLOCK_M, BLOCK_D)
        if RELEASED & FLAGS:
            too_close = cacc * inv_t > 20.0 * phi      # the released code's test
        else:
            too_close = cacc >= phi
        # the released code gives noise columns a complementary cosine of 0 (the tile dot
        # reads their rows as 0), so φ < 0 drops them too; the paper keeps them
        drop = too_close & (cols[None, :] != rows_g[:, None])
        if not (RELEASED & FLAGS):
            drop = drop & in_batch[None, :]
        s = tl.where(drop, DROPPED, s)
        if RELEASED & FLAGS:
            l = tl.where(drop, 0.0, l)                 # released: logit × 0
        else:
            l = tl.where(drop, float("-inf"), l)       # paper: leaves the denominator

    if RULES & FLAGS:
        block, group = _rule_columns(cols, n_pos, n_neg, n_noise, rules)
        drop, protect, hard, mirror = _rule_masks(side1, g, own_anchor, cols, block, group, rules)
        l = l + tl.where(hard, hard_beta * s, 0.0)     # MNRL's β·sg(s): no slope of its own
        if FOCAL & FLAGS:
            l = tl.where(mirror, s * s * inv_t, l)
        # duplicate texts (loads masked off without ids) and, with GUIDE, the guide's
        # cosine above the row's threshold: never the pair's own entries or the noise
        ids_on = (rules // HAS_IDS) % 2                  # 0 or 1
        col_ids = tl.load(col_ids_ptr + cols, mask=cols < M * ids_on, other=-1)
        row_ids = tl.load(row_ids_ptr + i_side, mask=rows < R * ids_on, other=-2)
        filtered = col_ids[None, :] == row_ids[:, None]
        if GUIDE & FLAGS:
            gacc = _tile_dot(cq_ptr, ck_ptr, row0, col0, R, n_ck, DC, stride_cq, stride_ck,
                             BLOCK_R, BLOCK_M, BLOCK_D)
            theta = tl.load(theta_ptr + i_side, mask=row_ok, other=0.0)
            filtered = filtered | (gacc > theta[:, None])
        drop = drop | (filtered & _not(protect) & (block != 2)[None, :])
        s = tl.where(drop, DROPPED, s)
        l = tl.where(drop, float("-inf"), l)

    if MARGIN & FLAGS:
        # the false-negative margin: s_ij above row i's threshold s_{i,p(i)} + m (theta_ptr's
        # second half, by the row's index in its side), never the positive or, on the
        # positive side, its own anchor
        if RULES & FLAGS:
            thr = tl.load(theta_ptr + R_half + i_side, mask=row_ok, other=0.0)
            close = (s > thr[:, None]) & _not(protect)
        else:
            thr = tl.load(theta_ptr + R_half + rows, mask=row_ok, other=0.0)
            close = (s > thr[:, None]) & _not(is_pos)
        s = tl.where(close, DROPPED, s)
        l = tl.where(close, float("-inf"), l)

    if (POSITIVES & FLAGS) and ((MASK | RULES | MARGIN) & FLAGS):
        _store_positive(l, s, is_pos, ginv_k_ptr, cols, col_ok, rows, rows_g, row_ok, row0, col0,
                        first_pos, R, M, pos_ptr, inv_t, FLAGS, BLOCK_R, BLOCK_M)
    l = tl.where(col_ok[None, :], l, float("-inf"))
    if BOUNDED & FLAGS:
        # exp(l − B) ≤ 1 for every logit, and no row-wide maximum is needed: the row sums
        # are the tiles' own. The positive stays out of both (its term is formed per row,
        # in float32, where p_ii → 1 would cancel in a 16-bit E_ii/Z − 1).
        # (the positive's entry is 0: its slope, 2s/τ with focal, is the diagonal tiles')
        e = tl.where(is_pos, 0.0, tl.exp(l - bound))
        tile_sum = tl.sum(e, axis=1)
        ginv_k = tl.load(ginv_k_ptr + cols, mask=col_ok, other=0.0)
        if FOCAL & FLAGS:
            e_store = e * (2.0 * s + focal_m) * (inv_t * ginv_k[None, :])
        else:
            e_store = e * (inv_t * ginv_k[None, :])
    else:
        # the partials leave the positive out (the row kernel adds it, from its logit): the
        # row's loss log(1 + Σ_{j≠i} e^(l_ij − l_ii)) and 1 − p_ii then keep their digits
        # where the positive dominates; its stored e is 0 (never read)
        l = tl.where(is_pos, float("-inf"), l)
        tile_max = tl.max(l, axis=1)
        safe_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
        e = tl.exp(l - safe_max[:, None])
        e_store = e
        tile_sum = tl.sum(e, axis=1)
    ok = row_ok[:, None] & col_ok[None, :]
    t_ptrs = _tile_ptrs(t_ptr, M, BLOCK_R, BLOCK_M)
    if STORE_EXP & FLAGS:
        tl.store(t_ptrs, e_store.to(t_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(t_ptrs, s, mask=ok)
    if not (BOUNDED & FLAGS):
        tl.store(part_max_ptr + rows * T + pid_m, tile_max, mask=row_ok)
    tl.store(part_sum_ptr + rows * T + pid_m, tile_sum, mask=row_ok)
    if TEACHER & FLAGS:
        # last: the student's tile is stored, its registers free for the second product
        tacc = _tile_dot(cq_ptr, ck_ptr, row0, col0, R, n_ck, DC, stride_cq, stride_ck,
                         BLOCK_R, BLOCK_M, BLOCK_D)
        # (tl.cast: R may be a launch's constant, 1)
        t_ptrs = _tile_ptrs(t_ptr + tl.cast(R, tl.int64) * M, n_ck, BLOCK_R, BLOCK_M)
        tl.store(t_ptrs, tacc, mask=row_ok[:, None] & (cols < n_ck)[None, :])


@triton.jit
def _store_positive(l, s, is_pos, ginv_k_ptr, cols, col_ok, rows, rows_g, row_ok, row0, col0,
                    first_pos, R, M, pos_ptr, inv_t, FLAGS: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tiles on the diagonal write each anchor's positive logit: the very value that
    enters the tile's sums (a separate dot would round differently, and lse − l_ii must
    cancel exactly when the loss is ~1e-5); the others skip the reduction. BOUNDED: also the
    positive's ``∂l_ii/∂s_ii · ginv_k_i`` (1/τ, focal 2s/τ), R entries further."""
    if (first_pos + row0 < col0 + BLOCK_M) & (first_pos + row0 + BLOCK_R > col0):
        pos_here = row_ok & (rows_g >= col0) & (rows_g < col0 + BLOCK_M) & (rows_g < M)
        tl.store(pos_ptr + rows, tl.sum(tl.where(is_pos, l, 0.0), axis=1), mask=pos_here)
        if BOUNDED & FLAGS:
            ginv_k = tl.load(ginv_k_ptr + cols, mask=col_ok, other=0.0)
            if FOCAL & FLAGS:
                slope = tl.where(is_pos, 2.0 * s * ginv_k[None, :], 0.0)
            else:
                slope = tl.where(is_pos, ginv_k[None, :], 0.0)
            tl.store(pos_ptr + R + rows, tl.sum(slope, axis=1) * inv_t, mask=pos_here)


@triton.jit
def _log1p(x):
    """log(1 + x), accurate for small x (fp32 has no log1p in every Triton): the rounding of
    u = 1 + x is undone by the ratio x/(u − 1)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _softplus(x):
    """log(1 + e^x) with full relative precision for x ≪ 0 (0 at x = −inf)."""
    big = x > 20.0
    return tl.where(big, x, 0.0) + _log1p(tl.exp(tl.where(big, -x, x)))


@triton.jit
def _logaddexp(x, y):
    """log(e^x + e^y), −inf when both are."""
    top = tl.maximum(x, y)
    top = tl.where(top == float("-inf"), 0.0, top)
    return top + tl.log(tl.exp(x - top) + tl.exp(y - top))


@triton.jit
def _debiased(gap, count, prior, positive, inv_t):
    """Chuang et al.'s debiased row loss in log space (``fastcl.tiled.engine._debiased``):
    ``(ℓ, f, ∂ℓ/∂l_ip)`` from the others' ``gap = lse_o − l_ip``, their count Q and τ⁺, with
    ``∂ℓ/∂l_ij = f·p̃_ij`` off the positive."""
    some = count > 0
    safe_q = tl.where(some, count, 1.0)
    log_u = tl.where(some & (prior > 0.0), tl.log(safe_q) + tl.log(tl.where(prior > 0.0, prior, 1.0)) - gap,
                     float("-inf"))
    u = tl.exp(log_u)
    one_less_u = 1.0 - u
    on_a = log_u < 0.0
    a = tl.where(on_a, gap + _log1p(-tl.where(on_a, u, 0.0)) - _log1p(-prior), float("-inf"))
    b = tl.where(some, tl.log(safe_q) - inv_t - positive, float("-inf"))
    g = tl.maximum(a, b)
    loss = _softplus(g)
    sig = 1.0 / (1.0 + tl.exp(-g))
    on_a = some & (a >= b)
    slope = tl.where(on_a, sig / tl.where(on_a, one_less_u, 1.0), 0.0)
    return loss, slope, tl.where(on_a, -slope, -sig)


@triton.jit
def _kept_others(t_row, M, rows_g, FLAGS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Q: the row's stored columns that are neither its positive nor dropped (the cosines
    mode, where ``DROPPED`` marks every drop)."""
    kept = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, M, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        ok = cols < M
        s = tl.load(t_row + cols, mask=ok, other=DROPPED)[None, :]
        kept += tl.where((s != DROPPED) & _not(_positive(cols, rows_g, FLAGS)), 1.0, 0.0)
    return tl.sum(tl.sum(kept, axis=1), axis=0)


@triton.jit
def _row_finish_kernel(part_sum_ptr, pos_ptr, pos_coef_ptr, loss_ptr, inv_z_ptr,
                       R, T, stride_part, bound,
                       POSITIVES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """The bounded design's rows (``BLOCK_R`` a program): ``A_i = Σ_{j≠i} exp(l_ij − B)`` from
    the tiles' partials, then with ``r_i = A_i · exp(B − l_ii)``: the row loss ``log(1 + r_i)``
    (= lse_i − l_ii, without the cancellation of two large numbers), ``1/Z_i`` with
    ``Z_i = A_i + exp(l_ii − B)``, and the positive's coefficient ``(1 − p_ii) · slope_ii ·
    ginv_k_i`` with ``1 − p_ii = r_i / (1 + r_i)``, in place of ``slope_ii · ginv_k_i``.
    Without positives (DCLR's noise loss): loss ``B + log A_i``, ``1/Z_i = 1/A_i``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        part = tl.load(part_sum_ptr + rows[:, None] * stride_part + t[None, :],
                       mask=ok[:, None] & (t < T)[None, :], other=0.0)
        acc += tl.sum(part, axis=1)
    acc = tl.where(ok, acc, 1.0)           # rows past R: nothing stored, nothing to divide
    if POSITIVES:
        gap = bound - tl.load(pos_ptr + rows, mask=ok, other=0.0)      # B − l_ii ≥ 0
        r = acc * tl.exp(gap)
        loss = _log1p(r)
        inv_z = 1.0 / (acc + tl.exp(-gap))
        coef = tl.load(pos_coef_ptr + rows, mask=ok, other=0.0)
        tl.store(pos_coef_ptr + rows, coef * (r / (1.0 + r)), mask=ok)
    else:
        loss = bound + tl.log(acc)
        inv_z = 1.0 / acc
    tl.store(loss_ptr + rows, loss, mask=ok)
    tl.store(inv_z_ptr + rows, inv_z, mask=ok)


@triton.jit
def _row_lse(part_max_ptr, part_sum_ptr, row, T, BLOCK_T: tl.constexpr):
    """log Σ_j exp(l_ij) of one row from its per-tile (max, Σexp) partials (T a row)."""
    run_max = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = t < T
        pm = tl.load(part_max_ptr + row * T + t, mask=ok, other=float("-inf"))
        ps = tl.load(part_sum_ptr + row * T + t, mask=ok, other=0.0)
        new_max = tl.maximum(run_max, pm)
        base = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - base) + ps * tl.exp(pm - base)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    base = tl.where(row_max == float("-inf"), 0.0, row_max)
    return base + tl.log(tl.sum(run_sum * tl.exp(run_max - base), axis=0))


@triton.jit
def _row_probs(t_row, max_row, c0, M, lse, scale, rows_g, side1, g, own_anchor, n_pos, n_neg,
               n_noise, rules, inv_t, focal_m, hard_w, hard_beta,
               FLAGS: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns [c0, c0 + BLOCK_N) of one row (its stored row ``t_row``, its tile maxima
    ``max_row``; ``rows_g`` … ``own_anchor`` from ``_rule_rows``): their indices and bounds,
    ``scale`` × the softmax p over ``lse``, the stored cosines s (unused in exp mode), the
    positive, where focal's slope is 2s (the positive, and the mirror with RULES) and the
    dropped columns, from whatever the similarity kernel stored; and the logits l (the
    cosines' mode only)."""
    cols = c0 + tl.arange(0, BLOCK_N)
    ok = cols < M
    x = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32)
    is_pos = _positive(cols, rows_g, FLAGS)
    squared = is_pos
    l = x[None, :]                           # the logits, in the cosines' mode
    if STORE_EXP & FLAGS:
        # p = exp(l − tile max) · exp(tile max − lse); a fully masked tile has max −inf, e 0
        tile_max = tl.load(max_row + cols // TILE_M, mask=ok, other=float("-inf"))
        p = (x * (scale * tl.where(tile_max == float("-inf"), 0.0, tl.exp(tile_max - lse))))[None, :]
        s = p                                # unused: exp mode has no slope or mask to read
        dropped = is_pos
    else:
        s = x[None, :]
        # the logits again, where ``DROPPED`` marks the masked negatives (logit × 0 in the
        # released code, out of the denominator in the paper and the layout's rules), tested
        # whatever dropped the entry (no cosine equals DROPPED): the row kernel then reads
        # none of the flags that drop, and their flag sets share its code
        l = _logits(s, is_pos, cols, rows_g, n_pos, inv_t, focal_m, hard_w, FLAGS)
        dropped = s == DROPPED
        if RELEASED & FLAGS:
            l = tl.where(dropped, 0.0, l)
        else:
            l = tl.where(dropped, float("-inf"), l)
        if RULES & FLAGS:
            block, group = _rule_columns(cols, n_pos, n_neg, n_noise, rules)
            _, _, hard, mirror = _rule_masks(side1, g, own_anchor, cols, block, group, rules)
            l = l + tl.where(hard & _not(dropped), hard_beta * s, 0.0)
            if FOCAL & FLAGS:
                l = tl.where(mirror & _not(dropped), s * s * inv_t, l)
                squared = squared | mirror
        p = tl.exp(l - lse) * scale
    p = tl.where(ok[None, :], p, 0.0)
    return cols, ok, p, s, l, is_pos, squared, dropped


@triton.jit
def _same_label(label_ids_ptr, cols, row_label, n_labels, is_pos):
    """The columns whose positives-block row has the row's label (``n_labels`` > 0: the
    positives block's rows; else none), and the positive itself."""
    lab = tl.load(label_ids_ptr + cols, mask=cols < n_labels, other=0)
    return ((lab[None, :] == row_label[:, None]) & (cols < n_labels)[None, :]) | is_pos


@triton.jit
def _teacher_logits(c_row, cols, kept, n_teacher, teacher_inv_t):
    """The teacher's logits ``c_ij/τ_t`` of a block of one row's columns (−inf off its
    documents or where the row drops the column), and where they count."""
    taught = kept & (cols < n_teacher)[None, :]
    c = tl.load(c_row + cols, mask=cols < n_teacher, other=0.0)[None, :]
    return tl.where(taught, c * teacher_inv_t, float("-inf")), taught


@triton.jit
def _row_kernel(
    t_ptr, g_ptr, part_max_ptr, part_sum_ptr, pos_ptr, ginv_k_ptr, loss_ptr, prior_ptr,
    label_ids_ptr, M, first_pos, n_pos, R_half, anchor_base, n_neg, n_noise, rules, n_labels,
    n_teacher, inv_t, focal_m, hard_w, hard_beta, smoothing, teacher_inv_t, distill_weight,
    FLAGS: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """One row of the chunk (``t`` and ``g`` R×M, the partials R × ⌈M/TILE_M⌉): its loss,
    and with WANT_GRAD its gradient row ``g``. SOFT: the soft target
    ``y = a·1[P] + b·1[K]`` (``fastcl.spec.Soft``; ``smoothing`` ε, the labels of the
    positives block where ``n_labels`` > 0), from a first pass over the row. TEACHER:
    ``y ← (1−λ)·y + λ·q``, ``q_ij = exp(c_ij/τ_t − lse_t)`` over the kept columns
    ``j < n_teacher`` (``c``: the teacher's cosines, R × n_teacher after ``t``'s R×M;
    ``teacher_inv_t`` 1/τ_t, ``distill_weight`` λ), ``lse_t`` formed in the first pass."""
    row = tl.program_id(0)
    T = tl.cdiv(M, TILE_M)
    t_row = t_ptr + row.to(tl.int64) * M
    max_row = part_max_ptr + row * T
    rows = tl.full((1,), 0, tl.int32) + row
    rows_g, side1, _, g, own_anchor = _rule_rows(rows, R_half, first_pos, anchor_base, FLAGS)
    # log Σ e^l over the row's columns but its positive (the similarity kernel's partials)
    lse = _row_lse(part_max_ptr, part_sum_ptr, row, T, BLOCK_T)
    scale = 1.0
    if POSITIVES & FLAGS:
        pos = tl.load(pos_ptr + row, mask=row < R_half, other=0.0)
    else:
        pos = 0.0
    # the row's loss softplus(lse_o − l_ii) = lse − l_ii, and the others' share of its
    # softmax q = σ(lse_o − l_ii) = 1 − p_ii, without the cancellation of either (a row
    # without a positive: lse_o is its lse)
    gap = lse - pos
    if RULES & FLAGS:
        # paired: rows i and R_half + i are the two sides of loss row i, with one softmax
        # over both (joint), or each its own, the loss the mean of the two log-sum-exps
        # and each side's softmax halved in the gradient (per direction)
        paired = (rules & PAIRED) != 0
        one_softmax = paired & ((rules & JOINT) != 0)
        two_softmaxes = paired & ((rules & JOINT) == 0)
        twin = tl.where(paired, tl.where(row >= R_half, row - R_half, row + R_half), row)
        lse_twin = _row_lse(part_max_ptr, part_sum_ptr, twin, T, BLOCK_T)
        if POSITIVES & FLAGS:
            # the positive side's twin is an anchor row: its partials leave its positive out
            twin_pos = tl.load(pos_ptr + twin, mask=(twin < R_half) & (row >= R_half), other=0.0)
            lse_twin = tl.where((twin < R_half) & (row >= R_half),
                                _logaddexp(lse_twin, twin_pos), lse_twin)
        both = _logaddexp(lse, lse_twin)
        gap = tl.where(one_softmax, both, lse) - pos
        lse = tl.where(one_softmax, both, lse)
        scale = tl.where(two_softmaxes, 0.5, 1.0)
    share = _softplus(gap)
    others = 1.0 / (1.0 + tl.exp(-gap))
    if POSITIVES & FLAGS:
        lse = tl.where(row < R_half, pos + share, lse)    # the full log-sum-exp, for p_ij
        row_loss = share
        if RULES & FLAGS:
            row_loss = tl.where(two_softmaxes, 0.5 * (share + lse_twin - pos), share)
    else:
        row_loss = lse
    if PRIOR & FLAGS:
        # the debiased loss (no positive side: build_spec's rule for this engine): p_ij =
        # f·p̃_ij = exp(l_ij − (lse_o − log f)), the positive's slope apart
        count = _kept_others(t_row, M, rows_g, FLAGS, BLOCK_N)
        row_loss, f, prior_pos_g = _debiased(gap, count, tl.load(prior_ptr + row), pos, inv_t)
        lse = tl.where(f > 0.0, gap + pos - tl.log(tl.where(f > 0.0, f, 1.0)), float("inf"))

    if RELEASED & FLAGS:
        # BCE on the softmax: v = p/(1−p) off the positive and, with q = 1 − p_ii,
        # v_ii = −p_ii·q/max(p_ii·q, 1e-12) (−1 unless clamped). Pass 1: Σ_{j≠i} v and
        # Σ_{j≠i} log(1−p) (accurate for small p, clamped at −100 like torch's BCE).
        v_acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)
        log_acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)
        for c0 in range(0, M, BLOCK_N):
            cols, ok, p, s, l, is_pos, squared, dropped = _row_probs(
                t_row, max_row, c0, M, lse, scale, rows_g, side1, g, own_anchor, n_pos, n_neg,
                n_noise, rules, inv_t, focal_m, hard_w, hard_beta, FLAGS, TILE_M, BLOCK_N)
            v_acc += tl.where(ok[None, :] & _not(is_pos), _bce_v(p, is_pos), 0.0)
            log_acc += tl.where(ok[None, :] & _not(is_pos), _bce_log_not(p), 0.0)
        v_others = tl.sum(tl.sum(v_acc, axis=1), axis=0)
        p_pos = 1.0 / (1.0 + tl.exp(gap))
        v_pos = -(p_pos * others) / tl.maximum(p_pos * others, 1e-12)
        vsum = v_others + v_pos
        row_loss = -tl.sum(tl.sum(log_acc, axis=1), axis=0) + tl.minimum(share, 100.0)
        pos_g = v_pos * others - p_pos * v_others
    else:
        vsum = 0.0
        # ∂ℓ/∂l_ii = scale·p_ii − 1
        pos_g = -(scale * others + (1.0 - scale))
        if PRIOR & FLAGS:
            pos_g = prior_pos_g
    a = 0.0
    b = 0.0
    if SOFT & FLAGS:
        # soft targets: Σ and count of the kept logits (K) and of the label's kept
        # positives-block columns (P: the positive alone without labels); then
        # ℓ = lse − l_ii + (1−ε)(l_ii − Σ_P l/|P|) + ε(l_ii − Σ_K l/|K|), ∂ℓ/∂l = p − y
        row_label = tl.load(label_ids_ptr + rows_g, mask=rows_g < n_labels, other=0)
        # (row sums block by block: four BLOCK_N accumulators would not fit in registers)
        count = tl.zeros((1,), dtype=tl.float32)
        kl_sum = tl.zeros((1,), dtype=tl.float32)
        size = tl.zeros((1,), dtype=tl.float32)
        pl_sum = tl.zeros((1,), dtype=tl.float32)
        # the teacher's running (max, Σ e^(u − max), Σ e^(u − max)·l) over its kept columns
        t_max = tl.full((1,), float("-inf"), tl.float32)
        t_sum = tl.zeros((1,), dtype=tl.float32)
        tl_sum = tl.zeros((1,), dtype=tl.float32)
        c_row = t_ptr + tl.num_programs(0).to(tl.int64) * M + row.to(tl.int64) * n_teacher
        for c0 in range(0, M, BLOCK_N):
            cols, ok, p, s, l, is_pos, squared, dropped = _row_probs(
                t_row, max_row, c0, M, lse, scale, rows_g, side1, g, own_anchor, n_pos, n_neg,
                n_noise, rules, inv_t, focal_m, hard_w, hard_beta, FLAGS, TILE_M, BLOCK_N)
            kept = ok[None, :] & _not(dropped)
            same = _same_label(label_ids_ptr, cols, row_label, n_labels, is_pos) & kept
            count += tl.sum(tl.where(kept, 1.0, 0.0), axis=1)
            kl_sum += tl.sum(tl.where(kept, l, 0.0), axis=1)
            size += tl.sum(tl.where(same, 1.0, 0.0), axis=1)
            pl_sum += tl.sum(tl.where(same, l, 0.0), axis=1)
            if TEACHER & FLAGS:
                u, taught = _teacher_logits(c_row, cols, kept, n_teacher, teacher_inv_t)
                new_max = tl.maximum(t_max, tl.max(u, axis=1))
                base = tl.where(new_max == float("-inf"), 0.0, new_max)
                e = tl.where(taught, tl.exp(u - base[:, None]), 0.0)
                t_sum = t_sum * tl.exp(t_max - base) + tl.sum(e, axis=1)
                tl_sum = tl_sum * tl.exp(t_max - base) + tl.sum(e * tl.where(taught, l, 0.0), axis=1)
                t_max = new_max
        count = tl.sum(count, axis=0)
        size = tl.sum(size, axis=0)
        a = (1.0 - smoothing) / size
        b = smoothing / count
        spread = tl.where(n_labels > 0, pos - tl.sum(pl_sum, axis=0) / size, 0.0)
        extra = (1.0 - smoothing) * spread + smoothing * (pos - tl.sum(kl_sum, axis=0) / count)
        if TEACHER & FLAGS:
            # the positive is kept and a document: the teacher's row is never empty
            t_lse = tl.sum(t_max + tl.log(t_sum), axis=0)
            extra = ((1.0 - distill_weight) * extra
                     + distill_weight * (pos - tl.sum(tl_sum / t_sum, axis=0)))
            a = (1.0 - distill_weight) * a
            b = (1.0 - distill_weight) * b
        row_loss += extra
        pos_g = pos_g + (1.0 - a - b)
    # the positive side has no loss row (a branch: the interpreter of Triton 3.1 takes a
    # scalar mask that is False for no mask at all)
    if row < R_half:
        tl.store(loss_ptr + row, row_loss)

    if WANT_GRAD & FLAGS:
        g_row = g_ptr + row.to(tl.int64) * M
        for c0 in range(0, M, BLOCK_N):
            cols, ok, p, s, l, is_pos, squared, dropped = _row_probs(
                t_row, max_row, c0, M, lse, scale, rows_g, side1, g, own_anchor, n_pos, n_neg,
                n_noise, rules, inv_t, focal_m, hard_w, hard_beta, FLAGS, TILE_M, BLOCK_N)
            if RELEASED & FLAGS:
                grad = tl.where(is_pos, pos_g, _bce_v(p, is_pos) - p * vsum) * inv_t
                grad = tl.where(dropped, 0.0, grad)      # a × 0 logit has no slope in s
            else:
                pos_grad = pos_g
                if SOFT & FLAGS:
                    y = (tl.where(_same_label(label_ids_ptr, cols, row_label, n_labels, is_pos),
                                  a, 0.0) + b)
                    if TEACHER & FLAGS:
                        u, taught = _teacher_logits(c_row, cols, _not(dropped) & ok[None, :],
                                                    n_teacher, teacher_inv_t)
                        q = distill_weight * tl.where(taught, tl.exp(u - t_lse), 0.0)
                        y = y + q
                        pos_grad = pos_g - q           # its y_ii's teacher share
                    p = tl.where(_not(dropped) & ok[None, :], p - y, 0.0)
                grad = tl.where(is_pos, pos_grad, p)
                if FOCAL & FLAGS:
                    grad = grad * tl.where(squared, 2.0 * s, 2.0 * s + focal_m) * inv_t
                else:
                    grad = grad * inv_t
            ginv_k = tl.load(ginv_k_ptr + cols, mask=ok, other=0.0)
            grad = grad * ginv_k[None, :]
            # in exp mode g_ptr is t_ptr: each block is read before it is overwritten
            tl.store(g_row + cols[None, :], grad.to(g_ptr.dtype.element_ty), mask=ok[None, :])


@triton.jit
def _tangent_kernel(u_ptr, x_ptr, inv_x_ptr, scale_ptr, out_ptr, x_hat_ptr,
                    inv_z_ptr, pos_coef_ptr, k_ptr, dk_ptr,
                    D, stride_u, stride_x, stride_out, stride_x_hat, scale_stride, inv_eps,
                    stride_k, stride_dk, first_pos,
                    WRITE_X_HAT: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row of the chain rule through x̂ = x/‖x‖: ``out = w·(u − x̂(x̂·u))`` with the row
    weight w = scale[row·scale_stride] (a stride of 0 for one scalar), no projection where
    the norm was clamped; optionally x̂ itself in the GEMM dtype (the second GEMM's operand).
    One launch in place of the ~10 elementwise passes it takes in PyTorch ops.

    BOUNDED (the anchors of a chunk in the bounded design, ``u = E K``): first
    ``u ← u/Z − c·k_pos`` with the row's 1/Z, its positive's coefficient c and key row
    ``first_pos + row``; the x̂ written is x̂/Z (the operand of ``dk += Eᵀ (x̂/Z)``), and the
    positive's own term goes straight into its dk row: ``dk[first_pos + row] −= c·x̂``."""
    row = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, BLOCK_D)
    ok = dd < D
    u = tl.load(u_ptr + row * stride_u + dd, mask=ok, other=0.0).to(tl.float32)
    inv_x = tl.load(inv_x_ptr + row)
    x_hat = tl.load(x_ptr + row * stride_x + dd, mask=ok, other=0.0).to(tl.float32) * inv_x
    if BOUNDED:
        inv_z = tl.load(inv_z_ptr + row)
        c = tl.load(pos_coef_ptr + row)
        pos = first_pos + row
        k_pos = tl.load(k_ptr + pos * stride_k + dd, mask=ok, other=0.0).to(tl.float32)
        u = u * inv_z - c * k_pos
    coef = tl.where(inv_x >= inv_eps, 0.0, tl.sum(x_hat * u, axis=0))
    w = tl.load(scale_ptr + row * scale_stride)
    tl.store(out_ptr + row * stride_out + dd, ((u - x_hat * coef) * w).to(out_ptr.dtype.element_ty),
             mask=ok)
    if WRITE_X_HAT:
        if BOUNDED:
            tl.store(x_hat_ptr + row * stride_x_hat + dd,
                     (x_hat * inv_z).to(x_hat_ptr.dtype.element_ty), mask=ok)
            dk_row = dk_ptr + pos * stride_dk + dd       # one program a row: no race
            tl.store(dk_row, tl.load(dk_row, mask=ok, other=0.0) - c * x_hat, mask=ok)
        else:
            tl.store(x_hat_ptr + row * stride_x_hat + dd, x_hat.to(x_hat_ptr.dtype.element_ty),
                     mask=ok)


@functools.cache
def _clamped_inverse(dtype: torch.dtype) -> float:
    """1/EPS rounded in ``dtype``: the inverse norm of a clamped row, as the driver has it."""
    # numpy's scalars round as the device does, without a tensor read back to the host
    kind = {torch.float32: np.float32, torch.float64: np.float64}[dtype]
    return float(kind(1.0) / kind(EPS))


def triton_tangent(u, x, inv_x, scale, out, x_hat=None, bounded=None):
    """``out = scale ⊙ (u − x̂(x̂·u))`` row by row (:func:`fastcl.tiled._tangent_` in one
    launch); ``scale`` has one entry per row or one for all; writes x̂ into ``x_hat`` if given.
    ``inv_x = 1/max(‖x‖, EPS)`` as the driver computes it: a row is clamped exactly when its
    entry equals 1/EPS rounded in that dtype, the threshold the kernel compares with.
    ``bounded``: ``(inv_z, pos_coef, keys, first_pos, dk)`` of a bounded chunk (see
    ``_tangent_kernel``); ``dk`` is updated when ``x_hat`` is given."""
    rows, d = u.shape
    if rows == 0:
        return out
    inv_z, pos_coef, keys, first_pos, dk = bounded if bounded is not None else (
        inv_x, inv_x, x, 0, out)                     # never read
    if dk is None:        # the candidates take no gradient: dk is written with x_hat only
        dk = out
    _tangent_kernel[(rows,)](
        u, x, inv_x, scale, out, x_hat if x_hat is not None else out,
        inv_z, pos_coef, keys, dk,
        d, u.stride(0), x.stride(0), out.stride(0),
        (x_hat if x_hat is not None else out).stride(0), 0 if scale.numel() == 1 else 1,
        _clamped_inverse(inv_x.dtype), keys.stride(0), dk.stride(0), first_pos,
        WRITE_X_HAT=x_hat is not None, BOUNDED=bounded is not None,
        **configs.vector_block(d))
    return out


@triton.jit
def _noise_step_kernel(u_ptr, x_ptr, inv_x_ptr, z_ptr, D, stride_u, stride_x, stride_z,
                       lr, inv_eps, eps, RELEASED: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row of DCLR's noise step, in place on z (``fastcl.tiled._noise_step`` in one launch
    in place of ~25 elementwise passes over the noise): from ``u = Σ_i H_ij q̂_i`` (∂L/∂x's
    row before the chain rule, times a positive factor), ``g = u − x̂(x̂·u)`` (no projection
    where the norm was clamped), projected once more with x̂ from x scaled by its largest
    entry (exact at d = 1: the chain rule's rounding residual along x, which the step would
    otherwise blow up), then ``z += lr·g/‖g‖`` with the norm of g scaled by its largest
    entry (no underflow of tiny gradients). A row with g = 0 stays put; RELEASED: it becomes 0."""
    row = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, BLOCK_D)
    ok = dd < D
    u = tl.load(u_ptr + row * stride_u + dd, mask=ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + dd, mask=ok, other=0.0).to(tl.float32)
    inv_x = tl.load(inv_x_ptr + row)
    x_hat = x * inv_x
    g = u - x_hat * tl.where(inv_x >= inv_eps, 0.0, tl.sum(x_hat * u, axis=0))
    top_x = tl.max(tl.abs(x), axis=0)
    scaled = x / tl.where(top_x == 0, 1.0, top_x)
    norm_x = tl.sqrt(tl.sum(scaled * scaled, axis=0))
    x_hat = scaled / tl.where(top_x == 0, 1.0, norm_x)
    g = g - x_hat * tl.where(top_x * norm_x <= eps, 0.0, tl.sum(x_hat * g, axis=0))
    top_g = tl.max(tl.abs(g), axis=0)
    scaled = g / tl.where(top_g == 0, 1.0, top_g)
    norm_g = tl.sqrt(tl.sum(scaled * scaled, axis=0))
    z = tl.load(z_ptr + row * stride_z + dd, mask=ok, other=0.0)
    z = z + lr * (scaled / tl.where(top_g == 0, 1.0, norm_g))
    if RELEASED:
        z = tl.where(top_g == 0, 0.0, z)
    tl.store(z_ptr + row * stride_z + dd, z, mask=ok)


def triton_noise_step(u, x, norm, inv_x, z, lr, released):
    """:func:`fastcl.tiled._noise_step` in one launch (``norm``: unused, the kernel reads
    ``inv_x``, clamped exactly where it equals 1/EPS rounded, as :func:`triton_tangent`)."""
    rows, d = z.shape
    if rows == 0:
        return
    _noise_step_kernel[(rows,)](
        u, x, inv_x, z, d, u.stride(0), x.stride(0), z.stride(0), float(lr),
        _clamped_inverse(inv_x.dtype), EPS, RELEASED=released, **configs.vector_block(d))


# --------------------------------------------------------------------------- launches
#: Offsets inside one tile of a row-major R×M buffer are int32: a 256-row tile of M columns.
MAX_CANDIDATES = 2**31 // 256

#: The widest ``B − lowest row maximum`` the bounded design takes (exp(−80) ≈ 1.8e-35: a
#: float32 normal number, with room for the slope and column factors).
BOUND_SPREAD = 80.0


def flags(ep) -> dict:
    """The kernels' flags for an epilogue (one of ``configs.VARIANTS``)."""
    return dict(FOCAL=ep.focal_m is not None, HARD=bool(ep.hard_negative_weight),
                MASK=ep.complementary is not None, RELEASED=ep.formulation == "released",
                POSITIVES=ep.positives, RULES=ep.sided, GUIDE=ep.guide is not None,
                MARGIN=ep.false_negative_margin is not None, PRIOR=ep.positive_prior is not None,
                SOFT=ep.soft, TEACHER=ep.teacher is not None)


def row_flags(f: dict) -> dict:
    """The row kernel's flags: the similarity kernel's less those whose drops are done by
    then (GUIDE, MASK, MARGIN: ``DROPPED`` in the stored tile, which the row kernel tests
    whatever the flags), so that their flag sets launch one row kernel."""
    return {k: v for k, v in f.items() if k not in ("GUIDE", "MASK", "MARGIN")}


def stores_exp(f: dict) -> bool:
    """Whether the gradient needs only the softmax: then the chunk buffer holds
    exp(l − tile max) in the GEMM dtype; focal needs s for its slope, the released DCLR and
    the debiased loss (its count Q) need the dropped columns, and soft targets the kept
    logits' row sums, so those keep the fp32 cosines."""
    return not (f["FOCAL"] or f["RELEASED"] or f["PRIOR"] or f.get("SOFT"))


def pack_flags(**on) -> int:
    """The kernels' constexpr ``FLAGS`` from flags by name (``FOCAL=True``, …,
    ``STORE_EXP``, ``BOUNDED``, ``WANT_GRAD``)."""
    return sum(_BITS[name].value for name, value in on.items() if value)


def kernel_constexprs(kernel, constexprs: dict) -> dict:
    """``kernel``'s constexpr arguments from flags by name and the other constexprs (block
    sizes): the flags packed into ``FLAGS`` where the kernel takes them so."""
    if "FLAGS" not in kernel.arg_names:
        return dict(constexprs)
    named = {k: v for k, v in constexprs.items() if k in _BITS}
    return {**{k: v for k, v in constexprs.items() if k not in _BITS},
            "FLAGS": pack_flags(**named)}


def pack_rules(vis0=0, vis1=0, exclude_own=False, neg_grouped=False, has_ids=False,
               hard_mode=0, paired=False, joint=False) -> int:
    """The kernels' ``rules`` integer (see ``EXCLUDE_OWN`` …): each side's visible blocks
    as bits, the rules' bits, MNRL's hardness mode."""
    return (vis0 | vis1 << VIS_BITS.value | EXCLUDE_OWN.value * bool(exclude_own)
            | NEG_GROUPED.value * bool(neg_grouped) | HAS_IDS.value * bool(has_ids)
            | PAIRED.value * bool(paired) | JOINT.value * bool(joint)
            | hard_mode << HARD_SHIFT.value)


@functools.lru_cache(maxsize=None)
def _arch(device_index: int) -> int:
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


@functools.lru_cache(maxsize=None)
def _autotuned(kept: tuple):
    """The similarity kernel autotuned over ``kept`` (one autotuner a list: the flags are in
    its key, so each objective gets its own choice)."""
    return triton.autotune(
        configs=[triton.Config({"BLOCK_R": r, "BLOCK_D": d}, num_warps=w, num_stages=s)
                 for r, d, w, s in kept],
        key=["M", "D", "DC", "FLAGS"])(_similarity_kernel)


def _similarity(f: dict, dtype: torch.dtype, device):
    """The similarity kernel for these flags: autotuned on a GPU over its list
    (``configs.sim_configs``), the bare kernel under the interpreter."""
    if INTERPRET:
        return _similarity_kernel
    index = torch.cuda.current_device() if device.index is None else device.index
    kept = configs.sim_configs(f, dtype, _arch(index))
    return _autotuned(tuple(kept[:1] if configs.autotune_pinned() else kept))


def bounded_design(f: dict, dtype) -> bool:
    """Whether the bounded design can apply to a flag set at this chunk dtype (a torch dtype
    or its name); :func:`logit_bound` says why not, and where the bound is too wide."""
    return not (f["RELEASED"] or f["RULES"] or f["PRIOR"] or f["SOFT"]
                or str(dtype).replace("torch.", "") == "float16")


def logit_bound(ep, dtype: torch.dtype) -> float | None:
    """The bound B ≥ every logit of a row, where the bounded design applies; else None.

    Unit rows bound every cosine by 1: an InfoNCE logit is at most 1/τ, a focal one at most
    (1 + |m|)/τ, and a hard negative adds at most its log-weight. ``exp(l − B)`` then never
    overflows and the row sums need no maximum. It must not underflow either: the row's
    largest term is at least its positive's, ``l_ii ≥ −1/τ`` (focal: ``s² ≥ 0``), or for
    DCLR's noise loss the largest noise logit, ``≥ −1/τ``; where B minus that lowest value
    passes :data:`BOUND_SPREAD` (τ below 0.025 for InfoNCE) the two-pass design runs. So
    does the released DCLR (its BCE needs each p_ij before its row sum), and float16 chunk
    buffers (5 exponent bits: ``exp(l − B)`` flushes to zero within 17 of B), and the
    layout's rules (a paired row's two sides share or split one softmax in the row kernel)."""
    if not bounded_design(flags(ep), dtype):
        return None
    inv_t = 1.0 / ep.temperature
    w = float(ep.hard_negative_weight)
    if ep.focal_m is not None:
        top, lowest = (1.0 + abs(ep.focal_m)) * inv_t, 0.0
    else:
        top, lowest = inv_t, -inv_t
    if not ep.positives:
        lowest = -inv_t
    bound = top + max(w, 0.0)
    return bound if bound - lowest <= BOUND_SPREAD else None


_HARD_MODES = {"in_batch_negatives": 1, "hard_negatives": 2, "all_negatives": 3}


def _rules(ep, c):
    """The kernels' arguments for :mod:`fastcl.layout`'s rules on chunk ``c``: the scalars
    both kernels take (rows a side, the anchors block's first group, the column blocks'
    sizes, ``rules`` and MNRL's β), and the tensors (the ids of the columns and of the
    chunk's rows; the guide's rows and columns in the GEMM dtype, and the rows'
    thresholds). Without rules: one side of R rows, zeros, and stand-ins never read."""
    if not ep.sided:
        return (dict(R_half=c.q.shape[0], anchor_base=0, n_neg=0, n_noise=0, rules=0,
                     hard_beta=0.0), c.inv_k, c.inv_k, None)
    r = c.r1 - c.r0
    n_pos, n_neg, n_noise, n_anchor = ep.blocks or (c.n_pos, c.keys.shape[0] - c.n_pos, 0, 0)
    lay = ep.layout or PLAIN
    mode, beta = ep.hardness or (None, 0.0)
    ints = dict(
        R_half=r, anchor_base=c.first_pos if n_anchor == n_pos else c.r0, n_neg=n_neg,
        n_noise=n_noise, rules=pack_rules(
            vis0=sum(1 << b for b in visible_blocks(lay, 0)),
            vis1=sum(1 << b for b in visible_blocks(lay, 1)), exclude_own=lay.exclude_own,
            neg_grouped=n_neg > 0 and n_neg % n_pos == 0, has_ids=ep.ids is not None,
            hard_mode=_HARD_MODES[mode] if mode is not None and beta else 0,
            paired=ep.paired, joint=lay.joint), hard_beta=float(beta))
    if ep.ids is not None:
        col_ids, row_ids = ep.ids[0], ep.ids[1][c.r0:c.r1].contiguous()
    else:
        col_ids = row_ids = c.inv_k              # never read (the loads are masked off)
    guide = None
    if ep.guide is not None:
        rows, cols, theta = ep.guide
        side = [rows[c.r0:c.r1]] + ([rows[c.n + c.r0:c.n + c.r1]] if ep.paired else [])
        guide = (torch.cat(side).to(c.q.dtype).contiguous(), cols.to(c.q.dtype).contiguous(),
                 theta[c.r0:c.r1].contiguous())
    return ints, col_ids, row_ids, guide


def _launch_similarity(ep, c, f, rules, shared, store_exp, bound=None):
    """The similarity kernel over the chunk: the stored buffer, the partials, the positives
    (and, ``bound`` given, the bounded design's positive coefficients). ``rules``: the
    tensors :func:`_rules` returns; ``shared``: the scalars both kernels take."""
    R, d = c.q.shape
    M = c.keys.shape[0]
    if M >= MAX_CANDIDATES:
        raise ValueError(f"{M} candidates: the Triton kernels take fewer than {MAX_CANDIDATES} "
                         "(32-bit offsets inside a tile); use backend='tiled'")
    dev = c.q.device
    col_ids, row_ids, guide = rules
    theta = c.inv_q                        # read with GUIDE only
    cq, ck = c.q, c.keys                   # read with a second product only
    if f["MASK"]:
        cq, ck = c.comp_q, c.comp_k
    elif f["GUIDE"]:
        cq, ck, theta = guide
    elif f["TEACHER"]:                     # (build_spec: never beside the mask or the guide)
        cq, ck = ep.teacher[0][c.r0:c.r1].contiguous(), ep.teacher[1]
    dc = cq.shape[1] if configs.second_product(f) else 0
    if f["MARGIN"]:
        r = shared["R_half"]
        theta = torch.cat([theta[:r], _margin_thresholds(ep, c, r)])
    # TEACHER: the teacher's R × N_t cosines after the R×M tile, in one buffer
    extra = R * ck.shape[0] if f["TEACHER"] else 0
    t = torch.empty(R * M + extra, dtype=c.q.dtype if store_exp else torch.float32,
                    device=dev)[:R * M].view(R, M)
    tiles = triton.cdiv(M, configs.SIM_BLOCK_M)
    part_sum = torch.empty(R, tiles, dtype=torch.float32, device=dev)
    # the bounded design needs no maxima (the pointer stands in, never written)
    part_max = part_sum if bound is not None else torch.empty_like(part_sum)
    # every row's positive logit is written; bounded, its coefficient after it
    pos = torch.empty(2 if bound is not None else 1, R, dtype=torch.float32, device=dev)
    kernel = _similarity(f, c.q.dtype, c.q.device)
    kernel[lambda meta: (triton.cdiv(R, meta["BLOCK_R"]), tiles)](
        c.q, c.keys, c.inv_q, c.inv_k, cq, ck, t, part_max, part_sum, pos, c.ginv_k,
        theta, col_ids, row_ids,
        R, M, d, dc, ck.shape[0] if dc else 0, **shared,
        stride_q=c.q.stride(0), stride_k=c.keys.stride(0), stride_cq=cq.stride(0),
        stride_ck=ck.stride(0), phi=float(ep.phi or 0.0), bound=float(bound or 0.0),
        FLAGS=pack_flags(**f, STORE_EXP=store_exp, BOUNDED=bound is not None),
        BLOCK_M=configs.SIM_BLOCK_M, **(configs.SIM_FIXED if INTERPRET else {}))
    return t, part_max, part_sum, pos[0], pos[-1]


def _margin_thresholds(ep, c, r):
    """The false-negative margin's threshold of the chunk's r loss rows, ``s_{i,p(i)} + m``:
    each anchor's cosine with its positive (column ``first_pos + i``), formed from the same
    GEMM-dtype rows and inverse norms as the tiles' cosines."""
    q = c.q[:r].to(torch.float32)
    k = c.keys[c.first_pos:c.first_pos + r].to(torch.float32)
    cos = (q * k).sum(dim=1) * c.inv_q[:r].to(torch.float32) * c.inv_k[c.first_pos:c.first_pos + r]
    return (cos + ep.false_negative_margin).to(torch.float32).contiguous()


def triton_chunk(ep, c, want_grad):
    """The Triton engine's chunk for :func:`fastcl.tiled.contrastive_forward` (the
    ``Engine.chunk`` hook; the torch engine runs its widths pass instead): row losses into
    ``c.loss_out``; returns H in the
    GEMM dtype, or in the bounded design ``(E, 1/Z, positive coefficients)`` with
    ``H = E/Z − δ·coefficient`` (``None`` without ``want_grad``). Bounded: the similarity
    kernel and one launch over the rows' partials; else the similarity kernel and one
    program per row over its R×M stored row."""
    f = flags(ep)
    bound = logit_bound(ep, c.q.dtype)
    ints, *rules = _rules(ep, c)
    # the scalars both kernels take: where the chunk's positives are, the layout's rules, the
    # logits' transform
    shared = dict(first_pos=c.first_pos, n_pos=c.n_pos, **ints, inv_t=1.0 / ep.temperature,
                  focal_m=float(ep.focal_m or 0.0), hard_w=float(ep.hard_negative_weight))
    if bound is not None:
        t, _, part_sum, pos, pos_coef = _launch_similarity(ep, c, f, rules, shared, True, bound)
        R = t.shape[0]
        inv_z = torch.empty(R, dtype=torch.float32, device=t.device)
        finish = configs.FINISH_BLOCK
        _row_finish_kernel[(triton.cdiv(R, finish["BLOCK_R"]),)](
            part_sum, pos, pos_coef, c.loss_out, inv_z, R, part_sum.shape[1],
            part_sum.stride(0), bound, POSITIVES=f["POSITIVES"], **finish)
        if not want_grad:
            return None
        return t, inv_z, pos_coef if f["POSITIVES"] else None
    store_exp = stores_exp(f)
    t, part_max, part_sum, pos, _ = _launch_similarity(ep, c, f, rules, shared, store_exp)
    R, M = t.shape
    # exp mode: the gradient overwrites the stored row in place; else a GEMM-dtype buffer
    g = t if store_exp else (torch.empty(R, M, dtype=c.q.dtype, device=t.device)
                             if want_grad else t)
    prior = c.inv_q if ep.positive_prior is None else (         # (a stand-in, never read)
        ep.positive_prior[c.r0:c.r1].to(torch.float32).contiguous())
    labels = ep.labels if ep.labels is not None else _no_labels(t.device)
    _row_kernel[(R,)](
        t, g, part_max, part_sum, pos, c.ginv_k, c.loss_out, prior, labels, M, **shared,
        n_labels=c.n_pos if ep.labels is not None else 0,
        n_teacher=0 if ep.teacher is None else ep.teacher[1].shape[0],
        smoothing=float(ep.label_smoothing), teacher_inv_t=1.0 / ep.teacher_temperature,
        distill_weight=float(ep.distill_weight),
        FLAGS=pack_flags(**row_flags(f), STORE_EXP=store_exp, WANT_GRAD=want_grad),
        TILE_M=configs.SIM_BLOCK_M, **configs.row_block(f))
    return g if want_grad else None


@functools.lru_cache(maxsize=None)
def _no_labels(device) -> torch.Tensor:
    """The row kernel's labels without labels (never read): an int64 stand-in, so that the
    launch is the specialization the compile check builds."""
    return torch.zeros(1, dtype=torch.long, device=device)


def _row_bytes(ep, dtype: torch.dtype, m: int, n_pos: int) -> int:
    """Chunk memory per anchor row: one buffer in the GEMM dtype (the bounded design, exp
    mode), or the fp32 cosines plus the gradient (focal and the released DCLR outside the
    bounded design). The DCLR mask is formed inside the tiles and costs nothing here."""
    gemm = torch.finfo(dtype).bits // 8
    if logit_bound(ep, dtype) is None and not stores_exp(flags(ep)):
        # (and the teacher's fp32 cosines of its documents)
        return m * (4 + gemm) + (0 if ep.teacher is None else 4 * ep.teacher[1].shape[0])
    return m * gemm


#: Chunk rows are rounded to this: the similarity kernel's largest row tile.
ROW_MULTIPLE = 16 if INTERPRET else 128
