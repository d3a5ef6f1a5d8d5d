"""The tiled path: every objective without ever holding the N×M similarity matrix.

Anchor rows are processed in chunks of R rows. For a chunk we form the R×M slice of
cosines ``s_ij = (q_i·k_j)/(‖q_i‖‖k_j‖)`` from the raw inputs and their norms, turn it
into logits (temperature, focal modulation, hard-negative log-weight, DCLR mask),
reduce it to the per-row log-sum-exp and positive logit, and — because the loss is
the last op of the graph — turn the same slice into the gradient at once:

    ∂L/∂l_ij = (p_ij − 1[j = i]) / N,      p = softmax over the row's kept columns
    ∂L/∂s_ij = ∂L/∂l_ij · g'(s_ij)          (1/τ; focal: 2s/τ on the positive, (2s+m)/τ else)
    G'_ij    = ∂L/∂s_ij / (‖q_i‖‖k_j‖)
    u_q = G' K,   u_k += G'ᵀ Q_chunk        (two GEMMs on the raw inputs)
    ∂L/∂x = u − x̂ (x̂·u)                     (the chain through the L2 normalization)

Backward only scales the stored gradients by the incoming scalar. Peak extra memory
is the R×M chunk buffers (one fp32 slice; two for focal; an R×N slice of the
complementary model's cosines for DCLR) plus the N×d and M×d gradients; R comes
from a memory budget. The driver is shared by the Triton backend, which swaps the
PyTorch epilogue (:func:`torch_chunk`) for fused kernels.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import common, layout
from .common import EPS, accumulate_dtype
from .layout import PLAIN, column_blocks, column_groups, hardness_columns, visible_blocks
from .spec import Epilogue, LossSpec, bits

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


@functools.lru_cache(maxsize=None)
def _mixed_addmm_supported(device_type: str) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=float32, out=acc)`` accumulates 16-bit
    products into a float32 buffer in place on this device type (cuBLAS with beta = 1)."""
    try:
        x = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, x, x, out_dtype=torch.float32, out=acc)
        return bool((acc == 3).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.lru_cache(maxsize=None)
def _mixed_mm_supported(device_type: str) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` takes 16-bit inputs on this device type."""
    try:
        x = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the chunk GEMMs read: 16-bit inputs stay 16-bit on a GPU (tensor cores);
    on a CPU they are widened once (16-bit GEMMs are no faster there)."""
    return dtype if device.type == "cuda" else accumulate_dtype(dtype)


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` written in ``acc``. 16-bit GEMMs write float32 directly where torch can; a
    CPU widens the operands (the same products and sums, and no slower there); elsewhere
    the product is rounded to 16 bits first (~3 significant digits: fine for the gradient
    GEMMs, too coarse for cosines at τ = 0.05 — the Triton kernels form those)."""
    if a.dtype == acc:
        return a @ b
    if _mixed_mm_supported(a.device.type):
        return torch.mm(a, b, out_dtype=acc)
    if a.device.type == "cpu":
        return a.to(acc) @ b.to(acc)
    return (a @ b).to(acc)


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` the accumulator: in place (one GEMM with beta = 1) where
    torch can; else through a product the size of ``out``."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif _mixed_addmm_supported(a.device.type):
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


def _slices(ep: Epilogue) -> int:
    """R×M slices torch_chunk holds: focal keeps the cosines beside the logits, the released
    BCE one more slice."""
    return 2 if (ep.focal_m is not None or ep.formulation == "released") else 1


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


class TiledContrastive(torch.autograd.Function):
    """``loss = TiledContrastive.apply(epilogue, engine, anchors, positives, *others)``.

    The gradient is produced in the forward pass (the loss is the last op of the graph);
    backward only scales it by the incoming gradient (:func:`_scaled`, which the custom op's
    backward shares).
    """

    @staticmethod
    def forward(ctx, ep: Epilogue, engine, anchors: torch.Tensor, *candidates: torch.Tensor):
        loss, grads = contrastive_forward(ep, anchors, candidates, need=ctx.needs_input_grad[2:],
                                          engine=engine)
        ctx.save_for_backward(*[g if g is not None else torch.empty(0) for g in grads])
        ctx.need = [g is not None for g in grads]
        ctx.dtypes = [anchors.dtype] + [c.dtype for c in candidates]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return (None, None, *_scaled(ctx, grad_loss))


def _scaled(ctx, grad_loss) -> list:
    """The backward of both front-ends: each stored gradient (``ctx.saved_tensors``, where
    ``ctx.need`` says one was wanted) times the incoming scalar, in its input's dtype."""
    if torch.is_grad_enabled():
        # create_graph=True (a gradient penalty, a Hessian-vector product): the stored
        # gradient has no graph, so a second derivative would silently miss this loss
        raise RuntimeError(
            "fastcl's fused backends (tiled, triton) compute the gradient in the forward "
            "pass and cannot be differentiated twice (backward with create_graph=True); "
            "use backend='reference' for higher-order gradients")
    # Always scaled: testing for a grad of exactly 1 would be a host sync, and the
    # multiply is one N×d elementwise pass, small next to the chunk GEMMs.
    return [None if not want else (g * grad_loss.to(g.dtype)).to(dtype)
            for g, want, dtype in zip(ctx.saved_tensors, ctx.need, ctx.dtypes)]


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
    comp_q: torch.Tensor | None = None   # (R×d_c) complementary anchors, normalized, matmul dtype
    comp_k: torch.Tensor | None = None   # (N×d_c) complementary positives, likewise


def torch_chunk(ep: Epilogue, c: Chunk, want_grad: bool):
    """The epilogue in PyTorch ops, in place on one R×M buffer (2R×M with a positive side).

    Writes each row's loss ℓ_i (before the mean) into ``c.loss_out`` and returns H, where
    ``H_ij = ∂ℓ_i/∂s_ij · ginv_k_j`` (matmul dtype; ``None`` if not ``want_grad``). The driver
    applies the row factors ``inv_q_i / (N·c)`` outside H: kept inside, they put the entries
    near 1e-9, where fp16 flushes them to zero.
    """
    n_pos, m = c.n_pos, c.keys.shape[0]
    r = c.r1 - c.r0
    acc = c.inv_q.dtype
    inv_t = 1.0 / ep.temperature
    released = ep.formulation == "released"
    ar = torch.arange(r, device=c.q.device)
    diag = ar + c.first_pos                            # column of each row's positive

    logits = _mm(c.q, c.keys.T, acc)                   # R×M raw dots → cosines → logits
    logits.mul_(c.inv_q[:, None]).mul_(c.inv_k[None, :])
    rules = _RowRules(ep, c, acc)
    # the cosines, kept where the slope (focal) or MNRL's β·sg(s) reads them
    cos = logits.clone() if ep.focal_m is not None else (
        logits[:r].clone() if rules.hard is not None else None)
    if ep.focal_m is not None:
        _focal_logits(logits, cos, ep, r, c.first_pos, rules.mirror)
    else:
        logits.mul_(inv_t)
    rules.apply(logits, n_pos, cos, c.first_pos)
    if ep.focal_m is None:
        del cos
    drop, rules = rules.comp_drop, None                # the layout's masks are released here
    # the released code gives the other columns (DCLR's noise) a complementary cosine of 0,
    # so its test drops all of them when 0/τ > 20φ, i.e. φ < 0
    drop_rest = released and ep.complementary is not None and 0.0 > 20 * ep.phi
    if drop_rest:
        logits[:, n_pos:] = 0.0
    # The positive apart: the softmax below is over each row's other columns (and, joint,
    # the positive side's), its log-sum-exp ``lse_o``; the row's loss is then
    # softplus(lse_o − l_ii) = log(1 + Σ_{j≠i} e^(l_ij − l_ii)) and the others' share of the
    # full softmax q = σ(lse_o − l_ii) = 1 − p_ii: neither cancels where the positive
    # dominates (lse − l_ii and p_ii − 1 keep no digit of a loss below eps·|l_ii|).
    if ep.positives:
        pos_logit = logits[ar, diag].clone()
        logits[ar, diag] = float("-inf")
    joint = ep.paired and ep.layout.joint
    view = logits.view(2, r, m) if joint else logits.view(1, -1, m)
    row_max = view.amax(dim=(0, 2), keepdim=True)
    row_max.masked_fill_(torch.isneginf(row_max), 0.0)      # a row with no other column
    probs = view.sub_(row_max).exp_()
    row_sum = probs.sum(dim=(0, 2), keepdim=True)
    probs.div_(row_sum.clamp_min(torch.finfo(acc).tiny))
    lse = (row_max + row_sum.log()).reshape(-1)
    probs = logits                                     # the buffer, as R'×M
    if ep.positives:
        gap = lse[:r] - pos_logit
        share, others = torch.nn.functional.softplus(gap), torch.sigmoid(gap)
        probs[:r].mul_(others[:, None])                # the full softmax, off the positive
        if joint:
            probs[r:].mul_(others[:, None])
    else:
        share = lse
    if ep.paired and not joint:
        # each side its own softmax: the mean of the two log-sum-exps, each side's softmax
        # halved in the gradient; the positive side has no positive of its own
        share = 0.5 * (share + lse[r:] - pos_logit)
        probs.mul_(0.5)

    if released:
        # BCE on the softmax, mean over all N·M entries; log p and log(1−p) clamped at −100
        # as torch's binary_cross_entropy does (−log p_ii = share)
        log_not = torch.neg(probs).log1p_().clamp_min_(-100.0)
        log_not[ar, diag] = 0.0
        row_loss = -log_not.sum(dim=1) + share.clamp_max(100.0)
        del log_not
    else:
        row_loss = share
    c.loss_out.copy_(row_loss)
    if not want_grad:
        return None

    grad = probs                                       # becomes ∂L/∂s in place
    if released:
        # v_ij = p·∂BCE/∂p = p(p − y)/max(p(1 − p), 1e-12), the clamp of torch's BCE backward:
        # p/(1−p) off the positive, −1 on it (−p_ii·q/max(p_ii·q, 1e-12), q = 1 − p_ii);
        # ∂L/∂a = (v − p·Σ_j v)/(N·M), a = α·s/τ, on the positive v_ii·q − p_ii·Σ_{j≠i} v_j
        p_pos = torch.sigmoid(-gap)
        v = torch.rsub(probs, 1.0).mul_(probs).clamp_min_(1e-12).reciprocal_()  # one extra slice
        v.mul_(probs).mul_(probs)
        v[ar, diag] = 0.0
        v_others = v.sum(dim=1)
        v_pos = -(p_pos * others) / (p_pos * others).clamp_min(1e-12)
        grad.mul_(-(v_others + v_pos)[:, None]).add_(v)
        grad[ar, diag] = v_pos * others - p_pos * v_others
        del v
        if drop is not None:
            grad[:, :n_pos].masked_fill_(drop, 0.0)
        if drop_rest:
            grad[:, n_pos:] = 0.0
    else:
        if ep.positives:
            # p_ii − 1 = −q; per direction, 0.5·p_ii − 1 = −0.5·q − 0.5
            grad[ar, diag] = -others if not (ep.paired and not joint) else -0.5 * others - 0.5
        if ep.focal_m is not None:
            grad.mul_(_focal_slope(cos, ep, r, c.first_pos, _RowRules.mirror_of(ep, c)))
    grad.mul_(c.ginv_k[None, :]).mul_(inv_t)
    return grad.to(c.q.dtype)


def _complementary_drop(ep: Epilogue, comp_q, comp_k, first_pos: int, acc: torch.dtype):
    """DCLR's mask on a chunk's anchor rows (R×N_b bool): the complementary model's cosine
    ≥ φ (the released code's ``cos/τ > 20φ``), never the positive (column first_pos + i)."""
    c_cos = _mm(comp_q, comp_k.T, acc)
    released = ep.formulation == "released"
    drop = (c_cos * (1.0 / ep.temperature) > 20 * ep.phi) if released else (c_cos >= ep.phi)
    drop.diagonal(first_pos).fill_(False)
    return drop


def _mirror_column(ep: Epilogue, c: Chunk) -> int:
    """The column of the positive side's first row's own anchor in the anchors block: row
    R + i's is this + i."""
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


def _acc_and_cast_bytes(dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of an accumulate-dtype entry, and of its cast to the GEMM dtype (0 if none)."""
    acc = accumulate_dtype(dtype)
    return torch.finfo(acc).bits // 8, 0 if dtype == acc else torch.finfo(dtype).bits // 8


def _torch_row_bytes(ep: Epilogue, dtype: torch.dtype, m: int, n_pos: int) -> int:
    """torch_chunk's buffers per anchor row: its accumulate-dtype slices, the cast to the
    GEMM dtype, the mask's R×N slices."""
    acc, cast = _acc_and_cast_bytes(dtype)
    mask = n_pos * (acc + 1) if ep.complementary is not None else 0
    sides = 2 if ep.paired else 1
    # the layout's masks: a few bool slices per side, the guide's cosines, the hardness term
    # (MNRL's hardness: its factor and the cosines it reads)
    rules = m * (4 + acc * (ep.guide is not None) + 2 * acc * (ep.hardness is not None)) if ep.sided else 0
    return sides * (m * (acc * _slices(ep) + cast) + rules) + mask


@dataclass(frozen=True)
class Engine:
    """A chunk engine of the driver: ``chunk(ep, c, want_grad)`` writes the row losses and
    returns H (:func:`torch_chunk`'s contract); ``row_bytes(ep, dtype, M, N_b)`` its buffers
    per anchor row; chunks are rounded to ``row_multiple`` rows; ``tangent`` and
    ``noise_step`` its fused chain rule and DCLR noise step (None: the driver's PyTorch ones,
    :func:`_tangent_` and :func:`_noise_step`)."""

    name: str
    chunk: Callable
    row_bytes: Callable
    row_multiple: int = 16
    tangent: Callable | None = None
    noise_step: Callable | None = None


TORCH = Engine("torch", torch_chunk, _torch_row_bytes)
_TRITON: list = []


def engine_for(backend: str) -> Engine:
    """The engine of a resolved backend ("tiled": :data:`TORCH`; "triton": the kernels')."""
    if backend != "triton":
        return TORCH
    if not _TRITON:
        from .kernels import contrastive as k
        _TRITON.append(Engine("triton", k.triton_chunk, k._row_bytes, k.ROW_MULTIPLE,
                              k.triton_tangent, k.triton_noise_step))
    return _TRITON[0]


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
                        anchor_norms: torch.Tensor | None = None, raw_candidates: bool = False):
    """The chunked driver shared by every engine. Returns
    ``(loss, [∂L/∂anchors, ∂L/∂candidates...])`` with ``None`` where ``need`` says no
    gradient is wanted. ``gemm_dtype`` overrides the dtype the chunk GEMMs read
    (:func:`matmul_dtype`): a CPU run can then reproduce a GPU's 16-bit buffers.
    ``anchor_norms``: the anchors' row norms (:func:`_norms`), where a caller that passes the
    same anchors again (DCLR's noise steps) has them. ``raw_candidates``: in place of the
    candidates' gradients, ``(u, keys, ‖k‖, 1/‖k‖)`` with ``u`` (M×d, accumulate dtype) the
    sums ``Σ_i H_ij q̂_i`` before the chain rule through k̂: each row is ∂L/∂k_j's before its
    projection onto k_j's tangent space, times a positive factor (what DCLR's noise step,
    which takes each row's direction alone, reads)."""
    if ep.matryoshka is not None:
        return matryoshka_forward(ep, anchors, candidates, need, gemm_dtype)
    n_rows, d = anchors.shape
    n = n_rows // 2 if ep.paired else n_rows      # loss rows: two sides each when paired
    in_dtype, device = anchors.dtype, anchors.device
    acc = accumulate_dtype(in_dtype)
    dtype = gemm_dtype or matmul_dtype(in_dtype, device)
    sizes = [c.shape[0] for c in candidates]
    m = sum(sizes)
    need_q, need_k = bool(need[0]), any(need[1:])
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
                             ep.anchor_offset + r0)
            if need_q and ep.paired:
                dq[r0:r1], dq[n + r0:n + r1] = dq_c[:r1 - r0], dq_c[r1 - r0:]
        # this chunk's R×M buffer is released before the next chunk allocates its own: the
        # peak is one buffer, not two
        del h

    loss = (row_loss.sum(dtype=torch.float64) / denom).to(acc)
    grads = [dq]
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
    return loss, grads


