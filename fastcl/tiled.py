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
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .reference import EPS, accumulate_dtype

#: Default bytes for the per-chunk R×M work buffers (all of them together). On a GPU a
#: larger chunk keeps the GEMMs efficient; both stay far below one N×M matrix at the
#: batch sizes where memory matters.
DEFAULT_MEMORY_BUDGET = {"cpu": 64 * 2**20, "cuda": 128 * 2**20}


@dataclass(frozen=True)
class Epilogue:
    """How a chunk of cosines becomes logits and a loss. Candidates are laid out as
    ``[positives (N rows); other candidates]``; anchor i's positive is column i."""

    temperature: float
    focal_m: float | None = None           # focal modulation on
    hard_negative_weight: float = 0.0      # log-weight added at column N + i
    phi: float | None = None               # DCLR mask threshold (needs `complementary`)
    complementary: tuple[torch.Tensor, torch.Tensor] | None = None
    formulation: str = "paper"             # "paper" (cross-entropy) or "released" (DCLR's BCE)
    positives: bool = True                 # False: no column is a positive (DCLR's noise loss)
    anchor_offset: int = 0                 # anchors are rows [offset, offset+N) of a larger batch
    chunk_size: int | None = None
    memory_budget: int | None = None       # bytes; None: DEFAULT_MEMORY_BUDGET for the device


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
    """``a @ b`` written in ``acc``. 16-bit GEMMs write float32 directly where torch can;
    elsewhere the product is rounded to 16 bits first (~3 significant digits: fine for the
    gradient GEMMs, too coarse for cosines at τ = 0.05 — the Triton kernels form those)."""
    if a.dtype == acc:
        return a @ b
    if _mixed_mm_supported(a.device.type):
        return torch.mm(a, b, out_dtype=acc)
    return (a @ b).to(acc)


