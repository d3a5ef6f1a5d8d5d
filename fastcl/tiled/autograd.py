"""The driver as a differentiable loss: the autograd Function and, under torch.compile, the
custom op ``fastcl::tiled_contrastive``; one backward (:func:`_scaled`) for both."""

from __future__ import annotations

import torch

from .. import _validation, common
from ..common import accumulate_dtype
from ..spec import Epilogue, bits
from .driver import contrastive_forward
from .engine import TORCH, Engine, engine_for


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


def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the gradients the driver returns (float16 ones stay in float32)."""
    return accumulate_dtype(dtype) if dtype == torch.float16 else dtype


# The schema written out, as torch >= 2.6 infers it from the annotations (earlier releases
# infer none from list[...] and float | None). The integers are SymInt: under dynamic shapes
# the block sizes stay symbolic, so one graph serves every batch size.
_OP_SCHEMA = ("(Tensor anchors, Tensor[] candidates, Tensor[] complementary, float temperature, "
              "float? focal_m, float hard_negative_weight, float phi, str formulation, "
              "SymInt anchor_offset, SymInt? chunk_size, str matryoshka, SymInt layout, "
              "SymInt[] blocks, str hardness, Tensor[] guide, Tensor[] ids, float label_smoothing, "
              "Tensor[] labels, Tensor[] teacher, float teacher_temperature, float distill_weight, "
              "str engine, "
              "SymInt need, bool scan) -> (Tensor, Tensor, Tensor[])")


@torch.library.custom_op("fastcl::tiled_contrastive", mutates_args=(), schema=_OP_SCHEMA)
def tiled_contrastive_op(anchors: torch.Tensor, candidates: list[torch.Tensor],
                         complementary: list[torch.Tensor], temperature: float,
                         focal_m: float | None, hard_negative_weight: float, phi: float,
                         formulation: str, anchor_offset: int, chunk_size: int | None,
                         matryoshka: str, layout: int, blocks: list[int], hardness: str,
                         guide: list[torch.Tensor], ids: list[torch.Tensor],
                         label_smoothing: float, labels: list[torch.Tensor],
                         teacher: list[torch.Tensor], teacher_temperature: float,
                         distill_weight: float, engine: str,
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
                               blocks, hardness, guide, ids, label_smoothing, labels, teacher,
                               teacher_temperature, distill_weight)
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
    want = torch.is_grad_enabled()
    need = sum(1 << i for i, t in enumerate((anchors, *candidates)) if want and t.requires_grad)
    loss, _, _ = tiled_contrastive_op(anchors, list(candidates), *ep.op_args(), engine.name, need,
                                      _validation._CHECK_FINITE)
    return loss
