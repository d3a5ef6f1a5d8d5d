"""The benchmark cases: inputs and one call of each implementation of each objective.

Objectives (all on the same random inputs for every implementation of a case):

=============  ==============================================================  ===========
objective      call                                                            M
=============  ==============================================================  ===========
infonce        ``infonce(h, h⁺)`` (unsupervised SimCSE)                          N
infonce-hard   ``infonce(h, h⁺, h⁻)``, one hard negative per anchor, w = 0       2N
               (supervised SimCSE; the objective MNRL computes for triplets)
focal          ``focal_infonce(h, h⁺, m=0.3)``                                   N
dclr           ``dclr_loss`` with a frozen 384-wide complementary model          N + K = 2N
               (φ = 0.9) and K = N noise negatives improved by 4 steps
escl           ``escl_loss(h, h⁺, h_sensitive)``                                 N
noise          ``dclr_noise(h, h⁺, K)``: the DCLR noise update alone, 4 steps,   K = N
               K = N, no graph (reference: an autograd graph per step, as
               the released code does it)
=============  ==============================================================  ===========

Implementations: ``fastcl`` (``backend="auto"``: Triton on CUDA, tiled elsewhere),
``tiled`` (``backend="tiled"``), ``reference`` (``backend="reference"``: eager, full N×M
matrices through autograd), ``compiled`` (``torch.compile`` of the same function in
:mod:`fastcl.reference`) and ``mnrl`` (sentence-transformers'
``MultipleNegativesRankingLoss.compute_loss_from_embeddings`` on the same embeddings,
scale 20 = 1/τ; infonce and infonce-hard only, the objectives it computes).

A call is forward + ``loss.backward()`` (the noise update has no backward: it returns the
noise). Useful FLOPs count the GEMM work an ideal implementation cannot avoid:
``6·N·M·d`` for a loss (similarities, and the two gradient products), plus for DCLR the
complementary cosines ``2·N·N·d_c`` and the noise update, ``4·N·K·d`` per step
(similarities and the noise gradient).

The inputs, the one definition every benchmark uses (``run.py`` on CPU and GPU, its
fresh-process memory figures included, ``ab.py``, ``profile_step.py`` and the
micro-benchmarks): standard normal anchors h; positives h⁺ = h + 3·noise, a second view
weakly correlated with the first (cosine ≈ 0.3, like two dropout views of a young encoder),
so that losses are O(1) and the softmax spreads over many columns; ESCL's sensitive view
h + 4·noise; independent hard negatives with weight ``w = 0`` (supervised SimCSE, what MNRL
computes); DCLR's complementary pair c⁺ = c + 0.5·noise and its initial noise drawn here
(the same for every implementation). Temperature, φ, m and the noise steps are fastcl's
defaults (:mod:`fastcl.common`).

Results written by the earlier ``bench/cpu_memory.py`` (``bench/results/cpu-memory-*.json``)
used other inputs: independent positives and sensitive views, ``w = 1`` for the hard
negatives, and DCLR's noise drawn by fastcl from a generator. The shapes were the same, so
memory and time are comparable; the loss values are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import _checkout  # noqa: F401  (fastcl importable from a bare checkout)
from fastcl.common import FOCAL_M, NOISE_STEPS, PHI, TEMPERATURE

OBJECTIVES = ("infonce", "infonce-hard", "focal", "dclr", "escl", "noise")
IMPLS = ("fastcl", "tiled", "reference", "compiled", "mnrl")
MNRL_OBJECTIVES = ("infonce", "infonce-hard")
COMPLEMENTARY_DIM = 384

_FUNCTIONS = {"infonce": "infonce", "infonce-hard": "infonce", "focal": "focal_infonce",
              "dclr": "dclr_loss", "escl": "escl_loss", "noise": "dclr_noise"}


def num_candidates(objective: str, n: int) -> int:
    """M: the candidate columns of the main loss (the noise count K for ``noise``)."""
    return 2 * n if objective in ("infonce-hard", "dclr") else n


def useful_flops(objective: str, n: int, d: int) -> float:
    """GEMM FLOPs of one call that no implementation can avoid (see the module docstring)."""
    m = num_candidates(objective, n)
    if objective == "noise":
        return float(NOISE_STEPS * 4 * n * n * d)
    flops = 6.0 * n * m * d
    if objective == "dclr":
        flops += 2.0 * n * n * COMPLEMENTARY_DIM + NOISE_STEPS * 4.0 * n * n * d
    return flops


def _mnrl():
    """sentence-transformers' loss object; it needs a model only to encode, which we skip."""
    try:
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    except ImportError:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from sentence_transformers.losses import MultipleNegativesRankingLoss
    loss = MultipleNegativesRankingLoss(model=None, scale=1.0 / TEMPERATURE)
    if not hasattr(loss, "compute_loss_from_embeddings"):
        raise RuntimeError("this sentence-transformers has no embedding-level entry point "
                           "(compute_loss_from_embeddings)")
    return loss


