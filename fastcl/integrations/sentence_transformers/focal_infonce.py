"""FastFocalInfoNCELoss: Focal-InfoNCE with in-batch negatives."""

from __future__ import annotations

from fastcl import citations, common

from ._base import FastLoss, SentenceTransformer, documented

__all__ = ["FastFocalInfoNCELoss"]


@documented(inputs="negatives", data="unsupervised",
            loss="FastFocalInfoNCELoss(model, temperature=0.05, m=0.3)")
class FastFocalInfoNCELoss(FastLoss):
    r"""Focal-InfoNCE (Hou & Li, 2023): InfoNCE whose logits are modulated by the similarity.

    With ``s_ij = cos(a_i, c_j)`` over the candidates ``c = [p_1 … p_N; n_1 …]``, the positive
    logit is ``s²/τ`` and every other ``s(s+m)/τ``, so hard negatives (large s) weigh more and
    easy ones less:

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}^2}{\tau} + \log\Big(e^{s_{ii}^2/\tau}
              + \sum_{j\ne i} e^{s_{ij}(s_{ij}+m)/\tau}\Big)\Big]

    computed by :func:`fastcl.contrastive` with ``focal_m=m``, without the N×M matrix.

    Args:
        model: the SentenceTransformer model to train.
        temperature: τ > 0 (``scale = 1/τ`` in MNRL's terms).
        m: the focal margin (the paper's m; 0.3 for BERT).
        backend: ``"auto"``, ``"reference"``, ``"tiled"`` or ``"triton"``, as
            :func:`fastcl.contrastive`.
        chunk_size: anchor rows per chunk inside the loss (None: the backend's choice).
        gather_across_devices: contrast each anchor with the candidates of every process
            (see :mod:`fastcl.integrations.sentence_transformers`).
        hard_negative_weight: a log-weight added to the logit of each anchor's own hard
            negative; needs exactly one negative column. 0: off.
        mask_duplicates: drop every candidate whose text equals that of the anchor's
            positive, as :class:`FastInfoNCELoss`.
        learnable_temperature: learn τ with the model, as :class:`FastInfoNCELoss` (focal's
            logits s(s+m)/τ: its gradient on the tiled path and the reference, not Triton's).

    Inputs:
        {inputs}

        The paper's unsupervised recipe: the same sentence in both columns.

    Relations:
        - Replaces ``MultipleNegativesRankingLoss`` where hard negatives should weigh more
          (sentence-transformers has no focal loss; its ``hardness_mode`` is another
          weighting).
        - Equals ``FastInfoNCELoss(model, scale=1/temperature, focal_m=m)``.
        - :class:`CachedFastFocalInfoNCELoss` is this loss with GradCache.

    References:
        Hou & Li, "Improving Contrastive Learning of Sentence Embeddings with Focal-InfoNCE",
        Findings of EMNLP 2023 (``citation``).

    Example:
        {example}
    """

    _spec_names = {"m": "focal_m"}

    def __init__(self, model: SentenceTransformer, temperature: float = common.TEMPERATURE,
                 m: float = common.FOCAL_M, backend: str = "auto", chunk_size: int | None = None,
                 gather_across_devices: bool = False, hard_negative_weight: float = 0.0,
                 mask_duplicates: bool = False, *, learnable_temperature: bool = False):
        super().__init__(model)
        self.temperature, self.m, self.backend, self.chunk_size = temperature, m, backend, chunk_size
        self.gather_across_devices = gather_across_devices
        self.hard_negative_weight, self.mask_duplicates = hard_negative_weight, bool(mask_duplicates)
        self._init_temperature(learnable_temperature, temperature)
        self._check_options()

    def compute_loss_from_embeddings(self, embeddings, labels=None, duplicate_ids=None):
        return self._in_batch_loss(embeddings, duplicate_ids=self._ids(duplicate_ids))

    @property
    def citation(self) -> str:
        return citations.FOCAL
