"""Which candidates each loss row scores, and which of them it drops: the rules that
sentence-transformers' ``MultipleNegativesRankingLoss`` (``directions``, ``partition_mode``,
``hardness_mode``) and ``GISTEmbedLoss`` (the guide's false-negative filter, the anchor–anchor
and positive–positive blocks) add to InfoNCE, plus fastcl's duplicate masking.

A leaf like :mod:`fastcl.common`: the reference (:mod:`fastcl.reference`, full matrices) and
the tiled engine (:mod:`fastcl.tiled`, one chunk of rows at a time) each apply these rules
with their own code, and the tests hold them to each other.

**Candidates** are laid out in blocks, always in this order::

    [ positives (N_b) | negatives (K) | noise Z (K_z) | anchors (N_a) ]

The anchors block exists only when a layout scores anchors (``query_to_query``,
``doc_to_query``, GIST's anchor–anchor block). A column's *group* is the batch row it
belongs to: positive j and the j-th row of every negative column (``j mod N_b``, when K is
a multiple of N_b), anchor j; noise columns belong to no group.

**Sides of a row.** Row i (global index ``g = anchor_offset + i``, positive in column g)
has an *anchor side*, the anchor ``a_i`` against the positives, negatives, noise and (with
``anchor_to_anchors``) the anchors; and, when the layout says so, a *positive side*, its
positive ``p_g`` against the blocks the layout names (never the noise). ``joint`` puts both
sides in one softmax, ``ℓ_i = log Σ_{both sides} e^l − l_{i,g}`` (MNRL's
``partition_mode="joint"``); otherwise each side has its own and the row loss is the mean
of their log-sum-exps minus the positive's logit (``"per_direction"``).

**Drops** (a dropped entry leaves the softmax): with ``exclude_own``, the anchor side drops
its own column in the anchors block and the positive side drops its own documents (every
column of group g in the positives and negatives blocks) — MNRL's rules, and GIST's, whose
positive side scores the positives block only (so drops only ``p_g``). The guide's filter
drops entries whose guide cosine exceeds the row's threshold (:func:`guide_threshold`), and
duplicate masking drops entries whose text id equals that of the row's positive; neither
ever drops the pair's own entries: the positive (anchor side) and the anchor's own column
(positive side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: MNRL's directions: query = anchor, doc = positive (or negative) document.
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")
#: MNRL's hardness modes: which anchor-side document columns get ``+ β·sg(s)``.
HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")
MARGIN_STRATEGIES = ("absolute", "relative")


@dataclass(frozen=True)
class Layout:
    """The blocks each side of a row scores (the module docstring states the rules)."""

    anchor_to_anchors: bool = False      # anchor side also scores the anchors block
    positive_to_anchors: bool = False    # positive side scores the anchors (doc_to_query)
    positive_to_positives: bool = False  # ... the positives block
    positive_to_negatives: bool = False  # ... the negatives block
    exclude_own: bool = True             # MNRL's self and own-document exclusions
    joint: bool = True                   # one softmax per row over both sides

    @property
    def positive_side(self) -> bool:
        return self.positive_to_anchors or self.positive_to_positives or self.positive_to_negatives

    @property
    def scores_anchors(self) -> bool:
        """Whether the candidates need the anchors block."""
        return self.anchor_to_anchors or self.positive_to_anchors

    @property
    def plain(self) -> bool:
        """InfoNCE's own layout: the anchor side alone, no anchors block."""
        return not (self.anchor_to_anchors or self.positive_side)


PLAIN = Layout()


def names_plain(directions, partition_mode: str = "joint") -> bool:
    """Whether ``directions`` given by name (and ``partition_mode``) are plain InfoNCE's, told
    without building a :class:`Layout` (which a torch.compile trace cannot) and without
    comparing a Layout with a tuple (where torch.compile before torch 2.6 breaks the graph)."""
    return (isinstance(directions, (tuple, list)) and tuple(directions) == ("query_to_doc",)
            and partition_mode == "joint")