@dataclass
class Case:
    objective: str
    impl: str
    n: int
    m: int
    d: int
    dtype: str
    device: str
    backend: str                     # what ran: tiled, triton, reference, compiled, mnrl
    step: object                     # () -> loss (after its backward) or the noise
    leaves: list = field(default_factory=list)
    flops: float = 0.0
    note: str = ""


def build(objective: str, impl: str, n: int, d: int, dtype: str = "float32", device: str = "cpu",
          seed: int = 0, compile_dynamic: bool | None = False, chunk_size: int | None = None,
          input_checks: bool = True) -> Case:
    """Inputs for one case and a closure running one call. Raises ``ValueError`` for an
    implementation that does not apply to the objective. ``input_checks`` is fastcl's
    NaN/Inf scan of the inputs (on by default, as users get it)."""
    import torch

    import fastcl
    from fastcl import reference

    fastcl.set_input_checks(input_checks)

    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}")
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}")
    if impl == "mnrl" and objective not in MNRL_OBJECTIVES:
        raise ValueError(f"MultipleNegativesRankingLoss does not compute {objective}")

    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(rows, cols, grad=True):
        x = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
        return x.to(tdtype).requires_grad_(grad)

    m = num_candidates(objective, n)
    anchors = randn(n, d)
    # A second view weakly correlated with the first (cosine ≈ 0.3, like two dropout views of
    # a young encoder): losses O(1), the softmax spread over many columns, not one-hot.
    positives = (anchors.detach().float() + 3.0 * randn(n, d, grad=False).float()).to(tdtype)
    positives.requires_grad_(objective != "noise")
    if objective == "noise":
        anchors.requires_grad_(False)
    leaves = [anchors, positives] if objective != "noise" else []
    args, kwargs = [anchors, positives], {"temperature": TEMPERATURE}

    if objective == "infonce-hard":
        negatives = randn(n, d)
        leaves.append(negatives)
        args.append(negatives)
        kwargs["hard_negative_weight"] = 0.0
    elif objective == "focal":
        kwargs["m"] = FOCAL_M
    elif objective == "dclr":
        c = randn(n, COMPLEMENTARY_DIM, grad=False)
        c_pos = (c.float() + 0.5 * randn(n, COMPLEMENTARY_DIM, grad=False).float()).to(tdtype)
        noise = torch.randn(n, d, generator=gen, device=device, dtype=torch.float32)
        kwargs.update(complementary=(c, c_pos), phi=PHI, noise=noise, noise_steps=NOISE_STEPS)
    elif objective == "escl":
        sensitive = (anchors.detach().float() + 4.0 * randn(n, d, grad=False).float()).to(tdtype)
        leaves.append(sensitive.requires_grad_(True))
        args.append(sensitive)
    elif objective == "noise":
        noise = torch.randn(n, d, generator=gen, device=device, dtype=torch.float32)
        args.append(n)
        kwargs.update(noise=noise, steps=NOISE_STEPS)

    name = _FUNCTIONS[objective]
    note = ""
    if impl == "mnrl":
        loss_fn = _mnrl()
        backend = "mnrl"
        fn = lambda *xs, **_: loss_fn.compute_loss_from_embeddings(list(xs), None)
        kwargs = {}
    elif impl == "compiled":
        backend = "compiled"
        fn = torch.compile(getattr(reference, name), dynamic=compile_dynamic)
        note = f"torch.compile(fastcl.reference.{name}, dynamic={compile_dynamic})"
    else:
        fn = getattr(fastcl, name)
        kwargs["backend"] = "auto" if impl == "fastcl" else impl
        backend = fastcl.resolve_backend(kwargs["backend"], anchors)
        if chunk_size is not None and impl != "reference":
            kwargs["chunk_size"] = chunk_size

    if objective == "noise":
        def step():
            return fn(*args, **kwargs)
    else:
        def step():
            # Gradients are dropped, not zeroed: every call allocates them as a first one does.
            for x in leaves:
                x.grad = None
            loss = fn(*args, **kwargs)
            loss.backward()
            return loss

    return Case(objective, impl, n, m, d, dtype, device, backend, step, leaves,
                useful_flops(objective, n, d), note)



def from_spec(spec: dict, device: str) -> Case:
    """:func:`build` for a spec of ``run.py``'s plan (``kind`` "case")."""
    return build(spec["objective"], spec["impl"], spec["n"], spec["d"], spec["dtype"], device,
                 seed=spec.get("seed", 0), compile_dynamic=spec.get("compile_dynamic"),
                 chunk_size=spec.get("chunk_size"), input_checks=spec.get("input_checks", True))
