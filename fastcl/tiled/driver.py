"""The one chunk driver: anchor rows in chunks, each chunk's cosines through an engine's
epilogue, and the gradients from its ``H`` (:func:`contrastive_forward`); Matryoshka's
widths in one pass over d (:func:`matryoshka_forward`, the torch engine's)."""

from __future__ import annotations

import functools
import math

import torch

from ..common import EPS, accumulate_dtype
from ..spec import Epilogue
from .engine import (TORCH, Chunk, Engine, _acc_and_cast_bytes, _accumulate_mm, _focal_logits,
                     _focal_slope, _mm, _mm_into, _RowRules)


#: Default bytes for the per-chunk R×M work buffers (all of them together). On a GPU a chunk
#: must also be large, for the GEMMs and to keep each chunk's launches behind the GPU's work:
#: there a chunk takes at least ``MIN_CHUNK_ROWS`` rows where the device has the memory for
#: them. Measured on an H200 (bf16, d = 768, bench/results/nvidia-h200-2026-11-30-check3-
#: targets.json): at N = M = 16384, 2048 / 3072 / 4096 rows took 4.57 / 3.78 / 3.55 ms; at
#: 32768, 12.49 / 12.08 / 11.52 ms. 128 MiB is 4096 rows of one 16-bit buffer at M = 16384.
DEFAULT_MEMORY_BUDGET = {"cpu": 64 * 2**20, "cuda": 128 * 2**20}


MIN_CHUNK_ROWS = {"cuda": 4096}


