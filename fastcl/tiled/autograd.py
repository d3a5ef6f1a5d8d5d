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
    """``loss = TiledContrastive.apply(epilogue, engine, tau, anchors, positives, *others)``
    (``tau``: the learnable temperature, a 0-dim tensor whose value is ``epilogue``'s, or
    None).

    The gradient is produced in the forward pass (the loss is the last op of the graph);
    backward only scales it by the incoming gradient (:func:`_scaled`, which the custom op's
    backward shares).
    """

    @staticmethod
    def forward(ctx, ep: Epilogue, engine, tau, anchors: torch.Tensor, *candidates: torch.Tensor):
        wants_tau = tau is not None and ctx.needs_input_grad[2]
        loss, grads = contrastive_forward(ep, anchors, candidates, need=ctx.needs_input_grad[3:],
                                          engine=engine, temperature_grad=wants_tau)
        if not wants_tau:
            grads.append(None)
        ctx.save_for_backward(*[g if g is not None else torch.empty(0) for g in grads])
        ctx.need = [g is not None for g in grads]
        ctx.dtypes = [anchors.dtype] + [c.dtype for c in candidates] + [_like(tau)]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        *grads, d_tau = _scaled(ctx, grad_loss)
        return (None, None, d_tau, *grads)


def _like(tau):
    """Where the temperature's gradient goes: ``(device, dtype)`` of ``tau``."""
    return None if tau is None else (tau.device, tau.dtype)


def _scaled(ctx, grad_loss) -> list:
    """The backward of both front-ends: each stored gradient (``ctx.saved_tensors``, where
    ``ctx.need`` says one was wanted) times the incoming scalar, in its input's dtype (the
    last, the temperature's, in its ``(device, dtype)``)."""
    if torch.is_grad_enabled():
        # create_graph=True (a gradient penalty, a Hessian-vector product): the stored
        # gradient has no graph, so a second derivative would silently miss this loss
        raise RuntimeError(
            "fastcl's fused backends (tiled, triton) compute the gradient in the forward "
            "pass and cannot be differentiated twice (backward with create_graph=True); "
            "use backend='reference' for higher-order gradients")
    # Always scaled: testing for a grad of exactly 1 would be a host sync, and the
    # multiply is one N×d elementwise pass, small next to the chunk GEMMs.
    out = [None if not want else g * grad_loss.to(g.dtype)
           for g, want in zip(ctx.saved_tensors, ctx.need)]
    *grads, d_tau = out
    grads = [g if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
    return grads + [d_tau if d_tau is None else d_tau.to(*ctx.dtypes[-1])]


def contrastive_loss(ep: Epilogue, anchors, *candidates, engine: Engine = TORCH, tau=None):
    """The driver as a differentiable loss (``tau``: a learnable temperature, the 0-dim
    tensor of ``ep.temperature``, which then gets its gradient). Autocast is off inside (for the inputs' device
    type): the chunk GEMMs read the dtype :func:`matmul_dtype` chooses, and autocast would
    round the cosines, hence the logits and log-sum-exp, to 16 bits. Under
    ``torch.compile`` the call is the custom op ``fastcl::tiled_contrastive`` (one node of
    the graph, shapes from its fake kernel), where it can be one."""
    with common.autocast_off(anchors.device):
        if torch.compiler.is_compiling():
            return _as_op(ep, engine, anchors, candidates, tau)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (tau, anchors, *candidates)):
            return TiledContrastive.apply(ep, engine, tau, anchors, *candidates)
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
              "SymInt[] blocks, str hardness, Tensor[] guide, Tensor[] ids, str engine, "
              "SymInt need, bool scan, Tensor? tau) -> (Tensor, Tensor, Tensor[], Tensor)")