def matryoshka_forward(ep: Epilogue, anchors, candidates, need, gemm_dtype=None):
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
    hardness term); the masks are the texts', computed once for every width."""
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
    return loss, grads


class _RowRules:
    """What a chunk's rows drop and weigh, the same at every Matryoshka width: DCLR's mask
    (R×N_b, the anchor side), :func:`_layout_drops`' masks (R'×M), MNRL's hardness columns
    (R×M, as a factor), and the column of the positive side's own anchor (focal gives it
    s²/τ: :func:`_focal_logits`)."""

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
        self.mirror = self.mirror_of(ep, c)

    @staticmethod
    def mirror_of(ep: Epilogue, c: Chunk) -> int | None:
        """The column of side 1's diagonal (each positive-side row's own anchor), or None."""
        return _mirror_column(ep, c) if ep.paired and ep.layout.positive_to_anchors else None

    def apply(self, logits, n_pos: int, cos, first: int) -> None:
        """In place on the logits: the hard negative's log-weight ``w`` at column
        ``N_b + first + i``, MNRL's ``β·sg(s)`` on the hardness columns (``cos``: the rows'
        cosines), then the drops (−inf; DCLR's released code: logit 0)."""
        r, ep = self.r, self.ep
        if ep.hard_negative_weight:
            logits[:r].diagonal(n_pos + first).add_(ep.hard_negative_weight)
        if self.hard is not None:
            logits[:r].addcmul_(cos[:r], self.hard, value=ep.hardness[1])
        if self.comp_drop is not None:
            fill = 0.0 if ep.formulation == "released" else float("-inf")
            logits[:r, :n_pos].masked_fill_(self.comp_drop, fill)
        if self.drop is not None:
            logits.masked_fill_(self.drop, float("-inf"))


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
    p_pos = p[:r].diagonal(first).clone()
    p[:r].diagonal(first).zero_()
    q = p[:r].sum(dim=1)
    scale = 1.0                       # each row's softmax in the loss's: p_loss = scale·p
    if exact:
        near = -p_pos.log()
    else:
        lse = top - p.amax(dim=1).log_()
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


