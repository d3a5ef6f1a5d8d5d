"""FastDCLRLoss: DCLR's noise negatives and instance weighting by a frozen guide model."""

from __future__ import annotations

import torch

import fastcl
from fastcl import citations, common, distributed

from ._base import FastLoss, Guided, SentenceTransformer, documented, gather_rows

__all__ = ["FastDCLRLoss"]


@documented(inputs="pairs", data="unsupervised",
            loss="FastDCLRLoss(model, guide, phi=0.9, noise_ratio=1.0)")
class FastDCLRLoss(Guided, FastLoss):
    r"""DCLR (Zhou et al., 2022): noise negatives and instance weighting by a frozen guide.

    The ``guide`` (a trained SimCSE model in the paper) embeds both columns in eval mode
    without gradients, ``g_i`` and ``g⁺_j``; every in-batch negative it scores at cosine
    ≥ ``phi`` leaves the denominator, ``α_ij = 1[cos(g_i, g⁺_j) < φ]`` (the positive and the
    noise keep α = 1). ``K = noise_ratio·N`` noise negatives ``z_k``, drawn from
    ``N(0, noise_std²)``, are improved by ``noise_steps`` normalized gradient-ascent steps of
    size ``noise_lr`` (:func:`fastcl.dclr_noise`). With ``s_ij = cos(a_i, p_j)``:

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}}{\tau} + \log\Big(\sum_j \alpha_{ij}\,
              e^{s_{ij}/\tau} + \sum_k e^{\cos(a_i, z_k)/\tau}\Big)\Big]

    computed by :func:`fastcl.contrastive` without the N×(N+K) matrix. If the guide's
    tokenizer differs from the model's (or it reads shorter inputs), the text is decoded and
    tokenized again for the guide.

    Args:
        model: the SentenceTransformer model to train.
        guide: the frozen SentenceTransformer whose cosines drop false negatives (DCLR's
            complementary model); it may be ``model`` itself. None: no instance weighting
            (α = 1 everywhere), the noise negatives only.
        guide_dropout: run the guide with its dropout on, as the authors' released code
            does (each column then gets its own dropout view); False: eval mode, the paper.
        phi: the guide's cosine threshold φ in [-1, 1].
        noise_ratio: noise negatives per example (K = ``noise_ratio``·N; 0: none).
        noise_steps: gradient-ascent steps on the noise.
        noise_lr: the step size β of each noise step.
        noise_std: the standard deviation of the initial noise.
        temperature: τ > 0.
        formulation: ``"paper"`` or ``"released"`` (the authors' code; the differences are
            listed in :func:`fastcl.dclr_loss`).
        generator: the ``torch.Generator`` the noise is drawn from (None: the global one).
        backend: ``"auto"``, ``"reference"``, ``"tiled"`` or ``"triton"``.
        chunk_size: anchor rows per chunk inside the loss (None: the backend's choice).
        gather_across_devices: N is the global batch, and the noise is the same on every
            process (see :mod:`fastcl.integrations.sentence_transformers`).
        focal_m: Focal-InfoNCE's modulation on top (paper formulation only). None: off.
        mask_duplicates: drop every in-batch candidate with the same text as the anchor's
            positive (paper formulation), as :class:`FastInfoNCELoss`.
        learnable_temperature: learn τ with the model, as :class:`FastInfoNCELoss` (the noise
            update takes its current value; the noise carries no gradient).

    Inputs:
        {inputs}

        The paper's unsupervised recipe: the same sentence in both columns.

    Relations:
        - Replaces ``MultipleNegativesRankingLoss`` in unsupervised (SimCSE-style) training,
          with two debiasing devices: the guide's false-negative mask and noise negatives.
        - ``GISTEmbedLoss`` is the closest sentence-transformers loss: a guide model filters
          false negatives there too, by a per-row margin (the guide's anchor–positive
          similarity) instead of one threshold φ; this loss is not a drop-in for it.
        - :class:`CachedFastDCLRLoss` is this loss with GradCache.
        - :class:`FastInfoNCELoss` is this loss without the guide and the noise.

    References:
        Zhou, Zhang, Zhao & Wen, "Debiased Contrastive Learning of Unsupervised Sentence
        Representations", ACL 2022 (``citation``).

    Example:
        {example}
    """

    _config = ("phi", "noise_ratio", "noise_steps", "noise_lr", "noise_std", "temperature",
               "formulation", "focal_m", "guide_dropout", "mask_duplicates", "gather_across_devices",
               "backend")
    _column_counts = (2, 2)
    _guide_argument = "complementary"

    def __init__(self, model: SentenceTransformer, guide: SentenceTransformer | None, phi: float = common.PHI,
                 noise_ratio: float = common.NOISE_RATIO, noise_steps: int = common.NOISE_STEPS,
                 noise_lr: float = common.NOISE_LR, noise_std: float = common.NOISE_STD,
                 temperature: float = common.TEMPERATURE, formulation: str = "paper",
                 generator: torch.Generator | None = None, backend: str = "auto",
                 chunk_size: int | None = None, gather_across_devices: bool = False,
                 focal_m: float | None = None, guide_dropout: bool = False,
                 mask_duplicates: bool = False, *, learnable_temperature: bool = False):
        super().__init__(model)
        self.mask_duplicates = bool(mask_duplicates)
        self._init_guide(model, guide, "the frozen model whose cosines drop DCLR's false "
                         "negatives; it may be the model itself; None for none", guide_dropout)
        self.focal_m, self.phi, self.formulation, self.temperature = focal_m, phi, formulation, temperature
        self.noise_ratio, self.noise_steps, self.noise_lr, self.noise_std = (noise_ratio, noise_steps,
                                                                             noise_lr, noise_std)
        self.generator = generator
        self.backend, self.chunk_size = backend, chunk_size
        self.gather_across_devices = gather_across_devices
        self._init_temperature(learnable_temperature, temperature)
        self._check_options()

    def compute_loss_from_embeddings(self, embeddings, labels=None, complementary=None,
                                     duplicate_ids=None):
        anchors, positives = self._columns(embeddings, type(self).__name__, 2, 2)
        kw = self._options()
        noise_options = {name: kw.pop(name) for name in ("noise_ratio", "noise_steps", "noise_lr",
                                                         "noise_std", "generator")}
        ids = self._ids(duplicate_ids)
        if not self._gathering():
            if ids is not None:
                kw["duplicate_ids"] = (ids[1],)
            return fastcl.contrastive(anchors, positives, complementary=complementary,
                                      **noise_options, **kw)
        guide_pos = [complementary[1].detach()] if complementary is not None else []
        extra = [ids[1][:, None]] if ids is not None else []
        offset, (positives, all_anchors, *rest) = gather_rows(positives, anchors.detach(), *guide_pos,
                                                              *extra)
        if ids is not None:
            kw["duplicate_ids"] = (rest.pop()[:, 0],)
        guide_pos = rest
        # the noise of one process on the whole batch; rank 0's copy for every process
        num = common.noise_count(self.noise_ratio, positives.shape[0], self.formulation)
        noise = fastcl.dclr_noise(all_anchors, positives.detach(), num, steps=self.noise_steps,
                                  lr=self.noise_lr, std=self.noise_std,
                                  temperature=self.current_temperature,
                                  generator=self.generator, formulation=self.formulation,
                                  backend=self.backend, chunk_size=self.chunk_size)
        noise = distributed.broadcast(noise, src=0)
        if complementary is not None:
            complementary = (complementary[0], guide_pos[0])
        return fastcl.contrastive(anchors, positives, complementary=complementary, noise=noise,
                                  noise_steps=0, anchor_offset=offset, **kw)

    @property
    def citation(self) -> str:
        return citations.DCLR
