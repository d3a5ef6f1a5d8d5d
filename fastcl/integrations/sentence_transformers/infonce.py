"""FastInfoNCELoss: InfoNCE with in-batch negatives, a drop-in for MultipleNegativesRankingLoss."""

from __future__ import annotations

from fastcl import citations, common

from ._base import FastLoss, SentenceTransformer, cos_sim, documented, number

__all__ = ["FastInfoNCELoss"]


@documented(inputs="negatives", data="pairs",
            loss="FastInfoNCELoss(model, scale=20.0)")
class FastInfoNCELoss(FastLoss):
    r"""InfoNCE with in-batch negatives, fused: a drop-in for ``MultipleNegativesRankingLoss``.

    Each anchor ``a_i`` is contrasted with every candidate of the batch, ``c = [p_1 … p_N;
    n_1 …]`` (the positive column, then each negative column), with ``s = scale = 1/τ``:

    .. math:: L = \frac1N\sum_i\Big[-s\cos(a_i, p_i) + \log\sum_j e^{s\cos(a_i, c_j)}\Big]

    :func:`fastcl.contrastive` computes it without the N×M similarity matrix: on the same
    embeddings, the loss and gradients of MNRL, with MNRL's options: ``directions`` (the
    anchors as candidates of each other, each positive scored against the anchors or the
    other documents), ``partition_mode`` (one softmax per row over every direction, or one
    per direction averaged) and ``hardness_mode``/``hardness_strength`` (``+β·sg(cos)`` on
    the chosen negatives' logits); :mod:`fastcl.layout` states each rule.

    Args:
        model: the SentenceTransformer model to train.
        scale: the factor on the cosine similarities, ``1/τ`` (20 ↔ τ = 0.05); a finite
            number > 0.
        similarity_fct: ``sentence_transformers.util.cos_sim``, the only similarity fastcl
            computes (taken for MNRL's signature).
        symmetric: also the reverse direction (each positive against every anchor), the two
            averaged: MNRL's ``directions=("query_to_doc", "doc_to_query"),
            partition_mode="per_direction"`` (kept as an alias; it also composes with
            ``focal_m``, the positive scored s² in both directions).
        hard_negative_weight: a log-weight ``w`` added to the logit of each anchor's own hard
            negative (supervised SimCSE); needs exactly one negative column. 0: off.
        backend: ``"auto"``, ``"reference"``, ``"tiled"`` or ``"triton"``, as
            :func:`fastcl.contrastive`.
        chunk_size: anchor rows per chunk inside the loss (None: the backend's choice).
        gather_across_devices: contrast each anchor with the candidates of every process
            (see :mod:`fastcl.integrations.sentence_transformers`), as MNRL's option.
        focal_m: Focal-InfoNCE's modulation on top: positive logit ``s·cos²``, every other
            ``s·cos(cos + m)``. None: off.
        directions: MNRL's tuple of ``"query_to_doc"`` (required), ``"query_to_query"``,
            ``"doc_to_query"``, ``"doc_to_doc"``.
        partition_mode: ``"joint"`` (one softmax over every direction) or
            ``"per_direction"`` (``query_to_doc`` and ``doc_to_query`` only).
        hardness_mode: None, ``"in_batch_negatives"``, ``"hard_negatives"`` or
            ``"all_negatives"``: which negatives get ``hardness_strength·sg(cos)`` added to
            their logit.
        hardness_strength: that β ≥ 0 (0: off).
        mask_duplicates: drop every candidate whose text (token ids) equals that of the
            anchor's positive: a duplicate sentence in the batch is no negative.
        matryoshka_dims: widths ``(d_1, …, d_K)``: the loss becomes ``Σ_k w_k·L(x[:, :d_k])``,
            ``MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), matryoshka_dims,
            matryoshka_weights)``, computed in one pass over the width on the tiled path
            (MNRL's options included; on the Triton backend: a fused call per width). None:
            off.
        matryoshka_weights: the ``w_k`` (default: all 1).
        learnable_temperature: learn τ with the model: a parameter of the loss, ``log_scale =
            log(1/τ)`` (CLIP's logit scale), starting at ``log(scale)``; ``temperature`` then
            reads its current value. Needs sentence-transformers ≥ 6.2.

    Inputs:
        {inputs}

        Unsupervised SimCSE: the same sentence in both columns; dropout makes the two views.

    Relations:
        - Replaces ``MultipleNegativesRankingLoss`` (the same ``scale``, columns, options and
          numbers; cosine similarity only), and with ``matryoshka_dims`` the
          ``MatryoshkaLoss`` around it (``MatryoshkaLoss(model, FastInfoNCELoss(model), dims)``
          works too, at one loss per width).
        - :class:`CachedFastInfoNCELoss` is this loss with GradCache, for batches whose
          encoder activations do not fit in memory.
        - :class:`FastFocalInfoNCELoss` is this loss with ``focal_m`` and a temperature;
          :class:`FastDCLRLoss` adds a guide model's false-negative mask and noise negatives.

    References:
        Gao, Yao & Chen, "SimCSE: Simple Contrastive Learning of Sentence Embeddings",
        EMNLP 2021 (``citation``).

    Example:
        {example}
    """

    def __init__(self, model: SentenceTransformer, scale: float = 1.0 / common.TEMPERATURE,
                 similarity_fct=cos_sim, gather_across_devices: bool = False,
                 directions: tuple[str, ...] = ("query_to_doc",), partition_mode: str = "joint",
                 hardness_mode: str | None = None, hardness_strength: float = 0.0, *,
                 symmetric: bool = False, hard_negative_weight: float = 0.0,
                 focal_m: float | None = None, mask_duplicates: bool = False,
                 matryoshka_dims=None, matryoshka_weights=None, learnable_temperature: bool = False,
                 backend: str = "auto", chunk_size: int | None = None):
        super().__init__(model)
        if similarity_fct is not cos_sim:
            raise ValueError("FastInfoNCELoss computes cosine similarity: similarity_fct must be "
                             "sentence_transformers.util.cos_sim")
        self.scale = number("scale", scale, positive=True)
        self.directions = tuple(directions) if isinstance(directions, list) else directions
        if symmetric and (self.directions != ("query_to_doc",) or partition_mode != "joint"):
            raise ValueError("symmetric=True is directions=('query_to_doc', 'doc_to_query'), "
                             "partition_mode='per_direction': give one or the other")
        self.similarity_fct, self.symmetric = similarity_fct, symmetric
        self.partition_mode, self.hardness_mode = partition_mode, hardness_mode
        self.hardness_strength, self.hard_negative_weight = hardness_strength, hard_negative_weight
        self.focal_m, self.mask_duplicates = focal_m, bool(mask_duplicates)
        self.matryoshka_dims, self.matryoshka_weights = matryoshka_dims, matryoshka_weights
        self.backend, self.chunk_size = backend, chunk_size
        self.gather_across_devices = gather_across_devices
        self._init_temperature(learnable_temperature, 1.0 / self.scale)
        self._check_options()

    def compute_loss_from_embeddings(self, embeddings, labels=None, duplicate_ids=None):
        return self._in_batch_loss(embeddings, duplicate_ids=self._ids(duplicate_ids))

    @property
    def temperature(self) -> float:
        """τ = 1/scale, as MNRL's property."""
        return 1.0 / self.scale

    @property
    def citation(self) -> str:
        return citations.SIMCSE
