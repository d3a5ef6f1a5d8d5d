"""The modules of fastcl's poolers. SimCSE's unsupervised recipe trains with an MLP on the CLS
state and evaluates without it (``mlp_only_train``): :class:`TrainingHead` acts in training mode
only and is dropped from the saved model (:func:`without_training_heads`); supervised SimCSE
keeps the MLP as a plain ``Dense`` with Tanh."""

from __future__ import annotations

import torch
from torch import nn

from ..encoders import POOLERS, layer_weights

try:  # sentence-transformers ≥ 5.4: the modules in their own package
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    from sentence_transformers.sentence_transformer.modules.weighted_layer_pooling import WeightedLayerPooling
except ImportError:  # pragma: no cover - older releases
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer, WeightedLayerPooling

__all__ = ["TrainingHead", "pooling_modules", "without_training_heads", "POOLERS", "Dense",
           "Normalize", "Pooling", "Transformer", "WeightedLayerPooling"]


class TrainingHead(Dense):
    """SimCSE's MLP (Linear + Tanh on the pooled CLS state), applied in training mode only:
    in eval mode the embedding passes through unchanged (``mlp_only_train``)."""

    def forward(self, features):
        return super().forward(features) if self.training else features


def pooling_modules(pooler: str, dim: int, num_layers: int, *, mlp_only_train: bool,
                    init_std: float = 0.02) -> list:
    """The modules after the Transformer for one of :data:`POOLERS`:

    - ``cls``: the CLS state, then SimCSE's MLP (:class:`TrainingHead` with
      ``mlp_only_train``, else a ``Dense`` with Tanh kept at inference);
    - ``cls_before_pooler``: the raw CLS state;
    - ``avg``: the masked mean of the last layer;
    - ``avg_first_last`` / ``avg_top2``: the masked mean of the mean of the first and last
      layers / the last two (a fixed ``WeightedLayerPooling``; the Transformer must return
      every layer's states, ``output_hidden_states``).
    """
    if pooler not in POOLERS:
        raise ValueError(f"pooler must be one of {', '.join(POOLERS)}, got {pooler!r}")
    modules = []
    if pooler in ("avg_first_last", "avg_top2"):
        start, weights = layer_weights(pooler, num_layers)
        layers = WeightedLayerPooling(dim, num_hidden_layers=num_layers, layer_start=start,
                                      layer_weights=nn.Parameter(torch.tensor(weights), requires_grad=False))
        modules.append(layers)
    cls = pooler in ("cls", "cls_before_pooler")
    modules.append(Pooling(dim, pooling_mode="cls" if cls else "mean"))
    if pooler == "cls":
        head = (TrainingHead if mlp_only_train else Dense)(dim, dim, activation_function=nn.Tanh())
        # as the encoder's own initialization (BERT's initializer_range): the head starts small
        nn.init.normal_(head.linear.weight, std=init_std)
        nn.init.zeros_(head.linear.bias)
        modules.append(head)
    return modules


def without_training_heads(model):
    """``model`` as it is saved and used after training: a SentenceTransformer sharing the
    modules of ``model`` but without its :class:`TrainingHead` modules (``model`` itself when
    it has none)."""
    if not any(isinstance(m, TrainingHead) for m in model):
        return model
    from fastcl.integrations.sentence_transformers._base import SentenceTransformer

    kept = [m for m in model if not isinstance(m, TrainingHead)]
    out = SentenceTransformer(modules=kept, device=str(model.device))
    out.model_card_data = model.model_card_data
    out.similarity_fn_name = model.similarity_fn_name
    return out
