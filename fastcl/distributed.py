"""Data parallelism with global negatives across processes (``torch.distributed``).

Each process embeds its equal share of the global batch. :func:`global_views` gathers the
candidates of every anchor (positives, hard negatives, DCLR's complementary c⁺) from all
processes *with gradient*; each process then computes the loss of its own anchors against
all candidates (fastcl's ``anchor_offset``), the mean over its anchors, with the one
objective dispatch (:func:`fastcl.objectives.objective_loss`). Gradients are then averaged
over the processes (:func:`average_gradients`). The gather's backward sums every process's
gradient contributions to a shard, so with equal shares the averaged gradient is exactly the
gradient of the global mean loss over the concatenated batch, as in single-process training.

A method whose entry asks for ``global_anchors`` (DCLR, for its noise) also receives every
process's anchors, detached: the noise is then drawn and improved from them with a
generator seeded identically on every process, the noise single-process training on the
concatenated batch would use.

Process plumbing for the trainer is here too: joining the group ``torchrun`` describes
(:func:`init_from_environment`), rank and world size, per-process dropout seeds, and
agreeing on a stop signal.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist


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


def global_views(obj, views: dict, group=None) -> tuple[dict, int]:
    """The views this process's loss needs against the candidates of all processes, and the
    offset of its anchors among them. ``obj`` is a :class:`fastcl.objectives.Objective`,
    ``views`` the local views of :func:`fastcl.training.embed_views`. Every process must
    hold the same number of examples."""
    n = views["anchors"].shape[0]
    sizes = gather_objects(n, group)
    if len(set(sizes)) != 1:
        raise ValueError(f"every process needs the same number of examples, got {sizes}")
    out = dict(views)
    out["positives"] = gather(views["positives"], group)
    if views.get("negatives") is not None:
        out["negatives"] = gather(views["negatives"], group)
    if views.get("complementary") is not None:
        c, c_pos = views["complementary"]
        out["complementary"] = (c, gather(c_pos.detach(), group))
    if obj.spec.global_anchors:
        out["all_anchors"] = gather(views["anchors"].detach(), group)
    return out, dist.get_rank(group) * n


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


def gather_objects(obj, group=None) -> list:
    """``obj`` of every process, in rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# ---------------------------------------------------------------------------------------
# Process plumbing (torchrun)

def world_and_rank() -> tuple[int, int]:
    """(number of processes, this process's rank); (1, 0) outside ``torch.distributed``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def launched() -> bool:
    """Whether a launcher (``torchrun``) started several processes (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def default_device() -> str:
    """cuda (this process's LOCAL_RANK GPU under a launcher) when there is one, else cpu."""
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if launched() else "cuda"


def init_from_environment(device: str | None = None) -> None:
    """Join the process group that ``torchrun`` describes (WORLD_SIZE > 1 in the
    environment): NCCL on GPUs, gloo on CPU. Nothing to do for a single process."""
    if not launched() or dist.is_initialized():
        return
    cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    join_group("nccl" if cuda else "gloo")


def join_group(backend: str, **kwargs) -> None:
    """``dist.init_process_group(backend, **kwargs)``, such that ``destroy_process_group``
    later really ends the group.

    torch.distributed.nn.functional binds the default group into its functions' defaults when
    first imported. Imported after the group exists (torch's sharded-tensor code does so
    lazily), it keeps the group alive past destroy_process_group, with gloo's workers still
    running at interpreter shutdown, where one that frees its last collective's tensors
    aborts the process. Imported first, its defaults hold None.
    """
    importlib.import_module("torch.distributed.nn.functional")
    dist.init_process_group(backend, **kwargs)


def seed_dropout(seed: int, rank: int) -> None:
    """Give each process its own dropout masks (the same seed on all would repeat them)."""
    torch.manual_seed(seed * 1_000_003 + rank)


def agreed_signal(signum: int | None, device) -> int | None:
    """The stop signal any process received (all stop after the same step), or None."""
    t = torch.tensor([signum or 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t) or None
