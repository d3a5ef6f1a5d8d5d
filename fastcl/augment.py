"""Positive-view augmentations beside dropout, applied to the positive column only.

Unsupervised training puts each sentence in both columns (anchor, positive); dropout makes
the two views. With an augmentation the positive copy is also augmented, dropout still on
for both. The sentence-transformers loss wrapper
:class:`fastcl.integrations.sentence_transformers.AugmentedPositives` applies them; this
module holds the augmentations themselves. Two kinds:

- **token level** (:func:`word_shuffle`, :func:`word_deletion`): new input ids for the
  positive rows, drawn once per step from the CPU's global random state, so every pass over
  the batch (a cached loss's two passes included) sees the same inputs.
- **embedding level** (token, span and feature cutoff): entries of the embedding layer's
  output (word + position + token-type embeddings, after their LayerNorm and dropout) set
  to zero. The entries are drawn once for the whole column (:func:`cutoff_mask`) and applied
  in every forward by a hook (:func:`cut_out`), so they do not depend on how the column is
  split into forwards.

Only *content* tokens are touched: ``[CLS]``, ``[SEP]`` (every special token of the
tokenizer but the unknown token, :func:`special_ids`) and padding never are, and the first copies never are. Each function takes the
rate ``r`` of its name in ``--augment NAME[:r]``; the defaults are in
:data:`fastcl.common.AUGMENT_RATES`. A row with ``L`` content tokens gets
``k = max(1, round(r·L))`` of them changed (cutoffs and deletion; deletion keeps at least
one token).

References: Yan et al., "ConSERT: A Contrastive Framework for Self-Supervised Sentence
Representation Transfer", ACL 2021 (token shuffling, token, span and feature cutoff on the
embedding layer); Shen et al., "A Simple but Tough-to-Beat Data Augmentation Approach for
Natural Language Understanding and Generation", 2020 (the cutoffs); Gao et al., "SimCSE",
EMNLP 2021 and Zhou et al., "DCLR", ACL 2022 §6.1 (word deletion and the other discrete
augmentations compared with dropout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import common

KEY = "augment_where"  # feature key: the tokens an embedding-level augmentation may change
TOKEN_LEVEL = ("word_shuffle", "word_deletion")
EMBEDDING_LEVEL = ("token_cutoff", "span_cutoff", "feature_cutoff")
NAMES = EMBEDDING_LEVEL + TOKEN_LEVEL


@dataclass(frozen=True)
class Augmentation:
    """One augmentation and its rate (``parse("token_cutoff:0.2")``)."""

    name: str
    rate: float

    @property
    def spec(self) -> str:
        """The canonical ``NAME:rate`` form (what the trainer saves and compares on resume)."""
        return f"{self.name}:{self.rate:g}"

    @property
    def embedding_level(self) -> bool:
        return self.name in EMBEDDING_LEVEL


def parse(spec) -> Augmentation | None:
    """``"NAME[:rate]"`` → :class:`Augmentation` (None for None). NAME is one of
    :data:`NAMES` (``-`` may stand for ``_``); the rate defaults per augmentation
    (:data:`fastcl.common.AUGMENT_RATES`) and lies in (0, 1]."""
    if spec is None or isinstance(spec, Augmentation):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"augment must be a string NAME[:rate], got {spec!r}")
    name, _, rate = spec.strip().partition(":")
    name = name.strip().replace("-", "_")
    if name not in NAMES:
        raise ValueError(f"augment: unknown augmentation {name!r}; one of {', '.join(NAMES)} "
                         f"(NAME[:rate])")
    if rate.strip():
        try:
            value = float(rate)
        except ValueError:
            raise ValueError(f"augment: rate {rate!r} of {name} is not a number") from None
    else:
        value = common.AUGMENT_RATES[name]
    if not 0.0 < value <= 1.0:
        raise ValueError(f"augment: the rate of {name} must be in (0, 1], got {value}")
    return Augmentation(name, value)


def special_ids(tokenizer) -> list:
    """The ids an augmentation never touches: the tokenizer's special tokens ([CLS], [SEP],
    padding, <s>, </s>, …) except the unknown token, which stands for a word."""
    return sorted(set(tokenizer.all_special_ids) - {tokenizer.unk_token_id})


def content_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, special_ids) -> torch.Tensor:
    """Boolean mask of the tokens an augmentation may change: attended, not a special token."""
    special = torch.isin(input_ids, torch.as_tensor(sorted(set(special_ids)), dtype=input_ids.dtype,
                                                    device=input_ids.device))
    return attention_mask.bool() & ~special


def _count(rate: float, lengths: torch.Tensor) -> torch.Tensor:
    """``k = max(1, round(rate·L))`` per row (0 for rows without content tokens)."""
    k = torch.round(rate * lengths.double()).long().clamp_min(1)
    return torch.minimum(k, lengths)


def _random_subset(where: torch.Tensor, k: torch.Tensor, device) -> torch.Tensor:
    """``k[i]`` positions of ``where[i]`` chosen uniformly without replacement (one draw of
    ``torch.rand`` of ``where``'s shape from the global random state of ``device``)."""
    scores = torch.rand(where.shape, device=device)
    scores = torch.where(where, scores, torch.full_like(scores, 2.0))  # non-candidates last
    rank = scores.argsort(dim=1).argsort(dim=1)
    return where & (rank < k.to(device)[:, None])


# ---------------------------------------------------------------------------------------
# Embedding level: masks over the embedding layer's output (rows × L × d)

def token_cut(where: torch.Tensor, rate: float, device=None) -> torch.Tensor:
    """The tokens :func:`token_cutoff` zeroes (rows × L, bool): ``k = max(1, round(rate·L))``
    content tokens per row, drawn uniformly without replacement (one ``torch.rand`` of
    ``where``'s shape from the global random state of ``device``, ``where``'s by default)."""
    device = where.device if device is None else torch.device(device)
    where = where.to(device)
    return _random_subset(where, _count(rate, where.sum(1)), device)


def span_cut(where: torch.Tensor, rate: float, device=None) -> torch.Tensor:
    """The tokens :func:`span_cutoff` zeroes (rows × L, bool): one contiguous span of ``k =
    max(1, round(rate·L))`` content tokens per row, its start drawn uniformly among the
    ``L − k + 1`` possible ones (one ``torch.rand`` per row)."""
    device = where.device if device is None else torch.device(device)
    where = where.to(device)
    lengths = where.sum(1)
    k = _count(rate, lengths).to(device)
    start = torch.floor(torch.rand(where.shape[0], device=device) * (lengths - k + 1).to(device)).long()
    index = where.long().cumsum(1) - 1  # position among the row's content tokens
    return where & (index >= start[:, None]) & (index < (start + k)[:, None])


def feature_cut(where: torch.Tensor, rate: float, dim: int, device=None) -> torch.Tensor:
    """The entries :func:`feature_cutoff` zeroes (rows × L × ``dim``, bool): ``k = max(1,
    round(rate·dim))`` embedding dimensions per row, drawn uniformly without replacement (one
    ``torch.rand`` of rows × ``dim``), in every content token of the row."""
    device = where.device if device is None else torch.device(device)
    where = where.to(device)
    rows = where.shape[0]
    chosen = where.any(1, keepdim=True) & torch.ones(rows, dim, dtype=torch.bool, device=device)
    k = torch.full((rows,), dim, dtype=torch.long)
    dims = _random_subset(chosen, _count(rate, k), device)
    return where[..., None] & dims[:, None, :]


def cut_out(embeddings: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """``embeddings`` (rows × L × d) with the entries ``cut`` marks set to zero: ``cut`` is
    rows × L (whole token vectors, :func:`token_cut`, :func:`span_cut`) or rows × L × d
    (:func:`feature_cut`)."""
    keep = ~cut.to(embeddings.device)
    if keep.ndim == 2:
        keep = keep[..., None]
    return embeddings * keep.to(embeddings.dtype)


def cutoff_mask(aug: Augmentation, where: torch.Tensor, dim: int | None = None, device=None) -> torch.Tensor:
    """What the embedding-level augmentation ``aug`` zeroes at the tokens ``where``, drawn now
    (the draws of :func:`token_cutoff`, :func:`span_cutoff` or :func:`feature_cutoff`, from the
    global random state of ``device``); :func:`cut_out` applies it. ``dim``, the width of the
    embedding layer's output, is needed by ``feature_cutoff`` only."""
    if aug.name == "token_cutoff":
        return token_cut(where, aug.rate, device)
    if aug.name == "span_cutoff":
        return span_cut(where, aug.rate, device)
    if aug.name == "feature_cutoff":
        if dim is None:
            raise ValueError("feature_cutoff needs the width of the embedding layer's output (dim)")
        return feature_cut(where, aug.rate, dim, device)
    raise ValueError(f"augment: {aug.name} is not an embedding-level augmentation")


def embedding_module(backbone: torch.nn.Module) -> torch.nn.Module:
    """The embedding layer of a Hugging Face encoder: its ``embeddings`` module (BERT,
    RoBERTa, …), else its input embeddings."""
    module = getattr(backbone, "embeddings", None)
    if isinstance(module, torch.nn.Module):
        return module
    return backbone.get_input_embeddings()


# ---------------------------------------------------------------------------------------
# Token level: new input ids for the chosen rows (drawn from the CPU's global random state)

def word_shuffle(features: dict, where: torch.Tensor, rate: float) -> dict:
    """Token shuffling: permute the content tokens of each row among their own positions.

    ConSERT shuffles the position ids given to the embedding layer; permuting the tokens
    instead gives every token the position the permutation assigns it, which is the same
    input for absolute position embeddings and also works for models without position ids.
    With ``rate < 1`` only ``k = max(1, round(rate·L))`` content tokens, drawn uniformly, are
    permuted among their positions (the default 1.0 permutes all of them).
    """
    out = {k: v.clone() for k, v in features.items()}
    chosen = _random_subset(where, _count(rate, where.sum(1)), torch.device("cpu"))
    for i in torch.nonzero(chosen.any(1)).flatten().tolist():
        positions = torch.nonzero(chosen[i]).flatten()
        order = positions[torch.randperm(len(positions))]
        for key in ("input_ids", "token_type_ids"):
            if key in out:
                out[key][i, positions] = features[key][i, order]
    return out


def word_deletion(features: dict, where: torch.Tensor, rate: float, pad_token_id: int) -> dict:
    """Word deletion: delete ``k = max(1, round(rate·L))`` content tokens per row, drawn
    uniformly, keeping at least one; the remaining tokens close up and the row ends in
    padding (the batch keeps its width)."""
    out = {k: v.clone() for k, v in features.items()}
    lengths = where.sum(1)
    k = torch.minimum(_count(rate, lengths), (lengths - 1).clamp_min(0))
    deleted = _random_subset(where, k, torch.device("cpu"))
    for i in torch.nonzero(deleted.any(1)).flatten().tolist():
        keep = ~deleted[i]
        kept = int(keep.sum())
        for key, fill in (("input_ids", pad_token_id), ("attention_mask", 0), ("token_type_ids", 0)):
            if key in out:
                row = features[key][i][keep]
                out[key][i] = fill
                out[key][i, :kept] = row
    return out