def _chunk_gradients(h, q, keys, inv_q, norm_q, w, dq, dk, tangent, acc, first_pos) -> None:
    """One chunk's share of the gradients from its ``H`` (R×M): ``dq = tangent(w ⊙ (H K))``
    for its rows, written into ``dq``, and ``dk += Hᵀ q̂``, with ``G' = w ⊙ H``. Row factors
    ``w_i = inv_q_i / (N·c)``: Σ_i H_ij w_i q_i = Σ_i H_ij q̂_i / (N·c), so the second GEMM takes
    unit rows q̂ (written by the same launch as dq where the engine has a fused chain rule)
    and the scalar 1/(N·c) is applied to dk once, at the end.

    ``h`` may be an engine's bounded form ``(E, 1/Z, c)``, ``H = diag(1/Z) E − δ·c`` (the
    positive of row i at column ``first_pos + i``, c None without positives): the GEMMs then
    take E itself, with 1/Z on the rows of E K and of q̂, and the positive's term apart."""
    if isinstance(h, tuple):
        _bounded_gradients(*h, q, keys, inv_q, w, dq, dk, tangent, acc, first_pos)
        return
    q_hat = None
    if dq is not None and tangent is not None:
        q_hat = torch.empty_like(q) if dk is not None else None
        tangent(_mm(h, keys, acc), q, inv_q, w, dq, x_hat=q_hat)
    elif dq is not None:
        dq.copy_(_tangent_(_mm(h, keys, acc).mul_(w[:, None]), q, norm_q, q.shape[0]))
    if dk is not None:
        if q_hat is None:
            q_hat = _unit(q, inv_q).to(q.dtype)
        _accumulate_mm(dk, h.T, q_hat)


