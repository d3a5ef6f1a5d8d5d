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
gist           GISTEmbedLoss's objective on triplets: ``contrastive(h, h⁺, h⁻,    3N (+ N on
               directions=layout.gist(), guide=(g, g⁺, g⁻))``, a frozen          the positive's
               384-wide guide, margin 0 (anchor–positive, –negative, –anchor     side)
               and positive–positive scores in one softmax)
matryoshka     ``infonce(h, h⁺, matryoshka_dims=(d, 2d/3, d/3, d/6, d/12))``:    N
               the loss of five prefix widths, summed (MatryoshkaLoss around
               MNRL); fastcl computes them in one pass over d
gist-          gist's objective at matryoshka's five widths (MatryoshkaLoss      as gist
matryoshka     around GISTEmbedLoss), the guide's filter the same at every width
infonce-       ``infonce(h, h⁺, symmetric=True)``: the mean of both directions    N
symmetric      (CLIP's loss)
smoothing      ``infonce(h, h⁺, label_smoothing=0.1)``: soft targets, each row's   N
               target mixed with the uniform one over its candidates
supcon         ``infonce(h, h⁺, labels=y)``, y uniform in [0, N/4): every          N
               positive of the anchor's class a target (SupCon's L_out)
=============  ==============================================================  ===========

Implementations: ``fastcl`` (``backend="auto"``: Triton on CUDA, tiled elsewhere),
``tiled`` (``backend="tiled"``), ``reference`` (``backend="reference"``: eager, full N×M
matrices through autograd), ``compiled`` (``torch.compile`` of the same function in
:mod:`fastcl.reference`) and ``mnrl`` (sentence-transformers'
``MultipleNegativesRankingLoss.compute_loss_from_embeddings`` on the same embeddings,
scale 20 = 1/τ; infonce and infonce-hard only, the objectives it computes) and
``gistembed`` (sentence-transformers' ``GISTEmbedLoss`` on the same embeddings and guide
embeddings, its own code from the embeddings on: gist only). For matryoshka, ``mnrl`` is
``MatryoshkaLoss`` around MNRL (MNRL on each normalized prefix, summed) and ``wrapped`` is
``MatryoshkaLoss`` around fastcl's loss (one fused loss per width, summed; gist-matryoshka
too). The alternatives a user would pick instead — ``torch-lce``, ``cce``, ``memeff``,
``inf-cl`` — are :mod:`_alternatives`' adapters, each on the objectives it expresses.

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
from _alternatives import ALTERNATIVES, loss_fn as alternative_loss
from fastcl.common import FOCAL_M, NOISE_STEPS, PHI, TEMPERATURE

OBJECTIVES = ("infonce", "infonce-hard", "focal", "dclr", "escl", "noise", "gist", "matryoshka",
              "gist-matryoshka", "infonce-symmetric", "infonce-learnable", "infonce-margin",
              "infonce-prior", "smoothing", "supcon", "teacher", "features")
IMPLS = ("fastcl", "tiled", "reference", "compiled", "mnrl", "gistembed", "wrapped") + ALTERNATIVES
MNRL_OBJECTIVES = ("infonce", "infonce-hard", "matryoshka")
#: The implementations that compute only some objectives: the sentence-transformers losses.
ONLY_FOR = {"mnrl": MNRL_OBJECTIVES, "gistembed": ("gist",), "wrapped": ("matryoshka", "gist-matryoshka")}
#: The objectives with options the reference's plain functions (hence ``compiled``) lack.
NOT_COMPILED = ("gist", "matryoshka", "gist-matryoshka", "infonce-margin", "infonce-prior",
                "smoothing", "supcon", "teacher", "features")