def rows_per_chunk(n: int, m: int, ep: Epilogue, n_pos: int, elem_bytes: int,
                   device_type: str = "cpu") -> int:
    """Anchor rows per chunk: ``ep.chunk_size``, or as many as the memory budget allows."""
    if ep.chunk_size is not None:
        return max(1, min(n, ep.chunk_size))
    budget = ep.memory_budget or DEFAULT_MEMORY_BUDGET.get(device_type, DEFAULT_MEMORY_BUDGET["cpu"])
    # focal keeps the cosines beside the logits; the released BCE needs one more slice too
    slices = 2 if (ep.focal_m is not None or ep.formulation == "released") else 1
    per_row = m * elem_bytes * slices
    if ep.complementary is not None:
        per_row += n_pos * (elem_bytes + 1)
    rows = max(1, budget // max(per_row, 1))
    return int(min(n, rows if rows < 16 else rows // 16 * 16))


class TiledContrastive(torch.autograd.Function):
    """``loss = TiledContrastive.apply(epilogue, engine, anchors, positives, *others)``.

    The gradient is produced in the forward pass (the loss is the last op of the graph);
    backward only scales it by the incoming gradient.
    """

    @staticmethod
    def forward(ctx, ep: Epilogue, engine, anchors: torch.Tensor, *candidates: torch.Tensor):
        loss, grads = contrastive_forward(ep, anchors, candidates, need=ctx.needs_input_grad[2:],
                                          engine=engine)
        ctx.save_for_backward(*[g if g is not None else torch.empty(0) for g in grads])
        ctx.has_grad = [g is not None for g in grads]
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        out = [None, None]
        # A grad of exactly 1 (the usual case) needs no copy of the stored gradients. The test
        # is made on CPU only: on an accelerator it is a host sync, and the multiply it saves is
        # one N×d elementwise pass, small next to the chunk GEMMs.
        scale = None if grad_loss.device.type == "cpu" and bool(grad_loss == 1) else grad_loss
        for has, g in zip(ctx.has_grad, ctx.saved_tensors):
            out.append(None if not has else (g if scale is None else g * scale.to(g.dtype)))
        return tuple(out)


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
    comp_q: torch.Tensor | None = None   # (R×d_c) complementary anchors, normalized, matmul dtype
    comp_k: torch.Tensor | None = None   # (N×d_c) complementary positives, likewise


def torch_chunk(ep: Epilogue, c: Chunk, want_grad: bool):
    """The epilogue in PyTorch ops, in place on one R×M buffer.

    Returns ``(Σ_rows loss, G')`` where ``G'_ij = ∂L/∂s_ij · inv_q_i · inv_k_j`` (matmul dtype),
    the form both gradient GEMMs consume with the raw inputs (``None`` if not ``want_grad``).
    """
    n, n_pos, m = c.n, c.n_pos, c.keys.shape[0]
    r = c.r1 - c.r0
    acc = c.inv_q.dtype
    inv_t = 1.0 / ep.temperature
    released = ep.formulation == "released"
    ar = torch.arange(r, device=c.q.device)
    diag = ar + c.first_pos                            # column of each row's positive

    logits = _mm(c.q, c.keys.T, acc)                   # R×M raw dots → cosines → logits
    logits.mul_(c.inv_q[:, None]).mul_(c.inv_k[None, :])
    if ep.focal_m is not None:
        pos_cos = logits[ar, diag].clone()
        cos = logits.clone()
        logits.add_(ep.focal_m).mul_(cos).mul_(inv_t)      # s(s+m)/τ on negatives
        logits[ar, diag] = pos_cos * pos_cos * inv_t       # s²/τ on the positive
    else:
        logits.mul_(inv_t)
    if ep.hard_negative_weight:
        logits[ar, n_pos + diag] += ep.hard_negative_weight
    drop = None
    if ep.complementary is not None:
        c_cos = _mm(c.comp_q, c.comp_k.T, acc)
        drop = (c_cos * inv_t > 20 * ep.phi) if released else (c_cos >= ep.phi)
        del c_cos
        drop[ar, diag] = False                         # the positive is never dropped
        logits[:, :n_pos].masked_fill_(drop, 0.0 if released else float("-inf"))
    pos_logit = logits[ar, diag].clone() if ep.positives else 0.0

    # Row log-sum-exp, leaving the softmax in the buffer.
    row_max = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    row_sum = probs.sum(dim=1, keepdim=True)
    probs.div_(row_sum)
    lse = row_max.squeeze(1) + row_sum.squeeze(1).log()

    if released:
        # BCE on the softmax, mean over all N·M entries; log p and log(1−p) clamped at −100
        # as torch's binary_cross_entropy does.
        log_not = torch.neg(probs).log1p_().clamp_min_(-100.0)
        log_not[ar, diag] = 0.0
        row_loss = -log_not.sum(dim=1) - (pos_logit - lse).clamp_min(-100.0)
        del log_not
    else:
        row_loss = lse - pos_logit
    loss_sum = row_loss.sum(dtype=torch.float64)
    if not want_grad:
        return loss_sum, None

    grad = probs                                       # becomes ∂L/∂s in place
    if released:
        # v_ij = p/(1−p) off the positive, −1 on it; ∂L/∂a = (v − p·Σ_j v)/(N·M), a = α·s/τ
        v = torch.rsub(probs, 1.0).reciprocal_().mul_(probs)    # one extra slice, not three
        v[ar, diag] = -1.0
        grad.mul_(-v.sum(dim=1, keepdim=True)).add_(v)
        del v
        scale = inv_t / (n * m)
        if drop is not None:
            grad[:, :n_pos].masked_fill_(drop, 0.0)
    else:
        if ep.positives:
            grad[ar, diag] -= 1.0
        scale = inv_t / n
        if ep.focal_m is not None:
            # g'(s) = (2s + m)/τ off the positive, 2s/τ on it
            slope = cos.mul_(2.0).add_(ep.focal_m)
            slope[ar, diag] -= ep.focal_m
            grad.mul_(slope)
    grad.mul_(c.inv_k[None, :]).mul_((c.inv_q * scale)[:, None])
    return loss_sum, grad.to(c.q.dtype)


# Chunk memory per R×M entry, for the driver's choice of R (focal and the mask add theirs).
torch_chunk.entry_bytes = lambda dtype: (torch.finfo(accumulate_dtype(dtype)).bits // 8
                                         + (0 if dtype == accumulate_dtype(dtype)
                                            else torch.finfo(dtype).bits // 8))


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


def _norms(x: torch.Tensor, acc: torch.dtype):
    return torch.linalg.vector_norm(x, dim=1, dtype=acc).clamp_min_(EPS)


def contrastive_forward(ep: Epilogue, anchors, candidates, need, engine=torch_chunk):
    """The chunked driver shared by every engine. Returns
    ``(loss, [∂L/∂anchors, ∂L/∂candidates...])`` with ``None`` where ``need`` says no
    gradient is wanted."""
    n, d = anchors.shape
    in_dtype, device = anchors.dtype, anchors.device
    acc = accumulate_dtype(in_dtype)
    dtype = matmul_dtype(in_dtype, device)
    sizes = [c.shape[0] for c in candidates]
    m = sum(sizes)
    need_q, need_k = bool(need[0]), any(need[1:])

    # One (M×d) candidate matrix; a copy only when there are several blocks or a dtype change.
    # Made contiguous once here, at the boundary: the engines assume unit stride along d.
    keys = (candidates[0] if len(candidates) == 1 else torch.cat(candidates)).to(dtype).contiguous()
    norm_k, norm_q = _norms(keys, acc), _norms(anchors, acc)
    inv_k, inv_q = 1.0 / norm_k, 1.0 / norm_q
    dk = torch.zeros(m, d, dtype=acc, device=device) if need_k else None
    # dq rows are final once their chunk is done: stored in the input dtype straight away
    dq = torch.empty(n, d, dtype=in_dtype, device=device) if need_q else None
    comp = None
    if ep.complementary is not None:
        comp = [torch.nn.functional.normalize(x.to(acc), dim=1, eps=EPS).to(dtype)
                for x in ep.complementary]

    rows = rows_per_chunk(n, m, ep, sizes[0], engine.entry_bytes(dtype), device.type)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        q = anchors[r0:r1].to(dtype).contiguous()
        chunk = Chunk(r0, r1, n, sizes[0], ep.anchor_offset + r0, q, keys, inv_q[r0:r1], inv_k,
                      comp[0][r0:r1] if comp else None, comp[1] if comp else None)
        part, g = engine(ep, chunk, need_q or need_k)
        loss_sum += part
        if g is None:
            continue
        if need_q:
            dq[r0:r1] = _tangent_(_mm(g, keys, acc), q, norm_q[r0:r1], rows)
        if need_k:
            if dtype == acc:
                dk.addmm_(g.T, q)
            else:
                dk += _mm(g.T, q, acc)

    released = ep.formulation == "released"
    loss = (loss_sum / (n * m if released else n)).to(acc)
    grads = [dq]
    if need_k:
        dk = _tangent_(dk, keys, norm_k, rows)
        grads += [dk[s:s + c.shape[0]].to(c.dtype) if want else None
                  for s, c, want in zip(_offsets(sizes), candidates, need[1:])]
    else:
        grads += [None] * len(candidates)
    return loss, grads


def _offsets(sizes):
    out, s = [], 0
    for size in sizes:
        out.append(s)
        s += size
    return out


def contrastive_loss(ep: Epilogue, anchors, *candidates, engine=torch_chunk):
    """Differentiable entry point used by :mod:`fastcl.functional`."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (anchors, *candidates)):
        return TiledContrastive.apply(ep, engine, anchors, *candidates)
    # No graph wanted (evaluation, no_grad): the loss alone, no gradient work at all.
    return contrastive_forward(ep, anchors, candidates, need=(False,) * (1 + len(candidates)),
                               engine=engine)[0]


@torch.no_grad()
def noise_update(anchors, noise, *, steps, lr, temperature, chunk_size=None, engine=torch_chunk):
    """DCLR's normalized gradient ascent on the noise, chunked, without an autograd graph.

    ``L_U``'s positive term does not depend on Z, so ``∂L_U/∂Z`` is the candidate gradient
    of a positive-free InfoNCE of the anchors against Z: each step is one pass of the
    shared driver asking for that gradient alone, then ``z_j += lr · g_j/‖g_j‖``.
    """
    z = noise.detach().to(accumulate_dtype(anchors.dtype)).clone()
    if steps == 0 or z.shape[0] == 0:
        return z
    ep = Epilogue(temperature, positives=False, chunk_size=chunk_size)
    for _ in range(steps):
        _, (_, g) = contrastive_forward(ep, anchors.detach(), (z,), need=(False, True), engine=engine)
        g_norm = torch.linalg.vector_norm(g, dim=1, keepdim=True)
        # a row with g_j = 0 adds 0/tiny = 0 and stays put
        z.addcdiv_(g, g_norm.clamp_min(torch.finfo(z.dtype).tiny), value=lr)
    return z
