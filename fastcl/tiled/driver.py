"""The one chunk driver: anchor rows in chunks, each chunk's cosines through an engine's
epilogue, and the gradients from its ``H`` (:func:`contrastive_forward`); with Matryoshka's
widths, every width in the same pass over d (:class:`_Widths`)."""

from __future__ import annotations

import functools
import math

import torch

from .. import common
from ..common import EPS, accumulate_dtype
from ..spec import Epilogue
from .engine import (TORCH, Chunk, Engine, _accumulate_mm, _mm, _mm_into, _RowRules, _slices,
                     torch_width)


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
    device, widths = torch.device(device), _by_widths(engine, ep)
    row_bytes = (TORCH if widths else engine).row_bytes(ep, dtype, m, n_pos)
    rows = rows_per_chunk(n, m, ep, row_bytes, device.type, 16 if widths else engine.row_multiple,
                          _free_bytes(device))
    # Matryoshka's GEMMs are per band, narrow: a short last chunk of them costs more
    return _even_chunks(n, rows) if widths and ep.chunk_size is None else rows


def _by_widths(engine: Engine, ep: Epilogue) -> bool:
    """Whether the driver takes :class:`_Widths`' pass: the torch engine's one epilogue
    (:func:`~fastcl.tiled.engine.torch_width`), and Matryoshka's widths on any engine."""
    return engine.chunk is None or ep.matryoshka is not None


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


def _column_factor(norm_k, inv_k, ep: Epilogue, dtype: torch.dtype):
    """H's column factor ``γ·c·inv_k_j ≤ γ`` along the last dim (each Matryoshka width's
    row), c the smallest norm of a row that was not clamped (1 if all were): it keeps H in a
    16-bit range whatever the norms (no host sync: c stays on the device); γ
    (:func:`_fp16_gain`) lifts fp16 entries off its subnormals. A zero row's c/EPS would
    overflow float16 (and a c of EPS would flush every other column): there its factor is
    capped at γ and its dk row gets the excess back; its terms in dq are 0 either way.
    Returns ``(γ·c·inv_k, γ·c, the excess or None)``."""
    c = torch.where(norm_k > EPS, norm_k, torch.inf).amin(dim=-1, keepdim=True).nan_to_num(posinf=1.0)
    gain, ratio = _fp16_gain(ep, dtype), inv_k * c
    excess = ratio.clamp_min(1.0) if dtype == torch.float16 else None
    if excess is not None:
        ratio = ratio.clamp_max(1.0)
    return (ratio * gain, c * gain, excess) if gain != 1.0 else (ratio, c, excess)


def _unit(x: torch.Tensor, inv_norm: torch.Tensor) -> torch.Tensor:
    """x̂ = x · inv_norm in the accumulate dtype: 1/EPS is inf in float16, and 0·inf = NaN
    for a zero row."""
    return x.to(inv_norm.dtype) * inv_norm[:, None]


def _norms(x: torch.Tensor, acc: torch.dtype):
    return torch.linalg.vector_norm(x, dim=1, dtype=acc).clamp_min_(EPS)


def _prefix_norms(x: torch.Tensor, bands, acc: torch.dtype) -> torch.Tensor:
    """(rows, K): ``‖x[:, :d_k]‖`` in ``acc``, each band's sum of squares added on."""
    parts = torch.stack([torch.linalg.vector_norm(x[:, lo:hi], dim=1, dtype=acc)
                         for lo, hi in bands], dim=1)
    return parts.square_().cumsum(dim=1).sqrt_()


