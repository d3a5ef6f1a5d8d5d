"""Public functional API: argument checks, then dispatch to a backend.

Backends: ``"reference"`` (:mod:`fastcl.reference`, full matrices), ``"tiled"``
(:mod:`fastcl.tiled`, chunked, any device), ``"triton"`` (fused kernels, CUDA) and
``"auto"`` (Triton for CUDA tensors once the kernels are built in, tiled otherwise).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from . import _validation as check
from . import common, reference, tiled
from ._validation import Backend, Formulation
from .spec import LossSpec, build_spec, escl_options, inputs, noise_settings, resolve_backend

__all__ = ["contrastive", "infonce", "focal_infonce", "dclr_loss", "dclr_noise", "escl_loss",
           "resolve_backend"]


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
                false_negative_margin: float | None = None,
                positive_prior: float | Tensor | None = None,
                label_smoothing: float = 0.0, labels: Tensor | None = None,
                teacher: tuple[Tensor, Tensor] | None = None,
                teacher_temperature: float | None = None, distill_weight: float = 0.5,
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
    and no ``Z``. It needs every anchor of the batch (no ``anchor_offset``). It is the layout
    ``directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"`` below
    (:data:`fastcl.spec.SYMMETRIC`) with DCLR's mask transposed on the reverse direction.

    **formulation="released"** is DCLR as the authors' released code computes it (every
    difference from the paper's: the table in :func:`dclr_loss`'s docstring). It combines with
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

    **false_negative_margin** ``m`` (self-referenced false-negative masking, as
    Qwen3-Embedding trains): every score of row i whose cosine exceeds the row's own
    positive's, ``s_ij > s_{i,p(i)} + m``, leaves the softmax — the loss's own cosines (each
    Matryoshka width's its own), a test with no gradient, the positive never dropped. With a
    positive side (``symmetric``, ``directions``) its scores are tested against the same
    ``s_{i,p(i)}`` (the pair's cosine), its own anchor never dropped; the test reads the
    cosine, not the logit (focal, ``w`` and β do not move it). It composes with every option
    above but ``formulation="released"``.

    **positive_prior** ``τ⁺`` (debiased contrastive loss, Chuang et al. 2020): the sum over a
    row's others corrects for the false negatives a class prior ``τ⁺`` expects among them,

    .. math:: ℓ_i = −\log\frac{e^{l_{ip}}}{e^{l_{ip}} + N_g},\quad
              N_g = \max\Big(\frac{\sum_{j≠p} e^{l_{ij}} − Q\,τ^+ e^{l_{ip}}}{1 − τ^+},\;
              Q\,e^{−1/τ}\Big)

    with ``Q`` the row's kept others (its softmax's columns but the positive, after every
    drop above) and the gradients through the max (the subgradient of the branch taken).
    ``τ⁺`` is one float or a tensor of one per anchor row. It needs one softmax a row: not
    with ``symmetric`` or ``partition_mode="per_direction"``, nor ``formulation="released"``;
    the Triton kernels take it without a positive side (``"auto"`` runs those on the tiled
    path).

    **matryoshka_dims** ``(d_1, …, d_K)`` with ``matryoshka_weights`` ``(w_1, …, w_K)`` (all 1
    by default): ``L = Σ_k w_k·L(x[:, :d_k])``, the loss of every prefix of the embeddings
    (their own cosines), as sentence-transformers' ``MatryoshkaLoss`` around this loss, with
    focal, the hard negatives' log-weight, the DCLR mask, ``symmetric`` and the options above
    (the tiled path: every width in one pass over d; Triton: a fused call per width;
    docs/engine.md). Not with the noise or ``formulation="released"``.

    **Soft targets** (``label_smoothing``, ``labels``). Row i's loss is the cross-entropy
    against a target distribution over its *kept* candidates ``K_i`` — the entries of its
    softmax: every column it scores (the positives, ``negatives``, ``Z``, and the anchors
    block of ``"query_to_query"``) less those dropped by DCLR's mask, the guide, the
    duplicate ids or the layout's exclusions (the positive is always kept):

    .. math:: ℓ_i = -\sum_{j∈K_i} y_{ij}\log p_{ij},\quad
              y_{ij} = (1-ε)\,\frac{[j∈P_i]}{|P_i|} + ε\,\frac{[j∈K_i]}{|K_i|}

    with ``p`` the softmax over ``K_i`` of the logits above (focal, ``w``, MNRL's ``β·sg(s)``
    included) and gradient ``∂ℓ_i/∂l_ij = p_ij − y_ij``. ``P_i`` is the positive alone, or
    with ``labels`` (one integer per batch row, N_b) every kept column ``j < N_b`` of the
    positives block with ``labels[j] = labels[p(i)]`` — SupCon's ``L_out``, the positive
    among them; the negatives block and ``Z`` are never targets. ``label_smoothing = ε``
    mixes the uniform distribution over ``K_i`` into the target, as
    ``F.cross_entropy(label_smoothing=ε)`` does over its classes (there every class is
    kept). Focal's ``s²/τ`` stays on column ``p(i)`` only. Per Matryoshka width, the same
    targets over that width's logits. With ``symmetric`` (or ``"doc_to_query"`` per
    direction, no guide, ids or hardness) each direction's softmax has its own target, the
    reverse one's positive the row's own anchor and, with labels, the anchors of its label;
    ``L = ½(L^→ + L^←)``. Not with ``formulation="released"`` or a positive side that shares
    the anchor's softmax or its drops (``"doc_to_doc"``, a joint ``"doc_to_query"``, GIST's
    positive–positive block): ``ValueError``.

    **teacher** ``(t_anchors, t_candidates)`` (a frozen encoder's embeddings of the N anchors
    and of the N_b + K positives and negatives, one width d_t) distils its in-batch
    similarity distribution: ``y ← (1−λ)·y + λ·q_i``, ``λ = distill_weight``,

    .. math:: q_{ij} = \frac{e^{\cos(t_i, t_j)/τ_t}}{\sum_{k∈T_i} e^{\cos(t_i, t_k)/τ_t}},
              \ j ∈ T_i

    over ``T_i``, the row's kept columns of the positives and negatives blocks (the noise and
    the anchors block have no teacher row: ``q = 0`` there), ``τ_t = teacher_temperature``
    (default τ). No gradient reaches the teacher. Not with a positive side (``symmetric``,
    ``"doc_to_query"``, ``"doc_to_doc"``).

    Args (the options not stated above):
        anchors, positives, negatives: (N, d), (N_b, d) and optional (K, d): row i of
            ``positives`` is anchor i's positive (row ``anchor_offset + i``); ``negatives``
            are hard negatives (row i anchor i's, K = N_b, which ``hard_negative_weight``
            needs) or any K rows such as a queue.
        temperature: τ ≥ (2 + |m|)/√max of the accumulate dtype (1.08e-19 for float32 and
            16-bit inputs; below it the logits or their gradient overflow). A 0-dim (one
            element) tensor that requires grad is a learnable τ with the exact gradient
            ``∂L/∂τ = −(1/τ²)·Σ_ij (∂L/∂l_ij)·f_ij`` (``f`` the logits' numerators: s, or
            focal's s² and s(s+m)), which the fused paths form from row sums the backward has
            (docs/engine.md). Focal with it runs on the tiled path and the reference, not on
            Triton nor beside ``matryoshka_dims``. Its value is read once; the noise ``Z``
            uses it and carries no gradient to it.
        phi: φ ∈ [-1, 1], read only with ``complementary``.
        noise, noise_ratio, noise_steps, noise_lr, noise_std, noise_temperature, generator:
            the noise (above; :func:`dclr_noise`'s ``steps``, ``lr``, ``std``,
            ``temperature``); ``noise`` fixes K_z, and ``noise_steps=0`` uses it as is.
        anchor_offset: the anchors are rows ``[anchor_offset, anchor_offset + N)`` of the
            batch that ``positives``, ``negatives`` and ``complementary[1]`` hold (global
            negatives across processes); the noise update then sees only these anchors
            (:func:`dclr_loss` says how to share one ``Z``).
        directions: MNRL's names, or a :class:`fastcl.layout.Layout` such as
            ``fastcl.layout.gist()`` for GISTEmbedLoss's blocks (``partition_mode`` then
            "joint").
        anchor_candidates: the whole batch's anchors (N_b rows) for ``"query_to_query"`` and
            ``"doc_to_query"`` with ``anchor_offset``, or any rows that anchor i finds at row
            i (default: ``anchors``).
        false_negative_margin: ``m``, any finite float (None: off; 0.1 in Qwen3-Embedding).
        positive_prior: ``τ⁺`` in [0, 1), a float or an (N,) floating tensor on the anchors'
            device (None: off; 0 keeps only the max's floor ``Q·e^{−1/τ}``).
        label_smoothing: ε ∈ [0, 1) (above; 0: off).
        labels: optional (N_b,) integer tensor, a class id per batch row (above).
        teacher, teacher_temperature, distill_weight: distillation into the target (above):
            (N, d_t) and (N_b + K, d_t) embeddings, τ_t > 0 (None: τ), λ ∈ [0, 1].
        backend: "auto", "reference", "tiled" or "triton". The Triton kernels take every
            option above with InfoNCE, focal and the noise, ``matryoshka_dims`` a call per
            width, but not the layout's options beside ``hard_negative_weight`` or the DCLR
            mask: ``"auto"`` runs those on the tiled path, ``"triton"`` refuses them.
        chunk_size: anchor rows per chunk in the tiled path (default: from a memory budget).

    Returns the scalar loss (float32 for 16-bit inputs); gradients flow to ``anchors``,
    ``positives``, ``negatives`` and ``anchor_candidates`` (never to ``complementary``,
    ``guide`` or ``Z``).

    References: Gao, Yao & Chen, "SimCSE", EMNLP 2021; Hou & Li, "Improving Contrastive
    Learning of Sentence Embeddings with Focal-InfoNCE", Findings of EMNLP 2023; Zhou et al.,
    "Debiased Contrastive Learning of Unsupervised Sentence Representations", ACL 2022.
    """
    spec, anchors, positives, negatives = build_spec(
        anchors, positives, negatives, temperature=temperature, focal_m=focal_m,
        hard_negative_weight=hard_negative_weight, complementary=complementary, phi=phi,
        noise=noise, noise_ratio=noise_ratio, noise_steps=noise_steps, noise_lr=noise_lr,
        noise_std=noise_std, noise_temperature=noise_temperature, generator=generator,
        formulation=formulation, symmetric=symmetric, anchor_offset=anchor_offset,
        directions=directions, partition_mode=partition_mode, hardness_mode=hardness_mode,
        hardness_strength=hardness_strength, anchor_candidates=anchor_candidates, guide=guide,
        guide_margin=guide_margin, margin_strategy=margin_strategy, duplicate_ids=duplicate_ids,
        matryoshka_dims=matryoshka_dims, matryoshka_weights=matryoshka_weights,
        false_negative_margin=false_negative_margin, positive_prior=positive_prior,
        label_smoothing=label_smoothing, labels=labels, teacher=teacher,
        teacher_temperature=teacher_temperature, distill_weight=distill_weight, backend=backend,
        chunk_size=chunk_size)
    return run(spec, anchors, positives, negatives)


