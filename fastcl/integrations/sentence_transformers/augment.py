"""AugmentedPositives: a positive-view augmentation (:mod:`fastcl.augment`) around any fastcl loss."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable

from torch import Tensor, nn

from fastcl import augment

from ._base import documented

__all__ = ["AugmentedPositives"]

_TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")  # what a token-level augmentation rewrites
_HOOKS = "_fastcl_augment_hooks"  # the attribute of the first module that holds its hooks
_MISSING = object()


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DistributedDataParallel / DataParallel / ``torch.compile`` wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _first_module(model: nn.Module):
    try:
        return model[0]
    except (TypeError, IndexError, KeyError, AttributeError):
        return None


class _CutHooks:
    """The hooks of one model's first module (sentence-transformers' ``Transformer``), shared by
    every :class:`AugmentedPositives` on that model and left in place (they do nothing to
    features without :data:`fastcl.augment.KEY`, as ``model.encode`` gives):

    - a forward pre-hook on the first module: when its features carry :data:`~fastcl.augment.KEY`
      (the entries to zero, drawn by :class:`AugmentedPositives`; a mini-batch of the features
      holds the matching slice of it), arm the embedding hook with it and forward a copy of the
      features without it (the caller's dict is left as it was: a cached loss replays it);
    - a forward hook on the embedding layer: while armed, zero those entries of its output;
    - a forward hook on the first module, called even when its forward raises: disarm.

    The armed mask is kept per thread (``DataParallel`` runs its replicas, which share these
    hooks, in threads; a CUDA backward, and so a cached loss's second pass, runs in autograd's).
    """

    def __init__(self, first: nn.Module, embedding: nn.Module):
        self.cuts: dict[int, Tensor] = {}  # thread id: the armed mask
        first.register_forward_pre_hook(self.arm, with_kwargs=True)
        first.register_forward_hook(self.disarm, always_call=True)
        embedding.register_forward_hook(self.apply)

    @classmethod
    def install(cls, first: nn.Module, embedding: nn.Module) -> _CutHooks:
        hooks = first.__dict__.get(_HOOKS)
        if hooks is None:
            hooks = cls(first, embedding)
            setattr(first, _HOOKS, hooks)
        return hooks

    def arm(self, module, args, kwargs):
        features = args[0] if args else kwargs.get("features")
        if not isinstance(features, dict) or augment.KEY not in features:
            return None
        features = dict(features)
        self.cuts[threading.get_ident()] = features.pop(augment.KEY)
        if args:
            return (features, *args[1:]), kwargs
        return args, {**kwargs, "features": features}

    def disarm(self, module, args, output):
        self.cuts.pop(threading.get_ident(), None)

    def apply(self, module, args, output):
        cut = self.cuts.get(threading.get_ident())
        if cut is None:
            return None
        if (not isinstance(output, Tensor) or output.ndim != 3
                or tuple(output.shape[:2]) != tuple(cut.shape[:2])
                or (cut.ndim == 3 and cut.shape[2] != output.shape[2])):
            shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            raise ValueError(f"AugmentedPositives: the embedding layer's output {shape} does not match "
                             f"the augmentation's mask {tuple(cut.shape)} (rows × tokens[ × dim])")
        return augment.cut_out(output, cut)


class _Target:
    """What the augmentation needs of one (unwrapped) model: its special token ids, its
    padding id, and for the embedding level the hooks and the embedding layer's width."""

    def __init__(self, model: nn.Module, aug: augment.Augmentation):
        self.model = model
        first = _first_module(model)
        embedding, self.dim = self._embedding_layer(first, aug) if aug.embedding_level else (None, None)
        tokenizer = getattr(first, "tokenizer", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer
        if not hasattr(tokenizer, "all_special_ids"):
            raise ValueError(f"AugmentedPositives({aug.spec}) needs a model whose first module has a "
                             f"Hugging Face tokenizer (to spare the special tokens); {type(first).__name__} "
                             "has none")
        self.special_ids = augment.special_ids(tokenizer)
        self.pad_token_id = tokenizer.pad_token_id or 0
        if embedding is not None:
            _CutHooks.install(first, embedding)

    @staticmethod
    def _embedding_layer(first, aug) -> tuple[nn.Module, int | None]:
        backbone = getattr(first, "auto_model", None)
        if not isinstance(backbone, nn.Module):
            backbone = getattr(first, "model", None)
        embedding = None
        if isinstance(backbone, nn.Module):
            try:
                embedding = augment.embedding_module(backbone)
            except (AttributeError, NotImplementedError):
                embedding = None
        if not isinstance(embedding, nn.Module):
            raise ValueError(
                f"AugmentedPositives({aug.spec}): the model's first module ({type(first).__name__}) has no "
                "embedding layer to hook; an embedding-level augmentation needs a Hugging Face encoder "
                "first (sentence-transformers' Transformer). The token-level ones (word_shuffle, "
                "word_deletion) only need the tokenizer.")
        dim = None
        try:
            dim = backbone.get_input_embeddings().embedding_dim
        except (AttributeError, NotImplementedError):
            dim = getattr(getattr(backbone, "config", None), "hidden_size", None)
        if dim is None and aug.name == "feature_cutoff":
            raise ValueError(f"AugmentedPositives({aug.spec}): cannot tell the width of the embedding "
                             f"layer's output of {type(backbone).__name__}")
        return embedding, dim


@documented(inputs="negatives", data="unsupervised",
            loss="AugmentedPositives(FastInfoNCELoss(model), 'token_cutoff')")
class AugmentedPositives(nn.Module):
    r"""A positive-view augmentation beside dropout (ConSERT's cutoffs, token shuffling, word
    deletion) around any fastcl loss, cached or not.

    The inner loss is computed with each positive ``p_i`` (input column 1) embedded from an
    augmented input, every other column as given:

    .. math:: L = L_{\text{inner}}\big(f(x_i),\ f(\mathcal{A}(x^+_i)),\ f(n_i)\dots\big)

    where ``𝒜`` is the augmentation (:mod:`fastcl.augment`), drawn anew at every call. Only
    content tokens change: special tokens ([CLS], [SEP], …; not the unknown token) and padding
    never do. A row with ``L`` content tokens gets ``k = max(1, round(rate·L))`` of them changed
    (cutoffs and deletion; deletion keeps at least one; ``feature_cutoff``: ``k`` of the ``d``
    embedding dimensions, in every content token of the row).

    - **token level** (``word_shuffle``, ``word_deletion``): the positive column's input ids
      (and attention mask, token type ids) are rewritten once per call, drawn from the CPU's
      global random state; every forward of the column, both passes of a cached loss included,
      sees the same inputs.
    - **embedding level** (``token_cutoff``, ``span_cutoff``, ``feature_cutoff``): the output
      of the backbone's embedding layer (word + position + token-type embeddings, after their
      LayerNorm and dropout) is zeroed at entries drawn once per call for the whole column,
      from the global random state of the column's device, and carried in the column's
      features under :data:`fastcl.augment.KEY` (rows × tokens, or rows × tokens × d for
      ``feature_cutoff``), which mini-batches slice like the other features. Hooks installed
      at construction on the model's first module (sentence-transformers' ``Transformer``)
      apply them during exactly the forwards of those features, wherever they run: a cached
      loss's second pass, in the backward, included. The masks do not depend on
      ``mini_batch_size``: with dropout off, a cached loss gives the numbers of the plain one.

    Args:
        loss: the loss to compute on the augmented batch: any fastcl sentence-transformers
            loss (``FastInfoNCELoss``, ``FastFocalInfoNCELoss``, ``FastDCLRLoss``,
            ``FastESCLLoss`` or a ``CachedFast*`` one), built on the model to train. It must
            take at least two input columns (anchor, positive).
        augmentation: ``"NAME[:rate]"`` (``-`` may stand for ``_``; the default rates are
            :data:`fastcl.common.AUGMENT_RATES`) or a :class:`fastcl.augment.Augmentation`.

    Inputs:
        {inputs}

        The columns of the inner loss; the unsupervised recipe: the same sentence in both
        columns, the positive copy augmented on top of dropout.

    Relations:
        - Wraps a loss the way ``MatryoshkaLoss`` does (``model`` and ``loss`` attributes; the
          model card lists both) and replaces none: ``FastInfoNCELoss`` on duplicated
          sentences then contrasts ConSERT-style augmented views (Yan et al., 2021) instead
          of unsupervised SimCSE's dropout-only ones. ``MatryoshkaLoss`` may wrap it in turn.
        - DCLR's ``guide`` scores the columns as given, not augmented (as the complementary
          encoder of fastcl's own trainer does); ESCL's high-dropout view re-encodes the
          anchors, which are never augmented.
        - The augmentations of ``--augment NAME[:RATE]`` in fastcl's own trainer
          (:mod:`fastcl.augment`), with the same rates and mask distributions; there the
          cutoff masks are drawn per forward, here once per call for the whole column.

    References:
        Yan et al., "ConSERT: A Contrastive Framework for Self-Supervised Sentence
        Representation Transfer", ACL 2021; Shen et al., "A Simple but Tough-to-Beat Data
        Augmentation Approach for Natural Language Understanding and Generation", 2020. The
        ``citation`` is the inner loss's.

    Example:
        ::

            from datasets import Dataset
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from fastcl.integrations.sentence_transformers import AugmentedPositives, CachedFastInfoNCELoss

            model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
            sentences = ["It's nice weather outside today.", "He drove to work."]
            train_dataset = Dataset.from_dict({"anchor": sentences, "positive": sentences})
            loss = AugmentedPositives(CachedFastInfoNCELoss(model, mini_batch_size=32), "token_cutoff:0.1")

            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
    """

    def __init__(self, loss: nn.Module, augmentation: str | augment.Augmentation):
        super().__init__()
        if not isinstance(loss, nn.Module) or not isinstance(getattr(loss, "model", None), nn.Module):
            raise TypeError("AugmentedPositives wraps a sentence-transformers loss (an nn.Module holding the "
                            f"model it trains as `model`), got {type(loss).__name__}")
        _, at_most = getattr(loss, "_column_counts", (2, None))
        if at_most is not None and at_most < 2:
            raise ValueError(f"AugmentedPositives augments input column 1, the positive; "
                             f"{type(loss).__name__} takes at most {at_most} input column(s)")
        aug = augment.parse(augmentation)
        if aug is None:
            raise ValueError(f"AugmentedPositives needs an augmentation NAME[:rate], one of "
                             f"{', '.join(augment.NAMES)}")
        self.augmentation = aug
        self.model = loss.model  # the trainer replaces both (DDP, model_init); the inner loss's is used
        self.loss = loss
        self._target = _Target(_unwrap(loss.model), aug)  # not a submodule: a plain attribute

    @property
    def uses_gradient_cache(self) -> bool:
        """The inner loss's: whether its backward re-embeds the mini-batches (sentence-transformers'
        ``uses_gradient_cache``)."""
        return bool(getattr(self.loss, "uses_gradient_cache", False))

    @property
    def calculate_loss(self):
        """The inner (cached) loss's ``calculate_loss``, which ``MatryoshkaLoss`` decorates."""
        return self.loss.calculate_loss

    @calculate_loss.setter
    def calculate_loss(self, fn) -> None:
        self.loss.calculate_loss = fn

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ValueError(f"AugmentedPositives augments input column 1, the positive; got "
                             f"{len(sentence_features)} input column(s)")
        model = _unwrap(self.loss.model)
        if model is not self._target.model:  # a new model (model_init): hook it
            self._target = _Target(model, self.augmentation)
        positive = self._augment(sentence_features[1])
        features = [sentence_features[0], positive, *sentence_features[2:]]
        if self.augmentation.embedding_level and not self.uses_gradient_cache:
            # the other candidate columns get an empty mask, so that they still share one forward
            # with the positives (sentence-transformers merges columns with the same keys)
            features[2:] = [self._unchanged(f, positive[augment.KEY]) for f in features[2:]]
        with self._guide_on(sentence_features):
            return self.loss(features, labels)

    def _augment(self, features: dict[str, Any]) -> dict[str, Any]:
        """A new feature dict for the positive column: token-level, rewritten inputs;
        embedding-level, the inputs and the entries to zero under :data:`fastcl.augment.KEY`."""
        ids, mask = features.get("input_ids"), features.get("attention_mask")
        if not (isinstance(ids, Tensor) and isinstance(mask, Tensor) and ids.ndim == 2
                and ids.shape == mask.shape):
            raise ValueError("AugmentedPositives needs padded text features in the positive column "
                             f"(input_ids and attention_mask, rows × tokens), got keys {sorted(features)}")
        if augment.KEY in features:
            raise ValueError(f"AugmentedPositives: the positive column is already augmented "
                             f"({augment.KEY!r} in its features)")
        aug, target = self.augmentation, self._target
        if aug.embedding_level:
            where = augment.content_tokens(ids, mask, target.special_ids)
            return {**features, augment.KEY: augment.cutoff_mask(aug, where, target.dim)}
        cpu = {key: features[key].cpu() for key in _TOKEN_KEYS
               if isinstance(features.get(key), Tensor) and features[key].shape == ids.shape}
        where = augment.content_tokens(cpu["input_ids"], cpu["attention_mask"], target.special_ids)
        if aug.name == "word_shuffle":
            cpu = augment.word_shuffle(cpu, where, aug.rate)
        else:
            cpu = augment.word_deletion(cpu, where, aug.rate, target.pad_token_id)
        return {**features, **{key: value.to(features[key].device) for key, value in cpu.items()}}

    @staticmethod
    def _unchanged(features: dict[str, Any], like: Tensor) -> dict[str, Any]:
        ids = features.get("input_ids")
        if augment.KEY in features or not isinstance(ids, Tensor) or ids.ndim != 2:
            return features
        return {**features, augment.KEY: like.new_zeros((*ids.shape, *like.shape[2:]))}

    @contextlib.contextmanager
    def _guide_on(self, sentence_features: list):
        """During the call, DCLR's guide embeds the columns as given, not augmented."""
        loss = self.loss
        if getattr(loss, "guide", None) is None or not callable(getattr(loss, "_guide_embeddings", None)):
            yield
            return
        own, saved = loss._guide_embeddings, loss.__dict__.get("_guide_embeddings", _MISSING)

        def as_given(features, *args, **kwargs):
            return own(sentence_features, *args, **kwargs)

        loss._guide_embeddings = as_given
        try:
            yield
        finally:
            if saved is _MISSING:
                del loss._guide_embeddings
            else:
                loss._guide_embeddings = saved

    def get_config_dict(self) -> dict[str, Any]:
        inner = self.loss.get_config_dict() if hasattr(self.loss, "get_config_dict") else {}
        return {"loss": type(self.loss).__name__, **inner, "augmentation": self.augmentation.spec}

    @property
    def citation(self) -> str:
        """The inner loss's BibTeX."""
        return self.loss.citation
