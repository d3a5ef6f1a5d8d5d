"""fastcl losses for ``SentenceTransformerTrainer``.

Each class follows sentence-transformers' loss conventions: the constructor takes the
``SentenceTransformer`` model first, ``forward(sentence_features, labels)`` embeds the
input columns and returns the loss, and ``compute_loss_from_embeddings(embeddings,
labels)`` scores embeddings computed elsewhere. Columns are ``(anchor, positive[,
negative...])``. For the unsupervised recipes put the same sentence in both columns:
dropout gives the two views.

=============================  ======================================================
``FastInfoNCELoss``            drop-in for ``MultipleNegativesRankingLoss`` (cosine
                               similarity, ``scale = 1/τ``, extra columns as negatives)
``FastFocalInfoNCELoss``       Focal-InfoNCE
``FastDCLRLoss``               DCLR; a frozen ``guide`` model gives the complementary
                               embeddings (like ``GISTEmbedLoss``'s guide)
``FastESCLLoss``               ESCL; the high-dropout view is a third forward of the
                               anchors with every dropout at ``sensitive_dropout``
``CachedFastInfoNCELoss``      each of the above, cached (GradCache): a drop-in for
``CachedFastFocalInfoNCELoss`` ``CachedMultipleNegativesRankingLoss``, with activation
``CachedFastDCLRLoss``         memory set by ``mini_batch_size`` instead of the batch
``CachedFastESCLLoss``
=============================  ======================================================

**Cached losses.** Pass 1 embeds each column in mini-batches of ``mini_batch_size``
inputs without a graph and keeps the random state taken before each mini-batch's forward
(ESCL's high-dropout view is one more column, embedded at ``sensitive_dropout``; DCLR's
guide embeds the batch once, here, without gradients). fastcl then computes the loss of
the whole batch and its gradient w.r.t. every embedding, without the N×M similarity
matrix. Pass 2 runs in the backward: each mini-batch is embedded again under its saved
random state, so dropout draws the masks of pass 1, and its cached gradient is
back-propagated. The gradients are those of one backward through the same forwards; a
``mini_batch_size`` that covers a whole column gives exactly the forwards, and so the
gradients, of the plain loss. ``mini_batch_size`` counts encoder inputs per forward; the
losses' own ``chunk_size`` (anchor rows per chunk inside the loss) is a separate knob.

The two passes come from sentence-transformers' ``CachedLossMixin``
(``sentence_transformers.base.losses``, sentence-transformers ≥ 5.7.0), the machinery of
its own cached losses. With older releases fastcl uses its own implementation of the same
contract (:mod:`fastcl.integrations._gradcache`), with the same numbers.

**Several devices.** ``gather_across_devices=True`` (every loss, cached or not) gathers the
candidates of every process with their gradients (:func:`fastcl.distributed.gather`), so
each anchor is contrasted with the whole global batch; each process computes the mean
loss over its own anchors, rows ``[rank·n, rank·n + n)`` of the gathered batch
(``anchor_offset``). Once the gradients are averaged over processes (as
DistributedDataParallel does) they equal those of one process on the whole batch. DCLR's
noise is drawn from the gathered batch and broadcast from rank 0, so every process uses
the same noise, the one a single process on the whole batch would draw with the same
generator. Every process must hold the same number of examples per step
(``dataloader_drop_last=True``). Without an initialized process group of two or more
processes the option does nothing.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

import fastcl
from fastcl import citations, common, distributed
from fastcl.encoders import dropout_rate
from fastcl.integrations._gradcache import batch_rows, minibatch, minibatch_ranges

try:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import cos_sim
except ImportError as err:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "fastcl.integrations.sentence_transformers needs the sentence-transformers package: "
        "pip install sentence-transformers (or pip install 'fastcl[dev]')") from err

from fastcl.integrations.sentence_transformers_evaluation import SentEvalSTSEvaluator  # noqa: E402,F401 (re-exported)

try:  # sentence-transformers ≥ 6 shares one forward across like columns
    from sentence_transformers.base.losses.merged_forward import embed_columns
except ImportError:  # pragma: no cover - older releases
    def embed_columns(model, features_list):
        return [model(features)["sentence_embedding"] for features in features_list]

try:  # sentence-transformers ≥ 5.7: the GradCache machinery of its own cached losses
    from sentence_transformers.base.losses import CachedLossMixin as _GradCacheBase
    from sentence_transformers.base.losses import has_static_embedding_input
except ImportError:  # older releases: fastcl's implementation of the same contract
    from fastcl.integrations._gradcache import GradCache as _GradCacheBase

    def has_static_embedding_input(model) -> bool:
        return False

#: The GradCache implementation the cached losses run on: sentence-transformers' own
#: ``CachedLossMixin`` (≥ 5.7.0) or fastcl's fallback.
GRADCACHE_BASE = _GradCacheBase

__all__ = ["FastInfoNCELoss", "FastFocalInfoNCELoss", "FastDCLRLoss", "FastESCLLoss",
           "CachedFastInfoNCELoss", "CachedFastFocalInfoNCELoss", "CachedFastDCLRLoss",
           "CachedFastESCLLoss", "SentEvalSTSEvaluator"]


def _gather_rows(*columns: Tensor) -> tuple[int, list[Tensor]]:
    """This process's first row in the global batch and, for each local column, the rows of
    every process in rank order. Columns that require grad keep it (the gather's backward
    sums every process's contribution to our rows). Columns of one dtype and grad mode
    travel in one all_gather, side by side."""
    n, device = columns[0].shape[0], columns[0].device
    sizes = distributed.gather(torch.tensor([n], device=device))
    if not bool((sizes == n).all()):
        raise ValueError(f"gather_across_devices needs the same batch size on every process, got "
                         f"{sizes.tolist()}; set dataloader_drop_last=True")
    out: list[Tensor | None] = [None] * len(columns)
    groups: dict = {}
    for i, col in enumerate(columns):
        groups.setdefault((col.dtype, col.requires_grad), []).append(i)
    for members in groups.values():
        parts = [columns[i] for i in members]
        joined = distributed.gather(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        for i, piece in zip(members, joined.split([p.shape[1] for p in parts], dim=1)):
            out[i] = piece
    return dist.get_rank() * n, out


class _FastLoss(nn.Module):
    """Shared plumbing: embedding the columns and the config sentence-transformers logs."""

    _config: tuple[str, ...] = ()
    gather_across_devices: bool = False

    def __init__(self, model: SentenceTransformer):
        super().__init__()
        self.model = model

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        embeddings = embed_columns(self.model, list(sentence_features))
        return self.compute_loss_from_embeddings(embeddings, labels)  # defined by each loss

    def get_config_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._config}

    def _gathering(self) -> bool:
        return (bool(self.gather_across_devices) and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1)

    def _in_batch_loss(self, embeddings, name: str, *, temperature: float, focal_m: float | None,
                       symmetric: bool = False) -> Tensor:
        """:func:`fastcl.contrastive` over columns (anchor, positive[, negative...]) with this
        loss's ``hard_negative_weight``, ``backend`` and ``chunk_size``; with
        ``gather_across_devices``, every process's positives and negatives as candidates."""
        anchors, positives, *negatives = self._columns(embeddings, name)
        if self.hard_negative_weight and len(negatives) != 1:
            raise ValueError("hard_negative_weight needs exactly one negative column, "
                             f"got {len(negatives)}")
        kw = dict(temperature=temperature, focal_m=focal_m, backend=self.backend,
                  chunk_size=self.chunk_size)
        hard = dict(hard_negative_weight=self.hard_negative_weight)
        if not self._gathering():
            return fastcl.contrastive(anchors, positives, torch.cat(negatives) if negatives else None,
                                      symmetric=symmetric, **hard, **kw)
        # each negative column gathered on its own, so row offset + i stays anchor i's own
        offset, (all_positives, *gathered) = _gather_rows(
            positives, *negatives, *([anchors] if symmetric else []))
        all_anchors = gathered.pop() if symmetric else None
        loss = fastcl.contrastive(anchors, all_positives, torch.cat(gathered) if gathered else None,
                                  anchor_offset=offset, **hard, **kw)
        if symmetric:  # positives → anchors: each process scores its own positives
            loss = 0.5 * (loss + fastcl.contrastive(positives, all_anchors, anchor_offset=offset, **kw))
        return loss

    @staticmethod
    def _columns(embeddings, name, at_least=2, at_most=None):
        if not at_least <= len(embeddings) <= (at_most or len(embeddings)):
            allowed = f"{at_least}" if at_most == at_least else f"{at_least} or more"
            raise ValueError(f"{name} takes {allowed} input columns (anchor, positive"
                             f"{', negative...' if at_most is None else ''}), got {len(embeddings)}")
        return embeddings


class FastInfoNCELoss(_FastLoss):
    r"""InfoNCE with in-batch negatives, a drop-in for ``MultipleNegativesRankingLoss``.

    ``L = mean_i[−scale·cos(a_i, p_i) + log Σ_j exp(scale·cos(a_i, c_j))]`` over the candidates
    ``c = [p; n_1; …]`` (every column after the anchor), computed by :func:`fastcl.infonce`
    without materializing the N×M matrix. ``scale`` is ``1/τ`` (20 ↔ τ = 0.05). Only cosine
    similarity is supported. ``symmetric=True`` matches MNRL's
    ``directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"``.
    ``hard_negative_weight`` (a log-weight on each anchor's own hard negative, supervised
    SimCSE) needs exactly one negative column. ``focal_m`` adds Focal-InfoNCE's modulation
    (positive logit ``s²·scale``, every other ``s(s+m)·scale``; None: off), as
    :func:`fastcl.contrastive`. ``gather_across_devices``: see the module docstring (the
    candidates of every process, as MNRL's option of that name).
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
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale, self.similarity_fct, self.symmetric = scale, similarity_fct, symmetric
        self.hard_negative_weight, self.backend, self.chunk_size = hard_negative_weight, backend, chunk_size
        self.gather_across_devices, self.focal_m = gather_across_devices, focal_m

    def compute_loss_from_embeddings(self, embeddings, labels=None):
        return self._in_batch_loss(embeddings, "FastInfoNCELoss", temperature=1.0 / self.scale,
                                   focal_m=self.focal_m, symmetric=self.symmetric)

    @property
    def citation(self) -> str:
        return citations.SIMCSE


class FastFocalInfoNCELoss(_FastLoss):
    r"""Focal-InfoNCE (Hou & Li, 2023): positive logit ``s²/τ``, negative logits ``s(s+m)/τ``.

    Columns: (anchor, positive[, negative...]); see :func:`fastcl.focal_infonce`.
    ``hard_negative_weight`` (a log-weight on each anchor's own hard negative) needs exactly
    one negative column, as in :class:`FastInfoNCELoss`; the loss is :func:`fastcl.contrastive`
    with ``focal_m=m``.
    """

    _config = ("temperature", "m", "hard_negative_weight", "gather_across_devices", "backend")

    def __init__(self, model: SentenceTransformer, temperature: float = common.TEMPERATURE,
                 m: float = common.FOCAL_M, backend: str = "auto", chunk_size: int | None = None,
                 gather_across_devices: bool = False, hard_negative_weight: float = 0.0):
        super().__init__(model)
        self.temperature, self.m, self.backend, self.chunk_size = temperature, m, backend, chunk_size
        self.gather_across_devices, self.hard_negative_weight = gather_across_devices, hard_negative_weight

    def compute_loss_from_embeddings(self, embeddings, labels=None):
        return self._in_batch_loss(embeddings, "FastFocalInfoNCELoss", temperature=self.temperature,
                                   focal_m=self.m)

    @property
    def citation(self) -> str:
        return citations.FOCAL


class FastDCLRLoss(_FastLoss):
    r"""DCLR (Zhou et al., 2022): noise negatives and instance weighting by a frozen guide.

    The ``guide`` (a trained SimCSE model in the paper) embeds the same two columns in eval
    mode without gradients; every in-batch negative it scores at cosine ≥ ``phi`` leaves the
    denominator. Noise negatives (``noise_ratio``·N of them) are improved by ``noise_steps``
    normalized gradient-ascent steps. Columns: (anchor, positive). If the guide's tokenizer
    differs from the model's, the text is decoded and tokenized again for the guide.
    See :func:`fastcl.dclr_loss`. ``focal_m`` adds Focal-InfoNCE's modulation on top (None:
    off; paper formulation only), as :func:`fastcl.contrastive`. With ``gather_across_devices``
    N is the global batch and the noise is the same on every process (see the module docstring).
    """

    _config = ("phi", "noise_ratio", "noise_steps", "noise_lr", "noise_std", "temperature",
               "formulation", "focal_m", "gather_across_devices", "backend")

    def __init__(self, model: SentenceTransformer, guide: SentenceTransformer, phi: float = common.PHI,
                 noise_ratio: float = common.NOISE_RATIO, noise_steps: int = common.NOISE_STEPS,
                 noise_lr: float = common.NOISE_LR, noise_std: float = common.NOISE_STD,
                 temperature: float = common.TEMPERATURE, formulation: str = "paper",
                 generator: torch.Generator | None = None, backend: str = "auto",
                 chunk_size: int | None = None, gather_across_devices: bool = False,
                 focal_m: float | None = None):
        super().__init__(model)
        self.guide, self.focal_m = guide, focal_m
        self.phi, self.noise_ratio, self.noise_steps = phi, noise_ratio, noise_steps
        self.noise_lr, self.noise_std, self.temperature = noise_lr, noise_std, temperature
        self.formulation, self.generator = formulation, generator
        self.backend, self.chunk_size = backend, chunk_size
        self.gather_across_devices = gather_across_devices
        self.must_retokenize = (model.tokenizer.get_vocab() != guide.tokenizer.get_vocab()
                                or (guide.max_seq_length or 0) < (model.max_seq_length or 0))
        self.tokenizer = model.tokenizer  # kept: the trainer may wrap self.model (DDP) later

    def _guide_forward(self, features):
        if self.must_retokenize:
            texts = self.tokenizer.batch_decode(features["input_ids"], skip_special_tokens=True)
            features = {k: v.to(self.guide.device) if torch.is_tensor(v) else v
                        for k, v in self.guide.preprocess(texts).items()}
        else:
            # a shallow copy: a model writes its outputs into the feature dict it is given
            features = dict(features)
        return self.guide(features)["sentence_embedding"]

    def _guide_embeddings(self, sentence_features, mini_batch_size: int | None = None):
        """The guide's embeddings of each column (eval mode, no gradients), in forwards of at
        most ``mini_batch_size`` inputs (one per column by default)."""
        was_training = self.guide.training
        self.guide.eval()
        try:
            with torch.no_grad():
                columns = []
                for features in sentence_features:
                    ranges = minibatch_ranges(features, mini_batch_size or batch_rows(features))
                    if len(ranges) == 1:
                        columns.append(self._guide_forward(features))
                    else:
                        columns.append(torch.cat([self._guide_forward(minibatch(features, begin, end))
                                                  for begin, end in ranges]))
                return [e.detach() for e in columns]
        finally:
            self.guide.train(was_training)

    def forward(self, sentence_features, labels=None):
        sentence_features = list(sentence_features)
        self._columns(sentence_features, "FastDCLRLoss", 2, 2)
        guide = self._guide_embeddings(sentence_features)
        embeddings = embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels, complementary=guide)

    def compute_loss_from_embeddings(self, embeddings, labels=None, complementary=None):
        anchors, positives = self._columns(embeddings, "FastDCLRLoss", 2, 2)
        kw = dict(phi=self.phi, temperature=self.temperature, formulation=self.formulation,
                  focal_m=self.focal_m, backend=self.backend, chunk_size=self.chunk_size)
        if not self._gathering():
            return fastcl.contrastive(anchors, positives, complementary=complementary,
                                      noise_ratio=self.noise_ratio, noise_steps=self.noise_steps,
                                      noise_lr=self.noise_lr, noise_std=self.noise_std,
                                      generator=self.generator, **kw)
        guide_pos = [complementary[1].detach()] if complementary is not None else []
        offset, (positives, all_anchors, *guide_pos) = _gather_rows(positives, anchors.detach(), *guide_pos)
        # the noise of one process on the whole batch; rank 0's copy for every process
        num = common.noise_count(self.noise_ratio, positives.shape[0], self.formulation)
        noise = fastcl.dclr_noise(all_anchors, positives.detach(), num, steps=self.noise_steps,
                                  lr=self.noise_lr, std=self.noise_std, temperature=self.temperature,
                                  generator=self.generator, formulation=self.formulation,
                                  backend=self.backend, chunk_size=self.chunk_size).contiguous()
        dist.broadcast(noise, src=0)
        if complementary is not None:
            complementary = (complementary[0], guide_pos[0])
        return fastcl.contrastive(anchors, positives, complementary=complementary, noise=noise,
                                  noise_steps=0, anchor_offset=offset, **kw)

    @property
    def citation(self) -> str:
        return citations.DCLR


class FastESCLLoss(_FastLoss):
    r"""ESCL (Liu et al., 2023): InfoNCE + λ·relative difference to a high-dropout view.

    Columns: (anchor, positive). The sensitive view re-encodes the anchor column with every
    dropout set to ``sensitive_dropout`` (0.45) for that forward only. See
    :func:`fastcl.escl_loss` (the RD term is a documented reconstruction).
    """

    _config = ("temperature", "weight", "rd", "margins", "sensitive_dropout", "gather_across_devices",
               "backend")

    def __init__(self, model: SentenceTransformer, temperature: float = common.TEMPERATURE,
                 weight: float = common.ESCL_WEIGHT, rd: str = common.ESCL_RD,
                 sensitive_dropout: float = common.SENSITIVE_DROPOUT, backend: str = "auto",
                 chunk_size: int | None = None, gather_across_devices: bool = False,
                 margins: tuple[float, float] = common.ESCL_MARGINS):
        super().__init__(model)
        if not 0.0 <= sensitive_dropout < 1.0:
            raise ValueError(f"sensitive_dropout must lie in [0, 1), got {sensitive_dropout}")
        self.temperature, self.weight, self.rd, self.margins = temperature, weight, rd, margins
        self.sensitive_dropout, self.backend, self.chunk_size = sensitive_dropout, backend, chunk_size
        self.gather_across_devices = gather_across_devices

    def forward(self, sentence_features, labels=None):
        sentence_features = list(sentence_features)
        self._columns(sentence_features, "FastESCLLoss", 2, 2)
        embeddings = embed_columns(self.model, sentence_features)
        with dropout_rate(self.model, self.sensitive_dropout):
            sensitive = self.model(dict(sentence_features[0]))["sentence_embedding"]
        return self.compute_loss_from_embeddings([*embeddings, sensitive], labels)

    def compute_loss_from_embeddings(self, embeddings, labels=None):
        anchors, positives, sensitive = self._columns(embeddings, "FastESCLLoss (with the sensitive view)", 3, 3)
        kw = dict(temperature=self.temperature, weight=self.weight, rd=self.rd, margins=self.margins,
                  backend=self.backend, chunk_size=self.chunk_size)
        if not self._gathering():
            return fastcl.escl_loss(anchors, positives, sensitive, **kw)
        offset, (positives,) = _gather_rows(positives)
        return fastcl.escl_loss(anchors, positives, sensitive, anchor_offset=offset, **kw)

    @property
    def citation(self) -> str:
        return citations.ESCL


# --- cached (GradCache) variants -------------------------------------------------------

class _SensitiveView(dict):
    """The anchor column's features, marked as ESCL's high-dropout view."""


class _Cached(_GradCacheBase):
    """The two-pass forward around a Fast* loss; mixed in before it. Subclasses may add
    columns to embed (:meth:`_views`) and loss inputs computed once in pass 1
    (:meth:`_pass_one_inputs`)."""

    _pass_one: dict = {}

    def _init_cache(self, mini_batch_size: int, show_progress_bar: bool) -> None:
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}")
        if has_static_embedding_input(self.model):
            raise ValueError(f"{type(self).__name__} cannot split a StaticEmbedding model's inputs into "
                             "mini-batches; use the loss without caching")
        self.mini_batch_size, self.show_progress_bar = mini_batch_size, show_progress_bar

    def _views(self, sentence_features: list) -> list:
        return sentence_features

    def _pass_one_inputs(self, sentence_features: list) -> dict:
        return {}

    def forward(self, sentence_features, labels=None):
        sentence_features = self._columns(list(sentence_features), type(self).__name__)
        self._pass_one = self._pass_one_inputs(sentence_features)
        try:
            return self.forward_cached(self._views(sentence_features), labels)
        finally:
            self._pass_one = {}

    def calculate_loss(self, reps, labels=None, *, with_backward=False):
        """The loss of the whole batch from the mini-batch embeddings ``reps[column][mini-batch]``;
        with ``with_backward`` its gradient w.r.t. each of them is left in their ``.grad``."""
        embeddings = [torch.cat(column) for column in reps]
        loss = self.compute_loss_from_embeddings(embeddings, labels, **self._pass_one)
        if not with_backward:
            return loss
        leaves = [r for column in reps for r in column]
        for leaf, grad in zip(leaves, torch.autograd.grad(loss, leaves, allow_unused=True)):
            leaf.grad = grad
        return loss.detach()

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        # ESCL's view: the same dropout rate in pass 1 and in its replay
        sensitive = isinstance(sentence_feature, _SensitiveView)
        with dropout_rate(self.model, self.sensitive_dropout) if sensitive else nullcontext():
            return super().embed_minibatch(sentence_feature=sentence_feature, begin=begin, end=end,
                                           with_grad=with_grad, copy_random_state=copy_random_state,
                                           random_state=random_state)

    @property
    def citation(self) -> str:
        return super().citation + citations.GRADCACHE


class CachedFastInfoNCELoss(_Cached, FastInfoNCELoss):
    r""":class:`FastInfoNCELoss` with GradCache: a drop-in for ``CachedMultipleNegativesRankingLoss``.

    Same loss, ``scale`` and columns as ``CachedMultipleNegativesRankingLoss`` (anchor,
    positive, any number of negative columns); the encoder runs on ``mini_batch_size``
    inputs at a time, twice (see the module docstring), and fastcl scores the whole batch
    at once without the N×M matrix.
    """

    _config = FastInfoNCELoss._config + ("mini_batch_size",)

    def __init__(self, model: SentenceTransformer, scale: float = 1.0 / common.TEMPERATURE,
                 similarity_fct=cos_sim, mini_batch_size: int = 32, *, show_progress_bar: bool = False,
                 gather_across_devices: bool = False, symmetric: bool = False,
                 hard_negative_weight: float = 0.0, backend: str = "auto", chunk_size: int | None = None,
                 focal_m: float | None = None):
        FastInfoNCELoss.__init__(self, model, scale, similarity_fct, symmetric=symmetric,
                                 hard_negative_weight=hard_negative_weight, backend=backend,
                                 chunk_size=chunk_size, gather_across_devices=gather_across_devices,
                                 focal_m=focal_m)
        self._init_cache(mini_batch_size, show_progress_bar)


class CachedFastFocalInfoNCELoss(_Cached, FastFocalInfoNCELoss):
    """:class:`FastFocalInfoNCELoss` with GradCache (``mini_batch_size`` inputs per forward)."""

    _config = FastFocalInfoNCELoss._config + ("mini_batch_size",)

    def __init__(self, model: SentenceTransformer, temperature: float = common.TEMPERATURE,
                 m: float = common.FOCAL_M, *, mini_batch_size: int = 32, show_progress_bar: bool = False,
                 gather_across_devices: bool = False, backend: str = "auto", chunk_size: int | None = None,
                 hard_negative_weight: float = 0.0):
        FastFocalInfoNCELoss.__init__(self, model, temperature, m, backend=backend, chunk_size=chunk_size,
                                      gather_across_devices=gather_across_devices,
                                      hard_negative_weight=hard_negative_weight)
        self._init_cache(mini_batch_size, show_progress_bar)


class CachedFastDCLRLoss(_Cached, FastDCLRLoss):
    """:class:`FastDCLRLoss` with GradCache (``mini_batch_size`` inputs per forward).

    The guide embeds both columns once per step, in pass 1, in forwards of at most
    ``mini_batch_size`` inputs, without gradients; the noise is drawn once, with the loss.
    """

    _config = FastDCLRLoss._config + ("mini_batch_size",)

    def __init__(self, model: SentenceTransformer, guide: SentenceTransformer, phi: float = common.PHI,
                 noise_ratio: float = common.NOISE_RATIO, noise_steps: int = common.NOISE_STEPS,
                 noise_lr: float = common.NOISE_LR, noise_std: float = common.NOISE_STD,
                 temperature: float = common.TEMPERATURE, formulation: str = "paper",
                 generator: torch.Generator | None = None, *, mini_batch_size: int = 32,
                 show_progress_bar: bool = False, gather_across_devices: bool = False,
                 backend: str = "auto", chunk_size: int | None = None, focal_m: float | None = None):
        FastDCLRLoss.__init__(self, model, guide, phi, noise_ratio, noise_steps, noise_lr, noise_std,
                              temperature, formulation, generator, backend=backend, chunk_size=chunk_size,
                              gather_across_devices=gather_across_devices, focal_m=focal_m)
        self._init_cache(mini_batch_size, show_progress_bar)

    def _pass_one_inputs(self, sentence_features):
        self._columns(sentence_features, type(self).__name__, 2, 2)
        return {"complementary": self._guide_embeddings(sentence_features, self.mini_batch_size)}


class CachedFastESCLLoss(_Cached, FastESCLLoss):
    """:class:`FastESCLLoss` with GradCache (``mini_batch_size`` inputs per forward).

    The high-dropout view is a third column: the anchors embedded with every dropout at
    ``sensitive_dropout``, in pass 1 and again, under the same random state and rate, in
    pass 2.
    """

    _config = FastESCLLoss._config + ("mini_batch_size",)

    def __init__(self, model: SentenceTransformer, temperature: float = common.TEMPERATURE,
                 weight: float = common.ESCL_WEIGHT, rd: str = common.ESCL_RD,
                 sensitive_dropout: float = common.SENSITIVE_DROPOUT, *, mini_batch_size: int = 32,
                 show_progress_bar: bool = False, gather_across_devices: bool = False,
                 margins: tuple[float, float] = common.ESCL_MARGINS, backend: str = "auto",
                 chunk_size: int | None = None):
        FastESCLLoss.__init__(self, model, temperature, weight, rd, sensitive_dropout, backend=backend,
                              chunk_size=chunk_size, gather_across_devices=gather_across_devices,
                              margins=margins)
        self._init_cache(mini_batch_size, show_progress_bar)

    def _views(self, sentence_features):
        self._columns(sentence_features, type(self).__name__, 2, 2)
        return [*sentence_features, _SensitiveView(sentence_features[0])]

