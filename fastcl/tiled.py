"""The tiled path: every objective without ever holding the N×M similarity matrix.

Anchor rows are processed in chunks of R rows. For a chunk we form the R×M slice of
cosines, turn it into logits (temperature, focal modulation, hard-negative log-weight,
DCLR mask), reduce it to the per-row log-sum-exp and positive logit, and — because
the loss is the last op of the graph — turn the same slice into ``∂L/∂s`` at once:

    ∂L/∂l_ij = (p_ij − 1[j = i]) / N,      p = softmax over the row's kept columns
    ∂L/∂s_ij = ∂L/∂l_ij · g'(s_ij)          (1/τ; focal: 2s/τ on the positive, (2s+m)/τ else)
    ∂L/∂ĥ_c  = G_c k̂,     ∂L/∂k̂ += G_cᵀ ĥ_c

then chain through the L2 normalization. Backward only scales the stored gradients
by the incoming scalar. Peak extra memory is one R×M fp32 slice (two for focal, plus
an R×N cosine slice of the complementary model for DCLR) and O((N+M)·d) for the
normalized candidates and the gradients; R is chosen from a memory budget.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .reference import EPS, accumulate_dtype

#: Default bytes for the per-chunk R×M work buffers (all of them together).
DEFAULT_MEMORY_BUDGET = 64 * 2**20


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
    chunk_size: int | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET


@functools.lru_cache(maxsize=None)
def _mixed_mm_supported(device_type: str) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` takes 16-bit inputs on this device type."""
    try:
        x = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the chunk GEMMs read. 16-bit inputs stay 16-bit only where the GEMM can
    write float32 directly (rounding cosines to bf16 would cost ~0.1 in logit at τ = 0.05);
    elsewhere they are widened once."""
    acc = accumulate_dtype(dtype)
    if dtype != acc and device.type == "cuda" and _mixed_mm_supported(device.type):
        return dtype
    return acc


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    return a @ b if a.dtype == acc else torch.mm(a, b, out_dtype=acc)


def _normalize(x: torch.Tensor, acc: torch.dtype, out_dtype: torch.dtype | None = None):
    """Return ``(x̂ in out_dtype (default x's dtype), ‖x‖ clamped at EPS in acc)``."""
    norm = torch.linalg.vector_norm(x, dim=1, dtype=acc).clamp_min_(EPS)
    return (x.to(acc) / norm[:, None]).to(out_dtype or x.dtype), norm


def _normalize_backward_(grad_hat: torch.Tensor, x_hat: torch.Tensor, norm: torch.Tensor):
    """In place: ``∂L/∂x = (∂L/∂x̂ − x̂ (x̂·∂L/∂x̂)) / ‖x‖`` (no projection where ‖x‖ < EPS)."""
    x_hat = x_hat.to(grad_hat.dtype)
    radial = (x_hat * grad_hat).sum(dim=1, keepdim=True)
    radial.masked_fill_((norm <= EPS)[:, None], 0.0)
    return grad_hat.sub_(x_hat * radial).div_(norm[:, None])


def rows_per_chunk(n: int, m: int, ep: Epilogue, n_pos: int, elem_bytes: int) -> int:
    if ep.chunk_size is not None:
        return max(1, min(n, ep.chunk_size))
    per_row = m * elem_bytes * (2 if ep.focal_m is not None else 1)
    if ep.complementary is not None:
        per_row += n_pos * (elem_bytes + 1)
    rows = max(1, ep.memory_budget // max(per_row, 1))
    return int(min(n, rows if rows < 16 else rows // 16 * 16))


class TiledContrastive(torch.autograd.Function):
    """``loss = TiledContrastive.apply(epilogue, anchors, positives, *other_candidates)``."""

    @staticmethod
    def forward(ctx, ep: Epilogue, anchors: torch.Tensor, *candidates: torch.Tensor):
        grads = contrastive_forward(ep, anchors, candidates, need=ctx.needs_input_grad[1:])
        loss, grad_list = grads
        ctx.save_for_backward(*[g if g is not None else torch.empty(0) for g in grad_list])
        ctx.has_grad = [g is not None for g in grad_list]
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        out = [None]
        # The loss is the last op; a grad of exactly 1 (the usual case) needs no copy.
        scale = None if bool(grad_loss == 1) else grad_loss
        for has, g in zip(ctx.has_grad, ctx.saved_tensors):
            out.append(None if not has else (g if scale is None else g * scale.to(g.dtype)))
        return tuple(out)


def contrastive_forward(ep: Epilogue, anchors, candidates, need):
    """The chunked loop. Returns ``(loss, [∂L/∂anchors, ∂L/∂candidates...])`` with ``None``
    where ``need`` says no gradient is wanted."""
    n, d = anchors.shape
    in_dtype, device = anchors.dtype, anchors.device
    acc = accumulate_dtype(in_dtype)
    dtype = matmul_dtype(in_dtype, device)
    sizes = [c.shape[0] for c in candidates]
    m = sum(sizes)
    need_q = bool(need[0])
    need_k = any(need[1:])
    inv_t = 1.0 / ep.temperature
    released = ep.formulation == "released"

    # Normalized candidates, written once into one (M×d) buffer: no separate concatenation.
    k_hat = torch.empty(m, d, dtype=dtype, device=device)
    k_norm = torch.empty(m, dtype=acc, device=device)
    start = 0
    for c in candidates:
        k_hat[start:start + c.shape[0]], k_norm[start:start + c.shape[0]] = _normalize(c, acc, dtype)
        start += c.shape[0]
    dk_hat = torch.zeros(m, d, dtype=acc, device=device) if need_k else None
    dq = torch.empty(n, d, dtype=acc, device=device) if need_q else None

    if ep.complementary is not None:
        c_q, _ = _normalize(ep.complementary[0], acc, acc)
        c_k, _ = _normalize(ep.complementary[1], acc, acc)

    rows = rows_per_chunk(n, m, ep, n, torch.finfo(acc).bits // 8)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        r = r1 - r0
        ar = torch.arange(r, device=device)
        diag = ar + r0                                  # column of each row's positive

        q_hat, q_norm = _normalize(anchors[r0:r1], acc, dtype)
        logits = _mm(q_hat, k_hat.T, acc)               # R×M cosines, then logits in place
        pos_cos = logits[ar, diag].clone()
        if ep.focal_m is not None:
            cos = logits.clone()
            logits.add_(ep.focal_m).mul_(cos).mul_(inv_t)      # s(s+m)/τ on negatives
            logits[ar, diag] = pos_cos * pos_cos * inv_t       # s²/τ on the positive
        else:
            logits.mul_(inv_t)
        if ep.hard_negative_weight:
            logits[ar, n + diag] += ep.hard_negative_weight
        if ep.complementary is not None:
            c_cos = c_q[r0:r1] @ c_k.T
            drop = (c_cos * inv_t > 20 * ep.phi) if released else (c_cos >= ep.phi)
            del c_cos
            drop[ar, diag] = False                      # the positive is never dropped
            logits[:, :n].masked_fill_(drop, 0.0 if released else float("-inf"))
        else:
            drop = None
        pos_logit = logits[ar, diag].clone()

        # Row log-sum-exp, leaving the softmax in the buffer.
        row_max = logits.amax(dim=1, keepdim=True)
        probs = logits.sub_(row_max).exp_()
        row_sum = probs.sum(dim=1, keepdim=True)
        probs.div_(row_sum)
        lse = row_max.squeeze(1) + row_sum.squeeze(1).log()

        if released:
            # BCE on the softmax, mean over all N·M entries; log p and log(1−p) clamped at −100
            # as torch's binary_cross_entropy does.
            p_pos = probs[ar, diag].clone()
            log_not = torch.log1p(-probs).clamp_min_(-100.0)
            log_not[ar, diag] = 0.0
            row_loss = -log_not.sum(dim=1) - (pos_logit - lse).clamp_min(-100.0)
            del log_not
        else:
            row_loss = lse - pos_logit
        loss_sum += row_loss.sum(dtype=torch.float64)

        if not (need_q or need_k):
            continue
        grad = probs                                     # becomes ∂L/∂s in place
        if released:
            # v_ij = p/(1−p) off the positive, −1 on it; ∂L/∂a = (v − p·Σ_j v)/(N·M), a = α·s/τ
            v = probs / (1.0 - probs)
            v[ar, diag] = -1.0
            grad.mul_(-v.sum(dim=1, keepdim=True)).add_(v)
            del v
            grad.mul_(inv_t / (n * m))
            if drop is not None:
                grad[:, :n].masked_fill_(drop, 0.0)
        else:
            grad[ar, diag] -= 1.0
            if ep.focal_m is not None:
                # g'(s) = (2s + m)/τ off the positive, 2s/τ on it
                slope = cos.mul_(2.0).add_(ep.focal_m)
                slope[ar, diag] -= ep.focal_m
                grad.mul_(slope).mul_(inv_t / n)
            else:
                grad.mul_(inv_t / n)
        grad = grad.to(dtype)
        if need_q:
            dq[r0:r1] = _normalize_backward_(_mm(grad, k_hat, acc), q_hat, q_norm)
        if need_k:
            if dtype == acc:
                dk_hat.addmm_(grad.T, q_hat)
            else:
                dk_hat += _mm(grad.T, q_hat, acc)

    loss = (loss_sum / (n * m if released else n)).to(acc)
    grads = [dq.to(in_dtype) if need_q else None]
    if need_k:
        dk = _normalize_backward_(dk_hat, k_hat, k_norm).to(in_dtype)
        grads += [dk[s:s + size] if want else None
                  for s, size, want in zip(_offsets(sizes), sizes, need[1:])]
    else:
        grads += [None] * len(candidates)
    return loss, grads


def _offsets(sizes):
    out, s = [], 0
    for size in sizes:
        out.append(s)
        s += size
    return out


def contrastive_loss(ep: Epilogue, anchors, *candidates):
    """Differentiable entry point used by :mod:`fastcl.functional`."""
    return TiledContrastive.apply(ep, anchors, *candidates)


@torch.no_grad()
def noise_update(anchors, noise, *, steps, lr, temperature, chunk_size=None,
                 memory_budget=DEFAULT_MEMORY_BUDGET):
    """DCLR's normalized gradient ascent on the noise, chunked, without an autograd graph.

    Each step needs only ``∂L_U/∂Z``: the column half of an InfoNCE backward over the
    noise columns, ``∂L_U/∂ẑ_j = Σ_i p_ij ĥ_i / (N τ_u)``, chained through ‖z_j‖.
    """
    z = noise.detach().to(accumulate_dtype(anchors.dtype)).clone()
    if steps == 0 or z.shape[0] == 0:
        return z
    n, k = anchors.shape[0], z.shape[0]
    acc = z.dtype
    q_hat, _ = _normalize(anchors.detach(), acc, acc)
    inv_t = 1.0 / temperature
    if chunk_size is not None:
        rows = max(1, min(n, chunk_size))
    else:
        rows = max(1, min(n, memory_budget // max(k * z.element_size(), 1)))
    for _ in range(steps):
        z_hat, z_norm = _normalize(z, acc)
        dz_hat = torch.zeros_like(z)
        for r0 in range(0, n, rows):
            qc = q_hat[r0:r0 + rows]
            probs = torch.softmax((qc @ z_hat.T).mul_(inv_t), dim=1)
            dz_hat.addmm_(probs.T, qc, alpha=inv_t / n)
        g = _normalize_backward_(dz_hat, z_hat, z_norm)
        g_norm = torch.linalg.vector_norm(g, dim=1, keepdim=True)
        # z_j += lr · g_j/‖g_j‖; a row with g_j = 0 adds 0/tiny = 0 and stays put.
        z.addcdiv_(g, g_norm.clamp_min(torch.finfo(acc).tiny), value=lr)
    return z
