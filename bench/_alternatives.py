"""What a user would pick instead of fastcl, as benchmark implementations, and the check
that every implementation computes the reference's loss and gradients before it is timed.

=============  =================================================  =============================
``--impl``     the call (â = a/‖a‖ in float32, then the inputs'   objectives it expresses
               dtype; τ = fastcl's temperature)
=============  =================================================  =============================
torch-lce      ``torch.nn.functional.linear_cross_entropy(â/τ,    infonce, infonce-hard
               k̂, arange(N), options=LinearCrossEntropyOptions())``
               — PyTorch's chunked cross-entropy (no extra
               install; gradients computed in the forward)
cce            ``cut_cross_entropy.linear_cross_entropy(â/τ, k̂,   infonce, infonce-hard
               arange(N), impl=...)``: its Triton kernels
               (``"cce"``, gradient filtering on) on a GPU, its
               ``"torch_compile"`` implementation elsewhere
memeff         ``MemoryEfficientQwen3Loss(margin=2)`` (one         infonce, infonce-symmetric,
               direction; a margin of 2 turns its false-negative  matryoshka
               mask off), ``MemoryEfficientCLIPLoss`` (both
               directions, averaged),
               ``MemoryEfficientMatryoshkaQwen3Loss`` (its one-pass
               Matryoshka); all with ``stable=False``, the
               textbook gradient scale. CUDA only
inf-cl         ``inf_cl.cal_inf_loss(â, k̂, scale=1/τ)``: Inf-CL's  infonce, infonce-hard
               tiled log-sum-exp (one GPU: its flash path).
               CUDA only
=============  =================================================  =============================

k̂ is the candidates ``[h⁺; h⁻]``, unit rows. infonce-hard has ``w = 0``, so one softmax over
2N columns is the whole objective. memeff's hard negatives are per row (each query against
its own K), not in-batch candidates: it does not express infonce-hard. An objective an
implementation cannot express is a row saying so, never timed; so is a missing package, and
an implementation that needs CUDA on a CPU-only machine ("no GPU").

The check (:func:`check`): before a case is timed, the same implementation runs on the same
kind of inputs at ``min(N, check_n)`` rows and its loss and the gradients of every input are
compared with :mod:`fastcl.reference` computed in float64 on the very same input values.
Errors are relative: ``|L − L_ref| / |L_ref|`` and, per input, ``‖g − g_ref‖ / ‖g_ref‖``
(Frobenius norm). Tolerances (:data:`TOLERANCE`): float32 1e-4 (loss) and 1e-3 (gradients),
bfloat16 and float16 2e-2 and 5e-2 (16-bit inputs and products). A case outside them is a
row saying "wrong", with the errors, and is not timed.
"""

from __future__ import annotations

import math
from importlib import metadata, util

ALTERNATIVES = ("torch-lce", "cce", "memeff", "inf-cl")
#: The PyPI distribution each alternative comes from (torch-lce: torch itself).
PACKAGES = {"torch-lce": "torch", "cce": "cut-cross-entropy", "memeff": "memeff", "inf-cl": "inf-cl"}
MODULES = {"torch-lce": "torch", "cce": "cut_cross_entropy", "memeff": "memeff", "inf-cl": "inf_cl"}
#: The versions bench/fetch_wheels.sh downloads (the ones measured here).
PINNED = {"cut-cross-entropy": "25.1.1", "memeff": "0.3.1", "inf-cl": "1.2.1"}
SUPPORTS = {
    "torch-lce": ("infonce", "infonce-hard"),
    "cce": ("infonce", "infonce-hard"),
    "memeff": ("infonce", "infonce-symmetric", "matryoshka"),
    "inf-cl": ("infonce", "infonce-hard"),
}
CUDA_ONLY = ("memeff", "inf-cl")
#: (loss, gradients) relative tolerances of :func:`check`, by input dtype.
TOLERANCE = {"float32": (1e-4, 1e-3), "float64": (1e-10, 1e-8), "bfloat16": (2e-2, 5e-2),
             "float16": (2e-2, 5e-2)}
CHECK_N = 1024


def version(impl: str) -> str | None:
    """The installed version of the package ``impl`` comes from (None: not installed)."""
    try:
        return metadata.version(PACKAGES[impl])
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """Every alternative's package version (None where it is not installed)."""
    return {PACKAGES[i]: version(i) for i in ALTERNATIVES}


def unavailable(impl: str, objective: str, device: str) -> str | None:
    """Why ``impl`` cannot run ``objective`` on ``device`` (None: it can). Cheap: no import
    of the package, so the benchmark's parent process can say it without a worker."""
    if impl not in ALTERNATIVES:
        return None
    if objective not in SUPPORTS[impl]:
        return (f"{impl} does not express {objective} (it computes "
                f"{', '.join(SUPPORTS[impl])})")
    if impl == "torch-lce":
        import torch
        if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
            return (f"torch {torch.__version__} has no torch.nn.LinearCrossEntropyOptions "
                    "(the chunked linear_cross_entropy)")
        return None
    if util.find_spec(MODULES[impl]) is None:
        return (f"{PACKAGES[impl]} is not installed (pip install --no-deps "
                f"{PACKAGES[impl]}=={PINNED[PACKAGES[impl]]}, or bench/fetch_wheels.sh)")
    if impl in CUDA_ONLY and device != "cuda":
        return f"no GPU ({PACKAGES[impl]}'s Triton kernels take CUDA tensors only)"
    return None


def _unit(x):
    """Unit rows formed in float32 (as fastcl's reference forms them), in x's dtype."""
    import torch.nn.functional as F
    return F.normalize(x.float(), dim=-1).to(x.dtype)


