"""Public functional API: argument checks, then dispatch to a backend.

Backends: ``"reference"`` (:mod:`fastcl.reference`, full matrices), ``"tiled"``
(:mod:`fastcl.tiled`, chunked, any device), ``"triton"`` (fused kernels, CUDA) and
``"auto"`` (Triton for CUDA tensors once the kernels are built in, tiled otherwise).
"""

from __future__ import annotations

import os

from typing import Literal

import torch
from torch import Tensor

from . import _validation as check
from . import common, layout, reference, tiled
from .kernels import triton_available
from .tiled import Epilogue

__all__ = ["contrastive", "infonce", "focal_infonce", "dclr_loss", "dclr_noise", "escl_loss",
           "resolve_backend"]

Backend = Literal["auto", "reference", "tiled", "triton"]
Formulation = Literal["paper", "released"]


#: Looked up once, at import: torch.compile before torch 2.6 breaks the graph at a call of
#: ``find_spec``, even through a cache.
_TRITON_INSTALLED = triton_available()


def _triton_problem(x: torch.Tensor) -> str | None:
    """Why the Triton backend cannot take ``x`` (None if it can)."""
    if not _TRITON_INSTALLED:
        return "the triton package is not installed (pip install 'fastcl[triton]')"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the kernels take float32, float16 or bfloat16 embeddings, not {x.dtype}"
    if x.is_meta:
        return "the embeddings are meta tensors, which hold no data for a kernel to read"
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return ("the embeddings are on the CPU: the kernels need CUDA tensors, or "
                "TRITON_INTERPRET=1 (set before fastcl.kernels is imported) to run them in "
                "Triton's interpreter")
    return None


def resolve_backend(backend: Backend, x: Tensor) -> str:
    """The backend a loss call with ``backend`` runs on for embeddings like ``x``: the
    rule of ``"auto"`` (Triton for CUDA tensors it can take, tiled otherwise), and a clear
    error when ``"triton"`` cannot run."""
    check.choice("backend", backend, check.BACKENDS)
    if backend == "triton":
        problem = _triton_problem(x)
        if problem:
            raise ValueError(f"backend='triton' cannot run here: {problem}; use backend='tiled'")
    elif backend == "auto":
        backend = "triton" if x.is_cuda and _triton_problem(x) is None else "tiled"
    return backend


def _engine(backend: str):
    """The chunk engine of the shared tiled driver for a resolved backend."""
    if backend == "triton":
        from .kernels.contrastive import triton_chunk
        return triton_chunk
    return tiled.torch_chunk


def _anchors_and_positives(anchors, positives, anchor_offset=None):
    """Anchors (N×d) and positives: N rows, or — with ``anchor_offset`` — the whole batch the
    anchors are rows ``[anchor_offset, anchor_offset + N)`` of. Returns the offset as an int."""
    anchors = check.embeddings("anchors", anchors, scale_free=True)
    if anchor_offset is None:
        positives = check.embeddings("positives", positives, rows=anchors.shape[0],
                                     width=anchors.shape[1], like=anchors, scale_free=True)
        anchor_offset = 0
    else:
        anchor_offset = check.non_negative_int("anchor_offset", anchor_offset)
        positives = check.embeddings("positives", positives, width=anchors.shape[1], like=anchors,
                                     scale_free=True)
        if positives.shape[0] < anchor_offset + anchors.shape[0]:
            raise ValueError(
                f"positives has {positives.shape[0]} rows but anchor_offset={anchor_offset} with "
                f"{anchors.shape[0]} anchors needs at least {anchor_offset + anchors.shape[0]}")
    return anchors, positives, anchor_offset


def _negatives(negatives, anchors):
    if negatives is None:
        return None
    return check.embeddings("negatives", negatives, width=anchors.shape[1], like=anchors,
                             allow_empty=True, scale_free=True)


