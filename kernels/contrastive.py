"""Fused Triton kernels for the contrastive family (InfoNCE, focal, DCLR, noise update).

The driver in :mod:`fastcl.tiled` walks anchor rows in chunks of R; for each chunk this
module replaces the PyTorch epilogue with two kernels over a grid of R×M tiles:

``_similarity_kernel``  s = (q·kᵀ)·inv‖q‖·inv‖k‖ accumulated over d in BLOCK_D steps
                        (fp32 accumulation), the logit transform (temperature, focal,
                        hard-negative log-weight), the DCLR mask computed in the tile from
                        the complementary embeddings, and each tile's (max, Σexp) of its
                        rows. Writes s (the cosines; ``DROPPED`` where masked) and the
                        per-tile partials.
``_gradient_kernel``    with the row log-sum-exp combined from the partials, recomputes the
                        logits from s and writes ``G'_ij = ∂L/∂s_ij / (‖q_i‖‖k_j‖)`` in the
                        GEMM dtype; for the released DCLR formulation a first stage reduces
                        Σ_j v_ij and Σ_j log(1−p_ij) per tile.

The two gradient GEMMs ``G'K`` and ``G'ᵀQ`` then run on the raw inputs (cuBLAS on a
GPU). Partials per column tile rather than a running max/sum in one program per row
block: a tile grid keeps every SM busy at any chunk size (the split-softmax idea of
flash-decoding), and the combine is an R×(M/BLOCK_M) reduction. No atomics: results are
bit-identical run to run.

Both kernels share ``_logits`` so the math lives in one place.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: A cosine never exceeds 1: this value in the stored s marks a dropped in-batch negative.
DROPPED = 4.0

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _logits(s, is_pos, cols, rows_g, n_pos, inv_t, focal_m, hard_w,
            FOCAL: tl.constexpr, HARD: tl.constexpr):
    """l = s/τ, or focal s²/τ (positive) and s(s+m)/τ (negatives); + w on column N+i."""
    if FOCAL:
        l = tl.where(is_pos, s * s, s * (s + focal_m)) * inv_t
    else:
        l = s * inv_t
    if HARD:
        l = tl.where(cols[None, :] == n_pos + rows_g[:, None], l + hard_w, l)
    return l


@triton.jit
def _tile(R, M, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's tile of the R×M chunk: row and column indices and their bounds."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, cols, rows < R, cols < M


@triton.jit
def _tile_dot(a_ptr, b_ptr, rows, cols, row_ok, col_ok, K, stride_a, stride_b,
              PREC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """(a_rows · b_colsᵀ) for one tile, accumulated in fp32 over K in BLOCK_D steps, like a
    matmul: K (the embedding width, 384–4096) is too wide to keep a row block resident."""
    acc = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_D):
        kk = k0 + tl.arange(0, BLOCK_D)
        a = tl.load(a_ptr + rows[:, None] * stride_a + kk[None, :],
                    mask=row_ok[:, None] & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + cols[:, None] * stride_b + kk[None, :],
                    mask=col_ok[:, None] & (kk[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
    return acc


@triton.jit
def _positive(cols, rows_g, POSITIVES: tl.constexpr):
    """Where column j holds row i's positive (j = i); nowhere for DCLR's noise loss."""
    if POSITIVES:
        is_pos = cols[None, :] == rows_g[:, None]
    else:
        is_pos = cols[None, :] < 0
    return is_pos


@triton.jit
def _similarity_kernel(
    q_ptr, k_ptr, inv_q_ptr, inv_k_ptr, cq_ptr, ck_ptr,
    s_ptr, part_max_ptr, part_sum_ptr, pos_ptr,
    R, M, D, DC, first_pos, n_pos,
    stride_q, stride_k, stride_cq, stride_ck, stride_s, stride_part,
    inv_t, focal_m, hard_w, phi,
    FOCAL: tl.constexpr, HARD: tl.constexpr, MASK: tl.constexpr, RELEASED: tl.constexpr,
    POSITIVES: tl.constexpr, PREC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(1)
    rows, cols, row_ok, col_ok = _tile(R, M, BLOCK_R, BLOCK_M)
    rows_g = first_pos + rows              # global anchor index = its positive's column

    acc = _tile_dot(q_ptr, k_ptr, rows, cols, row_ok, col_ok, D, stride_q, stride_k,
                    PREC, BLOCK_R, BLOCK_M, BLOCK_D)
    inv_q = tl.load(inv_q_ptr + rows, mask=row_ok, other=0.0)
    inv_k = tl.load(inv_k_ptr + cols, mask=col_ok, other=0.0)
    s = acc * inv_q[:, None] * inv_k[None, :]

    is_pos = _positive(cols, rows_g, POSITIVES)
    l = _logits(s, is_pos, cols, rows_g, n_pos, inv_t, focal_m, hard_w, FOCAL, HARD)

    if MASK:
        # the complementary model's cosine, in the same tile: no N×M mask ever exists
        in_batch = cols < n_pos
        cacc = _tile_dot(cq_ptr, ck_ptr, rows, cols, row_ok, in_batch, DC, stride_cq, stride_ck,
                         PREC, BLOCK_R, BLOCK_M, BLOCK_D)
        if RELEASED:
            too_close = cacc * inv_t > 20.0 * phi      # the released code's test
        else:
            too_close = cacc >= phi
        drop = too_close & in_batch[None, :] & (cols[None, :] != rows_g[:, None])
        s = tl.where(drop, DROPPED, s)
        if RELEASED:
            l = tl.where(drop, 0.0, l)                 # released: logit × 0
        else:
            l = tl.where(drop, float("-inf"), l)       # paper: leaves the denominator

    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(s_ptr + rows[:, None] * stride_s + cols[None, :], s, mask=ok)

    l = tl.where(col_ok[None, :], l, float("-inf"))
    tile_max = tl.max(l, axis=1)
    safe_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
    tile_sum = tl.sum(tl.exp(l - safe_max[:, None]), axis=1)
    tl.store(part_max_ptr + rows * stride_part + pid_m, tile_max, mask=row_ok)
    tl.store(part_sum_ptr + rows * stride_part + pid_m, tile_sum, mask=row_ok)
    if POSITIVES:
        # the tile holding column i writes anchor i's positive logit
        pos_here = row_ok & (rows_g >= pid_m * BLOCK_M) & (rows_g < pid_m * BLOCK_M + BLOCK_M) \
            & (rows_g < M)
        pos_logit = tl.sum(tl.where(is_pos, l, 0.0), axis=1)
        tl.store(pos_ptr + rows, pos_logit, mask=pos_here)


@triton.jit
def _gradient_kernel(
    s_ptr, lse_ptr, inv_q_ptr, inv_k_ptr, vsum_ptr, g_ptr, part_v_ptr, part_log_ptr,
    R, M, first_pos, n_pos, stride_s, stride_g, stride_part,
    inv_t, focal_m, hard_w, scale,
    FOCAL: tl.constexpr, HARD: tl.constexpr, MASK: tl.constexpr, RELEASED: tl.constexpr,
    POSITIVES: tl.constexpr, STAGE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(1)
    rows, cols, row_ok, col_ok = _tile(R, M, BLOCK_R, BLOCK_M)
    ok = row_ok[:, None] & col_ok[None, :]
    rows_g = first_pos + rows

    s = tl.load(s_ptr + rows[:, None] * stride_s + cols[None, :], mask=ok, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    is_pos = _positive(cols, rows_g, POSITIVES)
    l = _logits(s, is_pos, cols, rows_g, n_pos, inv_t, focal_m, hard_w, FOCAL, HARD)
    if MASK:
        dropped = s == DROPPED
        if RELEASED:
            l = tl.where(dropped, 0.0, l)
        else:
            l = tl.where(dropped, float("-inf"), l)
    p = tl.where(ok, tl.exp(l - lse[:, None]), 0.0)

    if RELEASED:
        # BCE on the softmax: v = p/(1−p) off the positive, −1 on it
        not_p = tl.maximum(1.0 - p, 1e-30)             # only p = 1 exactly is guarded
        v = tl.where(is_pos, -1.0, p / not_p)
        v = tl.where(ok, v, 0.0)
        if STAGE == 0:
            # log(1−p), accurate for small p, clamped at −100 like torch's BCE
            log_not = tl.where(p < 1e-4, -p - 0.5 * p * p, tl.log(not_p))
            log_not = tl.where(ok & (~is_pos), tl.maximum(log_not, -100.0), 0.0)
            tl.store(part_v_ptr + rows * stride_part + pid_m, tl.sum(v, axis=1), mask=row_ok)
            tl.store(part_log_ptr + rows * stride_part + pid_m, tl.sum(log_not, axis=1), mask=row_ok)
        else:
            vsum = tl.load(vsum_ptr + rows, mask=row_ok, other=0.0)
            g = (v - p * vsum[:, None]) * (inv_t * scale)
            if MASK:
                g = tl.where(dropped, 0.0, g)          # a × 0 logit has no slope in s
            _store_grad(g, rows, cols, row_ok, col_ok, ok, inv_q_ptr, inv_k_ptr, g_ptr, stride_g)
    else:
        g = tl.where(is_pos, p - 1.0, p)
        if FOCAL:
            slope = tl.where(is_pos, 2.0 * s, 2.0 * s + focal_m) * inv_t
        else:
            slope = inv_t
        g = g * slope * scale
        _store_grad(g, rows, cols, row_ok, col_ok, ok, inv_q_ptr, inv_k_ptr, g_ptr, stride_g)


@triton.jit
def _store_grad(g, rows, cols, row_ok, col_ok, ok, inv_q_ptr, inv_k_ptr, g_ptr, stride_g):
    """G'_ij = ∂L/∂s_ij / (‖q_i‖‖k_j‖), the form both gradient GEMMs take with raw inputs."""
    inv_q = tl.load(inv_q_ptr + rows, mask=row_ok, other=0.0)
    inv_k = tl.load(inv_k_ptr + cols, mask=col_ok, other=0.0)
    g = g * inv_q[:, None] * inv_k[None, :]
    tl.store(g_ptr + rows[:, None] * stride_g + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------- launch
# BLOCK_M is fixed per mode because the tile partials are laid out by column tile.
SIM_BLOCK_M = 16 if INTERPRET else 128


def _configs():
    """Tile sizes. One fixed config under the interpreter; a small autotuned set on GPU."""
    if INTERPRET:
        return None
    return [
        triton.Config({"BLOCK_R": br, "BLOCK_D": bd}, num_warps=w, num_stages=st)
        for br, bd, w, st in [(128, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 4), (256, 64, 8, 3)]
    ]


_TUNED = {}


def _kernel(fn, key):
    """The autotuned wrapper of a kernel on GPU, the bare kernel under the interpreter."""
    configs = _configs() if fn is _similarity_kernel else None
    if configs is None:
        return fn
    if fn not in _TUNED:
        _TUNED[fn] = triton.autotune(configs=configs, key=key)(fn)
    return _TUNED[fn]


SIM_FIXED = {"BLOCK_R": 16, "BLOCK_D": 16}                # interpreter tiles (tl.dot needs ≥ 16)
GRAD_BLOCK = ({"BLOCK_R": 16, "BLOCK_M": 16} if INTERPRET  # the elementwise kernel's tiles
              else {"BLOCK_R": 32, "BLOCK_M": 128})


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (TF32 would move cosines by ~1e-3, logits by ~0.02);
    # 16-bit inputs use the tensor cores whatever this says.
    return "ieee" if dtype == torch.float32 else "tf32"


def triton_chunk(ep, c, want_grad):
    """The Triton engine for :func:`fastcl.tiled.contrastive_forward` (same contract as
    :func:`fastcl.tiled.torch_chunk`)."""
    R, d = c.q.shape
    M = c.keys.shape[0]
    n, n_pos = c.n, c.n_pos
    dev = c.q.device
    released = ep.formulation == "released"
    mask = ep.complementary is not None
    flags = dict(FOCAL=ep.focal_m is not None, HARD=bool(ep.hard_negative_weight), MASK=mask,
                 RELEASED=released, POSITIVES=ep.positives)
    focal_m = float(ep.focal_m or 0.0)
    inv_t = 1.0 / ep.temperature
    q, keys = c.q, c.keys                  # contiguous, in the GEMM dtype (the driver's job)
    inv_q, inv_k = c.inv_q.float(), c.inv_k.float()
    if mask:
        cq, ck = c.comp_q, c.comp_k
        dc = cq.shape[1]
    else:
        cq, ck, dc = q, keys, 0            # never read

    s = torch.empty(R, M, dtype=torch.float32, device=dev)
    sim = _kernel(_similarity_kernel, ["M", "D", "DC"])
    tiles = triton.cdiv(M, SIM_BLOCK_M)
    part_max = torch.empty(R, tiles, dtype=torch.float32, device=dev)
    part_sum = torch.empty(R, tiles, dtype=torch.float32, device=dev)
    pos = torch.zeros(R, dtype=torch.float32, device=dev)
    grid = lambda meta: (triton.cdiv(R, meta["BLOCK_R"]), tiles)
    extra = SIM_FIXED if INTERPRET else {}
    sim[grid](q, keys, inv_q, inv_k, cq, ck, s, part_max, part_sum, pos,
              R, M, d, dc, c.first_pos, n_pos,
              q.stride(0), keys.stride(0), cq.stride(0), ck.stride(0), s.stride(0), tiles,
              inv_t, focal_m, float(ep.hard_negative_weight), float(ep.phi or 0.0),
              PREC=_precision(q.dtype), BLOCK_M=SIM_BLOCK_M, **flags, **extra)
    # Row log-sum-exp from the tile partials.
    row_max = part_max.amax(dim=1)
    safe = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    lse = safe + torch.log((part_sum * torch.exp(part_max - safe[:, None])).sum(dim=1))

    gb = GRAD_BLOCK
    ggrid = (triton.cdiv(R, gb["BLOCK_R"]), triton.cdiv(M, gb["BLOCK_M"]))
    gtiles = ggrid[1]
    scale = 1.0 / (n * M) if released else 1.0 / n
    common = (R, M, c.first_pos, n_pos, s.stride(0))
    vsum = lse                              # placeholder pointer unless released
    if released:
        part_v = torch.zeros(R, gtiles, dtype=torch.float32, device=dev)
        part_log = torch.zeros(R, gtiles, dtype=torch.float32, device=dev)
        _gradient_kernel[ggrid](s, lse, inv_q, inv_k, lse, s, part_v, part_log,
                                *common, s.stride(0), gtiles, inv_t, focal_m,
                                float(ep.hard_negative_weight), scale, STAGE=0, **flags, **gb)
        vsum = part_v.sum(dim=1)
        row_loss = -part_log.sum(dim=1) - (pos - lse).clamp_min(-100.0)
    else:
        row_loss = lse - pos if ep.positives else lse
    loss_sum = row_loss.sum(dtype=torch.float64)
    if not want_grad:
        return loss_sum, None
    g = torch.empty(R, M, dtype=q.dtype, device=dev)
    _gradient_kernel[ggrid](s, lse, inv_q, inv_k, vsum, g, lse, lse,
                            *common, g.stride(0), 0, inv_t, focal_m,
                            float(ep.hard_negative_weight), scale, STAGE=1, **flags, **gb)
    return loss_sum, g


# Chunk memory per R×M entry, for the driver's choice of R: s in fp32 plus G' in the GEMM dtype.
triton_chunk.entry_bytes = lambda dtype: 4 + torch.finfo(dtype).bits // 8