def _inf_cl_head_dim(d: int) -> int:
    """Inf-CL views the width as heads of 16…256 lanes; the widest that divides d."""
    for h in (256, 128, 64, 32, 16):
        if d % h == 0:
            return h
    raise ValueError(f"inf-cl needs d divisible by 16 (got d={d})")


def loss_fn(impl: str, objective: str, device: str, temperature: float, dims=None):
    """``fn(anchors, positives[, negatives]) -> loss`` of ``impl`` for ``objective``, and a
    note saying what was called. Raises ``ValueError`` with the reason where it cannot run."""
    why = unavailable(impl, objective, device)
    if why:
        raise ValueError(why)
    import torch

    inv_t = 1.0 / temperature

    def candidates(positives, negatives):
        k = _unit(positives)
        return k if negatives is None else torch.cat([k, _unit(negatives).to(k.dtype)])

    if impl == "torch-lce":
        import torch.nn.functional as F
        opts = torch.nn.LinearCrossEntropyOptions()

        def fn(anchors, positives, negatives=None):
            target = torch.arange(anchors.shape[0], device=anchors.device)
            return F.linear_cross_entropy(_unit(anchors) * inv_t, candidates(positives, negatives),
                                          target, options=opts)
        return fn, (f"torch.nn.functional.linear_cross_entropy(options=LinearCrossEntropyOptions()) "
                    f"torch {torch.__version__}")
    if impl == "cce":
        from cut_cross_entropy import linear_cross_entropy
        which = "cce" if device == "cuda" else "torch_compile"

        def fn(anchors, positives, negatives=None):
            target = torch.arange(anchors.shape[0], device=anchors.device)
            return linear_cross_entropy(_unit(anchors) * inv_t, candidates(positives, negatives),
                                        target, impl=which)
        return fn, f"cut_cross_entropy.linear_cross_entropy(impl={which!r}) {version(impl)}"
    if impl == "memeff":
        import memeff
        if objective == "infonce":
            loss = memeff.MemoryEfficientQwen3Loss(temperature=temperature, margin=2.0, stable=False)
            what = "MemoryEfficientQwen3Loss(margin=2, stable=False)"
        elif objective == "infonce-symmetric":
            loss = memeff.MemoryEfficientCLIPLoss(temperature=temperature, stable=False)
            what = "MemoryEfficientCLIPLoss(stable=False)"
        else:
            loss = memeff.MemoryEfficientMatryoshkaQwen3Loss(
                dims=tuple(sorted(dims)), temperature=temperature, margin=2.0, stable=False)
            what = f"MemoryEfficientMatryoshkaQwen3Loss(dims={tuple(sorted(dims))}, stable=False)"
        return (lambda anchors, positives: loss(anchors, positives)), f"memeff.{what} {version(impl)}"
    if impl == "inf-cl":
        from inf_cl import cal_inf_loss

        def fn(anchors, positives, negatives=None):
            return cal_inf_loss(_unit(anchors), candidates(positives, negatives), scale=inv_t,
                                head_dim=_inf_cl_head_dim(anchors.shape[1]))
        return fn, f"inf_cl.cal_inf_loss(scale=1/τ) {version(impl)}"
    raise ValueError(f"unknown alternative {impl!r}")


def relative(x, ref) -> float:
    """``‖x − ref‖ / ‖ref‖`` in float64 (0 where both are 0)."""
    x, ref = x.detach().double(), ref.detach().double()
    den = float(ref.norm())
    num = float((x - ref).norm())
    return num / den if den else (0.0 if num == 0 else math.inf)


def check(spec: dict, device: str, check_n: int = CHECK_N) -> dict:
    """Loss and gradients of ``spec``'s implementation against the float64 reference on the
    same input values at ``min(N, check_n)`` rows. Returns ``check_*`` fields for the row;
    ``check_ok`` False where an error exceeds :data:`TOLERANCE`."""
    from _cases import build

    n = min(int(spec["n"]), int(check_n))
    kw = dict(seed=spec.get("seed", 0), compile_dynamic=spec.get("compile_dynamic"),
              chunk_size=spec.get("chunk_size"), input_checks=spec.get("input_checks", True))
    case = build(spec["objective"], spec["impl"], n, spec["d"], spec["dtype"], device, **kw)
    ref = build(spec["objective"], "reference", n, spec["d"], "float64", device, **kw)
    for mine, theirs in zip(case.leaves, ref.leaves):   # the very same values, in float64
        with __import__("torch").no_grad():
            theirs.copy_(mine.detach().double())
    loss = float(case.step().detach())
    ref_loss = float(ref.step().detach())
    loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    grad_rel = max((relative(a.grad, b.grad) if a.grad is not None else math.inf)
                   for a, b in zip(case.leaves, ref.leaves))
    tol_loss, tol_grad = TOLERANCE[spec["dtype"]]
    ok = loss_rel <= tol_loss and grad_rel <= tol_grad
    out = {"check_ok": ok, "check_n": n, "check_loss_rel": loss_rel, "check_grad_rel": grad_rel,
           "check_tolerance": [tol_loss, tol_grad], "check_loss": loss,
           "check_ref_loss": ref_loss}
    for x in case.leaves + ref.leaves:
        x.grad = None
    return out


def check_error(result: dict) -> str:
    """The row's error for a failed :func:`check`."""
    return (f"wrong: against the float64 reference at N={result['check_n']}: loss rel. error "
            f"{result['check_loss_rel']:.2e}, gradient rel. error {result['check_grad_rel']:.2e} "
            f"(tolerances {result['check_tolerance'][0]:g}, {result['check_tolerance'][1]:g}); "
            "not timed")
