"""One loss specification: every option of :func:`fastcl.contrastive`, checked once.

:func:`build_spec` holds every default and every rule between options; every public loss
is ``spec = build_spec(...)`` and one dispatch. A :class:`LossSpec` is a frozen record of
small records, each ``None`` when its feature is off (one encoding for "off"):

* :class:`Logits` — ``l = s/τ``, focal ``s²/τ`` / ``s(s+m)/τ``, the hard negative's ``+w``;
* :class:`Mask` — DCLR's ``α_ij = 1[cos(c_i, c⁺_j) < φ]`` (``reverse``: also transposed on
  the positive side, as ``symmetric`` has it);
* :class:`Noise` — DCLR's noise negatives (the count, the start, the update's settings);
* :class:`Rules` — :mod:`fastcl.layout`'s layout, anchor candidates and MNRL's hardness
  (``symmetric=True`` is the layout :data:`SYMMETRIC`);
* :class:`Guide`, ``ids`` — GISTEmbedLoss's filter and duplicate masking;
* :class:`Matryoshka` — the prefix widths and their weights;
* ``false_negative_margin`` — drop ``j`` where the loss's own ``s_ij > s_{i,p(i)} + m``;
* ``positive_prior`` — Chuang et al.'s debiased negatives' sum, ``τ⁺`` per row.
* :class:`Soft` — soft targets: label smoothing and SupCon's labels.

:class:`Epilogue` is the spec as one engine call sees it (the chunk epilogue's fields: the
kernels read these names) and encodes itself to and from the custom op's arguments
(:meth:`Epilogue.op_args`, :meth:`Epilogue.from_op_args`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import _validation as check
from . import common, layout
from .layout import PLAIN, Layout

#: ``symmetric=True``: the positive also scores the anchors, each direction its own softmax
#: (``directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"``).
SYMMETRIC = Layout(positive_to_anchors=True, exclude_own=True, joint=False)


@dataclass(frozen=True)
class Logits:
    temperature: float | None             # τ's value (a learnable τ's, read once at the build;
    #                                        None while traced: the custom op reads it)
    focal_m: float | None = None          # None: no focal modulation
    hard_negative_weight: float = 0.0     # log-weight at column N_b + p(i)
    learnable: torch.Tensor | None = None  # τ as a 0-dim tensor that requires grad, or None

    @property
    def tau(self):
        """τ as the reference's logits divide by it: the learnable tensor, else the number."""
        return self.temperature if self.learnable is None else self.learnable


@dataclass(frozen=True)
class Mask:
    complementary: tuple[torch.Tensor, torch.Tensor]   # (c, c⁺), detached
    phi: float
    reverse: bool = False                 # the transposed mask on the positive side too


@dataclass(frozen=True)
class Noise:
    count: int                            # K_z rows
    start: torch.Tensor | None            # the given start (fixes K_z), or None: drawn
    steps: int
    lr: float
    std: float
    temperature: float
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class Rules:
    layout: Layout = PLAIN
    anchor_candidates: torch.Tensor | None = None
    hardness: tuple[str, float] | None = None          # MNRL's (mode, β), β > 0
    own_anchors: bool = True     # the anchors block is the anchors themselves (none was given)


@dataclass(frozen=True)
class Guide:
    embeddings: tuple                     # (g_anchors, g_positives, g_negatives, g_anchor_cands)
    margin: float = 0.0
    strategy: str = "absolute"


@dataclass(frozen=True)
class Soft:
    """Soft targets: row i's loss is ``−Σ_j y_ij log p_ij`` over its kept candidates K_i
    (those in its softmax), ``y_ij = (1−ε)·1[j ∈ P_i]/|P_i| + ε·1[j ∈ K_i]/|K_i|``; ``P_i``
    the positive alone, or with ``labels`` the kept columns of the positives block whose
    row has the anchor's label. ``teacher``: ``y ← (1−λ)·y + λ·q``, q the teacher's softmax
    ``cos(t_i, t_j)/τ_t`` over the row's kept columns of the positives and negatives blocks."""

    label_smoothing: float = 0.0          # ε ∈ [0, 1)
    labels: torch.Tensor | None = None    # (N_b,) int64, one per batch row
    teacher: tuple | None = None          # (t_anchors (N×d_t), t_candidates (N_b+K × d_t)), detached
    teacher_temperature: float = common.TEMPERATURE   # τ_t
    distill_weight: float = 0.0           # λ ∈ [0, 1]


class Matryoshka(NamedTuple):
    dims: tuple[int, ...]                 # d_1 < … < d_K
    weights: tuple[float, ...]

    def prefixes(self, *xs) -> list:
        """``(w_k, [x[:, :d_k] for x in xs])`` for every width (None stays None)."""
        return [(w, [None if x is None else x[:, :d] for x in xs]) for d, w in zip(*self)]