def matryoshka_dims(d: int) -> tuple[int, ...]:
    """The five widths of the matryoshka objective: 768, 512, 256, 128, 64 at d = 768."""
    return tuple(sorted({d, max(1, 2 * d // 3), max(1, d // 3), max(1, d // 6), max(1, d // 12)},
                        reverse=True))
COMPLEMENTARY_DIM = 384

_FUNCTIONS = {"infonce": "infonce", "infonce-hard": "infonce", "infonce-symmetric": "infonce",
              "infonce-learnable": "infonce", "infonce-margin": "infonce", "infonce-prior": "infonce",
              "focal": "focal_infonce",
              "dclr": "dclr_loss", "escl": "escl_loss", "noise": "dclr_noise", "gist": "contrastive",
              "matryoshka": "contrastive", "gist-matryoshka": "contrastive",
              "smoothing": "infonce", "supcon": "infonce", "teacher": "contrastive",
              "features": "contrastive"}


def num_candidates(objective: str, n: int) -> int:
    """M: the candidate columns of the main loss (the noise count K for ``noise``)."""
    if objective in ("gist", "gist-matryoshka"):
        return 3 * n
    return 2 * n if objective in ("infonce-hard", "dclr") else n


def useful_flops(objective: str, n: int, d: int) -> float:
    """GEMM FLOPs of one call that no implementation can avoid (see the module docstring)."""
    m = num_candidates(objective, n)
    if objective == "noise":
        return float(NOISE_STEPS * 4 * n * n * d)
    flops = 6.0 * n * m * d
    if objective == "dclr":
        flops += 2.0 * n * n * COMPLEMENTARY_DIM + NOISE_STEPS * 4.0 * n * n * d
    if objective in ("teacher", "features"):      # the teacher's cosines
        flops += 2.0 * n * n * COMPLEMENTARY_DIM
    if objective in ("gist", "gist-matryoshka"):   # the positive's N scores, the guide's 4N cosines a row
        flops += 6.0 * n * n * d + 2.0 * n * 4 * n * COMPLEMENTARY_DIM
    return flops    # matryoshka: one loss at full width, the floor of a one-pass computation


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


def _gistembed():
    """sentence-transformers' GISTEmbedLoss from the embeddings on: its ``forward`` with the
    model's and the guide's forwards replaced by the given embeddings (each column's
    "features" are ``{"model": h, "guide": g}``), margin 0, every block on."""
    import torch
    try:
        from sentence_transformers.sentence_transformer.losses import gist_embed as module
    except ImportError as err:
        raise RuntimeError("gistembed needs sentence-transformers 6's module layout (its loss "
                           "embeds through embed_columns)") from err
    loss = module.GISTEmbedLoss.__new__(module.GISTEmbedLoss)
    torch.nn.Module.__init__(loss)
    loss.model, loss.guide = "model", "guide"
    loss.temperature, loss.margin_strategy, loss.margin = TEMPERATURE, "absolute", 0.0
    loss.contrast_anchors = loss.contrast_positives = True
    loss.gather_across_devices, loss.must_retokenize = False, False
    loss.similarity_fct = torch.nn.CosineSimilarity(dim=-1)
    loss.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def call(columns, guide_columns):
        features = [{"model": x, "guide": g} for x, g in zip(columns, guide_columns)]
        own = module.embed_columns
        module.embed_columns = lambda model, feats: [f[model] for f in feats]
        try:
            return loss(features, None)
        finally:
            module.embed_columns = own
    return call


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
    if impl in ONLY_FOR and objective not in ONLY_FOR[impl]:
        raise ValueError(f"{impl} does not compute {objective}")
    if impl == "compiled" and objective in NOT_COMPILED:
        raise ValueError(f"compiled compiles the reference's functions, which take no {objective} "
                         "options")

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
    elif objective == "matryoshka":
        kwargs["matryoshka_dims"] = matryoshka_dims(d)
    elif objective == "infonce-symmetric":
        kwargs["symmetric"] = True
    elif objective == "infonce-learnable":   # τ a 0-dim tensor that takes a gradient
        kwargs["temperature"] = torch.tensor(TEMPERATURE, device=device, requires_grad=True)
        leaves.append(kwargs["temperature"])
    elif objective == "infonce-margin":     # Qwen3-Embedding's self-referenced false negatives
        kwargs["false_negative_margin"] = 0.1
    elif objective == "infonce-prior":      # Chuang et al.'s debiased loss
        kwargs["positive_prior"] = 0.1
    elif objective == "smoothing":
        kwargs["label_smoothing"] = 0.1
    elif objective == "supcon":
        kwargs["labels"] = torch.randint(0, max(1, n // 4), (n,), generator=gen, device=device)
    elif objective in ("teacher", "features"):
        # a teacher of the complementary width; "features": every option that composes with
        # it too (a learnable τ, the margin, smoothing, labels; positive_prior takes no
        # soft target, so it is measured on its own)
        t = randn(n, COMPLEMENTARY_DIM, grad=False)
        kwargs.update(teacher=(t, (t.float() + 0.5 * randn(n, COMPLEMENTARY_DIM, grad=False).float()).to(tdtype)),
                      distill_weight=0.5)
        if objective == "features":
            kwargs.update(false_negative_margin=0.1, label_smoothing=0.1,
                          labels=torch.randint(0, max(1, n // 4), (n,), generator=gen, device=device),
                          temperature=torch.tensor(TEMPERATURE, device=device, requires_grad=True))
            leaves.append(kwargs["temperature"])
    if objective in ("gist", "gist-matryoshka"):
        negatives = randn(n, d)
        leaves.append(negatives)
        args.append(negatives)
        g = randn(n, COMPLEMENTARY_DIM, grad=False)
        guide = (g, (g.float() + 0.5 * randn(n, COMPLEMENTARY_DIM, grad=False).float()).to(tdtype),
                 randn(n, COMPLEMENTARY_DIM, grad=False))
        kwargs.update(directions=fastcl.layout.gist(), guide=guide, guide_margin=0.0)
        if objective == "gist-matryoshka":
            kwargs["matryoshka_dims"] = matryoshka_dims(d)

    name = _FUNCTIONS[objective]
    note = ""
    if impl in ALTERNATIVES:
        fn, note = alternative_loss(impl, objective, device, TEMPERATURE,
                                    dims=kwargs.get("matryoshka_dims"))
        backend = "cce-triton" if impl == "cce" and device == "cuda" else (
            "cce-torch_compile" if impl == "cce" else impl)
        kwargs = {}
    elif impl == "mnrl" and objective == "matryoshka":
        loss_fn, dims = _mnrl(), kwargs["matryoshka_dims"]
        backend = "mnrl"
        unit = torch.nn.functional.normalize   # MatryoshkaLoss's shrink: prefix, then normalize
        fn = lambda *xs, **_: sum(loss_fn.compute_loss_from_embeddings([unit(x[:, :k], dim=-1) for x in xs],
                                                                      None) for k in dims)
        kwargs = {}
    elif impl == "wrapped":
        dims = kwargs.pop("matryoshka_dims")
        backend = fastcl.resolve_backend("auto", anchors)
        fn = lambda *xs, **kw: sum(getattr(fastcl, name)(*(x[:, :k] for x in xs), **kw) for k in dims)
        note = "one fused loss per width, summed (MatryoshkaLoss around FastInfoNCELoss)"
    elif impl == "mnrl":
        loss_fn = _mnrl()
        backend = "mnrl"
        fn = lambda *xs, **_: loss_fn.compute_loss_from_embeddings(list(xs), None)
        kwargs = {}
    elif impl == "gistembed":
        gist_fn, guide = _gistembed(), kwargs["guide"]
        backend = "gistembed"
        fn = lambda *xs, **_: gist_fn(list(xs), list(guide))
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