def _bounded_gradients(e, inv_z, pos_coef, q, keys, inv_q, w, dq, dk, tangent, acc,
                       first_pos) -> None:
    """:func:`_chunk_gradients` for ``H = diag(1/Z) E − δ·c``: dq through the engine's fused
    chain rule (which also applies 1/Z and the positive's term, writes q̂/Z and the
    positive's term of dk), or, without dq, q̂/Z and that term here."""
    r = q.shape[0]
    q_hat = None
    if dq is not None:
        q_hat = torch.empty_like(q) if dk is not None else None
        tangent(_mm(e, keys, acc), q, inv_q, w, dq, x_hat=q_hat,
                bounded=(inv_z, pos_coef, keys, first_pos, dk))
    elif dk is not None:
        unit = _unit(q, inv_q)
        if pos_coef is not None:
            dk[first_pos:first_pos + r].addcmul_(unit, pos_coef[:, None], value=-1.0)
        q_hat = unit.mul_(inv_z[:, None]).to(q.dtype)
    if dk is not None:
        _accumulate_mm(dk, e.T, q_hat)


def _fp16_gain(ep: Epilogue, dtype: torch.dtype) -> float:
    """A power of two for H in fp16 (5 exponent bits): the largest that keeps every entry
    below 2¹⁴ — |∂ℓ/∂s| ≤ (2 + |m|)/τ — so that small softmax entries stay normal numbers.
    bf16 and fp32 have the range already; the released BCE's v = p/(1−p) has no bound."""
    if dtype != torch.float16 or ep.formulation == "released":
        return 1.0
    slope = (2.0 + abs(ep.focal_m)) / ep.temperature if ep.focal_m is not None else 1.0 / ep.temperature
    return 2.0 ** max(0, math.floor(math.log2(2**14 / slope)))