@dataclass(frozen=True)
class LossSpec:
    """Everything :func:`fastcl.contrastive` computes, checked (:func:`build_spec`)."""

    logits: Logits
    mask: Mask | None = None
    noise: Noise | None = None
    rules: Rules | None = None            # None: plain InfoNCE's layout, no hardness
    guide: Guide | None = None
    ids: tuple | None = None              # (positive_ids, negative_ids, anchor_ids), int64
    matryoshka: Matryoshka | None = None
    formulation: str = "paper"
    anchor_offset: int = 0
    chunk_size: int | None = None
    backend: str = "tiled"                # resolved: "reference", "tiled" or "triton"
    false_negative_margin: float | None = None   # m: drop s_ij > s_{i,p(i)} + m (never p(i))
    positive_prior: torch.Tensor | None = None   # τ⁺ of each anchor row (N,), accumulate dtype

    soft: Soft | None = None              # None: the one-hot target on the positive

    def row_fields(self) -> dict:
        """The :class:`Epilogue` fields every direction of this spec shares (the reverse
        direction of ``symmetric`` too): how a row forms its logits and drops, and the chunking."""
        soft = {} if self.soft is None else dict(label_smoothing=self.soft.label_smoothing,
                                                  labels=self.soft.labels)
        return dict(temperature=self.logits.temperature, focal_m=self.logits.focal_m,
                    chunk_size=self.chunk_size, false_negative_margin=self.false_negative_margin,
                    positive_prior=self.positive_prior, **soft)

    @property
    def anchor_candidates(self) -> torch.Tensor | None:
        return None if self.rules is None else self.rules.anchor_candidates

    @property
    def layout(self) -> Layout:
        return PLAIN if self.rules is None else self.rules.layout

    @property
    def ruled(self) -> bool:
        """Whether a row may score more than the candidates or drop some (any rule of
        :mod:`fastcl.layout`)."""
        return self.rules is not None or self.guide is not None or self.ids is not None

    @property
    def two_directions(self) -> bool:
        """Whether the loss is ``½(L^→ + L^←)`` of two plain directions: the positive side
        scores only the anchors and has its own softmax, and no guide, ids or hardness
        (``symmetric``; ``per_direction`` with ``doc_to_query``), over the anchors
        themselves: given ``anchor_candidates`` (another process's too), the positive side's
        own anchor need not be the candidates' row ``anchor_offset + i``, and the rows go
        through the layout's path. The fused paths then run the two directions, not 2N rows
        against every block."""
        lay = self.layout
        return (self.rules is not None and self.rules.hardness is None and self.guide is None
                and self.ids is None and not lay.joint and not lay.anchor_to_anchors
                and lay.positive_to_anchors and not lay.positive_to_positives
                and not lay.positive_to_negatives and self.rules.own_anchors)


