"""CachedFastDCLRLoss: FastDCLRLoss with GradCache."""

from __future__ import annotations

import torch

from fastcl import common

from ._base import Cached, SentenceTransformer, documented
from .dclr import FastDCLRLoss

__all__ = ["CachedFastDCLRLoss"]


@documented(inputs="pairs", data="unsupervised",
            loss="CachedFastDCLRLoss(model, guide, phi=0.9, mini_batch_size=32)")
class CachedFastDCLRLoss(Cached):
    r""":class:`FastDCLRLoss` with GradCache (``mini_batch_size`` inputs per forward).

    The loss of :class:`FastDCLRLoss` (the guide's mask α, the noise negatives ``z_k``),

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}}{\tau} + \log\Big(\sum_j \alpha_{ij}\,
              e^{s_{ij}/\tau} + \sum_k e^{\cos(a_i, z_k)/\tau}\Big)\Big],

    with the encoder run on ``mini_batch_size`` inputs at a time, twice (see
    :mod:`fastcl.integrations.sentence_transformers`). The guide embeds both columns once
    per step, in pass 1, in forwards of at most ``mini_batch_size`` inputs, without
    gradients; the noise is drawn once, with the loss.

    Args:
        model: the SentenceTransformer model to train.
        guide: the frozen SentenceTransformer, as :class:`FastDCLRLoss`.
        phi, noise_ratio, noise_steps, noise_lr, noise_std, temperature, formulation,
            generator: as :class:`FastDCLRLoss`.
        {cached_args}
        mini_batch_num_tokens: as :class:`CachedFastInfoNCELoss`.
        gather_across_devices, backend, chunk_size, focal_m, guide_dropout, mask_duplicates: as
            :class:`FastDCLRLoss`.

    Inputs:
        {inputs}

    Relations:
        - Replaces ``CachedMultipleNegativesRankingLoss`` in unsupervised training, with
          DCLR's debiasing; ``CachedGISTEmbedLoss`` is its closest relative (a guide's
          false-negative filter by a per-row margin).
        - :class:`FastDCLRLoss` is the same loss without caching.

    References:
        Zhou et al., "Debiased Contrastive Learning of Unsupervised Sentence
        Representations", ACL 2022; Gao et al., "Scaling Deep Contrastive Learning Batch
        Size under Memory Limited Setup", RepL4NLP 2021 (GradCache). ``citation`` holds both.

    Example:
        {example}
    """

    _plain = FastDCLRLoss

    def __init__(self, model: SentenceTransformer, guide: SentenceTransformer, phi: float = common.PHI,
                 noise_ratio: float = common.NOISE_RATIO, noise_steps: int = common.NOISE_STEPS,
                 noise_lr: float = common.NOISE_LR, noise_std: float = common.NOISE_STD,
                 temperature: float = common.TEMPERATURE, formulation: str = "paper",
                 generator: torch.Generator | None = None, *, mini_batch_size: int = 32,
                 show_progress_bar: bool = False, mini_batch_num_tokens: int | None = None, **options):
        super().__init__(FastDCLRLoss(
            model, guide, phi, noise_ratio, noise_steps, noise_lr, noise_std, temperature,
            formulation, generator, **options), mini_batch_size, show_progress_bar, mini_batch_num_tokens)

    def _pass_one_inputs(self, sentence_features):
        return {"complementary": self._guide_embeddings(sentence_features, self.mini_batch_size)}