def contrastive_loss(ep: Epilogue, anchors, *candidates, engine: Engine = TORCH):
    """The driver as a differentiable loss. Autocast is off inside (for the inputs' device
    type): the chunk GEMMs read the dtype :func:`matmul_dtype` chooses, and autocast would
    round the cosines, hence the logits and log-sum-exp, to 16 bits. Under
    ``torch.compile`` the call is the custom op ``fastcl::tiled_contrastive`` (one node of
    the graph, shapes from its fake kernel), where it can be one."""
    with common.autocast_off(anchors.device):
        if torch.compiler.is_compiling():
            return _as_op(ep, engine, anchors, candidates)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (anchors, *candidates)):
            return TiledContrastive.apply(ep, engine, anchors, *candidates)
        # No graph wanted (evaluation, no_grad): the loss alone, no gradient work at all.
        return contrastive_forward(ep, anchors, candidates, need=(False,) * (1 + len(candidates)),
                                   engine=engine)[0]


# --------------------------------------------------------------------------- custom op
# For torch.compile: the driver as one opaque op (its chunk loop and host-side choices never
# traced), its gradient computed in the forward as TiledContrastive does, backward a scale.
# The epilogue travels as schema types (Epilogue.op_args, Epilogue.from_op_args).

def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the gradients the driver returns (float16 ones stay in float32)."""
    return accumulate_dtype(dtype) if dtype == torch.float16 else dtype


# The schema written out, as torch >= 2.6 infers it from the annotations (earlier releases
# infer none from list[...] and float | None). The integers are SymInt: under dynamic shapes
# the block sizes stay symbolic, so one graph serves every batch size.
_OP_SCHEMA = ("(Tensor anchors, Tensor[] candidates, Tensor[] complementary, float temperature, "
              "float? focal_m, float hard_negative_weight, float phi, str formulation, "
              "SymInt anchor_offset, SymInt? chunk_size, str matryoshka, SymInt layout, "
              "SymInt[] blocks, str hardness, Tensor[] guide, Tensor[] ids, str engine, "
              "SymInt need, bool scan) -> (Tensor, Tensor, Tensor[])")


@torch.library.custom_op("fastcl::tiled_contrastive", mutates_args=(), schema=_OP_SCHEMA)
def tiled_contrastive_op(anchors: torch.Tensor, candidates: list[torch.Tensor],
                         complementary: list[torch.Tensor], temperature: float,
                         focal_m: float | None, hard_negative_weight: float, phi: float,
                         formulation: str, anchor_offset: int, chunk_size: int | None,
                         matryoshka: str, layout: int, blocks: list[int], hardness: str,
                         guide: list[torch.Tensor], ids: list[torch.Tensor], engine: str,
                         need: int, scan: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``(loss, ∂L/∂anchors, [∂L/∂candidates…])`` of :func:`contrastive_forward` (empty
    tensors where ``need``, a bit per input, says no); the epilogue's arguments as
    :meth:`~fastcl.spec.Epilogue.op_args` writes them. ``scan``: test the inputs for
    NaN/Inf here (the traced caller could not read them)."""
    need = bits(need, 1 + len(candidates))
    if scan:                                # one host read for every input
        inputs = [("anchors", anchors), *((f"candidates[{i}]", c) for i, c in enumerate(candidates))]
        finite = torch.stack([torch.isfinite(x).all() for _, x in inputs]).tolist()
        for (name, _), ok in zip(inputs, finite):
            if not ok:
                raise ValueError(f"fastcl.tiled_contrastive: {name} contains NaN or Inf values")
    ep = Epilogue.from_op_args(complementary, temperature, focal_m, hard_negative_weight, phi,
                               formulation, anchor_offset, chunk_size, matryoshka, layout,
                               blocks, hardness, guide, ids)
    loss, grads = contrastive_forward(ep, anchors, tuple(candidates), need,
                                      engine=engine_for("triton" if engine == "triton" else "tiled"))
    empty = lambda x: x.new_empty(0, dtype=_grad_dtype(x.dtype))  # noqa: E731
    # the candidates' gradients are views of one M×d tensor; an op's outputs may not alias
    dks = [g if g is None or i == 0 else g.clone() for i, g in enumerate(grads[1:])]
    return (loss, grads[0] if grads[0] is not None else empty(anchors),
            [g if g is not None else empty(c) for g, c in zip(dks, candidates)])