@dataclass(frozen=True)
class Epilogue:
    """How a chunk of cosines becomes logits and a loss: a :class:`LossSpec` as one engine
    call sees it. Candidates are laid out as ``[positives (N rows); other candidates]``;
    anchor i's positive is column ``anchor_offset + i``."""

    temperature: float
    focal_m: float | None = None           # focal modulation on
    hard_negative_weight: float = 0.0      # log-weight added at column N + i
    phi: float | None = None               # DCLR mask threshold (read with `complementary`)
    complementary: tuple[torch.Tensor, torch.Tensor] | None = None   # None: no mask
    formulation: str = "paper"             # "paper" (cross-entropy) or "released" (DCLR's BCE)
    positives: bool = True                 # False: no column is a positive (DCLR's noise loss)
    anchor_offset: int = 0                 # anchors are rows [offset, offset+N) of a larger batch
    chunk_size: int | None = None
    memory_budget: int | None = None       # bytes; None: the device's default budget
    # The rules of fastcl.layout. With a positive side the anchors handed to the driver are
    # 2N rows, [anchors; their own positives]: rows i and N + i are the two sides of row i.
    layout: Layout | None = None                     # None: fastcl.layout.PLAIN
    blocks: tuple[int, int, int, int] | None = None  # (N_b, K, K_z, N_a): the column blocks
    hardness: tuple[str, float] | None = None        # MNRL's (hardness_mode, hardness_strength)
    guide: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #      (guide unit rows of the 2N (or N) anchor rows, of the M columns, θ (N,)), float32+
    #      (for the Triton engine the unit rows in the GEMM dtype, cast once a call)
    ids: tuple[torch.Tensor, torch.Tensor] | None = None  # (column text ids (M,), row keys (N,))
    matryoshka: Matryoshka | None = None   # the loss Σ_k w_k·L(x[:, :d_k]) in one pass
    # drop column j of row i where s_ij > s_{i,p(i)} + m, from the chunk's own cosines; never
    # the positive (a positive-side row: its own anchor), its threshold row i's
    false_negative_margin: float | None = None
    # Chuang et al.'s debiased sum of the row's others: τ⁺ of each of the call's N anchor rows
    positive_prior: torch.Tensor | None = None
    label_smoothing: float = 0.0           # soft targets (fastcl.spec.Soft): ε
    labels: torch.Tensor | None = None     # (N_b,) int64: SupCon's positives by label
    teacher: tuple | None = None           # (unit rows of the N anchors, of the N_b+K documents)
    teacher_temperature: float = common.TEMPERATURE
    distill_weight: float = 0.0

    @property
    def soft(self) -> bool:
        """Whether the target is more than the one-hot positive (:class:`Soft`)."""
        return bool(self.label_smoothing) or self.labels is not None or self.teacher is not None

    @property
    def paired(self) -> bool:
        """Whether the anchors are ``[anchors; positives]``, two sides per row."""
        return self.layout is not None and self.layout.positive_side

    @property
    def sided(self) -> bool:
        """Whether the chunk needs the layout's drops (any rule of :mod:`fastcl.layout`)."""
        return not ((self.layout or PLAIN).plain and self.hardness is None and self.guide is None
                    and self.ids is None)

    #: The custom op's arguments (``fastcl::tiled_contrastive``: anchors and candidates
    #: before, the engine and the call's flags after), a schema type a field: its schema has
    #: no records, optionals of lists or nested types, so a tuple of tensors travels as a
    #: list (empty: None) and the layout, blocks, widths and hardness as :data:`_CODECS`
    #: write them. A new field is one entry here.
    _OP = (("complementary", "Tensor[]"), ("temperature", "float?"), ("focal_m", "float?"),
           ("hard_negative_weight", "float"), ("phi", "float?"), ("formulation", "str"),
           ("anchor_offset", "SymInt"), ("chunk_size", "SymInt?"), ("matryoshka", "str"),
           ("layout", "SymInt"), ("blocks", "SymInt[]"), ("hardness", "str"), ("guide", "Tensor[]"),
           ("ids", "Tensor[]"), ("false_negative_margin", "float?"), ("positive_prior", "Tensor?"),
           ("label_smoothing", "float"), ("labels", "Tensor?"), ("teacher", "Tensor[]"),
           ("teacher_temperature", "float"), ("distill_weight", "float"))
    OP_SCHEMA = ", ".join(f"{kind} {name}" for name, kind in _OP)

    def op_args(self) -> tuple:
        """The fields as the op's arguments (:data:`_OP`)."""
        return tuple(_codec(name, kind)[0](getattr(self, name)) for name, kind in self._OP)

    @classmethod
    def from_op_args(cls, *args) -> "Epilogue":
        """The epilogue :meth:`op_args` wrote."""
        return cls(**{name: _codec(name, kind)[1](x) for (name, kind), x in zip(cls._OP, args)})


#: The fields of a :class:`~fastcl.layout.Layout`, a bit each in the op's ``layout``.
_LAYOUT_FIELDS = tuple(field.name for field in dataclasses.fields(Layout))


def bits(mask: int, count: int) -> list[bool]:
    return [bool(mask >> i & 1) for i in range(count)]


def _pairs(text: str, first=str) -> list[tuple]:
    """``"a:x,b:y"`` as ``[(first(a), float(x)), …]``."""
    return [(first(a), float(b)) for a, _, b in (item.partition(":") for item in text.split(","))]


#: How the fields that are not schema types travel: ``(to the op, from the op)``.
_CODECS = {
    "matryoshka": (lambda m: "" if m is None else ",".join(f"{d}:{float(w)!r}" for d, w in zip(*m)),
                   lambda t: Matryoshka(*map(tuple, zip(*_pairs(t, int)))) if t else None),
    "layout": (lambda lay: -1 if lay is None else sum(1 << i for i, name in enumerate(_LAYOUT_FIELDS)
                                                      if getattr(lay, name)),
               lambda v: None if v < 0 else Layout(**dict(zip(_LAYOUT_FIELDS, bits(v, len(_LAYOUT_FIELDS)))))),
    "blocks": (lambda b: list(b or (0, 0, 0, 0)), lambda b: tuple(b) if any(b) else None),
    "hardness": (lambda h: "" if h is None else f"{h[0]}:{float(h[1])!r}",
                 lambda t: _pairs(t)[0] if t else None),
}
_TENSORS = (lambda x: list(x or ()), lambda x: tuple(x) if x else None)
_SAME = (lambda x: x, lambda x: x)


def _codec(name: str, kind: str) -> tuple:
    return _CODECS.get(name) or (_TENSORS if kind == "Tensor[]" else _SAME)


# --------------------------------------------------------------------------- build_spec

