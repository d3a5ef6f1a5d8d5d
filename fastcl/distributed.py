"""Global negatives across processes (``torch.distributed``).

Each process embeds its equal share of the global batch. The candidates of every anchor
(positives, hard negatives, DCLR's complementary embeddings) are gathered from all processes
*with gradient*; each process computes the loss of its own anchors against all candidates
(fastcl's ``anchor_offset``), the mean over its anchors. Gradients are then averaged over the
processes (:func:`average_gradients`). The gather's backward sums every process's gradient
contributions to a shard, so with equal shares the averaged gradient is exactly the gradient of
the global mean loss over the concatenated batch, as in single-process training.

DCLR's noise is drawn once per step from the gathered (detached) anchors and positives with a
generator seeded identically on every process, so every process uses the same noise, the one
single-process training on the concatenated batch would draw.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import fastcl
from fastcl import reference


def is_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _GatherWithGrad(torch.autograd.Function):
    """All rows of every process (``cat`` of ``all_gather``); backward sums the gradients of
    all processes and returns each its own rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        n = grad.shape[0] // world
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = torch.empty((n, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=group)
        else:  # gloo has no reduce-scatter: sum everything, keep our rows
            grad = grad.clone()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
            out = grad[rank * n:(rank + 1) * n].clone()
        return out, None


def gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """The rows of ``x`` of every process, concatenated in rank order; differentiable when
    ``x`` requires grad (see :class:`_GatherWithGrad`), a plain all_gather otherwise."""
    if x.requires_grad:
        return _GatherWithGrad.apply(x, group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


def global_loss(obj, views: dict, group=None) -> torch.Tensor:
    """This process's share of the method's loss (mean over its own anchors) against the
    candidates of all processes; ``obj`` is a :class:`fastcl.training.Objective`, ``views``
    the local views of :func:`fastcl.training.embed_views`. Every process must hold the
    same number of examples."""
    h, h_pos = views["anchors"], views["positives"]
    n = h.shape[0]
    sizes = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, n, group=group)
    if len(set(sizes)) != 1:
        raise ValueError(f"every process needs the same number of examples, got {sizes}")
    offset = dist.get_rank(group) * n
    positives = gather(h_pos, group)
    t = obj.temperature
    if obj.method == "simcse":
        return fastcl.infonce(h, positives, temperature=t, anchor_offset=offset)
    if obj.method == "simcse-sup":
        neg = views.get("negatives")
        negatives = None if neg is None else gather(neg, group)
        return fastcl.infonce(h, positives, negatives, temperature=t, anchor_offset=offset,
                              hard_negative_weight=obj.hard_negative_weight if neg is not None else 0.0)
    if obj.method == "focal":
        return fastcl.focal_infonce(h, positives, temperature=t, m=obj.m, anchor_offset=offset)
    if obj.method == "escl":
        return fastcl.escl_loss(h, positives, views["sensitive"], temperature=t,
                                weight=obj.rd_weight, rd=obj.rd, anchor_offset=offset)
    # dclr: the noise of single-process training on the concatenated batch, on every process
    anchors = gather(h.detach(), group)
    num = reference.noise_count(obj.noise_ratio, anchors.shape[0], obj.formulation)
    noise = fastcl.dclr_noise(anchors, positives.detach(), num, steps=obj.noise_steps,
                              lr=obj.noise_lr, std=obj.noise_std, temperature=t,
                              generator=obj.generator, formulation=obj.formulation)
    comp = views.get("complementary")
    if comp is not None:
        c, c_pos = (x.to(h.dtype) for x in comp)
        comp = (c, gather(c_pos.detach(), group))
    return fastcl.dclr_loss(h, positives, complementary=comp, phi=obj.phi, noise=noise,
                            noise_steps=0, temperature=t, formulation=obj.formulation,
                            anchor_offset=offset)


def average_gradients(params, group=None) -> None:
    """Average the ``.grad`` of ``params`` over the processes (one flat all_reduce per dtype
    and device); a parameter without a gradient on every process is left alone."""
    world = dist.get_world_size(group)
    buckets: dict = {}
    for p in params:
        if p.grad is not None:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def mean(value: float, group=None, device=None) -> float:
    """The mean of a number over the processes."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return float(t) / dist.get_world_size(group)


def broadcast_parameters(module: torch.nn.Module, group=None) -> None:
    """Give every process rank 0's parameters and buffers."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0, group=group)