@check.one_host_read
def contrastive(anchors: Tensor, positives: Tensor, negatives: Tensor | None = None, *,
                temperature: float = common.TEMPERATURE, focal_m: float | None = None,
                hard_negative_weight: float = 0.0,
                complementary: tuple[Tensor, Tensor] | None = None, phi: float = common.PHI,
                noise: Tensor | None = None, noise_ratio: float = 0.0,
                noise_steps: int = common.NOISE_STEPS, noise_lr: float = common.NOISE_LR,
                noise_std: float = common.NOISE_STD, noise_temperature: float | None = None,
                generator: torch.Generator | None = None, formulation: Formulation = "paper",
                symmetric: bool = False, anchor_offset: int | None = None,
                directions: tuple[str, ...] = ("query_to_doc",), partition_mode: str = "joint",
                hardness_mode: str | None = None, hardness_strength: float = 0.0,
                anchor_candidates: Tensor | None = None, guide: tuple | None = None,
                guide_margin: float = 0.0, margin_strategy: str = "absolute",
                duplicate_ids: tuple | None = None,
                matryoshka_dims: tuple[int, ...] | None = None,
                matryoshka_weights: tuple[float, ...] | None = None,
                backend: Backend = "auto", chunk_size: int | None = None) -> Tensor:
    r"""The composable objective: InfoNCE with any set of the features below, on every backend.

    :func:`infonce`, :func:`focal_infonce` and :func:`dclr_loss` are special cases of it.
    Notation: anchors ``h_i`` (N rows), candidates ``k = [h⁺; h⁻; Z]`` — the positives (N_b
    rows: the batch, N_b = N unless ``anchor_offset``), then ``negatives`` (K rows, optional),
    then the noise negatives ``Z`` (K_z rows, optional) — and ``s_ij = cos(h_i, k_j)``.
    Anchor i's positive is column ``p(i) = anchor_offset + i``.

    **Logits.** ``l_ij = s_ij/τ``. With ``focal_m = m`` (Focal-InfoNCE) the positive gets
    ``l_{i,p(i)} = s²/τ`` and every other column — in-batch, hard and noise negatives alike —
    ``l_ij = s_ij(s_ij + m)/τ``. With ``hard_negative_weight = w`` the log-weight ``w`` is added
    at column ``N_b + p(i)`` (anchor i's own hard negative: ``negatives`` then has N_b rows).

    **Mask** (DCLR's instance weighting, ``complementary = (c, c⁺)``, a frozen model's
    embeddings of the anchors and of the N_b positives): ``α_ij = 1[cos(c_i, c⁺_j) < φ]`` on
    the in-batch columns ``j < N_b``, ``j ≠ p(i)``; ``α = 1`` on the positive, on ``negatives``
    and on ``Z``. Without ``complementary`` every ``α_ij = 1``.

    **Noise negatives.** ``Z = dclr_noise(h, h⁺, K_z, steps=noise_steps, lr=noise_lr,
    std=noise_std, temperature=noise_temperature or τ, noise=noise, generator=generator,
    formulation=formulation)``: ``K_z = round(noise_ratio·N_b)`` rows drawn from
    ``N(0, noise_std²)``, or the rows of ``noise`` as the starting point; then the normalized
    gradient-ascent steps of :func:`dclr_noise`, which always use the plain logits (focal,
    ``w`` and α do not enter the noise update). ``Z`` carries no gradient. No noise columns
    when ``noise is None`` and ``noise_ratio = 0`` (the default).

    **Loss** (``formulation="paper"``, the default):

    .. math:: L^{\rightarrow} = \frac1N\sum_i\Big[-l_{i,p(i)}
              + \log\sum_j \alpha_{ij}\,e^{l_{ij}}\Big]

    A dropped negative leaves the denominator; with every feature off this is SimCSE's InfoNCE.

    **symmetric=True** averages with the reverse direction, ``L = ½(L^→ + L^←)``, where the
    positives are the anchors and the anchors the candidates (``s'_ij = cos(h⁺_i, h_j)``,
    positive in column i). The per-pair features apply to both directions — the focal
    modulation, and the mask transposed, ``α'_ij = 1[cos(c⁺_i, c_j) < φ]`` — while the extra
    columns belong to the forward direction only: ``L^←`` has no ``negatives``, no ``w``
    and no ``Z``. It needs every anchor of the batch (no ``anchor_offset``).

    **formulation="released"** is DCLR as the authors' released code computes it (the table
    in :func:`dclr_loss`'s docstring: logits multiplied by α, binary cross-entropy on the row
    softmax averaged over all N·M entries, the mask test ``cos/τ > 20φ``, noise columns dropped
    when φ < 0, ``K_z = int(N_b·noise_ratio)``, the released noise update). It combines with
    ``complementary``/``phi`` and the noise options only: ``focal_m``, ``negatives``,
    ``hard_negative_weight`` or ``symmetric`` with it raise a ``ValueError`` naming them.

    **directions, partition_mode** (sentence-transformers' ``MultipleNegativesRankingLoss``;
    :mod:`fastcl.layout` states every rule). Each row may score more than its anchor against
    the candidates: ``"query_to_query"`` adds the anchors ``h_j`` (j ≠ i) as candidates of
    anchor i; ``"doc_to_query"`` scores its positive ``h⁺_i`` against every anchor;
    ``"doc_to_doc"`` scores ``h⁺_i`` against the positives and negatives of the other rows.
    With ``partition_mode="joint"`` (the default) every score of row i shares one softmax,
    ``ℓ_i = −l_{i,p(i)} + log Σ e^l``; with ``"per_direction"`` (``query_to_doc`` and
    ``doc_to_query`` only) ``ℓ_i = −l_{i,p(i)} + ½(LSE^{→}_i + LSE^{←}_i)``. The positive's
    scores never see the noise, ``negatives``' log-weight or the DCLR mask; focal applies to
    them: ``s²/τ`` on the row's own anchor (the positive pair, as ``symmetric`` has it),
    ``s(s+m)/τ`` on every other score.

    **hardness_mode, hardness_strength β** (MNRL's, after Lan et al. 2025): ``β·sg(s_ij)`` is
    added to the logits of the anchor's ``"in_batch_negatives"`` (the other rows' positives
    and negatives), its own ``"hard_negatives"`` or ``"all_negatives"``; no gradient flows
    through it (the logit's slope stays that of ``s/τ``).

    **guide** (GISTEmbedLoss's false-negative filter): a frozen model's embeddings
    ``(g_anchors, g_positives, g_negatives or None, g_anchor_candidates or None)`` of the
    same rows; with ``γ_i = cos(g_i, g⁺_{p(i)})`` and ``θ_i = γ_i − guide_margin``
    (``margin_strategy="absolute"``) or ``γ_i − |γ_i|·guide_margin`` (``"relative"``), every
    score whose guide cosine is ``> θ_i`` leaves the softmax, except the positive (and, on
    the positive's side, its own anchor). The noise is never filtered.

    **duplicate_ids** ``(positive_ids, negative_ids or None, anchor_ids or None)``: integer
    ids of the candidates' texts (e.g. a hash of their token ids); a candidate whose id
    equals that of the row's positive leaves the softmax (the same exceptions as the guide).

    **matryoshka_dims** ``(d_1, …, d_K)`` with ``matryoshka_weights`` ``(w_1, …, w_K)`` (all 1
    by default): ``L = Σ_k w_k·L(x[:, :d_k])``, the loss of every prefix of the embeddings
    (their own cosines), as sentence-transformers' ``MatryoshkaLoss`` around this loss. The
    tiled path computes every width in one pass over d (:func:`fastcl.tiled.matryoshka_forward`),
    with focal, the hard negatives' log-weight, the DCLR mask, ``symmetric`` and the options
    above (the masks, the guide's filter among them, computed once for every width); the
    Triton backend makes a fused call per width (the GEMM work of ``Σ_k d_k`` columns, 2.25×
    one loss for 768, 512, 256, 128, 64). Not with the noise or ``formulation="released"``.

    Args:
        anchors: (N, d) first view.
        positives: (N, d) second view (N_b rows with ``anchor_offset``); row i is anchor
            i's positive.
        negatives: optional (K, d) extra negatives: hard negatives (row i belongs to anchor
            i, K = N_b) or any K rows such as a queue.
        temperature: τ ≥ (2 + |m|)/√max of the accumulate dtype (1.08e-19 for float32 and
            16-bit inputs; below it the logits or their gradient overflow).
        focal_m: Focal-InfoNCE's m (None: no focal modulation; m = 0 still squares every
            cosine, s²/τ).
        hard_negative_weight: the log-weight ``w``; needs K = N_b ``negatives``.
        complementary: ``(c, c⁺)`` — (N, d_c) and (N_b, d_c) — turns the DCLR mask on.
        phi: the mask's cosine threshold φ ∈ [-1, 1] (read only with ``complementary``).
        noise: optional (K_z, d) starting noise (fixes K_z; ``noise_steps=0`` uses it as is).
        noise_ratio: ``K_z = round(noise_ratio·N_b)`` when ``noise`` is None; ≥ 0.
        noise_steps, noise_lr, noise_std, noise_temperature, generator: the noise update
            (:func:`dclr_noise`'s ``steps``, ``lr``, ``std``, ``temperature`` — default τ — and
            ``generator``).
        formulation: "paper" or "released" (above).
        symmetric: also score positives against anchors and average the two directions.
        anchor_offset: the anchors are rows ``[anchor_offset, anchor_offset + N)`` of the
            batch that ``positives``, ``negatives`` and ``complementary[1]`` hold (global
            negatives across processes; as in :func:`infonce`). The noise update then sees
            only these anchors (:func:`dclr_loss` says how to share one ``Z``).
        directions, partition_mode: as above (MNRL's names and defaults); ``directions`` may
            also be a :class:`fastcl.layout.Layout`, e.g. ``fastcl.layout.gist()`` for
            GISTEmbedLoss's blocks (then ``partition_mode`` stays "joint").
        hardness_mode: None, "in_batch_negatives", "hard_negatives" or "all_negatives".
        hardness_strength: β ≥ 0 (0: off).
        anchor_candidates: the whole batch's anchors (N_b rows) for ``"query_to_query"`` and
            ``"doc_to_query"`` when ``anchor_offset`` is given, or any rows that anchor i
            finds at row i (default: ``anchors``).
        guide, guide_margin, margin_strategy: the guide's filter (above).
        duplicate_ids: the texts' ids (above).
        matryoshka_dims, matryoshka_weights: the prefix widths and their weights (above).
        backend: "auto", "reference", "tiled" or "triton". The Triton kernels compute the
            directions, hardness, guide and duplicate ids with InfoNCE, focal and the noise,
            and ``matryoshka_dims`` a call per width, not those options beside
            ``hard_negative_weight`` or the DCLR mask: ``"auto"`` runs those on the tiled
            path, ``"triton"`` refuses them.
        chunk_size: anchor rows per chunk in the tiled path (default: from a memory budget).

    Returns the scalar loss (float32 for 16-bit inputs); gradients flow to ``anchors``,
    ``positives``, ``negatives`` and ``anchor_candidates`` (never to ``complementary``,
    ``guide`` or ``Z``).

    References: Gao, Yao & Chen, "SimCSE", EMNLP 2021; Hou & Li, "Improving Contrastive
    Learning of Sentence Embeddings with Focal-InfoNCE", Findings of EMNLP 2023; Zhou et al.,
    "Debiased Contrastive Learning of Unsupervised Sentence Representations", ACL 2022.
    """
    anchors, positives, anchor_offset = _anchors_and_positives(anchors, positives, anchor_offset)
    negatives = _negatives(negatives, anchors)
    n, n_pos = anchors.shape[0], positives.shape[0]
    focal_m = None if focal_m is None else check.finite("focal_m", focal_m)
    hard_negative_weight = check.finite("hard_negative_weight", hard_negative_weight)
    temperature = check.temperature(temperature, anchors.dtype, focal_m=focal_m,
                                    hard_negative_weight=hard_negative_weight)
    _check_hard_negatives(hard_negative_weight, negatives, n_pos)
    complementary = check.complementary(complementary, n, n_pos, anchors.device)
    phi = check.phi(phi)
    noise_ratio = _noise_ratio(noise_ratio)
    formulation = check.choice("formulation", formulation, ("paper", "released"))
    symmetric = _check_symmetric(symmetric, n, n_pos)
    if formulation == "released":
        others = [name for name, on in (("focal_m", focal_m is not None),
                                         ("negatives", negatives is not None),
                                         ("hard_negative_weight", bool(hard_negative_weight)),
                                         ("symmetric", symmetric)) if on]
        if others:
            raise ValueError(
                f"formulation='released' is DCLR as the authors' code computes it and combines "
                f"with complementary, phi and the noise options only; got {', '.join(others)} "
                f"as well: use formulation='paper' to combine them")
    rules = _rules(anchors, positives, negatives, anchor_offset, directions, partition_mode,
                   hardness_mode, hardness_strength, anchor_candidates, guide, guide_margin,
                   margin_strategy, duplicate_ids)
    if rules:
        others = [name for name, on in (("symmetric", symmetric),
                                         ("formulation='released'", formulation == "released"))
                  if on]
        if others:
            raise ValueError(f"{' and '.join(others)} cannot be combined with directions, "
                             f"hardness_mode, guide or duplicate_ids (symmetric=True is "
                             f"directions=('query_to_doc', 'doc_to_query'), "
                             f"partition_mode='per_direction')")
    matryoshka = _matryoshka(matryoshka_dims, matryoshka_weights, anchors.shape[1])
    if matryoshka is not None:
        others = [name for name, on in (
            ("formulation='released'", formulation == "released"),
            ("noise", noise is not None or common.noise_count(noise_ratio, n_pos, formulation) > 0))
            if on]
        if others:
            raise ValueError(f"matryoshka_dims does not combine with {' or '.join(others)}")
        rules = {**rules, "matryoshka": matryoshka}
    noise_temperature = temperature if noise_temperature is None else noise_temperature
    num = None if noise is not None else common.noise_count(noise_ratio, n_pos, formulation)
    steps, lr, std, noise_temperature, noise = _noise_args(
        anchors, num, noise_steps, noise_lr, noise_std, noise_temperature, noise)
    generator = check.generator(generator, anchors.device)
    chunk_size = check.chunk_size(chunk_size)
    check.read_inputs()
    return _contrastive(anchors, positives, negatives, temperature=temperature, focal_m=focal_m,
                        hard_negative_weight=hard_negative_weight, complementary=complementary,
                        phi=phi, noise=noise, noise_ratio=noise_ratio, noise_steps=steps,
                        noise_lr=lr, noise_std=std, noise_temperature=noise_temperature,
                        generator=generator, formulation=formulation, symmetric=symmetric,
                        anchor_offset=anchor_offset,
                        backend=_backend_for_rules(
                            backend, anchors, rules, hard_negative_weight=hard_negative_weight,
                            complementary=complementary),
                        chunk_size=chunk_size, **rules)