def build_spec(anchors, positives, negatives=None, *, temperature=common.TEMPERATURE,
               focal_m=None, hard_negative_weight=0.0, complementary=None, phi=common.PHI,
               noise=None, noise_ratio=0.0, noise_steps=common.NOISE_STEPS,
               noise_lr=common.NOISE_LR, noise_std=common.NOISE_STD, noise_temperature=None,
               generator=None, formulation="paper", symmetric=False, anchor_offset=None,
               directions=("query_to_doc",), partition_mode="joint", hardness_mode=None,
               hardness_strength=0.0, anchor_candidates=None, guide=None, guide_margin=0.0,
               margin_strategy="absolute", duplicate_ids=None, matryoshka_dims=None,
               matryoshka_weights=None, false_negative_margin=None, positive_prior=None,
               label_smoothing=0.0, labels=None, teacher=None, teacher_temperature=None,
               distill_weight=0.5, backend="auto", chunk_size=None, focal_name="focal_m"):
    """Check :func:`fastcl.contrastive`'s arguments (every default and cross-field rule) and
    return ``(spec, anchors, positives, negatives)``, the embeddings checked (rows too large
    to square rescaled). Errors name the argument (``focal_name``: ``focal_m``'s name in
    the caller). The scan of the inputs is queued, not read (:func:`fastcl._validation.read_inputs`)."""
    anchors, positives, anchor_offset = inputs(anchors, positives, anchor_offset)
    negatives = None if negatives is None else check.embeddings(
        "negatives", negatives, width=anchors.shape[1], like=anchors, allow_empty=True,
        scale_free=True)
    n, n_pos = anchors.shape[0], positives.shape[0]
    focal_m = None if focal_m is None else check.finite(focal_name, focal_m)
    hard_negative_weight = check.finite("hard_negative_weight", hard_negative_weight)
    temperature, learnable = check.learnable("temperature", temperature)
    if temperature is not None:       # None: a learnable τ being traced (the op reads it)
        temperature = check.temperature(temperature, anchors.dtype, focal_m=focal_m,
                                        hard_negative_weight=hard_negative_weight)
    if hard_negative_weight and (negatives is None or negatives.shape[0] != n_pos):
        got = "no negatives" if negatives is None else f"{negatives.shape[0]} negatives"
        raise ValueError(f"hard_negative_weight needs one hard negative per anchor "
                         f"({n_pos} negatives), got {got}")
    if complementary is not None:       # the frozen model's (c_anchors, c_positives)
        complementary = _frozen("complementary", complementary, ("anchors", "positives"),
                                (n, n_pos), anchors.device,
                                shape="a pair (c_anchors, c_positives) or None")
    phi = check.phi(phi)
    noise_ratio = check.within("noise_ratio", noise_ratio, 0.0)
    formulation = check.choice("formulation", formulation, check.FORMULATIONS)
    if false_negative_margin is not None:
        false_negative_margin = check.finite("false_negative_margin", false_negative_margin)
    symmetric = check.flag("symmetric", symmetric)
    if symmetric and n_pos != n:
        raise ValueError("symmetric=True needs every anchor of the batch in this call "
                         "(no anchor_offset slice)")
    rules, guide_spec, ids = _rules(anchors, positives, negatives, anchor_offset, directions,
                                    partition_mode, hardness_mode, hardness_strength,
                                    anchor_candidates, guide, guide_margin, margin_strategy,
                                    duplicate_ids)
    ruled = rules is not None or guide_spec is not None or ids is not None
    label_smoothing = check.within("label_smoothing", label_smoothing, 0.0, 1.0)
    extra = [name for name, on in (
        ("focal_m", focal_m is not None), ("negatives", negatives is not None),
        ("hard_negative_weight", bool(hard_negative_weight)), ("symmetric", symmetric),
        ("false_negative_margin", false_negative_margin is not None),
        ("positive_prior", positive_prior is not None),
        ("directions, hardness_mode, guide or duplicate_ids", ruled),
        ("matryoshka_dims", matryoshka_dims is not None),
        ("label_smoothing", label_smoothing != 0),
        ("labels", labels is not None), ("teacher", teacher is not None)) if on]
    if formulation == "released" and extra:
        raise ValueError(f"formulation='released' is DCLR as the authors' code computes it and "
                         f"combines with complementary, phi and the noise options only; got "
                         f"{', '.join(extra)} as well: use formulation='paper' to combine them")
    if symmetric and ruled:
        raise ValueError("symmetric cannot be combined with directions, hardness_mode, guide or "
                         "duplicate_ids (symmetric=True is directions=('query_to_doc', "
                         "'doc_to_query'), partition_mode='per_direction')")
    if symmetric:
        rules = Rules(SYMMETRIC, anchors)
    prior = _positive_prior(positive_prior, n, anchors)
    if prior is not None and rules is not None and rules.layout.positive_side and not rules.layout.joint:
        raise ValueError("positive_prior debiases a row's one softmax: not with symmetric=True or "
                         "partition_mode='per_direction' (two softmaxes a row)")
    widths = matryoshka(matryoshka_dims, matryoshka_weights, anchors.shape[1])
    count = noise.shape[0] if noise is not None else common.noise_count(noise_ratio, n_pos, formulation)
    noisy = noise is not None or count > 0
    if widths is not None and noisy:
        raise ValueError("matryoshka_dims does not combine with noise")
    # τ's value, the noise's and the teacher's default: a traced learnable τ is read here
    # only where one of them needs it (a graph break), else the default stands in, unused
    tau = temperature if temperature is not None else (
        float(learnable.detach()) if noisy or teacher is not None else common.TEMPERATURE)
    noise_temperature = tau if noise_temperature is None else noise_temperature
    noise_spec = noise_settings(anchors, None if noise is not None else count, noise_steps,
                                noise_lr, noise_std, noise_temperature, noise, generator)
    soft = _soft(label_smoothing, labels, teacher,
                 tau if teacher_temperature is None else teacher_temperature, distill_weight,
                 (n, n_pos, 0 if negatives is None else negatives.shape[0]), anchors)
    if soft is not None and prior is not None:
        raise ValueError("positive_prior cannot be combined with label_smoothing, labels or "
                         "teacher: the debiased loss has no target distribution")
    spec = LossSpec(
        Logits(temperature, focal_m, hard_negative_weight, learnable),
        mask=None if complementary is None else Mask(complementary, phi, reverse=symmetric),
        noise=noise_spec if noisy else None, rules=rules,
        guide=guide_spec, ids=ids, matryoshka=widths, formulation=formulation,
        anchor_offset=anchor_offset, chunk_size=check.chunk_size(chunk_size),
        false_negative_margin=false_negative_margin, positive_prior=prior, soft=soft)
    if soft is not None and soft.teacher is not None and spec.layout.positive_side:
        raise ValueError("teacher cannot be combined with a positive side (symmetric, "
                         "'doc_to_query', 'doc_to_doc', GIST's positive-positive block) yet: the "
                         "teacher scores the anchor's row only")
    if soft is not None and spec.layout.positive_side and not spec.two_directions:
        names = " and ".join(n for n, on in (("label_smoothing", soft.label_smoothing),
                                             ("labels", soft.labels is not None)) if on)
        raise ValueError(f"{names} cannot be combined with a positive side that shares the "
                         "anchor's softmax or its rules ('doc_to_doc', partition_mode='joint' "
                         "with 'doc_to_query', GIST's positive-positive block, or "
                         "'doc_to_query' with a guide, duplicate_ids or hardness_mode) yet; "
                         "symmetric=True and per_direction 'doc_to_query' take them")
    return _with_backend(spec, backend, anchors), anchors, positives, negatives


