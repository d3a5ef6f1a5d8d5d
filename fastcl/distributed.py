"""The one gather of global negatives across processes (``torch.distributed``).

:func:`gather` returns the rows of every process in rank order, with gradient: its backward
sums every process's gradient contributions to a shard and hands each process its own rows.
The sentence-transformers losses' ``gather_across_devices`` uses it
(:func:`fastcl.integrations.sentence_transformers._base.gather_rows`): each process computes
the loss of its own anchors against all candidates (``anchor_offset``), so once the gradients
are averaged over processes (as DistributedDataParallel does) they are exactly those of one
process on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

class _GatherWithGrad(torch.autograd.Function):
    """All rows of every process (``cat`` of ``all_gather``); backward sums the gradients of
    all processes and returns each its own rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group)

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
    return _GatherWithGrad.apply(x, group) if x.requires_grad else _all_gather(x, group)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


def broadcast(x: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """``x`` as process ``src`` has it, on every process (no gradient: a value every process
    must share, such as DCLR's noise drawn and improved once for the whole batch)."""
    x = x.detach().contiguous()
    dist.broadcast(x, src=src, group=group)
    return x
