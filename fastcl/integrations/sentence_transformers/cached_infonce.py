"""CachedFastInfoNCELoss: FastInfoNCELoss with GradCache, a drop-in for
CachedMultipleNegativesRankingLoss."""

from __future__ import annotations

from fastcl import common

from ._base import Cached, SentenceTransformer, cos_sim, documented
from .infonce import FastInfoNCELoss

__all__ = ["CachedFastInfoNCELoss"]


@documented(inputs="negatives", data="pairs",
            loss="CachedFastInfoNCELoss(model, scale=20.0, mini_batch_size=32)")
class CachedFastInfoNCELoss(Cached):
    r""":class:`FastInfoNCELoss` with GradCache: a drop-in for ``CachedMultipleNegativesRankingLoss``.

    The loss of :class:`FastInfoNCELoss` (the same formula, ``scale`` and columns),

    .. math:: L = \frac1N\sum_i\Big[-s\cos(a_i, p_i) + \log\sum_j e^{s\cos(a_i, c_j)}\Big],

    for batches whose encoder activations do not fit in memory. Pass 1 embeds every column
    ``mini_batch_size`` inputs at a time without a graph and keeps each forward's random
    state; fastcl scores the whole batch at once, without the N×M matrix, and takes the
    gradient w.r.t. every embedding; pass 2 embeds each mini-batch again under its saved
    random state (the same dropout masks) and back-propagates that gradient. The gradients
    are those of one backward through the same forwards (see
    :mod:`fastcl.integrations.sentence_transformers`).

    Args:
        model: the SentenceTransformer model to train.
        scale: ``1/τ``, as :class:`FastInfoNCELoss` (the positional order of
            CachedMultipleNegativesRankingLoss: ``model, scale, similarity_fct,
            mini_batch_size``).
        similarity_fct: ``sentence_transformers.util.cos_sim`` only.
        {cached_args}
        mini_batch_num_tokens: pack the mini-batches by their number of (non-padding) tokens
            instead, at most this many each (sentence-transformers' own packing, replayed
            exactly in pass 2). None: ``mini_batch_size`` decides.
        gather_across_devices, directions, partition_mode, hardness_mode, hardness_strength,
            symmetric, hard_negative_weight, focal_m, mask_duplicates, matryoshka_dims,
            matryoshka_weights, backend, chunk_size: as :class:`FastInfoNCELoss`.

    Inputs:
        {inputs}

    Relations:
        - Replaces ``CachedMultipleNegativesRankingLoss`` (same ``scale``, columns, options,
          ``mini_batch_size``, ``mini_batch_num_tokens`` and numbers).
        - :class:`FastInfoNCELoss` is the same loss in one forward per column: faster while
          the activations fit.
        - :class:`CachedFastFocalInfoNCELoss`, :class:`CachedFastDCLRLoss` and
          :class:`CachedFastESCLLoss` cache the other fastcl losses the same way.

    References:
        Gao, Yao & Chen, "SimCSE", EMNLP 2021; Gao, Zhang, Han & Callan, "Scaling Deep
        Contrastive Learning Batch Size under Memory Limited Setup", RepL4NLP 2021
        (GradCache). ``citation`` holds both.

    Example:
        {example}
    """

    _plain = FastInfoNCELoss

    def __init__(self, model: SentenceTransformer, scale: float = 1.0 / common.TEMPERATURE,
                 similarity_fct=cos_sim, mini_batch_size: int = 32,
                 mini_batch_num_tokens: int | None = None, gather_across_devices: bool = False,
                 directions: tuple[str, ...] = ("query_to_doc",), partition_mode: str = "joint",
                 show_progress_bar: bool = False, hardness_mode: str | None = None,
                 hardness_strength: float = 0.0, **options):
        super().__init__(FastInfoNCELoss(
            model, scale, similarity_fct, gather_across_devices, directions, partition_mode,
            hardness_mode, hardness_strength, **options),
            mini_batch_size, show_progress_bar, mini_batch_num_tokens)
