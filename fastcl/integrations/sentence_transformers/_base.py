"""What the losses of :mod:`fastcl.integrations.sentence_transformers` share.

- the sentence-transformers imports, from its current module layout (sentence-transformers 6)
  with a fallback for each older release down to 3.0, so that importing fastcl's integration
  raises no DeprecationWarning;
- :class:`FastLoss`: the model, the input checks (column count, no empty column, made before
  any forward), the embedding of the columns, the config sentence-transformers logs, and the
  in-batch loss of the InfoNCE family with ``gather_across_devices``, MNRL's directions and
  hardness, a guide's filter and duplicate masking;
- :class:`Guided`: a frozen guide model's embeddings of the columns (DCLR's complementary
  model, GIST's guide), re-tokenized when its vocabulary differs;
- :func:`text_ids`: one integer per input row, equal for equal token sequences (duplicate
  masking);
- :class:`Cached`: the two-pass (GradCache) forward that the ``CachedFast*`` losses mix in
  before their plain loss, on sentence-transformers' ``CachedLossMixin`` when the release has
  it (≥ 5.7.0), else on fastcl's own implementation of the same contract (:mod:`._gradcache`).
"""

from __future__ import annotations

import inspect
import math
import re
import textwrap
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

import fastcl
from fastcl import _validation as check
from fastcl import citations, distributed, layout

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

from ._gradcache import batch_rows, minibatch, minibatch_ranges

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

__all__ = ["GRADCACHE_BASE", "Cached", "FastLoss", "Guided", "SentenceTransformer", "cos_sim",
           "documented", "embed_columns", "gather_rows", "number", "text_ids"]

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
    numbers (mini_batch_num_tokens, where a loss takes it, packs by tokens instead).
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
    if isinstance(value, (str, bytes)):
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


#: The multiplier of :func:`text_ids`' polynomial hash (a large odd 64-bit constant).
_HASH_BASE = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def text_ids(features: dict[str, Tensor]) -> Tensor:
    """One int64 id per input row, the same for rows with the same token sequence (padding
    left out, on either side): ``Σ_t (token_t + 1)·B^t`` over the row's attended tokens
    (t counts those only), in 64-bit arithmetic that wraps, plus a term in the length. Equal
    texts tokenized alike get equal ids in every column, mini-batch and process; two
    different rows collide with probability ~2⁻⁶⁴."""
    if "input_ids" not in features:
        raise ValueError("mask_duplicates compares the texts' token ids, but the inputs have no "
                         "input_ids (a model that does not tokenize text)")
    tokens = features["input_ids"].to(torch.long)
    mask = features.get("attention_mask")
    mask = torch.ones_like(tokens) if mask is None else (mask != 0).to(torch.long)
    width = tokens.shape[1]
    powers = [1]
    for _ in range(width - 1):
        powers.append(powers[-1] * _HASH_BASE % (1 << 64))
    powers = torch.tensor([_signed(x) for x in powers], dtype=torch.long, device=tokens.device)
    position = (mask.cumsum(dim=1) - 1).clamp_min(0)   # among the attended tokens
    # integer products and sums wrap modulo 2⁶⁴ (two's complement) on every device
    return ((tokens + 1) * mask * powers[position]).sum(dim=1) + mask.sum(dim=1) * _signed(_HASH_BASE >> 1)