def contrastive_forward(ep: Epilogue, anchors, candidates, need, engine: Engine = TORCH,
                        gemm_dtype: torch.dtype | None = None,
                        anchor_norms: torch.Tensor | None = None, raw_candidates: bool = False,
                        temperature_grad: bool = False):
    r"""The chunked driver shared by every engine and every epilogue, Matryoshka's widths
    included (:class:`_Widths`). Returns ``(loss, [∂L/∂anchors, ∂L/∂candidates...])`` with
    ``None`` where ``need`` says no gradient is wanted.

    ``temperature_grad``: one more entry, ``∂L/∂τ = −(1/τ) Σ_i w_i q_i·u_i`` (0-dim) from the
    backward's ``u = H K`` (Matryoshka's widths: ``−(1/τ) Σ_k Σ_i c^k_i``; focal adds the
    epilogue's ``Chunk.tau_out``), as docs/engine.md derives it. ``gemm_dtype`` overrides the
    dtype the chunk GEMMs read (:func:`matmul_dtype`): a CPU run can then reproduce a GPU's
    16-bit buffers. ``anchor_norms``: the anchors' row norms (:func:`_norms`), where a
    caller that passes the same anchors again (DCLR's noise steps) has them.
    ``raw_candidates``: in place of the candidates' gradients, ``(u, keys, ‖k‖, 1/‖k‖)``
    with ``u`` (M×d, accumulate dtype) the sums ``Σ_i H_ij q̂_i`` before the chain rule
    through k̂: each row is ∂L/∂k_j's before its projection onto k_j's tangent space, times
    a positive factor (what DCLR's noise step, which takes each row's direction alone,
    reads)."""
    n_rows, d = anchors.shape
    n = n_rows // 2 if ep.paired else n_rows      # loss rows: two sides each when paired
    in_dtype, device = anchors.dtype, anchors.device
    acc = accumulate_dtype(in_dtype)
    dtype = gemm_dtype or matmul_dtype(in_dtype, device)
    sizes = [c.shape[0] for c in candidates]
    m = sum(sizes)
    need_k = any(need[1:])
    need_q = bool(need[0])
    released = ep.formulation == "released"
    # dq rows are final once their chunk is done: stored in the input dtype straight away
    # fp16 keeps them in the accumulate dtype until backward has applied the incoming scale:
    # at scale 1 (before a loss scaler's 2¹⁶) fp16 would flush most of a gradient of ~1/N.
    out_dtype = acc if in_dtype == torch.float16 else in_dtype

    # One (M×d) candidate matrix; a copy only when there are several blocks or a dtype change.
    # Made contiguous once here, at the boundary: the engines assume unit stride along d.
    keys = (candidates[0] if len(candidates) == 1 else torch.cat(candidates)).to(dtype).contiguous()
    comp = None
    if ep.complementary is not None:
        comp = [common.unit(x, dtype) for x in ep.complementary]
    rows = chunk_rows(engine, ep, n, m, sizes[0], dtype, device)
    denom = n * m if released else n
    widths = (_Widths(ep, anchors, keys, n, rows, need_q, need_k, anchor_norms)
              if _by_widths(engine, ep) else None)
    # Matryoshka's widths add their terms to the row losses; a single width writes them
    row_loss = (torch.empty if widths is None else torch.zeros)(n, dtype=acc, device=device)
    inv_q = inv_k = ginv_k = None                  # (the widths keep their prefix norms)
    if widths is None:
        norm_k = _norms(keys, acc)
        norm_q = _norms(anchors, acc) if anchor_norms is None else anchor_norms
        inv_k, inv_q = norm_k.reciprocal(), norm_q.reciprocal()
        ginv_k, h_scale, excess = _column_factor(norm_k, inv_k, ep, dtype)
        w = inv_q / (denom * h_scale)          # G' = w ⊙ H: the row factors
        tangent = engine.tangent                # the engine's fused chain rule, if it has one
    radial = torch.zeros((), dtype=acc, device=device) if temperature_grad else None
    # focal's logits f = s² (the positives) and s² + m·s: Σ g·f = (τ/2)·Σ A·s + (m/2)·Σ_off g·s,
    # the last a row sum the torch engine forms in its epilogue (the Triton one does not)
    focal_sum = radial.clone() if temperature_grad and ep.focal_m is not None else None
    dk = torch.zeros(m, d, dtype=acc, device=device) if need_k else None
    dq = None
    if need_q:
        dq = (torch.zeros(n_rows, d, dtype=acc, device=device) if widths is not None
              else torch.empty(n_rows, d, dtype=out_dtype, device=device))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        take = functools.partial(_chunk_rows, r0=r0, r1=r1, n=n, paired=ep.paired)
        q = take(anchors).to(dtype).contiguous()
        chunk = Chunk(r0, r1, n, sizes[0], ep.anchor_offset + r0, q, keys,
                      None if inv_q is None else take(inv_q), inv_k, ginv_k, loss_out=row_loss[r0:r1],
                      tau_out=focal_sum,
                      comp_q=comp[0][r0:r1] if comp else None, comp_k=comp[1] if comp else None)
        if widths is not None:
            widths.chunk(ep, chunk, take, dq, dk, radial)
            continue
        # ∂L/∂τ reads H's rows too (u = H K), without the anchors' gradient
        h = engine.chunk(ep, chunk, need_q or need_k or temperature_grad)
        if h is not None:
            dq_c = None
            if need_q:
                dq_c = dq[r0:r1] if not ep.paired else torch.empty_like(q, dtype=dq.dtype)
            _chunk_gradients(h, q, keys, chunk.inv_q, take(norm_q), take(w), dq_c, dk, tangent, acc,
                             ep.anchor_offset + r0, radial)
            if need_q and ep.paired:
                dq[r0:r1], dq[n + r0:n + r1] = dq_c[:r1 - r0], dq_c[r1 - r0:]
        # this chunk's R×M buffer is released before the next chunk allocates its own: the
        # peak is one buffer, not two
        del h

    loss = (row_loss.sum(dtype=torch.float64) / denom).to(acc)
    if need_k and raw_candidates:
        if widths is not None:        # (the noise takes no Matryoshka: one width, all of d)
            norm_k, inv_k = widths.norm_k[:, 0], widths.inv_k_w[0]
        return loss, [dq, (dk, keys, norm_k, inv_k)]
    if widths is not None:
        if need_k:
            widths.finish(keys, dk)
        dk = dk.to(out_dtype) if need_k else None
        dq = dq.to(out_dtype) if need_q else None
    elif need_k:
        col_scale = (denom * h_scale).reciprocal()
        if excess is not None:
            col_scale = col_scale * excess          # one entry per candidate row
        col_scale = col_scale.reshape(-1).to(acc)
        if tangent is not None:
            dk = tangent(dk, keys, inv_k, col_scale, torch.empty(m, d, dtype=out_dtype, device=device))
        else:
            dk = _tangent_(dk.mul_(col_scale[:, None]), keys, norm_k, rows).to(out_dtype)
    grads = [part if want else None for part, want in zip(dk.split(sizes), need[1:])] if need_k \
        else [None] * len(candidates)
    if focal_sum is not None:
        radial = 0.5 * radial + focal_sum * (0.5 * ep.focal_m / (ep.temperature * denom))
    return loss, [dq] + grads + (
        [radial / -ep.temperature] if temperature_grad else [])


