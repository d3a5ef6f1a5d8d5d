"""FastGISTEmbedLoss: a guide model's false-negative filter, fused; a drop-in for GISTEmbedLoss."""

from __future__ import annotations

from fastcl import citations, layout

from ._base import FastLoss, Guided, SentenceTransformer, documented

__all__ = ["FastGISTEmbedLoss"]


@documented(inputs="negatives", data="pairs",
            loss="FastGISTEmbedLoss(model, guide, temperature=0.01)")
class FastGISTEmbedLoss(Guided, FastLoss):
    r"""GISTEmbed's guided in-batch negatives, without the N×M matrices: a drop-in for
    ``GISTEmbedLoss``.

    A frozen ``guide`` embeds every column (``g``); its anchor–positive cosine
    ``γ_i = cos(g_{a_i}, g_{p_i})`` sets a threshold per row, ``θ_i = γ_i − margin``
    (``"absolute"``) or ``γ_i − |γ_i|·margin`` (``"relative"``). Row i scores its anchor
    against the positives, the negatives and (``contrast_anchors``) the anchors, and its
    positive against the positives (``contrast_positives``), all in one softmax; every score
    whose guide cosine exceeds ``θ_i`` is dropped, except the positive's own, and so are the
    self scores ``(a_i, a_i)`` and ``(p_i, p_i)``:

    .. math:: L = \frac1N\sum_i\Big[-\frac{\cos(a_i, p_i)}{\tau} + \log\!\!\sum_{(x, c)
              \in S_i,\ \cos(g_x, g_c) \le \theta_i \text{ or } c = p_i}\!\! e^{\cos(x, c)/\tau}\Big]

    with ``S_i`` = {(a_i, p_j), (a_i, n_j), (a_i, a_j)_{j≠i}, (p_i, p_j)_{j≠i}} over the
    blocks that are on. The self scores left ``S_i`` in sentence-transformers 6.3; before it
    GISTEmbedLoss dropped them only through the guide's filter, which differs from this loss
    only where a row's threshold reaches the guide's self cosine (~1: an anchor identical to
    its positive at margin 0, or a negative margin). :func:`fastcl.contrastive` computes it
    with ``directions=fastcl.layout.gist(...)`` and ``guide``: the guide's cosines and the
    threshold are applied inside each chunk of rows, so neither the N×M scores nor the guide's
    N×M cosines ever exist (the sentence-transformers loss holds eight such matrices, and an
    N×M×d one per block).

    Args:
        model: the SentenceTransformer model to train.
        guide: the frozen SentenceTransformer whose cosines drop false negatives (run in eval
            mode without gradients; re-tokenized when its vocabulary differs).
        temperature: τ > 0 (0.01, GISTEmbedLoss's default).
        margin_strategy: ``"absolute"`` or ``"relative"``.
        margin: the margin of the threshold.
        contrast_anchors: also the anchor–anchor scores (this process's anchors only, as
            GISTEmbedLoss, with ``gather_across_devices``).
        contrast_positives: also the positive–positive scores.
        gather_across_devices: contrast each anchor with the positives and negatives of every
            process (see :mod:`fastcl.integrations.sentence_transformers`).
        focal_m: Focal-InfoNCE's modulation on top (positive ``cos²/τ``, others
            ``cos(cos + m)/τ``). None: off.
        matryoshka_dims, matryoshka_weights: the loss of every prefix width, weighted and
            summed, as :class:`FastInfoNCELoss` (one pass per width here).
        learnable_temperature: learn τ with the model, as :class:`FastInfoNCELoss`.
        mask_duplicates: also drop candidates with the same text as the anchor's positive
            (the guide's cosine of a duplicate is ~1 and drops it anyway unless the margin is
            negative).
        backend: ``"auto"``, ``"reference"``, ``"tiled"`` or ``"triton"`` (``"auto"``: the
            Triton kernels for CUDA tensors, tiled otherwise).
        chunk_size: anchor rows per chunk inside the loss (None: the backend's choice).

    Inputs:
        {inputs}

    Relations:
        - Replaces ``GISTEmbedLoss`` (the same arguments, columns and numbers).
        - :class:`CachedFastGISTEmbedLoss` is this loss with GradCache, for
          ``CachedGISTEmbedLoss``.
        - :class:`FastDCLRLoss` filters with one threshold φ instead of the per-row margin,
          and adds noise negatives.

    References:
        Solatorio, "GISTEmbed: Guided In-sample Selection of Training Negatives for Text
        Embedding Fine-tuning", 2024 (``citation``).

    Example:
        {example}
    """

    _local_anchor_block = True    # GISTEmbedLoss's anchor–anchor block: this process's anchors
    _spec_names = {"margin": "guide_margin"}

    def __init__(self, model: SentenceTransformer, guide: SentenceTransformer, temperature: float = 0.01,
                 margin_strategy: str = "absolute", margin: float = 0.0, contrast_anchors: bool = True,
                 contrast_positives: bool = True, gather_across_devices: bool = False, *,
                 focal_m: float | None = None, mask_duplicates: bool = False, matryoshka_dims=None,
                 matryoshka_weights=None, learnable_temperature: bool = False,
                 backend: str = "auto", chunk_size: int | None = None):
        super().__init__(model)
        if guide is None:
            raise TypeError("FastGISTEmbedLoss needs a guide model (a SentenceTransformer)")
        self._init_guide(model, guide, "the frozen model whose cosines drop false negatives")
        self.temperature, self.margin_strategy, self.margin = temperature, margin_strategy, margin
        self.contrast_anchors, self.contrast_positives = bool(contrast_anchors), bool(contrast_positives)
        self.gather_across_devices, self.focal_m = gather_across_devices, focal_m
        self.mask_duplicates, self.backend, self.chunk_size = bool(mask_duplicates), backend, chunk_size
        self.matryoshka_dims, self.matryoshka_weights = matryoshka_dims, matryoshka_weights
        self._layout = layout.gist(self.contrast_anchors, self.contrast_positives)
        self._init_temperature(learnable_temperature, temperature)
        self._check_options()

    def _options(self) -> dict:
        return {**super()._options(), "directions": self._layout}

    def compute_loss_from_embeddings(self, embeddings, labels=None, guide_embeddings=None,
                                     duplicate_ids=None):
        """The loss of the columns' embeddings; ``guide_embeddings``: the guide's of the same
        columns (one tensor each), as :meth:`forward` computes them."""
        if guide_embeddings is None:
            raise ValueError("FastGISTEmbedLoss needs the guide's embeddings of the columns: call "
                             "the loss on the tokenized features, or pass guide_embeddings")
        if len(guide_embeddings) != len(embeddings):
            raise ValueError(f"guide_embeddings has {len(guide_embeddings)} columns but the "
                             f"embeddings have {len(embeddings)}")
        return self._in_batch_loss(embeddings, guide=guide_embeddings,
                                   duplicate_ids=self._ids(duplicate_ids))

    @property
    def citation(self) -> str:
        return citations.GIST