@torch.library.custom_op("fastcl::tiled_contrastive", mutates_args=(), schema=_OP_SCHEMA)
def tiled_contrastive_op(anchors: torch.Tensor, candidates: list[torch.Tensor],
                         complementary: list[torch.Tensor], temperature: float,
                         focal_m: float | None, hard_negative_weight: float, phi: float,
                         formulation: str, anchor_offset: int, chunk_size: int | None,
                         matryoshka: str, layout: int, blocks: list[int], hardness: str,
                         guide: list[torch.Tensor], ids: list[torch.Tensor], engine: str,
                         need: int, scan: bool, tau: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """``(loss, ∂L/∂anchors, [∂L/∂candidates…], ∂L/∂τ)`` of :func:`contrastive_forward`
    (empty tensors where ``need``, a bit per input and one for ``tau``, says no); the
    epilogue's arguments as :meth:`~fastcl.spec.Epilogue.op_args` writes them (``tau``: the
    learnable temperature whose value ``temperature`` is). ``scan``: test the inputs for
    NaN/Inf here (the traced caller could not read them)."""
    need = bits(need, 2 + len(candidates))
    if scan:                                # one host read for every input
        inputs = [("anchors", anchors), *((f"candidates[{i}]", c) for i, c in enumerate(candidates))]
        finite = torch.stack([torch.isfinite(x).all() for _, x in inputs]).tolist()
        for (name, _), ok in zip(inputs, finite):
            if not ok:
                raise ValueError(f"fastcl.tiled_contrastive: {name} contains NaN or Inf values")
    if tau is not None:       # a learnable τ: its value is read here (the caller was traced)
        temperature = _validation.temperature(float(tau), anchors.dtype, focal_m=focal_m,
                                              hard_negative_weight=hard_negative_weight)
    ep = Epilogue.from_op_args(complementary, temperature, focal_m, hard_negative_weight, phi,
                               formulation, anchor_offset, chunk_size, matryoshka, layout,
                               blocks, hardness, guide, ids)
    wants_tau = tau is not None and need[-1]
    loss, grads = contrastive_forward(ep, anchors, tuple(candidates), need[:-1],
                                      engine=engine_for("triton" if engine == "triton" else "tiled"),
                                      temperature_grad=wants_tau)
    empty = lambda x: x.new_empty(0, dtype=_grad_dtype(x.dtype))  # noqa: E731
    # the candidates' gradients are views of one M×d tensor; an op's outputs may not alias
    dks = [g if g is None or i == 0 else g.clone() for i, g in enumerate(grads[1:1 + len(candidates)])]
    return (loss, grads[0] if grads[0] is not None else empty(anchors),
            [g if g is not None else empty(c) for g, c in zip(dks, candidates)],
            grads[-1] if wants_tau else loss.new_empty(0))


@tiled_contrastive_op.register_fake
def _(anchors, candidates, complementary, temperature, focal_m, hard_negative_weight, phi,
      formulation, anchor_offset, chunk_size, matryoshka, layout, blocks, hardness, guide, ids,
      engine, need, scan, tau):
    need = bits(need, 2 + len(candidates))

    def grad(x, want):
        return x.new_empty(x.shape if want else (0,), dtype=_grad_dtype(x.dtype))
    loss = anchors.new_empty((), dtype=accumulate_dtype(anchors.dtype))
    return (loss, grad(anchors, need[0]), [grad(c, want) for c, want in zip(candidates, need[1:])],
            loss.new_empty(() if tau is not None and need[-1] else (0,)))


def _op_setup(ctx, inputs, output):
    _, dq, dks, d_tau = output
    ctx.save_for_backward(dq, *dks, d_tau)
    tau = inputs[-1]                        # the op's last input; ``need`` two before it
    ctx.need = bits(inputs[-3], 2 + len(inputs[1]))
    ctx.need[-1] = ctx.need[-1] and tau is not None
    ctx.dtypes = [inputs[0].dtype] + [c.dtype for c in inputs[1]] + [_like(tau)]
    # the structure of the inputs, which backward's result repeats: a tensor list's length,
    # or None (the blocks, a list of sizes, are one leaf)
    ctx.lists = [len(x) if isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in x)
                 else None for x in inputs]


def _op_backward(ctx, grad_loss, grad_dq, grad_dks, grad_d_tau):
    *scaled, d_tau = _scaled(ctx, grad_loss)
    # one entry per input, a list for a list: the anchors', the candidates' and the
    # temperature's gradients, nothing for the rest (the complementary pair, the guide and
    # the ids: lists of None)
    return tuple(scaled[0] if i == 0 else scaled[1:] if i == 1 else d_tau if i == len(ctx.lists) - 1
                 else None if n is None else [None] * n for i, n in enumerate(ctx.lists))


tiled_contrastive_op.register_autograd(_op_backward, setup_context=_op_setup)


def _as_op(ep: Epilogue, engine: Engine, anchors, candidates, tau=None):
    """:func:`contrastive_loss` through ``fastcl::tiled_contrastive``."""
    want = torch.is_grad_enabled()
    need = sum(1 << i for i, t in enumerate((anchors, *candidates, tau))
               if want and t is not None and t.requires_grad)
    loss, *_ = tiled_contrastive_op(anchors, list(candidates), *ep.op_args(), engine.name, need,
                                    _validation._CHECK_FINITE, tau)
    return loss