@tiled_contrastive_op.register_fake
def _(anchors, candidates, *args):
    need = bits(args[-2], 1 + len(candidates))

    def grad(x, want):
        return x.new_empty(x.shape if want else (0,), dtype=_grad_dtype(x.dtype))
    return (anchors.new_empty((), dtype=accumulate_dtype(anchors.dtype)), grad(anchors, need[0]),
            [grad(c, want) for c, want in zip(candidates, need[1:])])


def _op_setup(ctx, inputs, output):
    _, dq, dks = output
    ctx.save_for_backward(dq, *dks)
    ctx.need = bits(inputs[-2], 1 + len(inputs[1]))
    ctx.dtypes = [inputs[0].dtype] + [c.dtype for c in inputs[1]]
    # the structure of the inputs, which backward's result repeats: a tensor list's length,
    # or None (the blocks, a list of sizes, are one leaf)
    ctx.lists = [len(x) if isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in x)
                 else None for x in inputs]


def _op_backward(ctx, grad_loss, grad_dq, grad_dks):
    scaled = _scaled(ctx, grad_loss)
    # one entry per input, a list for a list: the anchors' and the candidates' gradients,
    # nothing for the rest (the complementary pair, the guide and the ids: lists of None)
    return tuple(scaled[0] if i == 0 else scaled[1:] if i == 1 else None if n is None else [None] * n
                 for i, n in enumerate(ctx.lists))