def _contrastive(anchors, positives, negatives=None, *, temperature, focal_m=None,
                 hard_negative_weight=0.0, complementary=None, phi=common.PHI, noise=None,
                 noise_ratio=0.0, noise_steps=common.NOISE_STEPS, noise_lr=common.NOISE_LR,
                 noise_std=common.NOISE_STD, noise_temperature=None, generator=None,
                 formulation="paper", symmetric=False, anchor_offset=0, backend, chunk_size=None,
                 **rules):
    """:func:`contrastive` on checked arguments and a resolved backend: what every public
    loss but ESCL runs. Autocast is off inside, on every backend: the loss depends on the
    inputs' dtype only (autocast would round the cosine GEMMs, hence the logits, to 16 bits).
    ``rules``: what :func:`_rules` returns."""
    with common.autocast_off(anchors.device):
        return _contrastive_on(
            anchors, positives, negatives, temperature=temperature, focal_m=focal_m,
            hard_negative_weight=hard_negative_weight, complementary=complementary, phi=phi,
            noise=noise, noise_ratio=noise_ratio, noise_steps=noise_steps, noise_lr=noise_lr,
            noise_std=noise_std, noise_temperature=noise_temperature, generator=generator,
            formulation=formulation, symmetric=symmetric, anchor_offset=anchor_offset,
            backend=backend, chunk_size=chunk_size, **rules)