def run(spec: LossSpec, anchors: Tensor, positives: Tensor, negatives: Tensor | None = None) -> Tensor:
    """The one dispatch: ``spec`` (:func:`fastcl.spec.build_spec`) on checked embeddings, on
    its backend — the reference's full matrices or the tiled driver with the torch or Triton
    engine. Reads the queued input checks first (nothing is computed before). Autocast is off
    inside, on every backend: the loss depends on the inputs' dtype only (autocast would
    round the cosine GEMMs, hence the logits, to 16 bits)."""
    check.read_inputs()
    with common.autocast_off(anchors.device):
        if spec.backend == "reference":
            return reference.contrastive(spec, anchors, positives, negatives)
        return tiled.spec_loss(spec, anchors, positives, negatives)


@check.one_host_read
def infonce(anchors: Tensor, positives: Tensor, negatives: Tensor | None = None, *,
            temperature: float = common.TEMPERATURE, hard_negative_weight: float = 0.0,
            symmetric: bool = False, anchor_offset: int | None = None,
            false_negative_margin: float | None = None,
            positive_prior: float | Tensor | None = None, label_smoothing: float = 0.0,
            labels: Tensor | None = None, backend: Backend = "auto",
            chunk_size: int | None = None) -> Tensor:
    r"""InfoNCE over in-batch negatives: unsupervised and supervised SimCSE.

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}}{\tau}
              + \log\sum_j \exp\big(\frac{s_{ij}}{\tau} + w\,[j = N+i]\big)\Big]

    with ``s_ij = cos(anchors_i, k_j)`` and candidates ``k = [positives; negatives]``.

    ``w`` = ``hard_negative_weight`` at anchor i's own hard negative (column N + i, K = N
    ``negatives``); the other arguments as in :func:`contrastive` (``anchor_offset``: anchor
    i's positive is ``positives[anchor_offset + i]``, the loss the mean over these anchors;
    ``false_negative_margin`` and ``positive_prior``: the self-referenced false-negative mask
    and the debiased loss, None: off;
    ``label_smoothing`` and ``labels``: soft targets, 0 and None: off).

    Reference: Gao, Yao & Chen, "SimCSE", EMNLP 2021.
    """
    return run(*build_spec(anchors, positives, negatives, temperature=temperature,
                           hard_negative_weight=hard_negative_weight, symmetric=symmetric,
                           anchor_offset=anchor_offset, false_negative_margin=false_negative_margin,
                           positive_prior=positive_prior, label_smoothing=label_smoothing,
                           labels=labels, backend=backend, chunk_size=chunk_size))