def from_directions(directions, partition_mode: str = "joint") -> Layout:
    """MNRL's ``directions`` and ``partition_mode`` as a layout (checked: ``query_to_doc`` is
    required, and ``per_direction`` takes ``query_to_doc`` and ``doc_to_query`` only, as
    MNRL)."""
    if isinstance(directions, str):
        raise TypeError(f"directions must be a tuple of names, got the string {directions!r} "
                        f"(write ({directions!r},))")
    if not isinstance(directions, (tuple, list)):
        raise TypeError(f"directions must be a tuple of names (or a fastcl.layout.Layout), got "
                        f"{directions!r}")
    directions = tuple(directions)
    unknown = [d for d in directions if d not in DIRECTIONS]
    if unknown or not directions:
        raise ValueError(f"directions must be a non-empty tuple of {', '.join(map(repr, DIRECTIONS))}; "
                         f"got {directions!r}")
    if "query_to_doc" not in directions:
        raise ValueError("directions must include 'query_to_doc' (the direction that holds the "
                         f"positive pair); got {directions!r}")
    if partition_mode not in PARTITION_MODES:
        raise ValueError(f"partition_mode must be one of {', '.join(map(repr, PARTITION_MODES))}; "
                         f"got {partition_mode!r}")
    if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
        raise ValueError("partition_mode='per_direction' takes the directions 'query_to_doc' and "
                         "'doc_to_query' only: 'query_to_query' and 'doc_to_doc' never score the "
                         "positive pair, so their own softmax has no target; use partition_mode='joint'")
    to_docs = "doc_to_doc" in directions
    return Layout(anchor_to_anchors="query_to_query" in directions,
                  positive_to_anchors="doc_to_query" in directions,
                  positive_to_positives=to_docs, positive_to_negatives=to_docs,
                  exclude_own=True, joint=partition_mode == "joint")


def gist(contrast_anchors: bool = True, contrast_positives: bool = True) -> Layout:
    """GISTEmbedLoss's blocks: anchor–positive and anchor–negative always, anchor–anchor
    (``contrast_anchors``) and positive–positive (``contrast_positives``: the positives block
    only, not the negatives), one softmax. The self entries ``(a_i, a_i)`` and ``(p_i, p_i)``
    are dropped whatever the guide says (``exclude_own``: on these blocks it drops exactly
    them), as GISTEmbedLoss from sentence-transformers 6.3; before 6.3 only the guide's filter
    dropped them, which it does unless the row's threshold reaches the guide's self cosine
    (~1: an anchor identical to its positive at margin 0, a negative margin)."""
    return Layout(anchor_to_anchors=bool(contrast_anchors),
                  positive_to_positives=bool(contrast_positives), exclude_own=True, joint=True)


def guide_threshold(guide_positive_cosine: torch.Tensor, margin: float,
                    strategy: str = "absolute") -> torch.Tensor:
    """The guide's per-row threshold ``θ_i`` from its anchor–positive cosine ``g_i``: an entry
    whose guide cosine is ``> θ_i`` is a false negative. ``"absolute"``: ``θ = g − margin``;
    ``"relative"``: ``θ = g − |g|·margin`` (GISTEmbedLoss's two strategies)."""
    if strategy == "absolute":
        return guide_positive_cosine - margin
    return guide_positive_cosine - guide_positive_cosine.abs() * margin


def keep_twin_ties(theta: torch.Tensor, gamma: torch.Tensor, partners, columns: torch.Tensor,
                   own_columns=(1, 1)) -> torch.Tensor:
    """``θ`` raised by a rounding margin on the rows whose guide pair has an exact twin.

    Equal texts have equal guide embeddings (sentence-transformers embeds like columns in one
    forward), so GISTEmbedLoss's guide cosine of a candidate equal to the row's positive is
    ``γ_i`` exactly, and its strict ``>`` keeps it at margin 0. The fused paths form ``γ_i``
    and the chunk's guide cosines by different products, which can put the same cosine an
    ulp above ``θ_i`` and drop it. On the rows where a column's guide unit row equals a row
    of ``partners`` bitwise (one tensor per side: the row's positive's, on the positive side
    its anchor's) beyond ``own_columns`` (each side's: the positive's own column; the
    anchor's own in the anchors block, 0 without one), and whose threshold
    keeps a tie (``θ_i ≥ γ_i``), ``θ_i`` becomes ``θ_i + 16·ε·(1 + |θ_i|)`` (ε of θ's
    dtype), above any rounding of the same cosine and below any cosine that differs."""
    keys = _row_keys(columns).sort().values
    twin = torch.zeros_like(theta, dtype=torch.bool)
    for side, rows in enumerate(partners):
        key = _row_keys(rows)
        count = torch.searchsorted(keys, key, right=True) - torch.searchsorted(keys, key)
        twin |= count > own_columns[side]
    eps = torch.finfo(theta.dtype).eps
    return torch.where(twin & (theta >= gamma), theta + 16 * eps * (1 + theta.abs()), theta)