def _contrastive_on(anchors, positives, negatives, *, temperature, focal_m, hard_negative_weight,
                    complementary, phi, noise, noise_ratio, noise_steps, noise_lr, noise_std,
                    noise_temperature, generator, formulation, symmetric, anchor_offset, backend,
                    chunk_size, **rules):
    noise_temperature = temperature if noise_temperature is None else noise_temperature
    if backend == "reference" and "matryoshka" not in rules:
        return reference.contrastive(
            anchors, positives, negatives, temperature=temperature, focal_m=focal_m,
            hard_negative_weight=hard_negative_weight, complementary=complementary, phi=phi,
            noise=noise, noise_ratio=noise_ratio, noise_steps=noise_steps, noise_lr=noise_lr,
            noise_std=noise_std, noise_temperature=noise_temperature, generator=generator,
            formulation=formulation, symmetric=symmetric, anchor_offset=anchor_offset, **rules)
    if "matryoshka" in rules:
        rules = dict(rules)
        dims, weights = rules.pop("matryoshka")
        # on the Triton backend, whose kernels take one width, a fused call per width (the
        # one pass over d is the tiled path's)
        if backend == "triton":
            return sum(w * _contrastive_on(
                *_prefixes(k, anchors, positives, negatives), temperature=temperature,
                focal_m=focal_m, hard_negative_weight=hard_negative_weight,
                complementary=complementary, phi=phi, noise=None, noise_ratio=0.0,
                noise_steps=0, noise_lr=noise_lr, noise_std=noise_std,
                noise_temperature=noise_temperature, generator=None, formulation=formulation,
                symmetric=symmetric, anchor_offset=anchor_offset, backend=backend,
                chunk_size=chunk_size, **_prefix_rules(k, rules)) for k, w in zip(dims, weights))
        return _matryoshka_loss(anchors, positives, negatives, backend, (dims, weights),
                                temperature=temperature, focal_m=focal_m,
                                hard_negative_weight=hard_negative_weight,
                                complementary=complementary, phi=phi, symmetric=symmetric,
                                anchor_offset=anchor_offset, chunk_size=chunk_size, rules=rules)
    engine = _engine(backend)
    blocks = [positives] + ([] if negatives is None else [negatives])
    num = (noise.shape[0] if noise is not None
           else common.noise_count(noise_ratio, positives.shape[0], formulation))
    if noise is not None or num:
        z = _dclr_noise(anchors, positives, num, noise_steps, noise_lr, noise_std,
                        noise_temperature, noise, generator, backend, chunk_size, formulation,
                        anchor_offset)
        # Z is not rescaled before its update (a step of lr is not scale-free); as loss
        # candidates its rows only enter through cosines
        blocks.append(common.shrink_huge_rows(z).to(anchors.dtype))
    masked = complementary is not None
    fields = dict(temperature=temperature, focal_m=focal_m,
                  hard_negative_weight=hard_negative_weight, phi=phi if masked else None,
                  complementary=complementary, formulation=formulation, chunk_size=chunk_size,
                  anchor_offset=anchor_offset)
    if rules:
        # the Triton kernels read the guide in the GEMM dtype: cast once here, not per chunk
        guide_dtype = tiled.matmul_dtype(anchors.dtype, anchors.device) if backend == "triton" else None
        rows, blocks, ep = _with_rules(fields, anchors, positives, negatives, blocks, rules,
                                       guide_dtype)
        return tiled.contrastive_loss(ep, rows, *blocks, engine=engine)
    loss = tiled.contrastive_loss(Epilogue(**fields), anchors, *blocks, engine=engine)
    if symmetric:
        # the reverse direction: positives against the anchors, focal and the transposed mask
        reverse = Epilogue(temperature, focal_m=focal_m, phi=phi if masked else None,
                           complementary=(complementary[1], complementary[0]) if masked else None,
                           chunk_size=chunk_size)
        loss = 0.5 * (loss + tiled.contrastive_loss(reverse, positives, anchors, engine=engine))
    return loss


def _rules(anchors, positives, negatives, anchor_offset, directions, partition_mode,
           hardness_mode, hardness_strength, anchor_candidates, guide, guide_margin,
           margin_strategy, duplicate_ids) -> dict:
    """The checked options of :mod:`fastcl.layout` as the keyword arguments the backends take,
    or ``{}`` when none is on (plain InfoNCE's layout, no hardness, guide or ids). (Here and
    in the helpers, a row count is compared with 0, never tested for truth: torch.compile
    before torch 2.6 fixes a traced batch size at ``if n``.)"""
    # checked whatever else is given (a strategy or margin without a guide is a mistake too)
    check.choice("margin_strategy", margin_strategy, layout.MARGIN_STRATEGIES)
    if (layout.names_plain(directions, partition_mode) and hardness_mode is None
            and guide is None and duplicate_ids is None and anchor_candidates is None):
        return {}          # the plain layout, decided without building one (torch.compile)
    n, n_pos = anchors.shape[0], positives.shape[0]
    n_neg = 0 if negatives is None else negatives.shape[0]
    if isinstance(directions, layout.Layout):
        if partition_mode != "joint":
            raise ValueError("partition_mode goes with directions given by name; a Layout says "
                             "its own (Layout.joint)")
        lay = directions
    else:
        lay = layout.from_directions(directions, partition_mode)
    if hardness_mode is not None:
        check.choice("hardness_mode", hardness_mode, layout.HARDNESS_MODES)
    hardness_strength = check.finite("hardness_strength", hardness_strength)
    if hardness_strength < 0:
        raise ValueError(f"hardness_strength must be >= 0, got {hardness_strength}")
    guide_margin = check.finite("guide_margin", guide_margin)
    if lay.plain and hardness_mode is None and guide is None and duplicate_ids is None:
        if anchor_candidates is not None:
            raise ValueError("anchor_candidates is read only with directions that score the "
                             "anchors ('query_to_query', 'doc_to_query')")
        return {}
    grouped = (hardness_mode is not None and hardness_strength) or (
        lay.positive_to_negatives and lay.exclude_own)
    if grouped and n_neg % n_pos:
        raise ValueError(f"hardness_mode and 'doc_to_doc' need the negatives as whole columns "
                         f"(a multiple of the {n_pos} positives, row j of each belonging to "
                         f"anchor j), got {n_neg} negatives")
    if lay.scores_anchors:
        if anchor_candidates is None:
            if n != n_pos:
                raise ValueError("directions that score the anchors need anchor_candidates (the "
                                 "whole batch's anchors) when anchor_offset is given")
            anchor_candidates = anchors
        else:
            anchor_candidates = check.embeddings("anchor_candidates", anchor_candidates,
                                                 width=anchors.shape[1], like=anchors,
                                                 scale_free=True)
            if anchor_candidates.shape[0] not in (n, n_pos):
                raise ValueError(f"anchor_candidates has {anchor_candidates.shape[0]} rows: it "
                                 f"holds the whole batch's anchors ({n_pos}) or these anchors ({n})")
    elif anchor_candidates is not None:
        raise ValueError("anchor_candidates is read only with directions that score the "
                         "anchors ('query_to_query', 'doc_to_query')")
    n_a = 0 if anchor_candidates is None or not lay.scores_anchors else anchor_candidates.shape[0]
    if guide is not None:
        guide = _guide(guide, n, n_pos, n_neg, n_a, anchors.device)
    if duplicate_ids is not None:
        duplicate_ids = _duplicate_ids(duplicate_ids, n_pos, n_neg, n_a, anchors.device)
    return dict(layout=lay, anchor_candidates=anchor_candidates if n_a > 0 else None,
                hardness_mode=hardness_mode if hardness_strength else None,
                hardness_strength=hardness_strength, guide=guide, guide_margin=guide_margin,
                margin_strategy=margin_strategy, duplicate_ids=duplicate_ids)


