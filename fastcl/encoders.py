"""Sentence encoders around Hugging Face models: loading, pooling, encoding.

A sentence embedding is a pooled view of the encoder's token states ``H`` (B×T×d) under the
attention mask ``m`` (SimCSE's poolers):

- ``cls``: ``tanh(W·H[:, 0] + b)``, the CLS state through an MLP head (Linear(d, d) + Tanh)
  that fastcl owns and trains; it is not the model's pretrained pooler.
- ``cls_before_pooler``: ``H[:, 0]``, the raw CLS state.
- ``avg``: ``Σ_t m_t H_t / Σ_t m_t`` over the last layer.
- ``avg_first_last``: the masked mean of ``(H¹ + H^L) / 2`` (first and last transformer layers,
  ``hidden_states[1]`` and ``hidden_states[-1]``).
- ``avg_top2``: the masked mean of ``(H^{L-1} + H^L) / 2``.

A model folder the trainer saves (sentence-transformers' layout: the Hugging Face model at
the root, ``1_Pooling/``, the ``cls`` pooler's head in ``2_Dense/``, a ``WeightedLayerPooling``
for ``avg_first_last`` / ``avg_top2``) loads with
``load_encoder(folder, fastcl.evaluate.saved_pooler(folder))`` and gives, through
:func:`encode`, the embeddings of ``SentenceTransformer(folder).encode`` (up to their length
when the folder ends with a Normalize module).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from pathlib import Path

import torch
from torch import nn

POOLERS = ("cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2")

# Where a saved model keeps the MLP head of the `cls` pooler (a sentence-transformers Dense
# module: Linear + Tanh), as the trainer saves it.
HEAD_DIR = "2_Dense"


def layer_weights(pooler: str, num_layers: int) -> tuple:
    """``(layer_start, weights)`` of the sentence-transformers WeightedLayerPooling that pools
    ``avg_first_last`` / ``avg_top2`` on a ``num_layers``-layer model: it averages
    ``all_layer_embeddings[layer_start:]`` (index 0: the embedding layer's output) with the
    weights, divided by their sum, so zero weights leave a layer out."""
    if pooler == "avg_first_last":
        return 1, [1.0] + [0.0] * (num_layers - 2) + [1.0]
    if pooler == "avg_top2":
        return num_layers - 1, [1.0, 1.0]
    raise ValueError(f"layer_weights: {pooler!r} pools one layer")


def check_pooler(pooler: str, name: str = "pooler") -> str:
    if pooler not in POOLERS:
        raise ValueError(f"{name} must be one of {', '.join(POOLERS)}, got {pooler!r}")
    return pooler


class MLPHead(nn.Module):
    """SimCSE's training head ``z = tanh(W h + b)`` with ``W ∈ R^{d×d}``.

    Initialized like a BERT linear layer (``W ~ N(0, std²)``, ``b = 0``).
    """

    def __init__(self, dim: int, init_std: float = 0.02):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.activation = nn.Tanh()
        nn.init.normal_(self.dense.weight, std=init_std)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x))


def _masked_mean(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.unsqueeze(-1).to(states.dtype)
    return (states * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def pool(outputs, attention_mask: torch.Tensor, pooler: str) -> torch.Tensor:
    """The pooled embedding (B×d) before any head; see the module docstring."""
    if pooler in ("cls", "cls_before_pooler"):
        return outputs.last_hidden_state[:, 0]
    if pooler == "avg":
        return _masked_mean(outputs.last_hidden_state, attention_mask)
    hidden = outputs.hidden_states
    if hidden is None:
        raise ValueError(f"pooler {pooler!r} needs the model's hidden_states "
                         "(run it with output_hidden_states=True)")
    if pooler == "avg_first_last":
        return _masked_mean((hidden[1] + hidden[-1]) / 2.0, attention_mask)
    if pooler == "avg_top2":
        return _masked_mean((hidden[-2] + hidden[-1]) / 2.0, attention_mask)
    raise ValueError(check_pooler(pooler))


class SentenceEncoder(nn.Module):
    """A Hugging Face encoder plus a pooler; pooler ``cls`` also applies ``head``.

    ``forward(**features)`` takes the tokenizer's output (input_ids, attention_mask and,
    if the tokenizer gives them, token_type_ids) and returns B×d embeddings.
    """

    def __init__(self, backbone: nn.Module, pooler: str, head: nn.Module | None = None):
        super().__init__()
        self.backbone = backbone
        self.pooler = check_pooler(pooler)
        if pooler == "cls" and head is None:
            raise ValueError("pooler 'cls' needs its MLP head (head=None was given)")
        self.head = head if pooler == "cls" else None
        # DistilBERT-like encoders have no segment embeddings (transformers 4 refuses the
        # argument, 5 takes it through **kwargs and ignores it)
        self._segments = "token_type_ids" in inspect.signature(backbone.forward).parameters

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        extra = {} if token_type_ids is None or not self._segments else {"token_type_ids": token_type_ids}
        outputs = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                                output_hidden_states=self.pooler in ("avg_first_last", "avg_top2"),
                                return_dict=True, **extra)
        z = pool(outputs, attention_mask, self.pooler)
        return self.head(z) if self.head is not None else z


@contextlib.contextmanager
def dropout_rate(module: nn.Module, p: float):
    """Temporarily set the rate of every ``nn.Dropout`` in ``module`` to ``p``.

    Hugging Face BERT-style models read their attention dropout from these modules too
    (``self.dropout.p``), so this covers hidden and attention dropout alike.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {p}")
    dropouts = [m for m in module.modules() if isinstance(m, nn.Dropout)]
    saved = [m.p for m in dropouts]
    try:
        for m in dropouts:
            m.p = p
        yield
    finally:
        for m, old in zip(dropouts, saved):
            m.p = old