tiled_contrastive_op.register_autograd(_op_backward, setup_context=_op_setup)


def _as_op(ep: Epilogue, engine: Engine, anchors, candidates):
    """:func:`contrastive_loss` through ``fastcl::tiled_contrastive``."""
    from . import _validation
    want = torch.is_grad_enabled()
    need = sum(1 << i for i, t in enumerate((anchors, *candidates)) if want and t.requires_grad)
    loss, _, _ = tiled_contrastive_op(anchors, list(candidates), *ep.op_args(), engine.name, need,
                                      _validation._CHECK_FINITE)
    return loss


# --------------------------------------------------------------------------- a spec's loss

def spec_loss(spec: LossSpec, anchors, positives, negatives=None):
    """The fused paths' loss of ``spec`` (:func:`fastcl.spec.build_spec`) on checked
    embeddings: the candidate blocks (DCLR's noise drawn and updated here), then the driver
    on the spec's engine. Matryoshka is one pass over every width where the engine takes
    them (the torch engine), else a call per width (the Triton kernels take one width)."""
    engine = engine_for(spec.backend)
    cands = None if spec.rules is None else spec.rules.anchor_candidates
    if spec.matryoshka is not None and engine is not TORCH:
        cut = lambda x, d: None if x is None else x[:, :d]  # noqa: E731
        return sum(w * _terms(spec, engine, *(cut(x, d) for x in (anchors, positives, negatives, cands)))
                   for d, w in zip(*spec.matryoshka))
    return _terms(spec, engine, anchors, positives, negatives, cands, spec.matryoshka)


def _terms(spec: LossSpec, engine: Engine, anchors, positives, negatives, cands, widths=None):
    logits, mask, offset = spec.logits, spec.mask, spec.anchor_offset
    blocks = [positives] + ([] if negatives is None else [negatives])
    if spec.noise is not None:
        z = dclr_noise(spec.noise, anchors, positives, formulation=spec.formulation,
                       anchor_offset=offset, engine=engine, chunk_size=spec.chunk_size)
        # Z is not rescaled before its update (a step of lr is not scale-free); as loss
        # candidates its rows only enter through cosines
        blocks.append(common.shrink_huge_rows(z).to(anchors.dtype))
    fields = dict(temperature=logits.temperature, focal_m=logits.focal_m,
                  hard_negative_weight=logits.hard_negative_weight,
                  phi=None if mask is None else mask.phi,
                  complementary=None if mask is None else mask.complementary,
                  formulation=spec.formulation, chunk_size=spec.chunk_size, anchor_offset=offset,
                  matryoshka=widths)
    if spec.two_directions:
        # ½(L→ + L←): the positives against the anchor candidates, focal and (symmetric) the
        # transposed mask there; negatives, w and Z belong to the forward direction only
        n, n_pos = anchors.shape[0], positives.shape[0]
        reverse = Epilogue(logits.temperature, focal_m=logits.focal_m,
                           phi=mask.phi if mask is not None and mask.reverse else None,
                           complementary=(mask.complementary[1], mask.complementary[0])
                           if mask is not None and mask.reverse else None,
                           chunk_size=spec.chunk_size, matryoshka=widths,
                           anchor_offset=offset if cands.shape[0] == n_pos else 0)
        forward = contrastive_loss(Epilogue(**fields), anchors, *blocks, engine=engine)
        return 0.5 * (forward + contrastive_loss(reverse, positives[offset:offset + n], cands,
                                                 engine=engine))
    if spec.ruled:
        rows, blocks, ep = _ruled_inputs(spec, fields, anchors, positives, negatives, blocks, cands,
                                         matmul_dtype(anchors.dtype, anchors.device)
                                         if engine is not TORCH else None)
        return contrastive_loss(ep, rows, *blocks, engine=engine)
    return contrastive_loss(Epilogue(**fields), anchors, *blocks, engine=engine)