def _same_inputs(a: dict, b: dict) -> bool:
    """Whether two columns' model inputs are equal (the same keys, shapes and values)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y) and x.shape == y.shape
                    and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _st_version() -> tuple[int, ...]:
    from importlib import metadata
    return tuple(int(x) for x in re.findall(r"\d+", metadata.version("sentence-transformers"))[:2])


#: fastcl's loss options (:func:`fastcl.spec.build_spec`'s keywords but the tensors): a loss's
#: constructor argument of one of these names goes to the loss under that name
_SPEC_OPTIONS = frozenset(name for name, p in inspect.signature(fastcl.spec.build_spec).parameters.items()
                          if p.kind is p.KEYWORD_ONLY) - {"focal_name", "noise", "anchor_candidates",
                                                          "guide", "complementary", "duplicate_ids"}


class FastLoss(nn.Module):
    """Shared plumbing: the input checks, embedding the columns, the options and the config
    sentence-transformers logs, both derived from the constructor's arguments.

    **Options.** A constructor argument named as one of :func:`fastcl.contrastive`'s options
    (``focal_m``, ``directions``, ``backend``…) is kept as an attribute of that name and
    handed to it unchanged (:meth:`_options`); ``_spec_names`` maps the arguments a loss names
    otherwise (focal's ``m``, GIST's ``margin``). :meth:`_check_options`, at the end of each
    constructor, builds the loss's :class:`~fastcl.spec.LossSpec` from them on a small batch:
    every bad option fails there, with build_spec's own error, under the argument's name. A
    new option of :func:`fastcl.contrastive` is one keyword of the constructor (and its
    docstring).

    **Config.** ``get_config_dict`` holds every constructor argument but those in
    ``_unlogged`` (the models, the similarity function and where the work runs), read back
    from the attribute of that name.

    **learnable_temperature.** τ becomes a parameter of the loss, ``log_scale = log(1/τ)``
    (CLIP's logit scale), initialized from the temperature given; the optimizer finds it
    among the loss's parameters (sentence-transformers' trainer builds it from the loss),
    and sentence-transformers ≥ 6.2 clears its gradient with the model's each step.
    """

    #: how many input columns the loss takes: (at least, at most or None for any number)
    _column_counts: tuple[int, int | None] = (2, None)
    gather_across_devices: bool = False
    #: constructor arguments that are not in the config
    _unlogged = ("self", "model", "guide", "similarity_fct", "generator", "chunk_size",
                 "show_progress_bar")
    #: constructor arguments named otherwise than fastcl.contrastive's options
    _spec_names: dict[str, str] = {}
    learnable_temperature = False

    def __init__(self, model: SentenceTransformer):
        super().__init__()
        self.model = model

    @classmethod
    def _arguments(cls) -> list[str]:
        """The constructor's named arguments, in order."""
        return [name for name, p in inspect.signature(cls.__init__).parameters.items()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]

    @classmethod
    def _config_names(cls) -> tuple[str, ...]:
        return tuple(name for name in cls._arguments() if name not in cls._unlogged)

    def get_config_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._config_names()}

    def _options(self) -> dict:
        """The options :func:`fastcl.contrastive` takes from this loss, under its names; the
        temperature a tensor (``exp(−log_scale)``) with ``learnable_temperature``."""
        out = {self._spec_names.get(name, name): getattr(self, name) for name in self._arguments()
               if self._spec_names.get(name, name) in _SPEC_OPTIONS}
        out["temperature"] = torch.exp(-self.log_scale) if self.learnable_temperature else self.temperature
        return out

    def _init_temperature(self, learnable_temperature: bool, temperature: float) -> None:
        """``learnable_temperature``: ``temperature`` (checked) becomes the parameter
        ``log_scale = log(1/τ)``."""
        self.learnable_temperature = check.flag("learnable_temperature", learnable_temperature)
        if not self.learnable_temperature:
            return
        if _st_version() < (6, 2):
            raise ValueError("learnable_temperature needs sentence-transformers >= 6.2, whose "
                             "trainer clears the gradients of parameters a loss owns each step")
        self.log_scale = nn.Parameter(torch.tensor(-math.log(check.positive("temperature",
                                                                            temperature))))

    def _own_parameters(self) -> list:
        """The parameters of the loss itself, not of its models: a learnable temperature."""
        return [self.log_scale] if self.learnable_temperature else []

    @property
    def current_temperature(self) -> float:
        """τ as the loss computes it now: the learned one with ``learnable_temperature``."""
        if self.learnable_temperature:
            return float(torch.exp(-self.log_scale.detach()))
        return float(self.temperature)

    def _check_options(self, **extra) -> None:
        """Build this loss's spec from its options on a batch of two rows (negatives too
        where the loss takes them; ``extra``: more of build_spec's arguments): the first bad
        option raises build_spec's error, the argument named as the constructor names it.
        (The backend is resolved again at each call, where the embeddings' device is known.)"""
        options = self._options()
        backend = check.choice("backend", options.pop("backend", "auto"), check.BACKENDS)
        dims = options.get("matryoshka_dims")
        try:
            width = max([x for x in dims if isinstance(x, int)] or [1]) if dims is not None else 1
        except TypeError:      # not a sequence: build_spec says so
            width = 1
        rows = torch.zeros(2, max(width, 1), device=self.model.device)   # (a generator's device)
        rows[:, 0] = 1.0
        negatives = rows if self._column_counts[1] != 2 else None
        try:
            # the backend's own rules where the rows can take it (else at the first call)
            fastcl.spec.build_spec(rows, rows, negatives, **options, **extra, backend=backend if (
                backend == "reference" or fastcl.spec.triton_problem(rows) is None) else "tiled")
        except (TypeError, ValueError) as err:
            renamed = str(err)
            for name, spec_name in self._spec_names.items():
                renamed = re.sub(rf"\b{spec_name}\b", name, renamed)
            raise type(err)(renamed) from None

    #: drop candidates with the same text as the anchor's positive (:func:`text_ids`)
    mask_duplicates = False

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        features = self._features(sentence_features)
        inputs = self._feature_inputs(features)
        embeddings = embed_columns(self.model, features)
        return self.compute_loss_from_embeddings(embeddings, labels, **inputs)  # defined by each loss

    def _feature_inputs(self, sentence_features) -> dict:
        """Loss inputs read from the features before any forward (a model may write into
        them): each column's text ids when ``mask_duplicates`` is on."""
        if not self.mask_duplicates:
            return {}
        return {"duplicate_ids": [text_ids(f) for f in sentence_features]}

    def _ids(self, duplicate_ids):
        """``duplicate_ids`` as given to ``compute_loss_from_embeddings``: required exactly when
        ``mask_duplicates`` is on."""
        if self.mask_duplicates and duplicate_ids is None:
            raise ValueError(f"{type(self).__name__}(mask_duplicates=True) compares the texts: call "
                             "the loss on the tokenized features, or pass duplicate_ids (one "
                             "integer tensor per column, e.g. text_ids(features)) to "
                             "compute_loss_from_embeddings")
        return duplicate_ids if self.mask_duplicates else None

    def _features(self, sentence_features: Iterable[dict[str, Tensor]],
                  name: str | None = None) -> list[dict[str, Tensor]]:
        """The input columns as a list, checked before any forward: as many as the loss
        takes, none of them empty (an encoder given no rows fails deep inside). ``name``: the
        loss the errors name (default this one's class; a cached loss passes its own)."""
        name = name or type(self).__name__
        sentence_features = self._columns(list(sentence_features), name, *self._column_counts)
        for i, features in enumerate(sentence_features):
            try:
                rows = batch_rows(features)
            except ValueError:  # no batched tensor at all: the tokenizer was given no text
                rows = 0
            if rows == 0:
                raise ValueError(f"{name} got an empty batch: input column {i} has no "
                                 "rows (a loss needs at least one example)")
        return sentence_features

    def _gathering(self) -> bool:
        return (bool(self.gather_across_devices) and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1)

    #: whether the anchors block holds this process's anchors only (GIST's anchor–anchor
    #: block), not the whole batch's (MNRL's query_to_query), under gather_across_devices
    _local_anchor_block = False

    def _in_batch_loss(self, embeddings, *, guide=None, duplicate_ids=None) -> Tensor:
        """:func:`fastcl.contrastive` over columns (anchor, positive[, negative...]) with this
        loss's :meth:`_options`; ``guide`` and ``duplicate_ids``: a guide's embeddings and the
        text ids of each column, in the same order. With ``gather_across_devices``, every
        process's positives, negatives (and anchors, where the rules score them) are the
        candidates."""
        anchors, positives, *negatives = self._columns(embeddings, type(self).__name__)
        kw = self._options()
        if kw.get("hard_negative_weight") and len(negatives) != 1:
            raise ValueError("hard_negative_weight needs exactly one negative column, "
                             f"got {len(negatives)}")
        symmetric = kw.pop("symmetric", False)
        lay = kw.get("directions", layout.PLAIN)
        if layout.names_plain(lay, kw.get("partition_mode", "joint")):
            lay = layout.PLAIN
        elif not isinstance(lay, layout.Layout):
            lay = layout.from_directions(lay, kw.get("partition_mode", "joint"))
        cat = lambda parts: torch.cat(parts) if parts else None
        g_anchors, g_positives, *g_negatives = guide if guide is not None else (None, None)
        i_anchors, i_positives, *i_negatives = (duplicate_ids if duplicate_ids is not None
                                                else (None, None))
        if not self._gathering():
            return fastcl.contrastive(
                anchors, positives, cat(negatives), symmetric=symmetric,
                guide=None if guide is None else (g_anchors, g_positives, cat(g_negatives)),
                duplicate_ids=None if duplicate_ids is None else (
                    i_positives, cat(i_negatives), i_anchors if lay.scores_anchors else None),
                **kw)
        # Each negative column gathered on its own, so that row offset + i stays anchor i's
        # own; 1-D ids travel as one-column tensors. The anchors block is the whole batch's
        # (MNRL) or this process's (GIST).
        whole_anchors = (lay.scores_anchors and not self._local_anchor_block) or symmetric
        columns = {"positives": positives, "negatives": negatives,
                   "anchors": [anchors] if whole_anchors else []}
        if guide is not None:
            columns.update(g_positives=g_positives, g_negatives=g_negatives,
                           g_anchors=[g_anchors] if whole_anchors else [])
        if duplicate_ids is not None:
            columns.update(i_positives=i_positives[:, None], i_negatives=[i[:, None] for i in i_negatives],
                           i_anchors=[i_anchors[:, None]] if whole_anchors else [])
        names = [k for k, v in columns.items() for _ in (v if isinstance(v, list) else [v])]
        flat = [x for v in columns.values() for x in (v if isinstance(v, list) else [v])]
        offset, gathered = gather_rows(*flat)
        got: dict = {}
        for name, x in zip(names, gathered):
            got.setdefault(name, []).append(x)
        one = lambda name: got[name][0] if got.get(name) else None
        ids = lambda name: [x[:, 0] for x in got.get(name, [])]
        if symmetric:   # each process scores its own positives against every anchor
            plain = {k: v for k, v in kw.items() if k != "hard_negative_weight"}
            forward = fastcl.contrastive(anchors, one("positives"), cat(got.get("negatives", [])),
                                         anchor_offset=offset, **kw)
            return 0.5 * (forward + fastcl.contrastive(positives, one("anchors"), anchor_offset=offset,
                                                       **plain))
        cands = None
        if lay.scores_anchors:
            cands = one("anchors") if not self._local_anchor_block else anchors
        g = None
        if guide is not None:
            g = (g_anchors, one("g_positives"), cat(got.get("g_negatives", [])),
                 (one("g_anchors") if not self._local_anchor_block else g_anchors)
                 if lay.scores_anchors else None)
        i = None
        if duplicate_ids is not None:
            i = (ids("i_positives")[0], cat(ids("i_negatives")),
                 ((ids("i_anchors") or [None])[0] if not self._local_anchor_block else i_anchors)
                 if lay.scores_anchors else None)
        return fastcl.contrastive(anchors, one("positives"), cat(got.get("negatives", [])),
                                  anchor_offset=offset, anchor_candidates=cands, guide=g,
                                  duplicate_ids=i, **kw)

    @staticmethod
    def _columns(embeddings, name, at_least=2, at_most=None):
        if not at_least <= len(embeddings) <= (at_most or len(embeddings)):
            allowed = f"{at_least}" if at_most == at_least else f"{at_least} or more"
            raise ValueError(f"{name} takes {allowed} input columns (anchor, positive"
                             f"{', negative...' if at_most is None else ''}), got {len(embeddings)}")
        return embeddings


