"""CachedFastGISTEmbedLoss: FastGISTEmbedLoss with GradCache, a drop-in for CachedGISTEmbedLoss."""

from __future__ import annotations

from ._base import Cached, SentenceTransformer, documented
from .gist import FastGISTEmbedLoss

__all__ = ["CachedFastGISTEmbedLoss"]


@documented(inputs="negatives", data="pairs",
            loss="CachedFastGISTEmbedLoss(model, guide, temperature=0.01, mini_batch_size=32)")
class CachedFastGISTEmbedLoss(Cached):
    r""":class:`FastGISTEmbedLoss` with GradCache: a drop-in for ``CachedGISTEmbedLoss``.

    The loss of :class:`FastGISTEmbedLoss` (the guide's per-row threshold
    ``θ_i = γ_i − margin``, or ``γ_i − |γ_i|·margin``, drops every score whose guide cosine
    exceeds it, the positive kept),

    .. math:: L = \frac1N\sum_i\Big[-\frac{\cos(a_i, p_i)}{\tau} + \log\!\!\sum_{(x, c)
              \in S_i,\ \cos(g_x, g_c) \le \theta_i \text{ or } c = p_i}\!\! e^{\cos(x, c)/\tau}\Big],

    for batches whose encoder activations do not fit in memory: pass 1 embeds every column
    (and the guide embeds it, without gradients) in mini-batches; the loss and its gradient
    w.r.t. every embedding come from one fused call; pass 2 embeds each mini-batch again
    under its saved random state and back-propagates (see
    :mod:`fastcl.integrations.sentence_transformers`).

    Args:
        model: the SentenceTransformer model to train.
        guide: the frozen guide model, as :class:`FastGISTEmbedLoss`.
        temperature: τ, as :class:`FastGISTEmbedLoss` (0.01).
        {cached_args}
        mini_batch_num_tokens: as :class:`CachedFastInfoNCELoss`.
        margin_strategy, margin, contrast_anchors, contrast_positives, gather_across_devices,
            focal_m, mask_duplicates, matryoshka_dims, matryoshka_weights, backend, chunk_size:
            as :class:`FastGISTEmbedLoss`.

    Inputs:
        {inputs}

    Relations:
        - Replaces ``CachedGISTEmbedLoss`` (the same arguments in its positional order,
          columns and numbers).
        - :class:`FastGISTEmbedLoss` is the same loss in one forward per column.

    References:
        Solatorio, "GISTEmbed", 2024; Gao et al., "Scaling Deep Contrastive Learning Batch
        Size under Memory Limited Setup", RepL4NLP 2021 (GradCache). ``citation`` holds both.

    Example:
        {example}
    """

    _plain = FastGISTEmbedLoss

    def __init__(self, model: SentenceTransformer, guide: SentenceTransformer, temperature: float = 0.01,
                 mini_batch_size: int = 32, mini_batch_num_tokens: int | None = None,
                 show_progress_bar: bool = False, margin_strategy: str = "absolute",
                 margin: float = 0.0, contrast_anchors: bool = True, contrast_positives: bool = True,
                 gather_across_devices: bool = False, **options):
        super().__init__(FastGISTEmbedLoss(
            model, guide, temperature, margin_strategy, margin, contrast_anchors, contrast_positives,
            gather_across_devices, **options), mini_batch_size, show_progress_bar, mini_batch_num_tokens)

    def _pass_one_inputs(self, sentence_features):
        return {"guide_embeddings": self._guide_embeddings(sentence_features, self.mini_batch_size)}