def default_max_length(tokenizer, backbone=None) -> int:
    """The longest input the model takes: the tokenizer's limit, capped by the position table."""
    limit = tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else 512
    positions = getattr(getattr(backbone, "config", None), "max_position_embeddings", None)
    return min(limit, positions) if positions else limit


def tokenize(tokenizer, sentences, max_length: int, device=None) -> dict:
    features = tokenizer(list(sentences), padding=True, truncation=True, max_length=max_length,
                         return_tensors="pt")
    keep = ("input_ids", "attention_mask", "token_type_ids")
    return {k: v.to(device) if device is not None else v for k, v in features.items() if k in keep}


@torch.no_grad()
def encode(encoder: SentenceEncoder, tokenizer, sentences, *, batch_size: int = 64,
           max_length: int | None = None, on_batch=None) -> torch.Tensor:
    """Embed ``sentences`` in eval mode (no dropout); returns a float32 CPU tensor (N×d).

    Sentences are batched in order of length (less padding) and returned in input order.
    Longer inputs are truncated to ``max_length`` tokens (default: the model's limit).
    ``on_batch(n)`` is called after each batch of n sentences (a progress bar's update).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sentences = list(sentences)
    if not sentences:
        raise ValueError("sentences is empty")
    device = next(encoder.parameters()).device
    max_length = max_length or default_max_length(tokenizer, encoder.backbone)
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    out = [None] * len(sentences)
    was_training = encoder.training
    encoder.eval()
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            feats = tokenize(tokenizer, [sentences[i] for i in idx], max_length, device)
            emb = encoder(**feats).float().cpu()
            for row, i in enumerate(idx):
                out[i] = emb[row]
            if on_batch is not None:
                on_batch(len(idx))
    finally:
        encoder.train(was_training)
    return torch.stack(out)


# ---------------------------------------------------------------------------------------
# Loading

def _looks_like_path(name: str) -> bool:
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name)


def _transformer_folder(path: Path) -> Path:
    """The folder holding the Hugging Face model of a sentence-transformers folder."""
    modules = path / "modules.json"
    if modules.is_file():
        for mod in json.loads(modules.read_text()):
            if mod.get("type", "").endswith("Transformer"):
                return path / mod.get("path", "")
    return path


def _hub_error(name: str, arg: str, err: Exception) -> OSError:
    from huggingface_hub import constants
    why = ("the Hugging Face hub is offline here (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE
           else "it could not be fetched from the Hugging Face hub (no connection, or no such model)")
    return OSError(f"{arg}: cannot load {name!r}: it is not a local folder and {why}. "
                   f"Pass a local path to a folder with config.json, the weights and the tokenizer "
                   f"files (as written by save_pretrained). ({type(err).__name__}: {err})")


def model_source(name_or_path, arg: str = "model") -> str:
    """The Hugging Face model folder of ``name_or_path`` (inside a sentence-transformers folder
    too), or the hub name it is; a missing folder, or one without ``config.json``, is an error
    naming ``arg``."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(f"{arg} must be a model name or a folder, got {name_or_path!r}")
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        path = _transformer_folder(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{arg}: {path} has no config.json; is it a Hugging Face "
                                    "model folder?")
        return str(path)
    if path.exists() or _looks_like_path(name):
        raise FileNotFoundError(f"{arg}: no such model folder: {name}")
    return name