def escl_options(weight, rd, margins) -> tuple:
    """ESCL's ``(weight, rd, margins)`` checked (:func:`fastcl.escl_loss`)."""
    weight = check.finite("weight", weight)
    rd = check.choice("rd", rd, ("softplus", "margin"))
    if not isinstance(margins, (tuple, list)) or len(margins) != 2:
        raise ValueError(f"margins must be a pair (a, b), got {margins!r}")
    return weight, rd, (check.finite("margins[0]", margins[0]), check.finite("margins[1]", margins[1]))


def _positive_prior(value, n: int, anchors) -> torch.Tensor | None:
    """``positive_prior`` checked: a float in [0, 1) or a floating (N,) tensor of such values
    on the anchors' device (its range read once, a host read); returned as (N,) in the
    anchors' accumulate dtype, detached (a class prior, not a parameter), or None."""
    if value is None:
        return None
    acc = common.accumulate_dtype(anchors.dtype)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        tau = check.within("positive_prior (τ⁺, a class prior)",
                           value.item() if isinstance(value, torch.Tensor) else value, 0.0, 1.0)
        return torch.full((n,), tau, dtype=acc, device=anchors.device)
    if not value.is_floating_point():
        raise TypeError(f"positive_prior must be a float or a floating tensor, got {value.dtype}")
    if value.shape != (n,):
        raise ValueError(f"positive_prior must be a float or have shape ({n},) (one τ⁺ per "
                         f"anchor), got {tuple(value.shape)}")
    if value.device != anchors.device:
        raise ValueError(f"positive_prior is on {value.device} but anchors are on {anchors.device}")
    if not torch.compiler.is_compiling():
        low, high = torch.aminmax(value.detach()) if n else (torch.zeros(()), torch.zeros(()))
        low, high = torch.stack([low, high]).tolist()
        if not (0.0 <= low and high < 1.0):
            raise ValueError(f"positive_prior (τ⁺, a class prior) must lie in [0, 1), got values "
                             f"in [{low}, {high}]")
    return value.detach().to(acc)


def _soft(eps, labels, teacher, teacher_temperature, distill_weight, rows, anchors) -> Soft | None:
    """The soft targets checked: a :class:`Soft`, or None when all are off. ``eps``:
    ``label_smoothing``, checked; ``labels``: one integer per batch row; ``teacher=(t_anchors,
    t_candidates)``: N and N_b + K rows of one width (the anchors', the positives' and
    negatives' teacher embeddings); ``distill_weight``: λ ∈ [0, 1]. ``rows``: (N, N_b, K)."""
    n, n_pos, n_neg = rows
    if labels is not None:
        labels = check.ids("labels", labels, n_pos, anchors.device)     # one per batch row
    if teacher is None:
        return None if not eps and labels is None else Soft(eps, labels)
    teacher = _frozen("teacher", teacher, ("anchors", "candidates"), (n, n_pos + n_neg),
                      anchors.device)
    tau = check.temperature(teacher_temperature, anchors.dtype, name="teacher_temperature")
    weight = check.within("distill_weight", distill_weight, 0.0, 1.0, closed=True)
    return Soft(eps, labels, teacher, tau, weight)


