"""CachedFastFocalInfoNCELoss: FastFocalInfoNCELoss with GradCache."""

from __future__ import annotations

from fastcl import common

from ._base import Cached, SentenceTransformer, documented
from .focal_infonce import FastFocalInfoNCELoss

__all__ = ["CachedFastFocalInfoNCELoss"]


@documented(inputs="negatives", data="unsupervised",
            loss="CachedFastFocalInfoNCELoss(model, m=0.3, mini_batch_size=32)")
class CachedFastFocalInfoNCELoss(Cached):
    r""":class:`FastFocalInfoNCELoss` with GradCache (``mini_batch_size`` inputs per forward).

    The loss of :class:`FastFocalInfoNCELoss` (positive logit ``s²/τ``, every other
    ``s(s+m)/τ``),

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}^2}{\tau} + \log\Big(e^{s_{ii}^2/\tau}
              + \sum_{j\ne i} e^{s_{ij}(s_{ij}+m)/\tau}\Big)\Big],

    with the encoder run on ``mini_batch_size`` inputs at a time, twice: without a graph,
    then again under each mini-batch's saved random state to back-propagate the cached
    gradient (see :mod:`fastcl.integrations.sentence_transformers`).

    Args:
        model: the SentenceTransformer model to train.
        temperature, m: as :class:`FastFocalInfoNCELoss`.
        {cached_args}
        mini_batch_num_tokens: as :class:`CachedFastInfoNCELoss`.
        gather_across_devices, backend, chunk_size, hard_negative_weight, mask_duplicates: as
            :class:`FastFocalInfoNCELoss`.

    Inputs:
        {inputs}

    Relations:
        - Replaces ``CachedMultipleNegativesRankingLoss`` where hard negatives should weigh
          more.
        - Equals ``CachedFastInfoNCELoss(model, scale=1/temperature, focal_m=m)``.
        - :class:`FastFocalInfoNCELoss` is the same loss without caching.

    References:
        Hou & Li, "Focal-InfoNCE", Findings of EMNLP 2023; Gao et al., "Scaling Deep
        Contrastive Learning Batch Size under Memory Limited Setup", RepL4NLP 2021
        (GradCache). ``citation`` holds both.

    Example:
        {example}
    """

    _plain = FastFocalInfoNCELoss

    def __init__(self, model: SentenceTransformer, temperature: float = common.TEMPERATURE,
                 m: float = common.FOCAL_M, *, mini_batch_size: int = 32, show_progress_bar: bool = False,
                 mini_batch_num_tokens: int | None = None, **options):
        super().__init__(FastFocalInfoNCELoss(model, temperature, m, **options), mini_batch_size,
                         show_progress_bar, mini_batch_num_tokens)