def _matryoshka(dims, weights, d):
    """``matryoshka_dims`` and ``matryoshka_weights`` checked: ``((d_1 < … < d_K), (w_k…))``
    sorted by width, or None when ``dims`` is None (``d``: the embeddings' width, None where
    it is not known yet)."""
    if dims is None:
        if weights is not None:
            raise ValueError("matryoshka_weights needs matryoshka_dims")
        return None
    if isinstance(dims, (int, str)) or not len(dims):
        raise TypeError(f"matryoshka_dims must be a non-empty sequence of widths, got {dims!r}")
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in dims):
        raise ValueError(f"matryoshka_dims must be positive integers, got {list(dims)}")
    dims = list(dims)
    if d is not None and max(dims) > d:
        raise ValueError(f"matryoshka_dims must lie in [1, {d}] (the embeddings' width), got {dims}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"matryoshka_dims has a width twice: {dims}")
    weights = [1.0] * len(dims) if weights is None else [check.finite("matryoshka_weights", w)
                                                          for w in weights]
    if len(weights) != len(dims):
        raise ValueError(f"matryoshka_weights has {len(weights)} entries for {len(dims)} widths")
    pairs = sorted(zip(dims, weights))
    return tuple(x for x, _ in pairs), tuple(w for _, w in pairs)


def _prefixes(k, *tensors):
    """The first ``k`` columns of each tensor (None stays None)."""
    return [None if x is None else x[:, :k] for x in tensors]


def _prefix_rules(k, rules):
    """``rules`` with the anchors block cut to its first ``k`` columns (the guide and the ids
    belong to the texts, not to a width)."""
    out = dict(rules)
    if out.get("anchor_candidates") is not None:
        out["anchor_candidates"] = out["anchor_candidates"][:, :k]
    return out


def _matryoshka_loss(anchors, positives, negatives, backend, matryoshka, *, temperature, focal_m,
                     hard_negative_weight, complementary, phi, symmetric, anchor_offset,
                     chunk_size, rules):
    """``Σ_k w_k·L(x[:, :d_k])``: the reference loss of each prefix (the literal sum), or the
    tiled path's one pass over every width (:func:`fastcl.tiled.matryoshka_forward`), with
    the layout's ``rules`` (:func:`_rules`) where there are any."""
    dims, weights = matryoshka
    if backend == "reference":
        return sum(w * reference.contrastive(
            *_prefixes(k, anchors, positives, negatives), temperature=temperature,
            focal_m=focal_m, hard_negative_weight=hard_negative_weight, complementary=complementary,
            phi=phi, symmetric=symmetric, anchor_offset=anchor_offset, **_prefix_rules(k, rules))
            for k, w in zip(dims, weights))
    blocks = [positives] + ([] if negatives is None else [negatives])
    fields = dict(temperature=temperature, focal_m=focal_m,
                  hard_negative_weight=hard_negative_weight,
                  phi=phi if complementary is not None else None, complementary=complementary,
                  chunk_size=chunk_size, anchor_offset=anchor_offset, matryoshka=matryoshka)
    if rules:
        rows, blocks, ep = _with_rules(fields, anchors, positives, negatives, blocks, rules)
        return tiled.contrastive_loss(ep, rows, *blocks)
    loss = tiled.contrastive_loss(Epilogue(**fields), anchors, *blocks)
    if symmetric:
        reverse = Epilogue(**{
            **fields, "hard_negative_weight": 0.0, "anchor_offset": 0,
            "complementary": None if complementary is None else (complementary[1], complementary[0])})
        loss = 0.5 * (loss + tiled.contrastive_loss(reverse, positives, anchors))
    return loss


def _guide(guide, n, n_pos, n_neg, n_a, device):
    """``guide=(g_anchors, g_positives, g_negatives, g_anchor_candidates)`` checked: the last
    two may be left out or None where there are no negatives or no anchors block (the anchors
    block's default: g_anchors, when those are its rows)."""
    if not isinstance(guide, (tuple, list)) or not 2 <= len(guide) <= 4:
        raise TypeError("guide must be a tuple (g_anchors, g_positives[, g_negatives"
                        "[, g_anchor_candidates]])")
    parts = list(guide) + [None] * (4 - len(guide))
    names = ("guide[0] (anchors)", "guide[1] (positives)", "guide[2] (negatives)",
             "guide[3] (anchor candidates)")
    if parts[3] is None and n_a == n:
        parts[3] = parts[0]
    rows = (n, n_pos, n_neg, n_a)
    out = []
    for name, x, want in zip(names, parts, rows):
        if x is None:
            if want > 0:
                raise ValueError(f"{name} is missing: the guide embeds every candidate block "
                                 f"({want} rows here)")
            out.append(None)
            continue
        x = check.embeddings(name, x, rows=want, width=out[0].shape[1] if out else None,
                             scale_free=True)
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but anchors are on {device}")
        if out and x.dtype != out[0].dtype:
            raise TypeError(f"{name} is {x.dtype} but guide[0] is {out[0].dtype}")
        out.append(x.detach() if want > 0 else None)
    return tuple(out)


def _duplicate_ids(ids, n_pos, n_neg, n_a, device):
    """``duplicate_ids=(positive_ids, negative_ids, anchor_ids)`` checked: 1-D integer tensors
    with one id per candidate row (None where the block is absent)."""
    if not isinstance(ids, (tuple, list)) or not 1 <= len(ids) <= 3:
        raise TypeError("duplicate_ids must be a tuple (positive_ids[, negative_ids[, anchor_ids]])")
    parts = list(ids) + [None] * (3 - len(ids))
    out = []
    for name, x, want in zip(("duplicate_ids[0] (positives)", "duplicate_ids[1] (negatives)",
                              "duplicate_ids[2] (anchor candidates)"), parts, (n_pos, n_neg, n_a)):
        if x is None:
            if want > 0:
                raise ValueError(f"{name} is missing: {want} candidates need an id each")
            out.append(None)
            continue
        if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dim() != 1 or x.shape[0] != want:
            raise ValueError(f"{name} must have shape ({want},), got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but anchors are on {device}")
        out.append(x.to(torch.long) if want > 0 else None)
    return tuple(out)


def _backend_for_rules(backend, anchors, rules, *, hard_negative_weight=0.0,
                       complementary=None) -> str:
    """The backend for a call with ``rules``: the Triton kernels apply the layout's rules,
    the guide and the ids on InfoNCE and focal (with DCLR's noise too), and Matryoshka's
    widths a call each, but not the layout's rules beside a hard-negative weight or DCLR's
    mask (the released formulation takes no rules at all); for those ``"auto"`` takes the
    tiled path and ``"triton"`` is refused with the reason."""
    be = resolve_backend(backend, anchors)
    if not rules or be != "triton":
        return be
    layout_rules = set(rules) - {"matryoshka"}
    lacking = [name for name, on in (
        ("hard_negative_weight", layout_rules and bool(hard_negative_weight)),
        ("complementary (DCLR's mask)", layout_rules and complementary is not None)) if on]
    if not lacking:
        return be
    if backend == "triton":
        raise ValueError(f"backend='triton' does not compute {' or '.join(lacking)} beside "
                         "directions beyond ('query_to_doc',), hardness_mode, guide or "
                         "duplicate_ids yet; use backend='tiled' (the same numbers, without "
                         "the N×M matrix)")
    return "tiled"


def _with_rules(fields, anchors, positives, negatives, blocks, rules, guide_dtype=None):
    """The tiled driver's inputs for a call with ``rules`` (:func:`_rules`): the rows
    (``[anchors; own positives]`` with a positive side), the candidate blocks with the
    anchors block last, and the epilogue of ``fields`` (an :class:`~fastcl.tiled.Epilogue`'s
    keyword arguments) with the column blocks, the guide's unit rows (in ``guide_dtype``,
    default the accumulate dtype) and thresholds (always in the accumulate dtype), the
    ids. (Epilogues are built whole, never ``dataclasses.replace``d: torch.compile before
    torch 2.6 breaks the graph there.)"""
    lay, anchor_candidates, guide, duplicate_ids = (
        rules["layout"], rules["anchor_candidates"], rules["guide"], rules["duplicate_ids"])
    hardness_mode = rules["hardness_mode"]
    n, n_pos = anchors.shape[0], positives.shape[0]
    offset = fields["anchor_offset"]
    n_neg = 0 if negatives is None else negatives.shape[0]
    n_noise = sum(b.shape[0] for b in blocks) - n_pos - n_neg
    n_a = 0 if anchor_candidates is None else anchor_candidates.shape[0]
    own = positives[offset:offset + n]
    rows = torch.cat([anchors, own]) if lay.positive_side else anchors
    blocks = list(blocks) + ([anchor_candidates] if n_a > 0 else [])
    g_rows = g_cols = theta = ids = None
    if guide is not None:
        acc = common.accumulate_dtype(anchors.dtype)
        unit = lambda x: torch.nn.functional.normalize(common.wide(x), dim=1, eps=common.EPS).to(acc)
        g_anchors, g_positives, g_negatives, g_cands = guide
        u_anchors, u_positives = unit(g_anchors), unit(g_positives)
        u_own = u_positives[offset:offset + n]
        gamma = (u_anchors * u_own).sum(dim=1)
        theta = layout.guide_threshold(gamma, rules["guide_margin"], rules["margin_strategy"])
        g_rows = torch.cat([u_anchors, u_own]) if lay.positive_side else u_anchors
        parts = [u_positives] + ([unit(g_negatives)] if n_neg > 0 else [])
        parts.append(u_anchors.new_zeros(n_noise, u_anchors.shape[1]))   # never filtered
        parts += [unit(g_cands)] if n_a > 0 else []
        g_cols = torch.cat(parts)
        theta = layout.keep_twin_ties(
            theta, gamma, [u_own] + ([u_anchors] if lay.positive_side else []), g_cols[:n_pos + n_neg]
            if n_a == 0 else torch.cat([g_cols[:n_pos + n_neg], g_cols[-n_a:]]),
            (1, int(n_a > 0)))
        if guide_dtype is not None:
            g_rows, g_cols = g_rows.to(guide_dtype), g_cols.to(guide_dtype)
    if duplicate_ids is not None:
        pos_ids, neg_ids, anchor_ids = duplicate_ids
        parts = [pos_ids] + ([neg_ids] if n_neg > 0 else [])
        parts.append(pos_ids.new_zeros(n_noise))                          # never compared
        parts += [anchor_ids] if n_a > 0 else []
        ids = (torch.cat(parts), pos_ids[offset:offset + n])
    ep = Epilogue(
        **fields, layout=lay, blocks=(n_pos, n_neg, n_noise, n_a),
        hardness=(hardness_mode, rules["hardness_strength"]) if hardness_mode is not None else None,
        guide=None if guide is None else (g_rows, g_cols, theta), ids=ids)
    return rows, blocks, ep


def _check_hard_negatives(hard_negative_weight, negatives, n_pos):
    if hard_negative_weight and (negatives is None or negatives.shape[0] != n_pos):
        got = "no negatives" if negatives is None else f"{negatives.shape[0]} negatives"
        raise ValueError(f"hard_negative_weight needs one hard negative per anchor "
                         f"({n_pos} negatives), got {got}")


def _check_symmetric(symmetric, n, n_pos) -> bool:
    symmetric = check.flag("symmetric", symmetric)
    if symmetric and n_pos != n:
        raise ValueError("symmetric=True needs every anchor of the batch in this call "
                         "(no anchor_offset slice)")
    return symmetric


def _noise_ratio(value):
    value = check.finite("noise_ratio", value)
    if value < 0:
        raise ValueError(f"noise_ratio must be >= 0, got {value}")
    return value


@check.one_host_read
def infonce(anchors: Tensor, positives: Tensor, negatives: Tensor | None = None, *,
            temperature: float = common.TEMPERATURE, hard_negative_weight: float = 0.0,
            symmetric: bool = False, anchor_offset: int | None = None, backend: Backend = "auto",
            chunk_size: int | None = None) -> Tensor:
    r"""InfoNCE over in-batch negatives: unsupervised and supervised SimCSE.

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}}{\tau}
              + \log\sum_j \exp\big(\frac{s_{ij}}{\tau} + w\,[j = N+i]\big)\Big]

    with ``s_ij = cos(anchors_i, k_j)`` and candidates ``k = [positives; negatives]``.

    Args:
        anchors: (N, d) first view.
        positives: (N, d) second view; row i is anchor i's positive.
        negatives: optional (K, d) extra negatives: hard negatives (row i belongs to
            anchor i, K = N) or any K rows such as a queue.
        temperature: τ > 0.
        hard_negative_weight: log-weight ``w`` added to the logit of each anchor's own hard
            negative (column N + i); needs K = N.
        symmetric: also score positives against anchors and average the two directions.
        anchor_offset: for global negatives across processes (None: positives has exactly
            the anchors' rows): the anchors are rows ``[anchor_offset, anchor_offset + N)``
            of the batch that ``positives`` and ``negatives`` hold (anchor i's positive is
            ``positives[anchor_offset + i]``, its hard negative ``negatives[anchor_offset + i]``);
            the loss is their mean.
        backend: "auto", "reference", "tiled" or "triton".
        chunk_size: anchor rows per chunk in the tiled path (default: from a memory budget).

    Reference: Gao, Yao & Chen, "SimCSE", EMNLP 2021.
    """
    anchors, positives, anchor_offset = _anchors_and_positives(anchors, positives, anchor_offset)
    negatives = _negatives(negatives, anchors)
    hard_negative_weight = check.finite("hard_negative_weight", hard_negative_weight)
    temperature = check.temperature(temperature, anchors.dtype,
                                    hard_negative_weight=hard_negative_weight)
    _check_hard_negatives(hard_negative_weight, negatives, positives.shape[0])
    symmetric = _check_symmetric(symmetric, anchors.shape[0], positives.shape[0])
    chunk_size = check.chunk_size(chunk_size)
    check.read_inputs()
    return _contrastive(anchors, positives, negatives, temperature=temperature,
                        hard_negative_weight=hard_negative_weight, symmetric=symmetric,
                        anchor_offset=anchor_offset, backend=resolve_backend(backend, anchors),
                        chunk_size=chunk_size)


@check.one_host_read
def focal_infonce(anchors: Tensor, positives: Tensor, negatives: Tensor | None = None, *,
                  temperature: float = common.TEMPERATURE, m: float = common.FOCAL_M,
                  anchor_offset: int | None = None, backend: Backend = "auto",
                  chunk_size: int | None = None) -> Tensor:
    r"""Focal-InfoNCE: InfoNCE whose logits are modulated by the similarity itself.

    Positive logit ``s²/τ``, negative logits ``s(s+m)/τ``:

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}^2}{\tau} + \log\Big(e^{s_{ii}^2/\tau}
              + \sum_{j\ne i} e^{s_{ij}(s_{ij}+m)/\tau}\Big)\Big]

    Hard negatives get up-weighted (large s), easy ones down-weighted. Nothing is detached.

    ``anchor_offset``: as in :func:`infonce`.

    Reference: Hou & Li, "Improving Contrastive Learning of Sentence Embeddings with
    Focal-InfoNCE", Findings of EMNLP 2023.
    """
    anchors, positives, anchor_offset = _anchors_and_positives(anchors, positives, anchor_offset)
    negatives = _negatives(negatives, anchors)
    m = check.finite("m", m)
    temperature = check.temperature(temperature, anchors.dtype, focal_m=m)
    chunk_size = check.chunk_size(chunk_size)
    check.read_inputs()
    return _contrastive(anchors, positives, negatives, temperature=temperature, focal_m=m,
                        anchor_offset=anchor_offset, backend=resolve_backend(backend, anchors),
                        chunk_size=chunk_size)


def _noise_args(anchors, num, steps, lr, std, temperature, noise,
                names=("noise_steps", "noise_lr", "noise_std", "noise_temperature")):
    steps = check.non_negative_int(names[0], steps)
    lr = check.finite(names[1], lr)
    std = check.positive(names[2], std)
    temperature = check.temperature(temperature, anchors.dtype, name=names[3])
    if noise is not None:
        noise = check.embeddings("noise", noise, width=anchors.shape[1], allow_empty=True)
        if noise.device != anchors.device:
            raise ValueError(f"noise is on {noise.device} but anchors are on {anchors.device}")
        if num is not None and noise.shape[0] != num:
            raise ValueError(f"noise has {noise.shape[0]} rows but num={num}")
    else:
        num = check.non_negative_int("num", num)
    return steps, lr, std, temperature, noise


def _dclr_noise(anchors, positives, num, steps, lr, std, temperature, noise, generator, be, chunk_size,
                formulation="paper", anchor_offset=0):
    with common.autocast_off(anchors.device):
        return _dclr_noise_on(anchors, positives, num, steps, lr, std, temperature, noise,
                              generator, be, chunk_size, formulation, anchor_offset)


def _dclr_noise_on(anchors, positives, num, steps, lr, std, temperature, noise, generator, be,
                   chunk_size, formulation, anchor_offset):
    if be == "reference":
        return reference.dclr_noise(anchors, positives, num, steps=steps, lr=lr, std=std,
                                    temperature=temperature, noise=noise, generator=generator,
                                    formulation=formulation, anchor_offset=anchor_offset)
    # whether Z can have rows too large to square, where that is known without reading Z:
    # drawn, its entries are std·N(0, 1), and no normal draw of torch's reaches NORMAL_MAX;
    # given, this call's scan of its inputs has cleared it
    if noise is None:
        noise = common.draw_noise(num, anchors.shape[1], std=std, generator=generator,
                                     device=anchors.device)
        huge = None if std * common.NORMAL_MAX > common.huge_row_limit(noise.dtype, noise.shape[1]) else False
    else:
        huge = False if check.inputs_read() else None
    return tiled.noise_update(anchors, noise, steps=steps, lr=lr, temperature=temperature,
                              chunk_size=chunk_size, engine=_engine(be),
                              positives=positives if formulation == "released" else None,
                              anchor_offset=anchor_offset, huge_rows=huge)


@check.one_host_read
def dclr_noise(anchors: Tensor, positives: Tensor, num: int | None, *,
               steps: int = common.NOISE_STEPS, lr: float = common.NOISE_LR,
               std: float = common.NOISE_STD, temperature: float = common.TEMPERATURE,
               noise: Tensor | None = None, generator: torch.Generator | None = None,
               formulation: Formulation = "paper", backend: Backend = "auto",
               chunk_size: int | None = None) -> Tensor:
    r"""DCLR's noise negatives after ``steps`` normalized gradient-ascent steps.

    Starting from ``Z ~ N(0, std²)`` (num×d, drawn with ``generator``) or from ``noise``,
    each step computes

    .. math:: L_U = \frac1N\sum_i\Big[-\frac{s(h_i,h^+_i)}{\tau_u}
              + \log\sum_j \exp\frac{\cos(h_i, z_j)}{\tau_u}\Big],\quad
              z_j \leftarrow z_j + \beta\,\frac{g_j}{\lVert g_j\rVert},\ g = \partial L_U/\partial Z

    with h, h⁺ detached (β = ``lr``, τ_u = ``temperature``). A row with g_j = 0 stays put.
    ``formulation="released"`` follows the authors' code: each step's loss is the
    cross-entropy over ``[h⁺; Z]`` (the N in-batch columns join the log-sum-exp), and a row
    with g_j = 0 becomes 0. Returns the (num×d) float32 noise (float64 for float64 anchors),
    with no autograd graph.

    Reference: Zhou et al., "Debiased Contrastive Learning of Unsupervised Sentence
    Representations", ACL 2022.
    """
    anchors, positives, _ = _anchors_and_positives(anchors, positives)
    steps, lr, std, temperature, noise = _noise_args(anchors, num, steps, lr, std, temperature, noise,
                                                     names=("steps", "lr", "std", "temperature"))
    num = noise.shape[0] if noise is not None else num
    generator = check.generator(generator, anchors.device)
    formulation = check.choice("formulation", formulation, ("paper", "released"))
    chunk_size = check.chunk_size(chunk_size)
    check.read_inputs()
    return _dclr_noise(anchors, positives, num, steps, lr, std, temperature, noise, generator,
                       resolve_backend(backend, anchors), chunk_size, formulation)


def dclr_loss(anchors: Tensor, positives: Tensor, *,
              complementary: tuple[Tensor, Tensor] | None = None, phi: float = common.PHI,
              noise: Tensor | None = None, noise_ratio: float = common.NOISE_RATIO,
              noise_steps: int = common.NOISE_STEPS, noise_lr: float = common.NOISE_LR,
              noise_std: float = common.NOISE_STD, noise_temperature: float | None = None,
              temperature: float = common.TEMPERATURE, generator: torch.Generator | None = None,
              formulation: Formulation = "paper", anchor_offset: int | None = None,
              backend: Backend = "auto", chunk_size: int | None = None) -> Tensor:
    r"""DCLR: InfoNCE with optimized noise negatives and instance weighting.

    Candidates ``k = [positives; Z]`` with ``Z`` from :func:`dclr_noise`
    (``K = round(noise_ratio·N)`` rows unless ``noise`` is given, which fixes K). A frozen
    complementary model's embeddings ``complementary=(c, c⁺)`` drop every in-batch negative
    it finds too similar, ``α_ij = 1[cos(c_i, c⁺_j) < φ]`` (positives and noise keep α = 1):

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}}{\tau} + \log\sum_j \alpha_{ij}\,e^{s_{ij}/\tau}\Big]

    ``formulation="released"`` reproduces the authors' released code instead. Every
    difference from the paper's formulation (the default), in one place:

    ====================  ===============================  ==================================
    what                  ``"paper"``                      ``"released"``
    ====================  ===============================  ==================================
    loss                  cross-entropy; a dropped         logits multiplied by α (a dropped
                          negative leaves the denominator  negative gets logit 0), binary
                                                           cross-entropy on the row softmax,
                                                           mean over all N·(N+K) entries
    mask test             ``cos(c_i, c⁺_j) ≥ φ`` drops     ``cos(c_i, c⁺_j)/τ > 20φ`` drops
    noise columns         never dropped                    complementary cosine 0: every one
                                                           dropped when φ < 0
    noise step's loss     ``−s⁺/τ_u + log Σ_j e^{cos(h,    cross-entropy over ``[h⁺; Z]``: the
                          z_j)/τ_u}`` (noise columns)      N in-batch columns join the LSE
    K noise rows          ``round(noise_ratio·N)``         ``int(N·noise_ratio)``
    zero noise gradient   the row stays where it was       the row becomes 0 (0/0 → NaN → 0)
    ====================  ===============================  ==================================

    Outside the loss, ``train.py --complementary-mode released`` runs the complementary model
    as that code does (dropout on, the duplicated batch, its own pooler output); the
    default ``frozen`` embeds the batch once in eval mode.

    ``anchor_offset`` (global negatives across processes): as in :func:`infonce`, with
    ``complementary = (c of these anchors, c⁺ of the whole batch)`` and K counted from the
    whole batch. The noise update then sees only these anchors: to match one process on
    the whole batch, compute ``Z = dclr_noise(all anchors, all positives, K, generator=g,
    formulation=...)`` identically on every process and pass ``noise=Z, noise_steps=0``.

    Reference: Zhou et al., "Debiased Contrastive Learning of Unsupervised Sentence
    Representations", ACL 2022.
    """
    return contrastive(anchors, positives, temperature=temperature, complementary=complementary,
                       phi=phi, noise=noise, noise_ratio=noise_ratio, noise_steps=noise_steps,
                       noise_lr=noise_lr, noise_std=noise_std, noise_temperature=noise_temperature,
                       generator=generator, formulation=formulation, anchor_offset=anchor_offset,
                       backend=backend, chunk_size=chunk_size)


@check.one_host_read
def escl_loss(anchors: Tensor, positives: Tensor, sensitive: Tensor, *,
              temperature: float = common.TEMPERATURE, weight: float = common.ESCL_WEIGHT,
              rd: Literal["softplus", "margin"] = common.ESCL_RD,
              margins: tuple[float, float] = common.ESCL_MARGINS, anchor_offset: int | None = None,
              duplicate_ids: Tensor | None = None, backend: Backend = "auto",
              chunk_size: int | None = None) -> Tensor:
    r"""ESCL: InfoNCE plus a relative-difference term on a high-dropout "sensitive" view.

    .. math:: L = \mathrm{InfoNCE}(h, h^+) + \lambda\,\frac{1}{2N}\sum_i\sum_{h'\in\{h,h^+\}}
              \mathrm{softplus}\Big(\frac{D^{pos}_i - D^{neg}_i(h')}{\tau}\Big)

    with ``D^pos = 1 − cos(h, h⁺)``, ``D^neg(h') = 1 − cos(h', h⁻)`` and λ = ``weight``.
    The paper's exact RD equation is not public; this relative-difference ranking form is a
    reconstruction. ``rd="margin"`` selects SNCSE's bidirectional margin form instead,
    ``relu(Δ + a) + relu(−Δ − b)`` with ``Δ = cos(h', h⁻) − cos(h, h⁺)`` and
    ``(a, b) = margins``. The sensitive view is a training-time device only.
    ``anchor_offset``: as in :func:`infonce` (``sensitive`` holds the anchors' own rows).
    ``duplicate_ids``: the positives' text ids (N_b,): the InfoNCE term drops every positive
    with the same text as the row's own (:func:`contrastive`'s ``duplicate_ids``); the RD term
    pairs row i with its own views only.

    Reference: Liu et al., "Equivariant Contrastive Learning for Sentence Embeddings"
    (ESCL), ICASSP 2023.
    """
    anchors, positives, anchor_offset = _anchors_and_positives(anchors, positives, anchor_offset)
    sensitive = check.embeddings("sensitive", sensitive, rows=anchors.shape[0],
                                 width=anchors.shape[1], like=anchors, scale_free=True)
    temperature = check.temperature(temperature, anchors.dtype)
    weight = check.finite("weight", weight)
    rd = check.choice("rd", rd, ("softplus", "margin"))
    if not isinstance(margins, (tuple, list)) or len(margins) != 2:
        raise ValueError(f"margins must be a pair (a, b), got {margins!r}")
    margins = (check.finite("margins[0]", margins[0]), check.finite("margins[1]", margins[1]))
    chunk_size = check.chunk_size(chunk_size)
    be = resolve_backend(backend, anchors)
    check.read_inputs()
    with common.autocast_off(anchors.device):
        return _escl(anchors, positives, sensitive, temperature, weight, rd, margins,
                     anchor_offset, be, chunk_size, duplicate_ids)


def _escl(anchors, positives, sensitive, temperature, weight, rd, margins, anchor_offset, be,
          chunk_size, duplicate_ids=None):
    if be == "reference" and duplicate_ids is None:
        return reference.escl_loss(anchors, positives, sensitive, temperature=temperature,
                                   weight=weight, rd=rd, margins=margins,
                                   anchor_offset=anchor_offset)
    # The RD term only pairs row i with row i: O(N·d), identical for every backend.
    own_positives = positives[anchor_offset:anchor_offset + anchors.shape[0]]
    rd_term = common.relative_difference(anchors, own_positives, sensitive,
                                            temperature=temperature, rd=rd, margins=margins)
    if duplicate_ids is not None:   # the InfoNCE term with the ids (checked there), any backend
        rules = _rules(anchors, positives, None, anchor_offset, ("query_to_doc",), "joint", None,
                       0.0, None, None, 0.0, "absolute", (duplicate_ids,))
        return _contrastive(anchors, positives, temperature=temperature,
                            anchor_offset=anchor_offset, backend=_backend_for_rules(be, anchors, rules),
                            chunk_size=chunk_size, **rules) + weight * rd_term
    ep = Epilogue(temperature, chunk_size=chunk_size, anchor_offset=anchor_offset)
    return tiled.contrastive_loss(ep, anchors, positives, engine=_engine(be)) + weight * rd_term
