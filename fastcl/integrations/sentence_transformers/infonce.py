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
    embeddings, the loss and gradients of MNRL.

    Args:
        model: the SentenceTransformer model to train.
        scale: the factor on the cosine similarities, ``1/τ`` (20 ↔ τ = 0.05); a finite
            number > 0.
        similarity_fct: ``sentence_transformers.util.cos_sim``, the only similarity fastcl
            computes (taken for MNRL's signature).
        symmetric: also the reverse direction (each positive against every anchor), the two
            averaged: MNRL's ``directions=("query_to_doc", "doc_to_query"),
            partition_mode="per_direction"``.
        hard_negative_weight: a log-weight ``w`` added to the logit of each anchor's own hard
            negative (supervised SimCSE); needs exactly one negative column. 0: off.
        backend: ``"auto"``, ``"reference"``, ``"tiled"`` or ``"triton"``, as
            :func:`fastcl.contrastive`.
        chunk_size: anchor rows per chunk inside the loss (None: the backend's choice).
        gather_across_devices: contrast each anchor with the candidates of every process
            (see :mod:`fastcl.integrations.sentence_transformers`), as MNRL's option.
        focal_m: Focal-InfoNCE's modulation on top: positive logit ``s·cos²``, every other
            ``s·cos(cos + m)``. None: off.

    Inputs:
        {inputs}

        Unsupervised SimCSE: the same sentence in both columns; dropout makes the two views.

    Relations:
        - Replaces ``MultipleNegativesRankingLoss`` (the same ``scale``, columns and numbers;
          cosine similarity only). MNRL's ``directions``, ``partition_mode`` and
          ``hardness_mode`` are not taken yet.
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

    _config = ("scale", "symmetric", "hard_negative_weight", "focal_m", "gather_across_devices",
               "backend")

    def __init__(self, model: SentenceTransformer, scale: float = 1.0 / common.TEMPERATURE,
                 similarity_fct=cos_sim, symmetric: bool = False, hard_negative_weight: float = 0.0,
                 backend: str = "auto", chunk_size: int | None = None, gather_across_devices: bool = False,
                 focal_m: float | None = None):
        super().__init__(model)
        if similarity_fct is not cos_sim:
            raise ValueError("FastInfoNCELoss computes cosine similarity: similarity_fct must be "
                             "sentence_transformers.util.cos_sim")
        self.scale = number("scale", scale, positive=True)
        self.similarity_fct, self.symmetric = similarity_fct, symmetric
        self.hard_negative_weight, self.backend, self.chunk_size = hard_negative_weight, backend, chunk_size
        self.gather_across_devices, self.focal_m = gather_across_devices, focal_m

    def compute_loss_from_embeddings(self, embeddings, labels=None):
        return self._in_batch_loss(embeddings, temperature=1.0 / self.scale, focal_m=self.focal_m,
                                   symmetric=self.symmetric)

    @property
    def citation(self) -> str:
        return citations.SIMCSE