def preprocess(model, texts) -> dict:
    """``model``'s input features of ``texts``, as a dict: ``SentenceTransformer.preprocess``
    (sentence-transformers 6), ``tokenize`` before."""
    return dict(model.preprocess(texts) if hasattr(model, "preprocess") else model.tokenize(texts))


class Guided:
    """A frozen guide model's embeddings of the input columns, for losses mixed with
    :class:`FastLoss` (DCLR's complementary model, GIST's guide). If the guide's tokenizer
    differs from the model's (or it reads shorter inputs), the text is decoded and tokenized
    again for it, as sentence-transformers' GISTEmbedLoss does. (No class-level ``guide``: a
    module registered by ``nn.Module.__setattr__`` would be shadowed by it.)"""

    #: the keyword of ``compute_loss_from_embeddings`` that takes the guide's embeddings
    _guide_argument = "guide_embeddings"

    def forward(self, sentence_features, labels=None):
        """:class:`FastLoss`'s forward with the guide's embeddings of the same columns."""
        features = self._features(sentence_features)
        inputs = self._feature_inputs(features)
        inputs[self._guide_argument] = self._guide_embeddings(features)
        embeddings = embed_columns(self.model, features)
        return self.compute_loss_from_embeddings(embeddings, labels, **inputs)

    def _init_guide(self, model, guide, what: str, guide_dropout: bool = False) -> None:
        if guide is not None and not isinstance(guide, SentenceTransformer):
            raise TypeError(f"guide must be a SentenceTransformer ({what}), got {type(guide).__name__}")
        self.guide, self.guide_dropout = guide, bool(guide_dropout)
        self.must_retokenize = guide is not None and (
            model.tokenizer.get_vocab() != guide.tokenizer.get_vocab()
            or (guide.max_seq_length or 0) < (model.max_seq_length or 0))
        self.tokenizer = model.tokenizer  # kept: the trainer may wrap self.model (DDP) later

    def _guide_inputs(self, features) -> dict:
        """The guide's input features of a column: the model's (a shallow copy: a model writes
        its outputs into the feature dict it is given), or its texts tokenized again."""
        if not self.must_retokenize:
            return dict(features)
        texts = self.tokenizer.batch_decode(features["input_ids"], skip_special_tokens=True)
        return {k: v.to(self.guide.device) if torch.is_tensor(v) else v
                for k, v in preprocess(self.guide, texts).items()}

    def _guide_forward(self, features):
        return self.guide(self._guide_inputs(features))["sentence_embedding"]

    def _guide_embeddings(self, sentence_features, mini_batch_size: int | None = None):
        """The guide's embeddings of each column (eval mode unless ``guide_dropout``, no
        gradients), in forwards of at most ``mini_batch_size`` inputs (one per column by
        default); None without a guide. In eval mode a column with the same inputs as an
        earlier one (unsupervised DCLR's anchors and positives) takes that column's
        embeddings: the guide's forward is a function of its inputs there, so the result is
        the same and one forward of the guide a step is saved."""
        if self.guide is None:
            return None
        was_training = self.guide.training
        self.guide.train(self.guide_dropout)
        try:
            with torch.no_grad():
                repeats = not self.guide_dropout and any(
                    _same_inputs(sentence_features[j], f)
                    for i, f in enumerate(sentence_features) for j in range(i))
                if mini_batch_size is None and not repeats:
                    # one forward over like columns, as sentence-transformers' own losses embed
                    # the guide: equal texts in two columns get equal embeddings there
                    inputs = [self._guide_inputs(f) for f in sentence_features]
                    return [e.detach() for e in embed_columns(self.guide, inputs)]
                columns = []
                for i, features in enumerate(sentence_features):
                    same = None if self.guide_dropout else next(
                        (j for j in range(i) if _same_inputs(sentence_features[j], features)), None)
                    if same is not None:
                        columns.append(columns[same])
                        continue
                    ranges = minibatch_ranges(features, mini_batch_size or batch_rows(features))
                    if len(ranges) == 1:
                        columns.append(self._guide_forward(features))
                    else:
                        columns.append(torch.cat([self._guide_forward(minibatch(features, begin, end))
                                                  for begin, end in ranges]))
                if mini_batch_size is not None and not self.guide_dropout:
                    columns = _equal_texts_equal_rows(columns, sentence_features)
                return [e.detach() for e in columns]
        finally:
            self.guide.train(was_training)


