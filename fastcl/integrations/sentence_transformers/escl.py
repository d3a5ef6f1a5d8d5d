"""FastESCLLoss: ESCL's InfoNCE plus a relative difference to a high-dropout view."""

from __future__ import annotations

import fastcl
from fastcl import citations, common
from fastcl.encoders import dropout_rate
from fastcl.spec import escl_options

from ._base import FastLoss, SentenceTransformer, documented, embed_columns, gather_rows

__all__ = ["FastESCLLoss"]


@documented(inputs="pairs", data="unsupervised",
            loss="FastESCLLoss(model, weight=2.5e-3, sensitive_dropout=0.45)")
class FastESCLLoss(FastLoss):
    r"""ESCL (Liu et al., 2023): InfoNCE + λ·relative difference to a high-dropout view.

    The sensitive view ``h⁻`` re-encodes the anchor column with every dropout of the model set
    to ``sensitive_dropout`` (0.45) for that forward only. With ``D⁺_i = 1 − cos(a_i, p_i)``
    and ``D⁻_i(h) = 1 − cos(h_i, h⁻_i)`` for ``h ∈ {a, p}``:

    .. math:: L = \mathrm{InfoNCE}_\tau(a, p) + \lambda\,\frac{1}{2N}\sum_i\sum_{h\in\{a,p\}}
              \mathrm{softplus}\Big(\frac{D^+_i - D^-_i(h)}{\tau}\Big)

    computed by :func:`fastcl.escl_loss` (the paper's exact RD equation is not public: this
    ranking form is a documented reconstruction; ``rd="margin"`` selects SNCSE's bidirectional
    margin form).

    Args:
        model: the SentenceTransformer model to train.
        temperature: τ > 0.
        weight: λ, the weight of the relative-difference term.
        rd: ``"softplus"`` (above) or ``"margin"``.
        sensitive_dropout: the dropout rate of the sensitive view, in [0, 1).
        backend: ``"auto"``, ``"reference"``, ``"tiled"`` or ``"triton"``.
        chunk_size: anchor rows per chunk inside the loss (None: the backend's choice).
        gather_across_devices: contrast each anchor with the positives of every process
            (see :mod:`fastcl.integrations.sentence_transformers`).
        margins: ``(a, b)`` of ``rd="margin"``.
        mask_duplicates: drop every candidate whose text equals that of the anchor's
            positive (the texts' token ids, hashed before the forward) from the InfoNCE term.
        learnable_temperature: learn τ with the model, as :class:`FastInfoNCELoss` (in both
            terms).

    Inputs:
        {inputs}

        The paper's unsupervised recipe: the same sentence in both columns. The sensitive
        view is a third forward of the anchor column, made by the loss.

    Relations:
        - Replaces ``MultipleNegativesRankingLoss`` in unsupervised (SimCSE-style) training,
          with ESCL's equivariance term; it costs one more forward of the anchors.
        - :class:`CachedFastESCLLoss` is this loss with GradCache (the sensitive view
          replayed at its own dropout rate).
        - :class:`FastInfoNCELoss` is this loss with ``weight=0``, without the extra forward.

    References:
        Liu et al., "Equivariant Contrastive Learning for Sentence Embeddings", ICASSP 2023
        (``citation``).

    Example:
        {example}
    """

    _config = ("temperature", "weight", "rd", "margins", "sensitive_dropout", "mask_duplicates",
               "gather_across_devices", "backend")
    _column_counts = (2, 2)

    def __init__(self, model: SentenceTransformer, temperature: float = common.TEMPERATURE,
                 weight: float = common.ESCL_WEIGHT, rd: str = common.ESCL_RD,
                 sensitive_dropout: float = common.SENSITIVE_DROPOUT, backend: str = "auto",
                 chunk_size: int | None = None, gather_across_devices: bool = False,
                 margins: tuple[float, float] = common.ESCL_MARGINS, mask_duplicates: bool = False,
                 *, learnable_temperature: bool = False):
        super().__init__(model)
        self.mask_duplicates = bool(mask_duplicates)
        if not 0.0 <= sensitive_dropout < 1.0:
            raise ValueError(f"sensitive_dropout must lie in [0, 1), got {sensitive_dropout}")
        self.temperature = temperature
        self.weight, self.rd, self.margins = escl_options(weight, rd, margins)
        self.sensitive_dropout, self.backend, self.chunk_size = sensitive_dropout, backend, chunk_size
        self.gather_across_devices = gather_across_devices
        self._init_temperature(learnable_temperature, temperature)
        self._check_options()

    def forward(self, sentence_features, labels=None):
        sentence_features = self._features(sentence_features)
        inputs = self._feature_inputs(sentence_features)
        embeddings = embed_columns(self.model, sentence_features)
        with dropout_rate(self.model, self.sensitive_dropout):
            sensitive = self.model(dict(sentence_features[0]))["sentence_embedding"]
        return self.compute_loss_from_embeddings([*embeddings, sensitive], labels, **inputs)

    def compute_loss_from_embeddings(self, embeddings, labels=None, duplicate_ids=None):
        anchors, positives, sensitive = self._columns(
            embeddings, f"{type(self).__name__} (with the sensitive view)", 3, 3)
        kw = dict(self._options(), weight=self.weight, rd=self.rd, margins=self.margins)
        ids = self._ids(duplicate_ids)
        if not self._gathering():
            return fastcl.escl_loss(anchors, positives, sensitive,
                                    duplicate_ids=None if ids is None else ids[1], **kw)
        extra = [ids[1][:, None]] if ids is not None else []
        offset, (positives, *rest) = gather_rows(positives, *extra)
        return fastcl.escl_loss(anchors, positives, sensitive, anchor_offset=offset,
                                duplicate_ids=rest[0][:, 0] if rest else None, **kw)

    @property
    def citation(self) -> str:
        return citations.ESCL
