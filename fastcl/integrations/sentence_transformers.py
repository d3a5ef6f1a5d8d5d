"""fastcl losses for ``SentenceTransformerTrainer``.

Each class follows sentence-transformers' loss conventions: the constructor takes the
``SentenceTransformer`` model first, ``forward(sentence_features, labels)`` embeds the
input columns and returns the loss, and ``compute_loss_from_embeddings(embeddings,
labels)`` scores embeddings computed elsewhere. Columns are ``(anchor, positive[,
negative...])``. For the unsupervised recipes put the same sentence in both columns:
dropout gives the two views.

=========================  ==========================================================
``FastInfoNCELoss``        drop-in for ``MultipleNegativesRankingLoss`` (cosine
                           similarity, ``scale = 1/τ``, extra columns as negatives)
``FastFocalInfoNCELoss``   Focal-InfoNCE
``FastDCLRLoss``           DCLR; a frozen ``guide`` model gives the complementary
                           embeddings (like ``GISTEmbedLoss``'s guide)
``FastESCLLoss``           ESCL; the high-dropout view is a third forward of the
                           anchors with every dropout at ``sensitive_dropout``
=========================  ==========================================================
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor, nn

import fastcl
from fastcl.encoders import dropout_rate

try:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import cos_sim
except ImportError as err:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "fastcl.integrations.sentence_transformers needs the sentence-transformers package: "
        "pip install sentence-transformers (or pip install 'fastcl[dev]')") from err

try:  # sentence-transformers ≥ 6 shares one forward across like columns
    from sentence_transformers.base.losses.merged_forward import embed_columns
except ImportError:  # pragma: no cover - older releases
    def embed_columns(model, features_list):
        return [model(features)["sentence_embedding"] for features in features_list]

__all__ = ["FastInfoNCELoss", "FastFocalInfoNCELoss", "FastDCLRLoss", "FastESCLLoss"]


class _FastLoss(nn.Module):
    """Shared plumbing: embedding the columns and the config sentence-transformers logs."""

    _config: tuple[str, ...] = ()

    def __init__(self, model: SentenceTransformer):
        super().__init__()
        self.model = model

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        embeddings = embed_columns(self.model, list(sentence_features))
        return self.compute_loss_from_embeddings(embeddings, labels)  # defined by each loss

    def get_config_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._config}

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
    SimCSE) needs exactly one negative column.
    """

    _config = ("scale", "symmetric", "hard_negative_weight", "backend")

    def __init__(self, model: SentenceTransformer, scale: float = 20.0, similarity_fct=cos_sim,
                 symmetric: bool = False, hard_negative_weight: float = 0.0, backend: str = "auto",
                 chunk_size: int | None = None):
        super().__init__(model)
        if similarity_fct is not cos_sim:
            raise ValueError("FastInfoNCELoss computes cosine similarity: similarity_fct must be "
                             "sentence_transformers.util.cos_sim")
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale, self.similarity_fct, self.symmetric = scale, similarity_fct, symmetric
        self.hard_negative_weight, self.backend, self.chunk_size = hard_negative_weight, backend, chunk_size

    def compute_loss_from_embeddings(self, embeddings, labels=None):
        anchors, positives, *negatives = self._columns(embeddings, "FastInfoNCELoss")
        if self.hard_negative_weight and len(negatives) != 1:
            raise ValueError("hard_negative_weight needs exactly one negative column, "
                             f"got {len(negatives)}")
        return fastcl.infonce(anchors, positives, torch.cat(negatives) if negatives else None,
                              temperature=1.0 / self.scale, symmetric=self.symmetric,
                              hard_negative_weight=self.hard_negative_weight,
                              backend=self.backend, chunk_size=self.chunk_size)

    @property
    def citation(self) -> str:
        return _SIMCSE


class FastFocalInfoNCELoss(_FastLoss):
    r"""Focal-InfoNCE (Hou & Li, 2023): positive logit ``s²/τ``, negative logits ``s(s+m)/τ``.

    Columns: (anchor, positive[, negative...]); see :func:`fastcl.focal_infonce`.
    """

    _config = ("temperature", "m", "backend")

    def __init__(self, model: SentenceTransformer, temperature: float = 0.05, m: float = 0.3,
                 backend: str = "auto", chunk_size: int | None = None):
        super().__init__(model)
        self.temperature, self.m, self.backend, self.chunk_size = temperature, m, backend, chunk_size

    def compute_loss_from_embeddings(self, embeddings, labels=None):
        anchors, positives, *negatives = self._columns(embeddings, "FastFocalInfoNCELoss")
        return fastcl.focal_infonce(anchors, positives, torch.cat(negatives) if negatives else None,
                                    temperature=self.temperature, m=self.m, backend=self.backend,
                                    chunk_size=self.chunk_size)

    @property
    def citation(self) -> str:
        return """
@inproceedings{hou2023focal,
    title={Improving Contrastive Learning of Sentence Embeddings with Focal-InfoNCE},
    author={Hou, Pengyue and Li, Xingyu},
    booktitle={Findings of EMNLP},
    year={2023}
}
"""