@check.one_host_read
def focal_infonce(anchors: Tensor, positives: Tensor, negatives: Tensor | None = None, *,
                  temperature: float = common.TEMPERATURE, m: float = common.FOCAL_M,
                  anchor_offset: int | None = None, false_negative_margin: float | None = None,
                  positive_prior: float | Tensor | None = None, backend: Backend = "auto",
                  chunk_size: int | None = None) -> Tensor:
    r"""Focal-InfoNCE: InfoNCE whose logits are modulated by the similarity itself.

    Positive logit ``s²/τ``, negative logits ``s(s+m)/τ``:

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}^2}{\tau} + \log\Big(e^{s_{ii}^2/\tau}
              + \sum_{j\ne i} e^{s_{ij}(s_{ij}+m)/\tau}\Big)\Big]

    Hard negatives get up-weighted (large s), easy ones down-weighted. Nothing is detached.

    ``anchor_offset``, ``false_negative_margin`` (tested on the cosines, not the focal
    logits) and ``positive_prior``: as in :func:`infonce`.

    Reference: Hou & Li, "Improving Contrastive Learning of Sentence Embeddings with
    Focal-InfoNCE", Findings of EMNLP 2023.
    """
    return run(*build_spec(anchors, positives, negatives, temperature=temperature, focal_m=m,
                           anchor_offset=anchor_offset, false_negative_margin=false_negative_margin,
                           positive_prior=positive_prior, backend=backend, chunk_size=chunk_size,
                           focal_name="m"))


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
    anchors, positives, _ = inputs(anchors, positives)
    noise = noise_settings(anchors, num, steps, lr, std, temperature, noise, generator, prefix="")
    formulation = check.choice("formulation", formulation, check.FORMULATIONS)
    chunk_size = check.chunk_size(chunk_size)
    backend = resolve_backend(backend, anchors)
    check.read_inputs()
    with common.autocast_off(anchors.device):
        if backend == "reference":
            return reference.dclr_noise(anchors, positives, noise.count, steps=noise.steps,
                                        lr=noise.lr, std=noise.std, temperature=noise.temperature,
                                        noise=noise.start, generator=noise.generator,
                                        formulation=formulation)
        return tiled.dclr_noise(noise, anchors, positives, formulation=formulation,
                                engine=tiled.engine_for(backend), chunk_size=chunk_size)


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
    spec, anchors, positives, _ = build_spec(
        anchors, positives, temperature=temperature, anchor_offset=anchor_offset,
        duplicate_ids=None if duplicate_ids is None else (duplicate_ids,), backend=backend,
        chunk_size=chunk_size)
    sensitive = check.embeddings("sensitive", sensitive, rows=anchors.shape[0],
                                 width=anchors.shape[1], like=anchors, scale_free=True)
    weight, rd, margins = escl_options(weight, rd, margins)
    loss = run(spec, anchors, positives)
    # The RD term only pairs row i with row i: O(N·d), identical for every backend.
    own = positives[spec.anchor_offset:spec.anchor_offset + anchors.shape[0]]
    with common.autocast_off(anchors.device):
        return loss + weight * common.relative_difference(anchors, own, sensitive,
                                                          temperature=spec.logits.tau,
                                                          rd=rd, margins=margins)