def _row_keys(x: torch.Tensor) -> torch.Tensor:
    """One int64 per row, equal for bitwise-equal rows: the rows' bit patterns against odd
    64-bit multipliers, summed with wrap-around (integer sums do not depend on their order;
    no host read, as torch.compile and meta tensors need). Two different rows collide with
    probability ~2⁻⁶⁴. Summed a band of 128 columns at a time: the int64 products of the
    whole M×d matrix would be 2–4× the guide embeddings themselves."""
    bits = x.contiguous().view(torch.int64 if x.element_size() == 8 else torch.int32)
    weights = torch.arange(x.shape[1], dtype=torch.int64, device=x.device) * 0x2545F4914F6CDD1D | 1
    key = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    for lo in range(0, x.shape[1], 128):
        key += (bits[:, lo:lo + 128].to(torch.int64) * weights[lo:lo + 128]).sum(dim=1)
    return key


def column_groups(n_pos: int, n_neg: int, n_noise: int, n_anchor: int, device) -> torch.Tensor:
    """Each candidate column's group (the batch row it belongs to; −1 for noise and for
    negatives when K is not a multiple of N_b), as int64 (M,)."""
    parts = [torch.arange(n_pos, device=device)]
    if n_neg:
        parts.append(torch.arange(n_neg, device=device) % n_pos if n_neg % n_pos == 0
                     else torch.full((n_neg,), -1, device=device, dtype=torch.long))
    parts.append(torch.full((n_noise,), -1, device=device, dtype=torch.long))
    parts.append(torch.arange(n_anchor, device=device))
    return torch.cat(parts)


def column_blocks(n_pos: int, n_neg: int, n_noise: int, n_anchor: int, device) -> torch.Tensor:
    """Each candidate column's block, int8 (M,): 0 positives, 1 negatives, 2 noise, 3 anchors."""
    return torch.cat([torch.full((size,), b, dtype=torch.int8, device=device)
                      for b, size in enumerate((n_pos, n_neg, n_noise, n_anchor))])


def visible_blocks(layout: Layout, side: int) -> tuple[int, ...]:
    """The blocks a side scores: side 0 the anchor side, 1 the positive side."""
    if side == 0:
        return (0, 1, 2) + ((3,) if layout.anchor_to_anchors else ())
    return tuple(b for b, on in ((0, layout.positive_to_positives), (1, layout.positive_to_negatives),
                                 (3, layout.positive_to_anchors)) if on)


def hardness_columns(mode: str, block: torch.Tensor, group: torch.Tensor,
                     own_group: torch.Tensor, positive_col: torch.Tensor) -> torch.Tensor:
    """Where MNRL's hardness term ``β·sg(s)`` applies on the anchor side, (R×M) bool for rows
    whose group is ``own_group`` (R,) and positive column ``positive_col`` (R,):
    ``in_batch_negatives``, every document (positives and negatives blocks) of another
    group; ``hard_negatives``, the row's own negatives; ``all_negatives``, every document but
    the positive."""
    document = (block <= 1)[None, :]
    own = group[None, :] == own_group[:, None]
    if mode == "in_batch_negatives":
        return document & ~own
    if mode == "hard_negatives":
        return (block == 1)[None, :] & own
    cols = torch.arange(block.shape[0], device=block.device)
    return document & (cols[None, :] != positive_col[:, None])