def _equal_texts_equal_rows(columns: list[Tensor], sentence_features: list) -> list[Tensor]:
    """Each row's embedding replaced by that of the first row with the same text (the same
    token ids, :func:`text_ids`) over all columns. Forwards in mini-batches pad each one to
    its own length, which moves a text's embedding in its last bits from column to column;
    one forward over like columns (sentence-transformers' plain losses) gives equal texts
    equal embeddings, and a guide's filter compares them as equal (an exact tie)."""
    if "input_ids" not in sentence_features[0]:
        return columns
    ids = torch.cat([text_ids(f) for f in sentence_features])
    rows = torch.cat(columns)
    _, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), rows.shape[0], dtype=torch.long, device=rows.device)
    first.scatter_reduce_(0, inverse.to(rows.device), torch.arange(rows.shape[0], device=rows.device),
                          reduce="amin")
    return list(rows[first[inverse.to(rows.device)]].split([c.shape[0] for c in columns]))


class Cached(GRADCACHE_BASE, nn.Module):
    """A ``Fast*`` loss with the two-pass (GradCache) forward, as sentence-transformers'
    cached losses wrap their plain loss: it holds the plain loss (``self.loss``), which owns
    and checks every option and computes the loss from the embeddings, and adds only the
    mini-batching. The plain loss's attributes read (and assign) through it. Subclasses may
    add columns to embed (:meth:`_views`) and loss inputs computed once in pass 1
    (:meth:`_pass_one_inputs`)."""

    _pass_one: dict = {}
    _own_grads: list = []      # (parameter, its gradient) of the loss's own, from pass 1
    #: the plain loss's class
    _plain: type = FastLoss
    #: the plain loss's attributes assigned through the wrapper besides its ``_config``
    _delegated = ("chunk_size", "guide", "generator", "similarity_fct")

    def __init__(self, loss: FastLoss, mini_batch_size: int, show_progress_bar: bool = False,
                 mini_batch_num_tokens: int | None = None):
        nn.Module.__init__(self)
        self.model = loss.model
        self.loss = loss
        self._init_cache(mini_batch_size, show_progress_bar, mini_batch_num_tokens)

    def __getattr__(self, name: str):
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            if name == "loss" or "loss" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["loss"], name)

    def __setattr__(self, name: str, value) -> None:
        # the plain loss's options are its own: assigned there (nn.Module would keep a module
        # value, a guide, on the wrapper where the plain loss never sees it)
        loss = self.__dict__.get("_modules", {}).get("loss")
        if loss is not None and (name in loss._config_names() or name in self._delegated):
            setattr(loss, name, value)
        else:
            super().__setattr__(name, value)

    @classmethod
    def _config_names(cls) -> tuple[str, ...]:
        """The plain loss's config and this loss's own arguments (the mini-batching's)."""
        plain = cls._plain._config_names()
        own = [name for name, p in inspect.signature(cls.__init__).parameters.items()
               if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
               and name not in cls._plain._unlogged and name not in plain]
        return plain + tuple(own)

    def get_config_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._config_names()}

    def _views(self, sentence_features: list) -> list:
        return sentence_features

    def _pass_one_inputs(self, sentence_features: list) -> dict:
        return {}

    def _init_cache(self, mini_batch_size: int, show_progress_bar: bool,
                    mini_batch_num_tokens: int | None = None) -> None:
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}")
        if mini_batch_num_tokens is not None:
            if (isinstance(mini_batch_num_tokens, bool) or not isinstance(mini_batch_num_tokens, int)
                    or mini_batch_num_tokens < 1):
                raise ValueError(f"mini_batch_num_tokens must be a positive int or None, got "
                                 f"{mini_batch_num_tokens!r}")
            if "mini_batch_num_tokens" not in getattr(GRADCACHE_BASE, "__annotations__", {}):
                raise ValueError("mini_batch_num_tokens needs sentence-transformers' own GradCache "
                                 "with token budgets (sentence-transformers >= 6.2); this release "
                                 "takes mini_batch_size only")
        if has_static_embedding_input(self.model):
            raise ValueError(f"{type(self).__name__} cannot split a StaticEmbedding model's inputs into "
                             "mini-batches; use the loss without caching")
        self.mini_batch_size, self.show_progress_bar = mini_batch_size, show_progress_bar
        self.mini_batch_num_tokens = mini_batch_num_tokens

    def forward(self, sentence_features, labels=None):
        sentence_features = self.loss._features(sentence_features, type(self).__name__)
        self._pass_one = {**self.loss._feature_inputs(sentence_features),
                          **self._pass_one_inputs(sentence_features)}
        self._own_grads = []
        try:
            loss = self.forward_cached(self._views(sentence_features), labels)
        finally:
            self._pass_one = {}
        # The loss's own parameters (a learnable temperature): the GradCache forward returns
        # a detached loss; their gradient from pass 1 joins it as a term of value 0 whose
        # gradient is that one, times whatever the backward brings (accumulation, scaling).
        for param, grad in self._own_grads:
            loss = loss + ((param - param.detach()) * grad).sum()
        self._own_grads = []
        return loss

    def compute_loss_from_embeddings(self, embeddings, labels=None, **inputs):
        """The plain loss's, on the whole batch's embeddings."""
        return self.loss.compute_loss_from_embeddings(embeddings, labels, **inputs)

    def calculate_loss(self, reps, labels=None, *, with_backward=False):
        """The loss of the whole batch from the mini-batch embeddings ``reps[column][mini-batch]``;
        with ``with_backward`` its gradient w.r.t. each of them is left in their ``.grad``."""
        embeddings = [torch.cat(column) for column in reps]
        loss = self.compute_loss_from_embeddings(embeddings, labels, **self._pass_one)
        if not with_backward:
            return loss
        leaves = [r for column in reps for r in column]
        own = [p for p in self.loss._own_parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, leaves + own, allow_unused=True)
        for leaf, grad in zip(leaves, grads):
            leaf.grad = grad
        self._own_grads = [(p, g) for p, g in zip(own, grads[len(leaves):]) if g is not None]
        return loss.detach()

    @property
    def citation(self) -> str:
        return self._plain.citation.fget(self) + citations.GRADCACHE   # (reads no state)