class FastDCLRLoss(_FastLoss):
    r"""DCLR (Zhou et al., 2022): noise negatives and instance weighting by a frozen guide.

    The ``guide`` (a trained SimCSE model in the paper) embeds the same two columns in eval
    mode without gradients; every in-batch negative it scores at cosine ≥ ``phi`` leaves the
    denominator. Noise negatives (``noise_ratio``·N of them) are improved by ``noise_steps``
    normalized gradient-ascent steps. Columns: (anchor, positive). If the guide's tokenizer
    differs from the model's, the text is decoded and tokenized again for the guide.
    See :func:`fastcl.dclr_loss`.
    """

    _config = ("phi", "noise_ratio", "noise_steps", "noise_lr", "noise_std", "temperature",
               "formulation", "backend")

    def __init__(self, model: SentenceTransformer, guide: SentenceTransformer, phi: float = 0.9,
                 noise_ratio: float = 1.0, noise_steps: int = 4, noise_lr: float = 1e-3,
                 noise_std: float = 1.0, temperature: float = 0.05, formulation: str = "paper",
                 generator: torch.Generator | None = None, backend: str = "auto",
                 chunk_size: int | None = None):
        super().__init__(model)
        self.guide = guide
        self.phi, self.noise_ratio, self.noise_steps = phi, noise_ratio, noise_steps
        self.noise_lr, self.noise_std, self.temperature = noise_lr, noise_std, temperature
        self.formulation, self.generator = formulation, generator
        self.backend, self.chunk_size = backend, chunk_size
        self.must_retokenize = (model.tokenizer.get_vocab() != guide.tokenizer.get_vocab()
                                or (guide.max_seq_length or 0) < (model.max_seq_length or 0))

    def _guide_embeddings(self, sentence_features):
        if self.must_retokenize:
            texts = [self.model.tokenizer.batch_decode(f["input_ids"], skip_special_tokens=True)
                     for f in sentence_features]
            features = [{k: v.to(self.guide.device) if torch.is_tensor(v) else v
                         for k, v in self.guide.preprocess(t).items()} for t in texts]
        else:
            # shallow copies: a model writes its outputs into the feature dicts it is given
            features = [dict(f) for f in sentence_features]
        was_training = self.guide.training
        self.guide.eval()
        try:
            with torch.no_grad():
                return [e.detach() for e in embed_columns(self.guide, features)]
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
        return fastcl.dclr_loss(anchors, positives, complementary=complementary, phi=self.phi,
                                noise_ratio=self.noise_ratio, noise_steps=self.noise_steps,
                                noise_lr=self.noise_lr, noise_std=self.noise_std,
                                temperature=self.temperature, generator=self.generator,
                                formulation=self.formulation, backend=self.backend,
                                chunk_size=self.chunk_size)

    @property
    def citation(self) -> str:
        return """
@inproceedings{zhou2022debiased,
    title={Debiased Contrastive Learning of Unsupervised Sentence Representations},
    author={Zhou, Kun and Zhang, Beichen and Zhao, Wayne Xin and Wen, Ji-Rong},
    booktitle={ACL},
    year={2022}
}
"""


class FastESCLLoss(_FastLoss):
    r"""ESCL (Liu et al., 2023): InfoNCE + λ·relative difference to a high-dropout view.

    Columns: (anchor, positive). The sensitive view re-encodes the anchor column with every
    dropout set to ``sensitive_dropout`` (0.45) for that forward only. See
    :func:`fastcl.escl_loss` (the RD term is a documented reconstruction).
    """

    _config = ("temperature", "weight", "rd", "sensitive_dropout", "backend")

    def __init__(self, model: SentenceTransformer, temperature: float = 0.05, weight: float = 2.5e-3,
                 rd: str = "softplus", sensitive_dropout: float = 0.45, backend: str = "auto",
                 chunk_size: int | None = None):
        super().__init__(model)
        if not 0.0 <= sensitive_dropout < 1.0:
            raise ValueError(f"sensitive_dropout must lie in [0, 1), got {sensitive_dropout}")
        self.temperature, self.weight, self.rd = temperature, weight, rd
        self.sensitive_dropout, self.backend, self.chunk_size = sensitive_dropout, backend, chunk_size

    def forward(self, sentence_features, labels=None):
        sentence_features = list(sentence_features)
        self._columns(sentence_features, "FastESCLLoss", 2, 2)
        embeddings = embed_columns(self.model, sentence_features)
        with dropout_rate(self.model, self.sensitive_dropout):
            sensitive = self.model(dict(sentence_features[0]))["sentence_embedding"]
        return self.compute_loss_from_embeddings([*embeddings, sensitive], labels)

    def compute_loss_from_embeddings(self, embeddings, labels=None):
        anchors, positives, sensitive = self._columns(embeddings, "FastESCLLoss (with the sensitive view)", 3, 3)
        return fastcl.escl_loss(anchors, positives, sensitive, temperature=self.temperature,
                                weight=self.weight, rd=self.rd, backend=self.backend,
                                chunk_size=self.chunk_size)

    @property
    def citation(self) -> str:
        return """
@inproceedings{liu2023equivariant,
    title={Equivariant Contrastive Learning for Sentence Embeddings},
    author={Liu, Jiahao and others},
    booktitle={ICASSP},
    year={2023}
}
"""


_SIMCSE = """
@inproceedings{gao2021simcse,
    title={SimCSE: Simple Contrastive Learning of Sentence Embeddings},
    author={Gao, Tianyu and Yao, Xingcheng and Chen, Danqi},
    booktitle={EMNLP},
    year={2021}
}
"""