def inputs(anchors, positives, anchor_offset=None):
    """Anchors (N×d) and positives: N rows, or — with ``anchor_offset`` — the whole batch the
    anchors are rows ``[anchor_offset, anchor_offset + N)`` of. Returns the offset as an int."""
    anchors = check.embeddings("anchors", anchors, scale_free=True)
    positives = check.embeddings("positives", positives, rows=None if anchor_offset is not None
                                 else anchors.shape[0], width=anchors.shape[1], like=anchors,
                                 scale_free=True)
    if anchor_offset is None:
        return anchors, positives, 0
    anchor_offset = check.non_negative_int("anchor_offset", anchor_offset)
    if positives.shape[0] < anchor_offset + anchors.shape[0]:
        raise ValueError(
            f"positives has {positives.shape[0]} rows but anchor_offset={anchor_offset} with "
            f"{anchors.shape[0]} anchors needs at least {anchor_offset + anchors.shape[0]}")
    return anchors, positives, anchor_offset


def noise_settings(anchors, num, steps, lr, std, temperature, noise, generator=None,
                   prefix="noise_") -> Noise:
    """DCLR's noise update checked (the arguments named ``prefix + "steps"`` etc. in the
    caller); ``num`` None when ``noise`` gives the rows."""
    steps = check.non_negative_int(prefix + "steps", steps)
    lr = check.finite(prefix + "lr", lr)
    std = check.positive(prefix + "std", std)
    temperature = check.temperature(temperature, anchors.dtype, name=prefix + "temperature")
    if noise is not None:
        noise = check.embeddings("noise", noise, width=anchors.shape[1], allow_empty=True,
                                 device=anchors.device)
        if num is not None and noise.shape[0] != num:
            raise ValueError(f"noise has {noise.shape[0]} rows but num={num}")
        num = noise.shape[0]
    else:
        num = check.non_negative_int("num", num)
    return Noise(num, noise, steps, lr, std, temperature,
                 check.generator(generator, anchors.device))