#: The share of the device's free memory that the chunk buffers may take to reach
#: ``MIN_CHUNK_ROWS``.
MIN_ROWS_FREE_SHARE = 0.25


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the chunk GEMMs read: 16-bit inputs stay 16-bit on a GPU (tensor cores);
    on a CPU they are widened once (16-bit GEMMs are no faster there)."""
    return dtype if device.type == "cuda" else accumulate_dtype(dtype)


def rows_per_chunk(n: int, m: int, ep: Epilogue, row_bytes: int, device_type: str = "cpu",
                   multiple: int = 16, free_bytes=None) -> int:
    """Anchor rows per chunk: ``ep.chunk_size``, or as many as the memory budget allows given
    ``row_bytes``, the engine's chunk buffers per anchor row (``engine.row_bytes``), rounded
    down to a multiple of ``multiple`` (the engine's row tile) when there is room for one. On
    a device with a :data:`MIN_CHUNK_ROWS` (and no ``ep.memory_budget``) a chunk takes at
    least that many rows when they need at most :data:`MIN_ROWS_FREE_SHARE` of
    ``free_bytes()``, the device's free memory (asked only then)."""
    if ep.chunk_size is not None:
        return max(1, min(n, ep.chunk_size))
    budget = ep.memory_budget or DEFAULT_MEMORY_BUDGET.get(device_type, DEFAULT_MEMORY_BUDGET["cpu"])
    row_bytes = max(row_bytes, 1)
    rows = max(1, budget // row_bytes)
    floor = MIN_CHUNK_ROWS.get(device_type) if ep.memory_budget is None else None
    if floor and rows < min(n, floor) and free_bytes is not None:
        if min(n, floor) * row_bytes <= MIN_ROWS_FREE_SHARE * free_bytes():
            rows = floor
    return int(min(n, rows if rows < multiple else rows // multiple * multiple))


def _free_bytes(device: torch.device):
    """The device's free memory in bytes, asked when called (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.mem_get_info(device)[0]


def chunk_rows(engine, ep: Epilogue, n: int, m: int, n_pos: int, dtype: torch.dtype,
               device: torch.device) -> int:
    """The rows per chunk the driver uses for ``engine`` (the benchmarks ask it too)."""
    device = torch.device(device)
    return rows_per_chunk(n, m, ep, engine.row_bytes(ep, dtype, m, n_pos), device.type,
                          engine.row_multiple, _free_bytes(device))


def _tangent_(u: torch.Tensor, x: torch.Tensor, norm: torch.Tensor, block: int):
    """In place: ``∂L/∂x = u − x̂ (x̂·u)`` with ``u = Σ_j G'_ij k_j`` — the chain through
    ``x̂ = x / max(‖x‖, eps)`` (no projection where the norm was clamped). ``x̂`` is formed by
    division, block by block, so that d = 1 gives an exact 0 and temporaries stay small."""
    for b in range(0, u.shape[0], block):
        ub, nb = u[b:b + block], norm[b:b + block]
        x_hat = x[b:b + block].to(u.dtype) / nb[:, None]
        coef = torch.einsum("id,id->i", x_hat, ub).masked_fill_(nb <= EPS, 0.0)
        ub.addcmul_(x_hat, coef[:, None], value=-1.0)
    return u


def _smallest_unclamped(norm: torch.Tensor) -> torch.Tensor:
    """The smallest norm above EPS (a 0-dim tensor, no host sync); 1 if every row was clamped."""
    return torch.where(norm > EPS, norm, torch.inf).amin().nan_to_num(posinf=1.0)


def _unit(x: torch.Tensor, inv_norm: torch.Tensor) -> torch.Tensor:
    """x̂ = x · inv_norm in the accumulate dtype: 1/EPS is inf in float16, and 0·inf = NaN
    for a zero row."""
    return x.to(inv_norm.dtype) * inv_norm[:, None]


def _norms(x: torch.Tensor, acc: torch.dtype):
    return torch.linalg.vector_norm(x, dim=1, dtype=acc).clamp_min_(EPS)


def contrastive_forward(ep: Epilogue, anchors, candidates, need, engine: Engine = TORCH,
                        gemm_dtype: torch.dtype | None = None,
                        anchor_norms: torch.Tensor | None = None, raw_candidates: bool = False,
                        temperature_grad: bool = False):
    r"""The chunked driver shared by every engine. Returns
    ``(loss, [∂L/∂anchors, ∂L/∂candidates...])`` with ``None`` where ``need`` says no
    gradient is wanted; with ``temperature_grad`` one more entry, ∂L/∂τ (0-dim), from sums
    the backward forms anyway. Every logit is ``s/τ`` plus terms free of τ with no slope in s
    (the hard negative's w, MNRL's ``β·sg(s)``, a drop's −inf, the released code's 0), so
    ``∂L/∂τ = −(1/τ) Σ_ij (∂L/∂s_ij)·s_ij = −(1/τ) Σ_i w_i q_i·u_i``: each anchor row's dot
    product with its ``u_i = (H K)_i`` before the chain rule through q̂ (``G' = w ⊙ H``,
    :func:`_chunk_gradients`), an R×d pass a chunk; no second pass over the N×M products.
    (Focal logits break the identity: :func:`fastcl.spec.build_spec` keeps those on the
    reference.) ``gemm_dtype`` overrides the dtype the chunk GEMMs read
    (:func:`matmul_dtype`): a CPU run can then reproduce a GPU's 16-bit buffers.
    ``anchor_norms``: the anchors' row norms (:func:`_norms`), where a caller that passes the
    same anchors again (DCLR's noise steps) has them. ``raw_candidates``: in place of the
    candidates' gradients, ``(u, keys, ‖k‖, 1/‖k‖)`` with ``u`` (M×d, accumulate dtype) the
    sums ``Σ_i H_ij q̂_i`` before the chain rule through k̂: each row is ∂L/∂k_j's before its
    projection onto k_j's tangent space, times a positive factor (what DCLR's noise step,
    which takes each row's direction alone, reads)."""
    if ep.matryoshka is not None:
        return matryoshka_forward(ep, anchors, candidates, need, gemm_dtype, temperature_grad)
    n_rows, d = anchors.shape
    n = n_rows // 2 if ep.paired else n_rows      # loss rows: two sides each when paired
    in_dtype, device = anchors.dtype, anchors.device
    acc = accumulate_dtype(in_dtype)
    dtype = gemm_dtype or matmul_dtype(in_dtype, device)
    sizes = [c.shape[0] for c in candidates]
    m = sum(sizes)
    need_k = any(need[1:])
    need_q = bool(need[0]) or temperature_grad      # ∂L/∂τ reads the rows' u (dq unreturned)
    released = ep.formulation == "released"

    # One (M×d) candidate matrix; a copy only when there are several blocks or a dtype change.
    # Made contiguous once here, at the boundary: the engines assume unit stride along d.
    keys = (candidates[0] if len(candidates) == 1 else torch.cat(candidates)).to(dtype).contiguous()
    norm_k = _norms(keys, acc)
    norm_q = _norms(anchors, acc) if anchor_norms is None else anchor_norms
    inv_k, inv_q = norm_k.reciprocal(), norm_q.reciprocal()
    # H's column factor γ·c·inv_k_j ≤ γ (c = the smallest norm of a row that was not clamped)
    # keeps H in a 16-bit range whatever the norms (no host sync: c stays on the device); γ
    # lifts fp16 entries off its subnormals. A zero row's c/EPS would overflow float16 (and a
    # c of EPS would flush every other column): there its factor is capped at γ and its dk
    # row gets the excess back; its terms in dq are 0 either way.
    c_min, gain = _smallest_unclamped(norm_k), _fp16_gain(ep, dtype)
    h_scale = c_min * gain if gain != 1.0 else c_min
    ratio = inv_k * c_min
    excess = ratio.clamp_min(1.0) if dtype == torch.float16 else None
    ginv_k = ratio.clamp_max(1.0) if excess is not None else ratio
    if gain != 1.0:
        ginv_k = ginv_k * gain
    dk = torch.zeros(m, d, dtype=acc, device=device) if need_k else None
    # dq rows are final once their chunk is done: stored in the input dtype straight away
    # fp16 keeps them in the accumulate dtype until backward has applied the incoming scale:
    # at scale 1 (before a loss scaler's 2¹⁶) fp16 would flush most of a gradient of ~1/N.
    grad_dtype = acc if in_dtype == torch.float16 else in_dtype
    dq = torch.empty(n_rows, d, dtype=grad_dtype, device=device) if need_q else None
    comp = None
    if ep.complementary is not None:
        comp = [torch.nn.functional.normalize(x.to(acc), dim=1, eps=EPS).to(dtype)
                for x in ep.complementary]

    rows = chunk_rows(engine, ep, n, m, sizes[0], dtype, device)
    denom = n * m if released else n
    row_loss = torch.empty(n, dtype=acc, device=device)
    tangent = engine.tangent                  # the engine's fused chain rule, if it has one
    w = inv_q / (denom * h_scale)          # G' = w ⊙ H: the row factors
    radial = torch.zeros((), dtype=acc, device=device) if temperature_grad else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        take = functools.partial(_chunk_rows, r0=r0, r1=r1, n=n, paired=ep.paired)
        q = take(anchors).to(dtype).contiguous()
        inv_q_c = take(inv_q)
        chunk = Chunk(r0, r1, n, sizes[0], ep.anchor_offset + r0, q, keys, inv_q_c, inv_k,
                      ginv_k, loss_out=row_loss[r0:r1], comp_q=comp[0][r0:r1] if comp else None,
                      comp_k=comp[1] if comp else None)
        h = engine.chunk(ep, chunk, need_q or need_k)
        if h is not None:
            dq_c = None
            if need_q:
                dq_c = dq[r0:r1] if not ep.paired else torch.empty_like(q, dtype=dq.dtype)
            _chunk_gradients(h, q, keys, inv_q_c, take(norm_q), take(w), dq_c, dk, tangent, acc,
                             ep.anchor_offset + r0, radial)
            if need_q and ep.paired:
                dq[r0:r1], dq[n + r0:n + r1] = dq_c[:r1 - r0], dq_c[r1 - r0:]
        # this chunk's R×M buffer is released before the next chunk allocates its own: the
        # peak is one buffer, not two
        del h

    loss = (row_loss.sum(dtype=torch.float64) / denom).to(acc)
    grads = [dq if need[0] else None]
    if need_k and raw_candidates:
        return loss, grads + [(dk, keys, norm_k, inv_k)]
    if need_k:
        out_dtype = acc if in_dtype == torch.float16 else in_dtype
        col_scale = (denom * h_scale).reciprocal()
        if excess is not None:
            col_scale = col_scale * excess          # one entry per candidate row
        col_scale = col_scale.reshape(-1).to(acc)
        if tangent is not None:
            dk = tangent(dk, keys, inv_k, col_scale, torch.empty(m, d, dtype=out_dtype, device=device))
        else:
            dk = _tangent_(dk.mul_(col_scale[:, None]), keys, norm_k, rows).to(out_dtype)
        grads += [part if want else None for part, want in zip(dk.split(sizes), need[1:])]
    else:
        grads += [None] * len(candidates)
    return loss, grads + ([radial / -ep.temperature] if temperature_grad else [])


def matryoshka_forward(ep: Epilogue, anchors, candidates, need, gemm_dtype=None,
                       temperature_grad: bool = False):
    r"""Matryoshka in one pass: ``L = Σ_k w_k·L_k``, ``L_k`` the loss of the prefixes
    ``x[:, :d_k]`` (their own cosines ``s^k``), with one GEMM over d per product instead of
    one per dimension. Same contract as :func:`contrastive_forward`.

    The widths split d into bands ``(d_{k−1}, d_k]``. Forward: the prefix dot products grow
    band by band, ``D^k = D^{k−1} + Q_band K_bandᵀ``, and each ``k`` turns its cosines
    ``s^k = D^k / (‖q^k‖‖k^k‖)`` (prefix norms) into its row loss and ``A^k = ∂L/∂s^k``. By
    the chain rule through the prefix cosines,

    .. math:: \frac{∂L}{∂q_i}\Big|_{band} = \Big(\sum_{k: d_k ≥ band} Ã^k\Big) K_{band}
              − \sum_{k: d_k ≥ band} \frac{c^k_i}{‖q^k_i‖^2} q_{i,band},\quad
              Ã^k_{ij} = \frac{A^k_{ij}}{‖q^k_i‖‖k^k_j‖},\ c^k_i = \sum_j A^k_{ij} s^k_{ij}

    (and the same for the keys with ``Ãᵀ`` and column sums): the sums ``B = Σ_{k ≥ band}
    Ã^k``, formed from the widest width down, take one GEMM per band for each gradient.
    A chunk holds every width's Ã^k (as ``f^k ⊙ H^k``, its row factor apart) besides D and
    one scratch slice, allocated once for the call. The anchors' and candidates' own
    features: focal modulation, the hard negative's log-weight, DCLR's mask, and the rules
    of :mod:`fastcl.layout` (a positive side, its joint or own softmax, the drops, MNRL's
    hardness term); the masks are the texts', computed once for every width. ``temperature_grad``:
    ∂L/∂τ = −(1/τ) Σ_k Σ_i c^k_i (:func:`contrastive_forward`'s identity, width by width)."""
    n_rows, d = anchors.shape
    n = n_rows // 2 if ep.paired else n_rows      # loss rows: two sides each when paired
    sides = 2 if ep.paired else 1
    in_dtype, device = anchors.dtype, anchors.device
    acc = accumulate_dtype(in_dtype)
    dtype = gemm_dtype or matmul_dtype(in_dtype, device)
    sizes = [c.shape[0] for c in candidates]
    m, n_pos = sum(sizes), sizes[0]
    need_q, need_k = bool(need[0]), any(need[1:])
    dims, weights = ep.matryoshka
    bands = list(zip((0,) + dims[:-1], dims))
    keys = (candidates[0] if len(candidates) == 1 else torch.cat(candidates)).to(dtype).contiguous()
    q_all = anchors.to(dtype)

    def prefix_norms(x):                        # (rows, K): ‖x[:, :d_k]‖ in acc
        parts = torch.stack([torch.linalg.vector_norm(x[:, lo:hi], dim=1, dtype=acc) for lo, hi in bands],
                            dim=1)
        return parts.square_().cumsum(dim=1).sqrt_()

    norm_q, norm_k = prefix_norms(anchors), prefix_norms(keys)
    inv_q, inv_k = 1.0 / norm_q.clamp_min(EPS), 1.0 / norm_k.clamp_min(EPS)
    # the radial term of x/max(‖x‖, EPS) exists only where the norm was not clamped
    radial_q = (norm_q > EPS).to(acc) * inv_q * inv_q
    radial_k = (norm_k > EPS).to(acc) * inv_k * inv_k
    # each width's factors contiguous (rows' per chunk, below): a strided broadcast operand
    # costs the R×M passes their vectorization
    inv_k_w = inv_k.T.contiguous()
    dq = torch.zeros(n_rows, d, dtype=acc, device=device) if need_q else None
    dk = torch.zeros(m, d, dtype=acc, device=device) if need_k else None
    col_c = torch.zeros(len(dims), m, dtype=acc, device=device)   # per width, contiguous
    row_loss = torch.zeros(n, dtype=acc, device=device)
    tau_sum = torch.zeros((), dtype=acc, device=device)
    comp = None
    if ep.complementary is not None:
        comp = [torch.nn.functional.normalize(x.to(acc), dim=1, eps=EPS).to(dtype)
                for x in ep.complementary]
    rows = rows_per_chunk(n, m, ep, _matryoshka_row_bytes(ep, dtype, m), device.type, 16,
                          _free_bytes(device))
    if ep.chunk_size is None:
        rows = _even_chunks(n, rows)
    # The chunk's slices, allocated once and reused by every chunk (the last one takes the
    # first rows): a fresh R×M allocation per chunk and width costs its page faults again.
    slices = 2 + len(dims) + (ep.focal_m is not None or ep.hardness is not None)
    buffers = torch.empty(slices, sides * min(rows, n), m, dtype=acc, device=device).unbind(0)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        r = r1 - r0
        take = functools.partial(_chunk_rows, r0=r0, r1=r1, n=n, paired=ep.paired)
        q = take(q_all)
        first = ep.anchor_offset + r0               # the column of row r0's positive
        rules = _RowRules(ep, Chunk(r0, r1, n, n_pos, first, q, keys, None, None, None,
                                    comp_q=comp[0][r0:r1] if comp else None,
                                    comp_k=comp[1] if comp else None), acc)
        dots, pool = buffers[0][:sides * r], [b[:sides * r] for b in buffers[1:len(dims) + 2]]
        cos = buffers[-1][:sides * r] if slices > 2 + len(dims) else None
        # per width: Ã^k = diag(f^k) H^k − δ·g^k, and the radial sums
        row_f, row_c = torch.empty(2, len(dims), sides * r, dtype=acc, device=device)
        pos_g = torch.empty(len(dims), r, dtype=acc, device=device)
        inv_q_c = take(inv_q).T.contiguous()          # (K, sides·r)
        h = []
        for k, (lo, hi) in enumerate(bands):
            if k == 0:
                _mm_into(dots, q[:, lo:hi], keys[:, lo:hi].T)
            else:
                _accumulate_mm(dots, q[:, lo:hi], keys[:, lo:hi].T)
            kept, free = _matryoshka_width(ep, weights[k], n, n_pos, dots, pool.pop(), pool.pop(), cos,
                                           inv_q_c[k], inv_k_w[k], first, rules, row_loss[r0:r1],
                                           row_f[k], pos_g[k], row_c[k], col_c[k])
            h.append(kept)
            pool.append(free)
        if temperature_grad:
            tau_sum += row_c.sum()
        # the widest width down: B = Σ_{k ≥ band} Ã^k, one GEMM per band and gradient
        total_b = None
        for k in reversed(range(len(bands))):
            lo, hi = bands[k]
            if total_b is None:
                total_b = h[k].mul_(row_f[k, :, None])
            else:
                total_b.addcmul_(h[k], row_f[k, :, None])
            total_b[:r].diagonal(first).sub_(pos_g[k])
            b = total_b.to(dtype)
            if need_q:
                _accumulate_mm(dq[r0:r1, lo:hi], b[:r], keys[:, lo:hi])
                if ep.paired:
                    _accumulate_mm(dq[n + r0:n + r1, lo:hi], b[r:], keys[:, lo:hi])
            if need_k:
                _accumulate_mm(dk[:, lo:hi], b.T, q[:, lo:hi])
        if need_q:
            coef = row_c.T * take(radial_q)                       # (sides·r, K)
            for k, (lo, hi) in enumerate(bands):
                # band k takes the radial terms of every width that covers it
                radial = q[:, lo:hi].to(acc) * coef[:, k:].sum(dim=1, keepdim=True)
                dq[r0:r1, lo:hi] -= radial[:r]
                if ep.paired:
                    dq[n + r0:n + r1, lo:hi] -= radial[r:]
    if need_k:
        coef = col_c.T * radial_k
        for k, (lo, hi) in enumerate(bands):
            dk[:, lo:hi].addcmul_(keys[:, lo:hi].to(acc), coef[:, k:].sum(dim=1, keepdim=True),
                                  value=-1.0)
    loss = (row_loss.sum(dtype=torch.float64) / n).to(acc)
    out_dtype = acc if in_dtype == torch.float16 else in_dtype
    grads = [dq.to(out_dtype) if need_q else None]
    if need_k:
        grads += [part.to(out_dtype) if want else None for part, want in zip(dk.split(sizes), need[1:])]
    else:
        grads += [None] * len(candidates)
    return loss, grads + ([tau_sum / -ep.temperature] if temperature_grad else [])


def _even_chunks(n: int, rows: int, multiple: int = 16) -> int:
    """Rows per chunk for as many chunks of ``rows`` as ``n`` needs, but of even size (a
    multiple of ``multiple``, never above ``rows``): no short last chunk of slow GEMMs."""
    chunks = -(-n // rows)
    even = -(-(-(-n // chunks)) // multiple) * multiple
    return min(rows, even)


def _chunk_rows(x: torch.Tensor, r0: int, r1: int, n: int, paired: bool) -> torch.Tensor:
    """A chunk's rows of ``x``: [r0, r1), and with a positive side also [n + r0, n + r1)."""
    return x[r0:r1] if not paired else torch.cat([x[r0:r1], x[n + r0:n + r1]])


def _matryoshka_row_bytes(ep: Epilogue, dtype: torch.dtype, m: int) -> int:
    """:func:`matryoshka_forward`'s buffers per loss row: D, a scratch slice and one H per
    width (the cosines too with focal or MNRL's hardness), each side's, the masks, and B's
    cast to the GEMM dtype."""
    acc, cast = _acc_and_cast_bytes(dtype)
    slices = 2 + len(ep.matryoshka[0]) + (ep.focal_m is not None or ep.hardness is not None)
    sides = 2 if ep.paired else 1
    # the layout's masks (bool), the hardness factor, the guide's cosines while formed
    rules = m * (sides + acc * (ep.hardness is not None) + acc * (ep.guide is not None)) if ep.sided else 0
    return sides * m * (acc * slices + cast) + rules + (m * (acc + 1) if ep.complementary is not None else 0)


#: Where ``2·bound + ln M`` (:func:`_logit_bound`) stays below this, every softmax entry is a
#: normal float32 number, and a row's loss ``lse − l_ii`` is ``−log p_ii`` without its
#: log-sum-exp.
_EXACT_LOG_BOUND = 80.0


def _logit_bound(ep: Epilogue) -> float:
    """A bound on |logit| from the epilogue alone (cosines lie in [−1, 1]): 1/τ, (1 + |m|)/τ
    with focal modulation, plus the hard negative's |log-weight|."""
    slope = 1.0 + abs(ep.focal_m) if ep.focal_m is not None else 1.0
    return slope / ep.temperature + abs(ep.hard_negative_weight)


def _matryoshka_width(ep, weight, n, n_pos, dots, out, spare, cos, inv_q, inv_k, first, rules,
                      row_loss, row_f, pos_g, row_c, col_c):
    r"""One width's epilogue on a chunk, from its prefix dot products ``dots`` (R'×M, kept;
    R' = 2R with a positive side, rows R + i): ``row_loss += w_k·L_k``; ``row_f`` ← ``f``
    (R') and ``pos_g`` ← ``g`` (R) with ``Ã^k = diag(f) H − δ·g`` (δ: each anchor-side row's
    positive, column ``first + i``); the radial sums ``Σ_j Ã_ij D_ij`` into ``row_c`` and
    ``Σ_i Ã_ij D_ij`` added to ``col_c``. ``out`` and ``spare`` are free R'×M slices, ``cos``
    (R'×M, with focal or MNRL's hardness) holds the cosines; ``rules``: the chunk's
    :class:`_MatryoshkaRules`. Returns ``(H, free)``: the slice that holds H and the one
    left free.

    Every pass over the slice counts (they, not the GEMMs, bound the time): the softmax is
    one fused pass (its rows stay in cache), 1/(‖q‖τN) stays in the row factor ``f``, and
    the column factor 1/‖k‖ is applied once, to H, before the radial product."""
    r = rules.r
    inv_t = 1.0 / ep.temperature
    if cos is not None:
        torch.mul(dots, inv_q[:, None], out=cos).mul_(inv_k[None, :])
    if ep.focal_m is not None:
        pos_cos = cos[:r].diagonal(first).clone()
        logits = _focal_logits(spare, cos, ep, r, first, rules.mirror)
    else:
        logits = torch.mul(dots, (inv_q * inv_t)[:, None], out=spare).mul_(inv_k[None, :])
    rules.apply(logits, n_pos, cos, first)
    # Every row's own softmax, one fused pass. ℓ_i = lse_i − l_ii = −log p_ii where p_ii ≥
    # e^(−2·bound)/M cannot underflow (no positive side, no layout); else lse_i through the
    # row's largest logit, whose p ≥ 1/M. (Where the others' share q < 1/2: −log1p(−q).)
    exact = not ep.sided and 2.0 * _logit_bound(ep) + math.log(logits.shape[1]) <= _EXACT_LOG_BOUND
    if not exact:
        top = logits.amax(dim=1)
        pos = logits[:r].diagonal(first).clone()
    p = torch.ops.aten._softmax.out(logits, 1, False, out=out)
    # The others' share of each anchor row's softmax, q = Σ_{j≠i} p_ij = 1 − p_ii, summed with
    # the positive's entry taken out: where the positive dominates p_ii rounds to 1, and
    # −log p_ii and p_ii − 1 keep no digit; −log1p(−q) and −q keep them all. The
    # positive's entry of H is then 0, its whole term in g (below).
    if not exact:
        lse = top - p.amax(dim=1).log_()
    p_pos = p[:r].diagonal(first).clone()
    p[:r].diagonal(first).zero_()
    q = p[:r].sum(dim=1)
    scale = 1.0                       # each row's softmax in the loss's: p_loss = scale·p
    if exact:
        near = -p_pos.log()
    else:
        if ep.paired and ep.layout.joint:
            # rows i and R + i share one softmax, log Σ_{both sides} e^l: each side's own
            # rescaled by e^(lse_side − lse). A positive side may drop every column (the
            # guide's filter): its row is 0/0 on its own, and nothing in the shared one.
            dead = torch.isneginf(top)
            p.masked_fill_(dead[:, None], 0.0)
            lse = lse.masked_fill(dead, float("-inf"))
            joint = torch.logaddexp(lse[:r], lse[r:])
            scale = torch.exp(lse - joint.repeat(2))
            q = scale[:r] * q + scale[r:] * (~dead[r:]).to(q.dtype)
            lse = joint
        near = lse[:r] - pos
        if ep.paired and not ep.layout.joint:
            # each side its own softmax: the mean of the two log-sum-exps
            scale = 0.5
            far = lse[r:] - pos
    loss = torch.where(q < 0.5, torch.neg(q).log1p_().neg_(), near)
    if ep.paired and not ep.layout.joint:
        row_loss += weight * 0.5 * (loss + far)
        q = 0.5 + 0.5 * q                  # 1 − 0.5·p_ii
    else:
        row_loss += weight * loss
    # ∂L/∂s^k = w_k (p − δ) g'(s)/N: g'(s) = 1/τ, or with focal modulation (2s + m)/τ off
    # the positive (and the positive side's own anchor) and 2s/τ on them; MNRL's β·sg(s) has
    # no slope. The positive's p_loss − 1 = −q.
    base = inv_q * (weight * inv_t / n)
    row_f.copy_(base * scale)
    pos_g.copy_(base[:r] * inv_k[first:first + r] * q
                * (1.0 if ep.focal_m is None else 2.0 * pos_cos))
    if ep.focal_m is not None:
        p.mul_(_focal_slope(cos, ep, r, first, rules.mirror))
    held = p.mul_(inv_k[None, :])
    # the radial sums: Σ_j Ã_ij D_ij = f_i Σ_j H_ij D_ij − g_i D_ii, and by columns
    product = torch.mul(held, dots, out=spare)
    pos_dots = pos_g * dots[:r].diagonal(first)
    row_c.copy_(product.sum(dim=1).mul_(row_f))
    row_c[:r] -= pos_dots
    col_c += torch.mv(product.T, row_f)
    col_c[first:first + r] -= pos_dots
    return held, spare


def _chunk_gradients(h, q, keys, inv_q, norm_q, w, dq, dk, tangent, acc, first_pos,
                     radial=None) -> None:
    """One chunk's share of the gradients from its ``H`` (R×M): ``dq = tangent(w ⊙ (H K))``
    for its rows, written into ``dq``, and ``dk += Hᵀ q̂``, with ``G' = w ⊙ H``. Row factors
    ``w_i = inv_q_i / (N·c)``: Σ_i H_ij w_i q_i = Σ_i H_ij q̂_i / (N·c), so the second GEMM takes
    unit rows q̂ (written by the same launch as dq where the engine has a fused chain rule)
    and the scalar 1/(N·c) is applied to dk once, at the end.

    ``h`` may be an engine's bounded form ``(E, 1/Z, c)``, ``H = diag(1/Z) E − δ·c`` (the
    positive of row i at column ``first_pos + i``, c None without positives): the GEMMs then
    take E itself, with 1/Z on the rows of E K and of q̂, and the positive's term apart.
    ``radial`` (0-dim, given with dq): ``Σ_i w_i q_i·u_i`` with ``u = H K`` is added to it
    (:func:`contrastive_forward`'s ∂L/∂τ)."""
    if isinstance(h, tuple):
        _bounded_gradients(*h, q, keys, inv_q, w, dq, dk, tangent, acc, first_pos, radial)
        return
    q_hat = None
    u = _mm(h, keys, acc) if dq is not None else None
    if radial is not None:
        radial += _row_dots(q, u) @ w
    if dq is not None and tangent is not None:
        q_hat = torch.empty_like(q) if dk is not None else None
        tangent(u, q, inv_q, w, dq, x_hat=q_hat)
    elif dq is not None:
        dq.copy_(_tangent_(u.mul_(w[:, None]), q, norm_q, q.shape[0]))
    if dk is not None:
        if q_hat is None:
            q_hat = _unit(q, inv_q).to(q.dtype)
        _accumulate_mm(dk, h.T, q_hat)


def _bounded_gradients(e, inv_z, pos_coef, q, keys, inv_q, w, dq, dk, tangent, acc,
                       first_pos, radial=None) -> None:
    """:func:`_chunk_gradients` for ``H = diag(1/Z) E − δ·c``: dq through the engine's fused
    chain rule (which also applies 1/Z and the positive's term, writes q̂/Z and the
    positive's term of dk), or, without dq, q̂/Z and that term here. ``radial``: as there,
    with ``u_i = (E K)_i/Z_i − c_i k_{first_pos + i}``."""
    r = q.shape[0]
    q_hat = None
    if dq is not None:
        u = _mm(e, keys, acc)
        if radial is not None:
            dots = _row_dots(q, u) * inv_z
            if pos_coef is not None:
                dots -= _row_dots(q, keys[first_pos:first_pos + r].to(acc)) * pos_coef
            radial += dots @ w
        q_hat = torch.empty_like(q) if dk is not None else None
        tangent(u, q, inv_q, w, dq, x_hat=q_hat,
                bounded=(inv_z, pos_coef, keys, first_pos, dk))
    elif dk is not None:
        unit = _unit(q, inv_q)
        if pos_coef is not None:
            dk[first_pos:first_pos + r].addcmul_(unit, pos_coef[:, None], value=-1.0)
        q_hat = unit.mul_(inv_z[:, None]).to(q.dtype)
    if dk is not None:
        _accumulate_mm(dk, e.T, q_hat)


def _row_dots(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``x_i · u_i`` for each row, in u's (accumulate) dtype."""
    return torch.einsum("id,id->i", x.to(u.dtype), u)


def _fp16_gain(ep: Epilogue, dtype: torch.dtype) -> float:
    """A power of two for H in fp16 (5 exponent bits): the largest that keeps every entry
    below 2¹⁴ — |∂ℓ/∂s| ≤ (2 + |m|)/τ — so that small softmax entries stay normal numbers.
    bf16 and fp32 have the range already; the released BCE's v = p/(1−p) has no bound."""
    if dtype != torch.float16 or ep.formulation == "released":
        return 1.0
    slope = (2.0 + abs(ep.focal_m)) / ep.temperature if ep.focal_m is not None else 1.0 / ep.temperature
    return 2.0 ** max(0, math.floor(math.log2(2**14 / slope)))