class _Widths:
    r"""Matryoshka's ``L = Σ_k w_k·L_k`` in the driver's one pass: ``L_k`` the loss of the
    prefixes ``x[:, :d_k]`` (their own cosines ``s^k``), with one GEMM over d per product
    instead of one per width. The state of one driver call: the bands, the prefix norms, the
    chunk buffers (allocated once) and the candidates' radial sums.

    The widths split d into bands ``(d_{k−1}, d_k]``. Forward: the prefix dot products grow
    band by band, ``D^k = D^{k−1} + Q_band K_bandᵀ``, and each ``k`` turns its cosines
    ``s^k = D^k / (‖q^k‖‖k^k‖)`` (prefix norms) into its row loss and ``A^k = ∂L/∂s^k``
    (the torch engine's epilogue of a width, :func:`~fastcl.tiled.engine.torch_width`). By
    the chain rule through the prefix cosines,

    .. math:: \frac{∂L}{∂q_i}\Big|_{band} = \Big(\sum_{k: d_k ≥ band} Ã^k\Big) K_{band}
              − \sum_{k: d_k ≥ band} \frac{c^k_i}{‖q^k_i‖^2} q_{i,band},\quad
              Ã^k_{ij} = \frac{A^k_{ij}}{‖q^k_i‖‖k^k_j‖},\ c^k_i = \sum_j A^k_{ij} s^k_{ij}

    (and the same for the keys with ``Ãᵀ`` and column sums): the sums ``B = Σ_{k ≥ band}
    Ã^k``, formed from the widest width down, take one GEMM per band for each gradient.
    The radial sums ``c`` replace the single width's tangent projection: each width projects
    onto its own prefix. A chunk holds every width's Ã^k (as ``f^k ⊙ H^k``, its row factor
    apart) besides D and one scratch slice. The masks (:class:`_RowRules`) are the texts',
    computed once per chunk for every width."""

    def __init__(self, ep: Epilogue, anchors, keys, n: int, rows: int, need_q: bool, need_k: bool,
                 anchor_norms: torch.Tensor | None = None):
        acc, device, m = accumulate_dtype(anchors.dtype), anchors.device, keys.shape[0]
        dims, self.weights = ep.matryoshka or ((anchors.shape[1],), (1.0,))
        self.bands = list(zip((0,) + dims[:-1], dims))
        # one width over the whole of d: the tangent projection (a prefix narrower than d
        # projects onto its own prefix, through the radial sums)
        self.whole = dims == (anchors.shape[1],)
        self.need_q, self.need_k, self.acc = need_q, need_k, acc

        # (the anchors' norms of a call's every step, as the noise update gives them: one width)
        norm_q = (_prefix_norms(anchors, self.bands, acc) if anchor_norms is None or not self.whole
                  else anchor_norms[:, None])
        norm_k = _prefix_norms(keys, self.bands, acc)
        self.norm_q, self.norm_k = norm_q.clamp_min(EPS), norm_k.clamp_min(EPS)
        self.inv_q, inv_k = 1.0 / self.norm_q, 1.0 / self.norm_k
        # the radial term of x/max(‖x‖, EPS) exists only where the norm was not clamped
        self.radial_q = (norm_q > EPS).to(acc) * self.inv_q * self.inv_q
        self.radial_k = (norm_k > EPS).to(acc) * inv_k * inv_k
        # each width's factors contiguous (rows' per chunk, below): a strided broadcast
        # operand costs the R×M passes their vectorization
        self.inv_k_w = inv_k.T.contiguous()
        # 16-bit GEMMs (a GPU's) read B = Σ Ã^k cast to 16 bits: H's column factor is then
        # :func:`_column_factor`'s (the widest width's excess, at :meth:`finish`), and B's rows
        # are divided by ρ_i = ‖q_i‖⁻¹·unit, applied to dq's rows after the GEMM and, as q̂
        # and a scalar ``unit``, to dk: kept inside, 1/(‖q‖τN) flushes in fp16.
        self.ginv_k_w, self.gain, self.excess, self.unit = self.inv_k_w, [1.0] * len(dims), None, None
        if keys.dtype != acc:
            self.ginv_k_w, gain, excess = _column_factor(norm_k.T, self.inv_k_w, ep, keys.dtype)
            self.gain, self.excess = gain.unbind(), None if excess is None else excess[-1]
            denom = n * m if ep.formulation == "released" else n
            self.unit = 1.0 / (ep.temperature * denom * self.gain[-1])
        self.col_c = torch.zeros(len(dims), m, dtype=acc, device=device)   # per width
        # The chunk's slices, allocated once and reused by every chunk (the last one takes
        # the first rows): a fresh R×M allocation per chunk and width costs its page faults
        # again.
        sides = 2 if ep.paired else 1
        self.buffers = [torch.empty(sides * min(rows, n), m, dtype=acc, device=device)
                        for _ in range(_slices(ep))]
        self.rows = rows

    def chunk(self, ep: Epilogue, c: Chunk, take, dq, dk, tau_sum=None) -> None:
        """One chunk: its row losses into ``c.loss_out``, its rows of ``dq`` and its share of
        ``dk`` (the keys' radial terms at :meth:`finish`); ``tau_sum`` (0-dim): its radial
        sums ``Σ_k Σ_i c^k_i`` added (∂L/∂τ's)."""
        r, n, r0, r1, acc, bands = c.r1 - c.r0, c.n, c.r0, c.r1, self.acc, self.bands
        q, keys, first, buffers = c.q, c.keys, c.first_pos, self.buffers
        want = self.need_q or self.need_k or tau_sum is not None
        rules = _RowRules(ep, c, acc)
        sides = 2 if ep.paired else 1
        dots, pool = buffers[0][:sides * r], [b[:sides * r] for b in buffers[1:len(bands) + 2]]
        cos = buffers[-1][:sides * r] if len(buffers) > 2 + len(bands) else None
        # per width: Ã^k = diag(f^k) H^k − δ·g^k, and the radial sums
        row_f, row_c = torch.empty(2, len(bands), sides * r, dtype=acc, device=q.device)
        pos_g = torch.empty(len(bands), r, dtype=acc, device=q.device)
        inv_q_c = take(self.inv_q).T.contiguous()          # (K, sides·r)
        # one width takes the tangent projection, not the radial sums (but ∂L/∂τ reads them)
        one = self.whole
        radial = not one or tau_sum is not None
        h = []
        for k, (lo, hi) in enumerate(bands):
            if k == 0:
                _mm_into(dots, q[:, lo:hi], keys[:, lo:hi].T)
            else:
                _accumulate_mm(dots, q[:, lo:hi], keys[:, lo:hi].T)
            slices = pool.pop(), pool.pop()
            kept, free = torch_width(ep, self.weights[k], c, dots, *slices, cos, inv_q_c[k],
                                     self.inv_k_w[k], self.ginv_k_w[k], self.gain[k], rules,
                                     row_f[k], pos_g[k], row_c[k] if radial else None,
                                     None if one else self.col_c[k], want)
            if kept is None:                       # no gradient: both slices free again
                pool.extend(slices)
                continue
            h.append(kept)
            pool.append(free)
        if not want:
            return
        rho = None
        if self.unit is not None:                  # 16-bit GEMMs: B/ρ (row_c is formed)
            rho = inv_q_c[-1] * self.unit
            row_f /= rho
            pos_g /= rho[:r]             # (unused without positives)
            q_hat = _unit(q, inv_q_c[-1]).to(q.dtype) if self.need_k else None
        # the widest width down: B = Σ_{k ≥ band} Ã^k, one GEMM per band and gradient
        total_b = None
        # (dq's rows of each side, and the chunk's rows that hold them)
        rows = [(slice(r0, r1), slice(0, r))] + ([(slice(n + r0, n + r1), slice(r, 2 * r))]
                                                  if ep.paired else [])
        for k in reversed(range(len(bands))):
            lo, hi = bands[k]
            if total_b is None:
                total_b = h[k].mul_(row_f[k, :, None])
            else:
                total_b.addcmul_(h[k], row_f[k, :, None])
            if ep.positives:
                total_b[:r].diagonal(first).sub_(pos_g[k])
            b = total_b.to(q.dtype)
            if self.need_q:
                for out, mine in rows:
                    if rho is None:
                        _accumulate_mm(dq[out, lo:hi], b[mine], keys[:, lo:hi])
                    else:
                        dq[out, lo:hi].addcmul_(_mm(b[mine], keys[:, lo:hi], acc), rho[mine, None])
            if self.need_k:
                _accumulate_mm(dk[:, lo:hi], b.T, q[:, lo:hi] if rho is None else q_hat[:, lo:hi])
        if tau_sum is not None:
            tau_sum += row_c.sum()
        if self.need_q and one:
            # one width: the tangent projection of u = B K itself (exact where d = 1)
            norm = take(self.norm_q)[:, 0]
            for out, mine in rows:
                _tangent_(dq[out], q[mine], norm[mine], r)
        elif self.need_q:
            coef = row_c.T * take(self.radial_q)                       # (sides·r, K)
            for k, (lo, hi) in enumerate(bands):
                # band k takes the radial terms of every width that covers it
                radial = q[:, lo:hi].to(acc) * coef[:, k:].sum(dim=1, keepdim=True)
                for out, mine in rows:
                    dq[out, lo:hi] -= radial[mine]

    def finish(self, keys, dk) -> None:
        """The keys' radial terms, every chunk's column sums together, into ``dk`` (after the
        16-bit GEMMs' ``unit`` and fp16's excess); one width over all of d: the tangent
        projection."""
        if self.unit is not None:
            dk.mul_((self.unit * (1.0 if self.excess is None else self.excess)).reshape(-1, 1))
        if self.whole:
            _tangent_(dk, keys, self.norm_k[:, 0], self.rows)
            return
        coef = self.col_c.T * self.radial_k
        for k, (lo, hi) in enumerate(self.bands):
            dk[:, lo:hi].addcmul_(keys[:, lo:hi].to(self.acc), coef[:, k:].sum(dim=1, keepdim=True),
                                  value=-1.0)


