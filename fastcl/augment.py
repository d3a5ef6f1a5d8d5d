"""Positive-view augmentations beside dropout, applied to the second view of a pair only.

Unsupervised training encodes the duplicated batch ``[x1, x1, x2, x2, …]`` (see
:mod:`fastcl.training`); the second copy of each sentence is its positive. With an
augmentation, that copy is also augmented while dropout stays on for both copies. Two kinds:

- **token level** (:func:`word_shuffle`, :func:`word_deletion`): the input ids of the second
  copies are changed once per step, when the batch is tokenized
  (:func:`fastcl.training.view_inputs`); every pass over the batch — the cached encoding's
  two passes included — then sees the same inputs.
- **embedding level** (:func:`token_cutoff`, :func:`span_cutoff`, :func:`feature_cutoff`):
  applied to the output of the backbone's embedding layer (word + position + token-type
  embeddings, after their LayerNorm and dropout) inside the forward, by a hook
  (:func:`on_embeddings`). Their masks are drawn from the global random state of the
  forward's device, like dropout, so the cached encoding's replay of that state per
  mini-batch replays them too.

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

import contextlib
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

def token_cutoff(embeddings: torch.Tensor, where: torch.Tensor, rate: float) -> torch.Tensor:
    """ConSERT's token cutoff: zero the whole embedding vector of ``k = max(1, round(rate·L))``
    content tokens per row, at positions drawn uniformly without replacement."""
    where = where.to(embeddings.device)
    cut = _random_subset(where, _count(rate, where.sum(1)), embeddings.device)
    return embeddings * (~cut).to(embeddings.dtype)[..., None]


def span_cutoff(embeddings: torch.Tensor, where: torch.Tensor, rate: float) -> torch.Tensor:
    """ConSERT's span cutoff: zero the embeddings of one contiguous span of ``k = max(1,
    round(rate·L))`` content tokens per row, its start drawn uniformly among the ``L − k + 1``
    possible ones."""
    where = where.to(embeddings.device)
    lengths = where.sum(1)
    k = _count(rate, lengths).to(embeddings.device)
    start = torch.floor(torch.rand(where.shape[0], device=embeddings.device)
                        * (lengths - k + 1).to(embeddings.device)).long()
    index = where.long().cumsum(1) - 1  # position among the row's content tokens
    cut = where & (index >= start[:, None]) & (index < (start + k)[:, None])
    return embeddings * (~cut).to(embeddings.dtype)[..., None]


def feature_cutoff(embeddings: torch.Tensor, where: torch.Tensor, rate: float) -> torch.Tensor:
    """ConSERT's feature cutoff: zero ``k = max(1, round(rate·d))`` embedding dimensions per
    row, drawn uniformly without replacement, in every content token of the row (ConSERT
    erases the columns for the whole sequence; here the special tokens keep theirs)."""
    where = where.to(embeddings.device)
    rows, _, dim = embeddings.shape
    chosen = (where.any(1, keepdim=True) & torch.ones(rows, dim, dtype=torch.bool,
                                                       device=embeddings.device))
    k = torch.full((rows,), dim, dtype=torch.long)
    dims = _random_subset(chosen, _count(rate, k), embeddings.device)
    cut = where[..., None] & dims[:, None, :]
    return embeddings * (~cut).to(embeddings.dtype)


_EMBEDDING = {"token_cutoff": token_cutoff, "span_cutoff": span_cutoff,
              "feature_cutoff": feature_cutoff}


def embedding_module(backbone: torch.nn.Module) -> torch.nn.Module:
    """The embedding layer of a Hugging Face encoder: its ``embeddings`` module (BERT,
    RoBERTa, …), else its input embeddings."""
    module = getattr(backbone, "embeddings", None)
    if isinstance(module, torch.nn.Module):
        return module
    return backbone.get_input_embeddings()


@contextlib.contextmanager
def on_embeddings(aug: Augmentation | None, backbone: torch.nn.Module, where: torch.Tensor | None):
    """Within the block, the embedding layer's output of ``backbone`` goes through the
    embedding-level augmentation ``aug`` at the tokens ``where`` (rows × L, True where a
    token may change: the content tokens of the second copies). Nothing happens when
    ``aug`` is None, token level, or ``where`` is None."""
    if aug is None or not aug.embedding_level or where is None:
        yield
        return
    fn = _EMBEDDING[aug.name]

    def hook(module, inputs, output):
        if output.shape[:2] != where.shape:
            raise ValueError(f"augment {aug.name}: the embedding layer's output {tuple(output.shape)} "
                             f"does not match the token mask {tuple(where.shape)}")
        return fn(output, where, aug.rate)

    handle = embedding_module(backbone).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


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


def augment_features(aug: Augmentation | None, features: dict, rows: torch.Tensor, tokenizer) -> dict:
    """The features of a forward with ``aug`` on the rows ``rows`` (bool, one per row):
    token-level augmentations change those rows' input ids now; an embedding-level one adds
    :data:`KEY`, the tokens its hook may change (see :func:`on_embeddings`)."""
    if aug is None:
        return features
    device = features["input_ids"].device
    cpu = {k: v.cpu() for k, v in features.items()}
    where = content_tokens(cpu["input_ids"], cpu["attention_mask"], special_ids(tokenizer))
    where &= rows.cpu()[:, None]
    if aug.embedding_level:
        return {**features, KEY: where.to(device)}
    if aug.name == "word_shuffle":
        cpu = word_shuffle(cpu, where, aug.rate)
    else:
        cpu = word_deletion(cpu, where, aug.rate, tokenizer.pad_token_id or 0)
    return {k: v.to(device) for k, v in cpu.items()}