def _ruled_inputs(spec: LossSpec, fields, anchors, positives, negatives, blocks, cands,
                  guide_dtype=None):
    """The driver's inputs for a spec with :mod:`fastcl.layout`'s rules: the rows
    (``[anchors; own positives]`` with a positive side), the candidate blocks with the
    anchors block last, and the epilogue of ``fields`` with the column blocks, the guide's
    unit rows (in ``guide_dtype``, default the accumulate dtype) and thresholds (always in
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
    if spec.guide is not None:
        acc = accumulate_dtype(anchors.dtype)
        unit = lambda x: torch.nn.functional.normalize(common.wide(x), dim=1, eps=EPS).to(acc)  # noqa: E731
        g_anchors, g_positives, g_negatives, g_cands = spec.guide.embeddings
        u_anchors, u_positives = unit(g_anchors), unit(g_positives)
        u_own = u_positives[offset:offset + n]
        theta = layout.guide_threshold((u_anchors * u_own).sum(dim=1), spec.guide.margin,
                                       spec.guide.strategy)
        g_rows = torch.cat([u_anchors, u_own]) if lay.positive_side else u_anchors
        parts = [u_positives] + ([unit(g_negatives)] if n_neg > 0 else [])
        parts.append(u_anchors.new_zeros(n_noise, u_anchors.shape[1]))   # never filtered
        parts += [unit(g_cands)] if n_a > 0 else []
        g_cols = torch.cat(parts)
        if guide_dtype is not None:
            g_rows, g_cols = g_rows.to(guide_dtype), g_cols.to(guide_dtype)
        guide = (g_rows, g_cols, theta)
    if spec.ids is not None:
        pos_ids, neg_ids, anchor_ids = spec.ids
        parts = [pos_ids] + ([neg_ids] if n_neg > 0 else [])
        parts.append(pos_ids.new_zeros(n_noise))                          # never compared
        parts += [anchor_ids] if n_a > 0 else []
        ids = (torch.cat(parts), pos_ids[offset:offset + n])
    ep = Epilogue(**fields, layout=lay, blocks=(n_pos, n_neg, n_noise, n_a), hardness=hardness,
                  guide=guide, ids=ids)
    return rows, blocks, ep


def dclr_noise(noise, anchors, positives, *, formulation="paper", anchor_offset=0,
               engine: Engine = TORCH, chunk_size=None):
    """DCLR's noise negatives (:class:`fastcl.spec.Noise`) on the fused paths: drawn (or the
    given start), then :func:`noise_update`."""
    with common.autocast_off(anchors.device):
        # whether Z can have rows too large to square, where that is known without reading Z:
        # drawn, its entries are std·N(0, 1), and no normal draw of torch's reaches NORMAL_MAX;
        # given, this call's scan of its inputs has cleared it
        from . import _validation
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
    from .common import autocast_off, huge_row_limit, shrink_huge_rows
    z = noise.detach().to(accumulate_dtype(anchors.dtype)).clone()
    if steps == 0 or z.shape[0] == 0:
        return z
    released = positives is not None
    ep = Epilogue(temperature, positives=released, chunk_size=chunk_size,
                  anchor_offset=anchor_offset if released else 0)
    fixed = (positives.detach(),) if released else ()
    # the scan of inputs decides, as for the embeddings (one host read; none when the input
    # checks are off, which leave rows too large to square as they are)
    from . import _validation
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
    from .common import project_out_radial, safe_direction
    g = _tangent_(u, x, norm, u.shape[0])
    direction, zero = safe_direction(project_out_radial(g.to(z.dtype), x))
    z.add_(direction, alpha=lr)
    if released:
        z.masked_fill_(zero[:, None], 0.0)      # (a mask, not an index: no host sync)