def _even_chunks(n: int, rows: int, multiple: int = 16) -> int:
    """Rows per chunk for as many chunks of ``rows`` as ``n`` needs, but of even size (a
    multiple of ``multiple``, never above ``rows``): no short last chunk of slow GEMMs."""
    chunks = -(-n // rows)
    even = -(-(-(-n // chunks)) // multiple) * multiple
    return min(rows, even)


def _chunk_rows(x: torch.Tensor, r0: int, r1: int, n: int, paired: bool) -> torch.Tensor:
    """A chunk's rows of ``x``: [r0, r1), and with a positive side also [n + r0, n + r1)."""
    return x[r0:r1] if not paired else torch.cat([x[r0:r1], x[n + r0:n + r1]])


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
    ``radial`` (0-dim): ``Σ_i w_i q_i·u_i`` with ``u = H K`` is added to it
    (:func:`contrastive_forward`'s ∂L/∂τ); in the bounded form
    ``u_i = (E K)_i/Z_i − c_i k_{first_pos + i}``."""
    bounded, r = None, q.shape[0]
    if isinstance(h, tuple):       # only from an engine with a fused chain rule (Triton's)
        h, inv_z, pos_coef = h
        bounded = (inv_z, pos_coef, keys, first_pos, dk)
    q_hat = None
    u = _mm(h, keys, acc) if dq is not None or radial is not None else None
    if radial is not None:
        dots = _row_dots(q, u)
        if bounded is not None:
            dots *= inv_z
            if pos_coef is not None:
                dots -= _row_dots(q, keys[first_pos:first_pos + r].to(acc)) * pos_coef
        radial += dots @ w
    if dq is not None and tangent is not None:
        # the bounded form's fused chain rule also applies 1/Z and the positive's term, and
        # writes q̂/Z and the positive's term of dk
        q_hat = torch.empty_like(q) if dk is not None else None
        tangent(u, q, inv_q, w, dq, x_hat=q_hat, bounded=bounded)
    elif dq is not None:
        dq.copy_(_tangent_(u.mul_(w[:, None]), q, norm_q, r))
    if dk is None:
        return
    if q_hat is None:
        q_hat = _unit(q, inv_q)
        if bounded is not None:
            if pos_coef is not None:
                dk[first_pos:first_pos + r].addcmul_(q_hat, pos_coef[:, None], value=-1.0)
            q_hat.mul_(inv_z[:, None])
        q_hat = q_hat.to(q.dtype)
    _accumulate_mm(dk, h.T, q_hat)


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