def matryoshka(dims, weights, d) -> Matryoshka | None:
    """``matryoshka_dims`` and ``matryoshka_weights`` checked, sorted by width, or None when
    ``dims`` is None (``d``: the embeddings' width)."""
    if dims is None:
        if weights is not None:
            raise ValueError("matryoshka_weights needs matryoshka_dims")
        return None
    if isinstance(dims, (int, str)) or not len(dims):
        raise TypeError(f"matryoshka_dims must be a non-empty sequence of widths, got {dims!r}")
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in dims):
        raise ValueError(f"matryoshka_dims must be positive integers, got {list(dims)}")
    dims = list(dims)
    if max(dims) > d:
        raise ValueError(f"matryoshka_dims must lie in [1, {d}] (the embeddings' width), got {dims}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"matryoshka_dims has a width twice: {dims}")
    weights = [1.0] * len(dims) if weights is None else [check.finite("matryoshka_weights", w)
                                                          for w in weights]
    if len(weights) != len(dims):
        raise ValueError(f"matryoshka_weights has {len(weights)} entries for {len(dims)} widths")
    pairs = sorted(zip(dims, weights))
    return Matryoshka(tuple(x for x, _ in pairs), tuple(w for _, w in pairs))


def _rules(anchors, positives, negatives, anchor_offset, directions, partition_mode,
           hardness_mode, hardness_strength, anchor_candidates, guide, guide_margin,
           margin_strategy, duplicate_ids):
    """The options of :mod:`fastcl.layout` checked: ``(Rules or None, Guide or None, ids or
    None)``, all None when none is on. (A row count is compared with 0 here, never tested
    for truth: torch.compile before torch 2.6 fixes a traced batch size at ``if n``.)"""
    # checked whatever else is given (a strategy or margin without a guide is a mistake too)
    check.choice("margin_strategy", margin_strategy, layout.MARGIN_STRATEGIES)
    if (layout.names_plain(directions, partition_mode) and hardness_mode is None
            and guide is None and duplicate_ids is None and anchor_candidates is None):
        return None, None, None   # the plain layout, decided without building one (torch.compile)
    n, n_pos = anchors.shape[0], positives.shape[0]
    n_neg = 0 if negatives is None else negatives.shape[0]
    if isinstance(directions, Layout):
        if partition_mode != "joint":
            raise ValueError("partition_mode goes with directions given by name; a Layout says "
                             "its own (Layout.joint)")
        lay = directions
    else:
        lay = layout.from_directions(directions, partition_mode)
    if hardness_mode is not None:
        check.choice("hardness_mode", hardness_mode, layout.HARDNESS_MODES)
    hardness_strength = check.within("hardness_strength", hardness_strength, 0.0)
    guide_margin = check.finite("guide_margin", guide_margin)
    grouped = (hardness_mode is not None and hardness_strength) or (
        lay.positive_to_negatives and lay.exclude_own)
    if grouped and n_neg % n_pos:
        raise ValueError(f"hardness_mode and 'doc_to_doc' need the negatives as whole columns "
                         f"(a multiple of the {n_pos} positives, row j of each belonging to "
                         f"anchor j), got {n_neg} negatives")
    own_anchors = anchor_candidates is None
    if lay.scores_anchors:
        if anchor_candidates is None:
            if n != n_pos:
                raise ValueError("directions that score the anchors need anchor_candidates (the "
                                 "whole batch's anchors) when anchor_offset is given")
            anchor_candidates = anchors
        else:
            anchor_candidates = check.embeddings("anchor_candidates", anchor_candidates,
                                                 width=anchors.shape[1], like=anchors,
                                                 scale_free=True)
            if anchor_candidates.shape[0] not in (n, n_pos):
                raise ValueError(f"anchor_candidates has {anchor_candidates.shape[0]} rows: it "
                                 f"holds the whole batch's anchors ({n_pos}) or these anchors ({n})")
    elif anchor_candidates is not None:
        raise ValueError("anchor_candidates is read only with directions that score the "
                         "anchors ('query_to_query', 'doc_to_query')")
    n_a = 0 if anchor_candidates is None or not lay.scores_anchors else anchor_candidates.shape[0]
    if guide is not None:
        # (g_anchors, g_positives, g_negatives, g_anchor_candidates): the last two may be left
        # out or None where there are no negatives or no anchors block (the anchors block's
        # default: g_anchors, when those are its rows)
        guide = Guide(_frozen("guide", guide, ("anchors", "positives", "negatives",
                                               "anchor candidates"), (n, n_pos, n_neg, n_a),
                              anchors.device, fill={3: 0} if n_a == n else None),
                      guide_margin, margin_strategy)
    if duplicate_ids is not None:   # (positive_ids, negative_ids, anchor_ids): an id a candidate row
        duplicate_ids = _per_block("duplicate_ids", duplicate_ids, ("positives", "negatives",
                                                                    "anchor candidates"),
                                   (n_pos, n_neg, n_a),
                                   lambda name, x, rows, _: check.ids(name, x, rows, anchors.device))
    hardness = (hardness_mode, hardness_strength) if hardness_mode is not None and hardness_strength else None
    rules = None
    if not lay.plain or hardness is not None:
        rules = Rules(lay, anchor_candidates if n_a > 0 else None, hardness, own_anchors)
    return rules, guide, duplicate_ids


def _frozen(arg, value, blocks, rows, device, fill=None, shape=None):
    """A frozen model's embeddings (``complementary``, ``guide``, ``teacher``): a tuple of a
    matrix a block (:func:`_per_block`, the first two required), each of the first's width
    and dtype, returned detached."""

    def part(name, x, rows, done):
        x = check.embeddings(name, x, rows=rows, width=done[0].shape[1] if done else None,
                             scale_free=True, device=device)
        if done and x.dtype != done[0].dtype:
            raise TypeError(f"{name} is {x.dtype} but {arg}[0] is {done[0].dtype}")
        return x.detach()
    return _per_block(arg, value, blocks, rows, part, least=2, fill=fill, shape=shape)


def _per_block(arg, value, blocks, rows, part, least=1, fill=None, shape=None):
    """``arg``: a tuple of one tensor a block (``blocks``, of ``rows`` rows each; ``shape``:
    how the error calls the tuple, and the parts are then named by index alone), the last
    ones optional (None or left out) where a block has no rows or ``fill`` names the part
    that stands in; each checked by ``part(name, x, rows, the parts before)``, None where its
    block has no rows."""
    if not isinstance(value, (tuple, list)) or not least <= len(value) <= len(blocks):
        names = ", ".join(blocks[:least]) + "".join(f"[, {b}" for b in blocks[least:])
        shape = shape or f"a tuple ({names}{']' * (len(blocks) - least)}) of tensors"
        raise TypeError(f"{arg} must be {shape}")
    out = []
    for i, (block, x, want) in enumerate(zip(blocks, (*value, None, None, None), rows)):
        name = f"{arg}[{i}]" + ("" if shape else f" ({block})")
        x = value[fill[i]] if x is None and i in (fill or {}) else x
        if x is None and want > 0:
            raise ValueError(f"{name} is missing: {arg} holds a block of {want} rows here")
        x = None if x is None else part(name, x, want, out)
        out.append(x if want > 0 else None)
    return tuple(out)


# --------------------------------------------------------------------------- the backend

#: Looked up once, at import: torch.compile before torch 2.6 breaks the graph at a call of
#: ``find_spec``, even through a cache.
def _triton_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


_TRITON_INSTALLED = _triton_installed()


def triton_problem(x: torch.Tensor) -> str | None:
    """Why the Triton backend cannot take ``x`` (None if it can)."""
    import os
    if not _TRITON_INSTALLED:
        return "the triton package is not installed (pip install 'fastcl[triton]')"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the kernels take float32, float16 or bfloat16 embeddings, not {x.dtype}"
    if x.is_meta:
        return "the embeddings are meta tensors, which hold no data for a kernel to read"
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return ("the embeddings are on the CPU: the kernels need CUDA tensors, or "
                "TRITON_INTERPRET=1 (set before fastcl.kernels is imported) to run them in "
                "Triton's interpreter")
    return None


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """The backend a loss call with ``backend`` runs on for embeddings like ``x``: the
    rule of ``"auto"`` (Triton for CUDA tensors it can take, tiled otherwise), and a clear
    error when ``"triton"`` cannot run."""
    check.choice("backend", backend, check.BACKENDS)
    if backend == "triton":
        problem = triton_problem(x)
        if problem:
            raise ValueError(f"backend='triton' cannot run here: {problem}; use backend='tiled'")
    elif backend == "auto":
        backend = "triton" if x.is_cuda and triton_problem(x) is None else "tiled"
    return backend


#: The options the Triton kernels compute ``positive_prior`` beside (their flag sets are
#: ``kernels.configs.VARIANTS``' ``*-prior``).
TRITON_PRIOR = {frozenset(x) for x in ((), ("focal",), ("hard",), ("mask",), ("margin",),
                                       ("focal", "margin"), ("hard", "margin"), ("mask", "margin"),
                                       ("rules",), ("rules", "guide"), ("rules", "margin"),
                                       ("rules", "guide", "margin"))}


def _triton_refusal(spec: LossSpec) -> str | None:
    """Why the Triton kernels do not compute ``spec`` (None where they do), as the rest of
    "backend='triton' …": the debiased loss only with a row's one softmax and the flag sets
    the compile check builds with it; no teacher beside the guide or DCLR's mask (the
    teacher's cosines take their slots in the similarity kernel: a pair of its own would pass
    the kernel's 40 parameters); no layout's rules beside a hard-negative weight or DCLR's
    mask (two plain directions take both)."""
    logits = spec.logits
    if spec.positive_prior is not None:
        on = frozenset(name for name, value in (
            ("focal", logits.focal_m is not None), ("hard", bool(logits.hard_negative_weight)),
            ("mask", spec.mask is not None), ("rules", spec.ruled), ("guide", spec.guide is not None),
            ("margin", spec.false_negative_margin is not None)) if value)
        if spec.layout.positive_side or on not in TRITON_PRIOR:
            return ("computes positive_prior without a positive side (directions 'query_to_doc', "
                    "'query_to_query') and beside at most one of focal_m, hard_negative_weight, "
                    "complementary, directions/ids (with or without guide), each with or without "
                    "false_negative_margin")
    if spec.soft is not None and spec.soft.teacher is not None and (
            spec.guide is not None or spec.mask is not None):
        return "does not compute teacher beside guide or complementary (DCLR's mask)"
    lacking = [name for name, on in (
        ("hard_negative_weight", bool(logits.hard_negative_weight)),
        ("complementary (DCLR's mask)", spec.mask is not None)) if on]
    if spec.ruled and not spec.two_directions and lacking:
        return (f"does not compute {' or '.join(lacking)} beside directions beyond "
                "('query_to_doc',), hardness_mode, guide or duplicate_ids yet")
    return None


def _with_backend(spec: LossSpec, backend, anchors) -> LossSpec:
    """``spec`` on its resolved backend: where the Triton kernels do not compute it
    (:func:`_triton_refusal`) ``"auto"`` takes the tiled path and ``"triton"`` is refused
    with the reason."""
    be = resolve_backend(backend, anchors)
    refusal = _triton_refusal(spec) if be == "triton" else None
    if refusal is not None:
        if backend == "triton":
            raise ValueError(f"backend='triton' {refusal}; use backend='tiled' (the same "
                             "numbers, without the N×M matrix)")
        be = "tiled"
    if spec.logits.learnable is not None and spec.logits.focal_m is not None and be != "reference":
        # focal logits s(s+m)/τ: ∂L/∂τ needs a row sum the torch engine's epilogue of a single
        # width forms, not the kernels' nor Matryoshka's widths'
        widths = spec.matryoshka is not None
        if widths or backend == "triton":
            where = "backend='reference'" + ("" if widths else " or 'tiled'")
            raise ValueError(f"a learnable temperature (a tensor that requires grad) with focal_m"
                             f"{' and matryoshka_dims' if widths else ''} has its gradient on "
                             f"{where} only")
        be = "tiled"
    return dataclasses.replace(spec, backend=be)