def load_backbone(name_or_path: str, *, arg: str = "model"):
    """``(AutoModel, AutoTokenizer)`` from a local folder or a hub name.

    A sentence-transformers folder whose model lives in a subfolder (``0_Transformer/``) works.
    A hub name that cannot be fetched raises an OSError asking for a local path.
    """
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    name, source = str(name_or_path), model_source(name_or_path, arg)
    path = Path(name).expanduser()
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as err:
        if source == name and not path.exists():
            raise _hub_error(name, arg, err) from err
        raise
    backbone = AutoModel.from_pretrained(source, config=config)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return backbone, tokenizer


def load_head(path, dim: int | None = None) -> MLPHead | None:
    """The ``cls`` pooler's MLP head saved with the model in ``HEAD_DIR`` (a
    sentence-transformers Dense, Linear + Tanh), or None when there is none."""
    folder = Path(path) / HEAD_DIR
    if not (folder / "config.json").is_file():
        return None
    from safetensors.torch import load_file
    config = json.loads((folder / "config.json").read_text())
    if config.get("in_features") != config.get("out_features") or "Tanh" not in config.get(
            "activation_function", ""):
        raise ValueError(f"{folder} is not a square Linear + Tanh head")
    if dim is not None and config["in_features"] != dim:
        raise ValueError(f"{folder} maps width {config['in_features']}, the encoder has {dim}")
    head = MLPHead(config["in_features"])
    state = load_file(str(folder / "model.safetensors"))
    head.dense.load_state_dict({"weight": state["linear.weight"], "bias": state["linear.bias"]})
    return head


def model_pooler_head(backbone) -> MLPHead | None:
    """The model's own Linear + Tanh pooler as a head, if it has one.

    SimCSE's released checkpoints store their MLP there, so their ``pooler_output`` is the
    ``cls`` sentence embedding.
    """
    own = getattr(backbone, "pooler", None)
    dense = getattr(own, "dense", None)
    if not isinstance(dense, nn.Linear) or not isinstance(getattr(own, "activation", None), nn.Tanh):
        return None
    head = MLPHead(dense.in_features)
    head.dense.load_state_dict(dense.state_dict())
    return head.to(dense.weight.device)


def load_encoder(name_or_path: str, pooler: str, *, arg: str = "model", device=None):
    """``(SentenceEncoder, tokenizer)`` ready to :func:`encode`.

    For pooler ``cls`` the head is the one saved next to the model (``2_Dense/``), else the
    model's own Linear + Tanh pooler (SimCSE's convention); a model with neither is an error.
    """
    check_pooler(pooler)
    backbone, tokenizer = load_backbone(name_or_path, arg=arg)
    head = None
    if pooler == "cls":
        head = load_head(name_or_path, backbone.config.hidden_size) or model_pooler_head(backbone)
        if head is None:
            raise ValueError(f"pooler 'cls' needs an MLP head: {name_or_path} has neither "
                             f"{HEAD_DIR}/ nor a Linear + Tanh pooler; use cls_before_pooler")
    encoder = SentenceEncoder(backbone, pooler, head)
    return encoder.to(device or "cpu").eval(), tokenizer

