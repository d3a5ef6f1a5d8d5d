"""What the losses of :mod:`fastcl.integrations.sentence_transformers` share.

- the sentence-transformers imports, from its current module layout (sentence-transformers 6)
  with a fallback for each older release down to 3.0, so that importing fastcl's integration
  raises no DeprecationWarning;
- :class:`FastLoss`: the model, the input checks (column count, no empty column, made before
  any forward), the embedding of the columns, the config sentence-transformers logs, and the
  in-batch loss of the InfoNCE family with ``gather_across_devices``;
- :class:`Cached`: the two-pass (GradCache) forward that the ``CachedFast*`` losses mix in
  before their plain loss, on sentence-transformers' ``CachedLossMixin`` when the release has
  it (≥ 5.7.0), else on fastcl's own implementation of the same contract (:mod:`._gradcache`).
"""

from __future__ import annotations

import textwrap
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

import fastcl
from fastcl import _validation as check
from fastcl import citations, distributed

try:
    try:  # sentence-transformers ≥ 5.4: the model class in its own module
        from sentence_transformers.sentence_transformer.model import SentenceTransformer
    except ImportError:  # older releases export it from the top level only
        from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import cos_sim  # a module before 5.4, a package after
except ImportError as err:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "fastcl.integrations.sentence_transformers needs the sentence-transformers package: "
        "pip install sentence-transformers (or pip install 'fastcl[dev]')") from err

from ._gradcache import batch_rows

try:  # sentence-transformers ≥ 6 shares one forward across like columns
    from sentence_transformers.base.losses.merged_forward import embed_columns
except ImportError:  # pragma: no cover - older releases
    def embed_columns(model, features_list):
        return [model(features)["sentence_embedding"] for features in features_list]

try:  # sentence-transformers ≥ 5.7: the GradCache machinery of its own cached losses
    from sentence_transformers.base.losses import CachedLossMixin as GRADCACHE_BASE
    from sentence_transformers.base.losses import has_static_embedding_input
except ImportError:  # older releases: fastcl's implementation of the same contract
    from ._gradcache import GradCache as GRADCACHE_BASE

    def has_static_embedding_input(model) -> bool:
        return False

__all__ = ["GRADCACHE_BASE", "Cached", "FastLoss", "SentenceTransformer", "cos_sim", "documented",
           "embed_columns", "gather_rows", "number"]

# The sections every loss's docstring shares in form, written once (see `documented`).
_INPUTS = {
    "pairs": """
+--------------------------+--------+
| Texts                    | Labels |
+==========================+========+
| (anchor, positive) pairs | none   |
+--------------------------+--------+""",
    "negatives": """
+-------------------------------------------------+--------+
| Texts                                           | Labels |
+=================================================+========+
| (anchor, positive) pairs                        | none   |
+-------------------------------------------------+--------+
| (anchor, positive, negative) triplets           | none   |
+-------------------------------------------------+--------+
| (anchor, positive, negative_1, ..., negative_n) | none   |
+-------------------------------------------------+--------+""",
}
_DATA = {
    "pairs": """train_dataset = Dataset.from_dict({
    "anchor": ["It's nice weather outside today.", "He drove to work."],
    "positive": ["It's so sunny.", "He took the car to the office."],
})""",
    # the unsupervised recipe: the same sentence in both columns, dropout makes the two views
    "unsupervised": """sentences = ["It's nice weather outside today.", "He drove to work."]
train_dataset = Dataset.from_dict({"anchor": sentences, "positive": sentences})""",
}
_EXAMPLE = """::

    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from fastcl.integrations.sentence_transformers import {name}

    model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2"){guide}
{data}
    loss = {loss}

    trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
    trainer.train()"""
_GUIDE = '\n    guide = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")'
_CACHED_ARGS = """mini_batch_size: encoder inputs per forward; sets the activation memory, not the
    numbers.
show_progress_bar: a progress bar over each pass's mini-batches."""


def documented(*, inputs: str, data: str, loss: str):
    """A class decorator that writes the parts of a loss's docstring that every loss has in
    the same form: the ``{inputs}`` line becomes the Inputs table (``"pairs"``, or
    ``"negatives"`` for any number of negative columns), the ``{example}`` line a runnable
    example (``data``: ``"pairs"`` or ``"unsupervised"``) that trains with ``loss``, an
    expression of ``model`` (and of ``guide``, which it then loads), and a cached loss's
    ``{cached_args}`` line the Args of its two passes."""
    def fill(cls):
        if cls.__doc__:  # None under python -OO
            example = _EXAMPLE.format(name=cls.__name__, loss=loss, guide=_GUIDE if "guide" in loss else "",
                                      data=textwrap.indent(_DATA[data], " " * 4))
            for marker, text in (("{inputs}", _INPUTS[inputs].lstrip("\n")), ("{example}", example),
                                 ("{cached_args}", _CACHED_ARGS)):
                cls.__doc__ = cls.__doc__.replace(" " * 8 + marker, textwrap.indent(text, " " * 8))
        return cls
    return fill


def number(name: str, value, *, positive: bool = False) -> float:
    """A real-number argument checked where the loss is built, so a bad one fails there with its
    name, not at the first step: finite (and > 0 with ``positive``); a string or a bool is a
    mistake, not a number."""
    if isinstance(value, (str, bytes, bool)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    return check.positive(name, value) if positive else check.finite(name, value)


def gather_rows(*columns: Tensor) -> tuple[int, list[Tensor]]:
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


class FastLoss(nn.Module):
    """Shared plumbing: the input checks, embedding the columns, the config
    sentence-transformers logs (the attributes named in ``_config``)."""

    _config: tuple[str, ...] = ()
    #: how many input columns the loss takes: (at least, at most or None for any number)
    _column_counts: tuple[int, int | None] = (2, None)
    gather_across_devices: bool = False

    def __init__(self, model: SentenceTransformer):
        super().__init__()
        self.model = model

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        embeddings = embed_columns(self.model, self._features(sentence_features))
        return self.compute_loss_from_embeddings(embeddings, labels)  # defined by each loss

    def get_config_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._config}

    def _features(self, sentence_features: Iterable[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """The input columns as a list, checked before any forward: as many as the loss
        takes, none of them empty (an encoder given no rows fails deep inside)."""
        sentence_features = self._columns(list(sentence_features), type(self).__name__,
                                          *self._column_counts)
        for i, features in enumerate(sentence_features):
            try:
                rows = batch_rows(features)
            except ValueError:  # no batched tensor at all: the tokenizer was given no text
                rows = 0
            if rows == 0:
                raise ValueError(f"{type(self).__name__} got an empty batch: input column {i} has no "
                                 "rows (a loss needs at least one example)")
        return sentence_features

    def _gathering(self) -> bool:
        return (bool(self.gather_across_devices) and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1)

    def _in_batch_loss(self, embeddings, *, temperature: float, focal_m: float | None,
                       symmetric: bool = False) -> Tensor:
        """:func:`fastcl.contrastive` over columns (anchor, positive[, negative...]) with this
        loss's ``hard_negative_weight``, ``backend`` and ``chunk_size``; with
        ``gather_across_devices``, every process's positives and negatives as candidates."""
        anchors, positives, *negatives = self._columns(embeddings, type(self).__name__)
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
        offset, (all_positives, *gathered) = gather_rows(
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


class Cached(GRADCACHE_BASE):
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
        sentence_features = self._features(sentence_features)
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

    @property
    def citation(self) -> str:
        return super().citation + citations.GRADCACHE
