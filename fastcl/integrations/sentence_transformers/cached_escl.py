"""CachedFastESCLLoss: FastESCLLoss with GradCache, its high-dropout view replayed at its rate."""

from __future__ import annotations

from contextlib import nullcontext

from fastcl import common
from fastcl.encoders import dropout_rate

from ._base import Cached, SentenceTransformer, documented
from .escl import FastESCLLoss

__all__ = ["CachedFastESCLLoss"]


class _SensitiveView(dict):
    """The anchor column's features, marked as ESCL's high-dropout view."""


@documented(inputs="pairs", data="unsupervised",
            loss="CachedFastESCLLoss(model, weight=2.5e-3, mini_batch_size=32)")
class CachedFastESCLLoss(Cached):
    r""":class:`FastESCLLoss` with GradCache (``mini_batch_size`` inputs per forward).

    The loss of :class:`FastESCLLoss` (InfoNCE plus λ times the relative difference to the
    sensitive view ``h⁻``),

    .. math:: L = \mathrm{InfoNCE}_\tau(a, p) + \lambda\,\frac{1}{2N}\sum_i\sum_{h\in\{a,p\}}
              \mathrm{softplus}\Big(\frac{D^+_i - D^-_i(h)}{\tau}\Big),

    with the encoder run on ``mini_batch_size`` inputs at a time, twice (see
    :mod:`fastcl.integrations.sentence_transformers`). The high-dropout view is a third
    column: the anchors embedded with every dropout at ``sensitive_dropout``, in pass 1 and
    again, under the same random state and rate, in pass 2.

    Args:
        model: the SentenceTransformer model to train.
        temperature, weight, rd, sensitive_dropout: as :class:`FastESCLLoss`.
        {cached_args}
        gather_across_devices, margins, backend, chunk_size, mask_duplicates: as
            :class:`FastESCLLoss`.

    Inputs:
        {inputs}

    Relations:
        - Replaces ``CachedMultipleNegativesRankingLoss`` in unsupervised training, with
          ESCL's equivariance term (one more cached forward of the anchors).
        - :class:`FastESCLLoss` is the same loss without caching.

    References:
        Liu et al., "Equivariant Contrastive Learning for Sentence Embeddings", ICASSP 2023;
        Gao et al., "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup",
        RepL4NLP 2021 (GradCache). ``citation`` holds both.

    Example:
        {example}
    """

    _plain = FastESCLLoss

    def __init__(self, model: SentenceTransformer, temperature: float = common.TEMPERATURE,
                 weight: float = common.ESCL_WEIGHT, rd: str = common.ESCL_RD,
                 sensitive_dropout: float = common.SENSITIVE_DROPOUT, *, mini_batch_size: int = 32,
                 show_progress_bar: bool = False, **options):
        super().__init__(FastESCLLoss(model, temperature, weight, rd, sensitive_dropout, **options),
                         mini_batch_size, show_progress_bar)

    def _views(self, sentence_features):
        return [*sentence_features, _SensitiveView(sentence_features[0])]

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        # ESCL's view: the same dropout rate in pass 1 and in its replay
        sensitive = isinstance(sentence_feature, _SensitiveView)
        with dropout_rate(self.model, self.sensitive_dropout) if sensitive else nullcontext():
            return super().embed_minibatch(sentence_feature=sentence_feature, begin=begin, end=end,
                                           with_grad=with_grad, copy_random_state=copy_random_state,
                                           random_state=random_state)
