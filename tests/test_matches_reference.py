"""Every engine against the reference: one grid, the backend an axis.

A case is a loss call and its inputs: the named objectives (``conftest.objectives``: InfoNCE
with a queue, hard negatives or symmetric, focal, DCLR paper and released, ESCL), every
combination of ``fastcl.contrastive``'s features (``focal``, ``hard``: a hard negative a
row with its log-weight, ``mask``: DCLR's complementary + phi, ``noise``, ``symmetric``, and
``queue``, ``released``, ``matryoshka``) and fastcl.layout's rules (MNRL's directions,
partitions and hardness, GIST's blocks and guide, duplicate ids, with focal and noise) and the
per-row option families (``options-``: soft targets, a learnable temperature whose gradient is
compared too, the false-negative margin and positive prior; class ``Options``). Each
runs on the tiled torch engine and on the Triton kernels (in Triton's interpreter on a
CPU-only machine, tests/conftest.py) at shapes that cut the engines' tiles (N = 1, N and M
not multiples of the chunk or of the interpreter's 16-wide tiles, d = 1, 7, 130, 384).

Tolerances, values and every gradient, against the reference on the same inputs:
tiled ``atol = rtol = 1e-5`` in float32, ``1e-10 / 1e-8`` in float64 (``conftest.TOL``);
Triton ``1e-4`` in float32; 16-bit inputs (either engine, the float32 reference on the same
rounded inputs): the loss within 2e-2 relative, gradients within 3e-2 of their largest entry
(float16's taken of a loss scaled as AMP scales it, which its range needs).
``16bit`` cases keep the chunk buffers in the inputs' dtype as a GPU does (conftest's
``gpu_buffers``). The option families keep tighter ones where they hold (``options_grid``).

The default run: on the tiled engine every case; on Triton every objective at each shape,
every feature combination at N = 17, d = 24 and a covering set of them (strength 2: none,
all, all but one) at N = 1 and the tiled shapes, covering sets of the layout rules and of
the anchor slices' features, and in 16-bit buffers each objective in both dtypes (N = 17,
K = 16 in one, another shape in the other, each shape in both dtypes). ``-m slow`` takes
the rest of each grid.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import fastcl
from fastcl import layout

from conftest import (TOL, complementary, correlated, device_of, inputs, loss_and_grads, make,
                      needs_gpu, needs_triton, objectives)
from conftest import TRITON_TOL as FP32_TRITON

BF16 = dict(atol=0, rtol=2e-2, grad_frac=3e-2)
DTYPES_16 = [torch.bfloat16, torch.float16]


def tolerance(backend, dtype):
    if dtype in DTYPES_16:
        return BF16
    return FP32_TRITON if backend == "triton" and dtype == torch.float32 else TOL[dtype]


def check(call, leaves, backend, chunk=None, tol=None):
    """``call(*leaves, backend=...)`` against the reference: on 16-bit leaves the float32
    reference on the same rounded values. Gradients that the reference lacks are absent or 0."""
    dtype = leaves[0].dtype
    tol = tol or tolerance(backend, dtype)
    wide = leaves if dtype not in DTYPES_16 else [x.detach().float().requires_grad_(x.requires_grad)
                                                   for x in leaves]
    ref, ref_grads = loss_and_grads(lambda: call(*wide, backend="reference"), wide)
    scale = 1.0
    if dtype == torch.float16:
        # float16 holds nothing below 6e-8, where a mean loss's gradients over hundreds of rows
        # fall: the loss's gradient is scaled as AMP's GradScaler scales it, here so that the
        # largest entry is near 2^10
        peak = max([rg.abs().max().item() for rg in ref_grads if rg is not None and rg.numel()] + [0])
        scale = 2.0 ** round(math.log2(1024 / peak)) if peak > 0 else 1.0
        ref_grads = [None if rg is None else rg * scale for rg in ref_grads]
    kw = {} if chunk is None else dict(chunk_size=chunk)
    got, grads = loss_and_grads(lambda: call(*leaves, backend=backend, **kw), leaves, scale)
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, atol=tol["atol"], rtol=tol["rtol"],
                               msg=lambda s: f"loss, chunk={chunk}: {s}")
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
        if rg is None or rg.numel() == 0:
            assert g is None or not g.abs().any(), f"input {i}: unexpected gradient"
            continue
        assert g is not None and g.dtype == dtype, f"input {i}: missing gradient"
        g_tol = (dict(atol=tol["grad_frac"] * rg.abs().max().item(), rtol=0) if "grad_frac" in tol
                 else dict(atol=tol["atol"], rtol=tol["rtol"]))
        torch.testing.assert_close(g.to(rg.dtype), rg, **g_tol,
                                   msg=lambda s: f"grad {i}, chunk={chunk}: {s}")


# --------------------------------------------------------------------------- the cases
class Objective:
    """``conftest.objectives(n, k)[name]`` on ``conftest.inputs(n, k, d)``."""

    def __init__(self, name, n, k, d, noise=0.7):
        self.name, self.shape, self.noise = name, (n, k, d), noise
        self.id = f"{name}-N{n}K{k}d{d}"

    def build(self, dtype, device):
        n, k, d = self.shape
        leaves = [t.detach().to(device).requires_grad_() for t in inputs(n, k, d, dtype, self.noise)]
        return leaves, objectives(n, k)[self.name]


FEATURES = ("focal", "hard", "mask", "noise", "symmetric")
#: Every subset of the features; COVERING: none, all, and all but one (every pair of
#: features on together, apart and off together: a covering array of strength 2).
COMBOS = [c for r in range(len(FEATURES) + 1) for c in itertools.combinations(FEATURES, r)]
COVERING = [(), FEATURES] + [tuple(f for f in FEATURES if f != g) for g in FEATURES]
TEMPERATURE, FOCAL_M, HARD_W, PHI = 0.1, 0.3, 0.8, 0.2


class Features:
    """``fastcl.contrastive`` with a set of features on anchors, positives and N hard
    negatives (or a K-row ``queue``), K_z noise rows and the complementary embeddings."""

    def __init__(self, combo, n, d, *, k_noise=5, k_queue=None, **extra):
        self.combo, self.shape, self.k_noise, self.k_queue, self.extra = combo, (n, d), k_noise, k_queue, extra
        self.id = "features-" + ("+".join(combo) or "plain")
        self.id += f"-N{n}d{d}" + (f"K{k_queue}" if k_queue else "") + "".join(f"-{key}" for key in extra)

    def build(self, dtype, device):
        n, d = self.shape
        a = make(n, d, dtype=dtype, seed=100 * n + d).to(device).detach().requires_grad_()
        p = correlated(a, 1.5).detach().requires_grad_()
        neg = make(self.k_queue or n, d, dtype=dtype, seed=3).to(device).detach().requires_grad_()
        self.z = z = make(self.k_noise, d, dtype=dtype, seed=9, grad=False).to(device)
        self.comp = comp = tuple(c.to(device, dtype) for c in complementary(n))
        return [a, p, neg], self.call(z, comp)

    def kwargs(self, dtype, z, comp):
        kw, combo = dict(temperature=TEMPERATURE, **self.extra), self.combo
        if "focal" in combo:
            kw["focal_m"] = FOCAL_M
        if "hard" in combo:
            kw["hard_negative_weight"] = HARD_W
        if "mask" in combo:
            kw.update(complementary=tuple(c.to(dtype) for c in comp), phi=PHI)
        if "noise" in combo:
            kw.update(noise=z.to(dtype), noise_steps=0)
        if "symmetric" in combo:
            kw["symmetric"] = True
        if "released" in combo:
            kw["formulation"] = "released"
        if "matryoshka" in combo:
            d = self.shape[1]
            kw.update(matryoshka_dims=(d, d // 2 - 2, 3), matryoshka_weights=(1.0, 0.5, 2.0))
        return kw

    def call(self, z, comp):
        """The loss; z and comp follow the leaves' dtype (the float32 reference of 16-bit
        inputs reads them as rounded to 16 bits)."""
        def loss(a, p, neg, **kw):
            negatives = neg if {"hard", "queue"} & set(self.combo) else None
            return fastcl.contrastive(a, p, negatives, **self.kwargs(a.dtype, z, comp), **kw)
        return loss


class Batch:
    """A :class:`Features` case's inputs by name (``.a``, ``.p``, ``.neg``, ``.z``, ``.comp``)."""

    def __init__(self, n, d, *, dtype=torch.float32, device="cpu", **kw):
        self.case = Features((), n, d, **kw)
        (self.a, self.p, self.neg), _ = self.case.build(dtype, device)
        self.z, self.comp = self.case.z, self.case.comp

    def leaves(self):
        return [self.a, self.p, self.neg]

    def kwargs(self, combo):
        """(negatives, keyword arguments) of ``fastcl.contrastive`` for ``combo``."""
        negatives = self.neg if {"hard", "queue"} & set(combo) else None
        return negatives, Features(combo, *self.case.shape).kwargs(self.a.dtype, self.z, self.comp)

    def __call__(self, combo, backend, **extra):
        negatives, kw = self.kwargs(combo)
        return fastcl.contrastive(self.a, self.p, negatives, backend=backend, **{**kw, **extra})


ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


class Rules:
    """fastcl.layout's rules (directions, partition, hardness, GIST's guide, ids) with focal
    and noise: anchors, positives and K hard negatives a row, a guide 8 wide, text ids in 3
    classes (many duplicates). ``clustered``: the guide of :func:`separated_guide`, every
    cosine at least 0.04 from its row's threshold (at N ≥ 130 a random guide has entries
    within 16-bit rounding of θ)."""

    def __init__(self, n, k, d, directions, partition="joint", hardness=None, focal=None,
                 guide=None, ids=False, noise=False, clustered=False):
        self.shape, self.directions, self.partition, self.hardness = (n, k, d), directions, partition, hardness
        self.focal, self.guide, self.ids, self.noise, self.clustered = focal, guide, ids, noise, clustered
        dirs = directions
        name = ("+".join(x.replace("_to_", "2")[0] + x.split("_to_")[1][0] for x in dirs)
                if isinstance(dirs, tuple) else f"gist{int(dirs.anchor_to_anchors)}{int(dirs.positive_to_positives)}")
        extras = [partition if partition != "joint" else "", (hardness or "").split("_")[0],
                  "focal" if focal else "", "guide-%s-%s" % guide if guide else "",
                  "ids" if ids else "", "noise" if noise else ""]
        self.id = "-".join([name] + [e for e in extras if e]) + "-N%dK%dd%d" % self.shape

    def resized(self, n, d, clustered=True):
        return Rules(n, self.shape[1], d, self.directions, self.partition, self.hardness, self.focal,
                     self.guide, self.ids, self.noise, clustered)

    def build(self, dtype, device):
        n, k, d = self.shape
        g = torch.Generator().manual_seed(n * 100 + d)
        base = torch.randn(n, d, generator=g)
        a, p = base, base + 0.7 * torch.randn(n, d, generator=g)
        neg = torch.cat([base + 1.2 * torch.randn(n, d, generator=g) for _ in range(k)]) if k else None
        lay = self.directions
        lay = lay if isinstance(lay, layout.Layout) else layout.from_directions(lay, self.partition)
        kw = dict(temperature=0.1, directions=lay, focal_m=self.focal)
        if self.hardness:
            kw.update(hardness_mode=self.hardness, hardness_strength=0.8)
        if self.guide:
            if self.clustered:
                guide = separated_guide(n, k)
            else:
                gb = torch.randn(n, 8, generator=g)
                guide = [gb + 0.3 * torch.randn(n, 8, generator=g) for _ in range(2)]
                guide.append(torch.cat([gb + 0.5 * torch.randn(n, 8, generator=g) for _ in range(k)])
                             if k else None)
            kw.update(guide=tuple(x if x is None else x.to(device) for x in guide) + (None,),
                      guide_margin=self.guide[0], margin_strategy=self.guide[1])
        if self.ids:
            ids = [torch.randint(0, 3, (size,), generator=g).to(device) for size in (n, n * k, n)]
            kw.update(duplicate_ids=(ids[0], ids[1] if k else None, ids[2] if lay.scores_anchors else None))
        if self.noise:
            kw.update(noise=torch.randn(3, d, generator=g).to(device), noise_steps=0)
        leaves = [x.to(device, dtype).requires_grad_() for x in (a, p) + ((neg,) if k else ())]
        return leaves, lambda *xs, **more: fastcl.contrastive(*xs, **kw, **more)


def rule_cases():
    """Every directions set and partition with each hardness mode, and GIST's four block
    sets with both margin strategies, each with and without focal, ids and noise."""
    sets = [("query_to_doc",) + extra for r in range(4)
            for extra in itertools.combinations(ALL_DIRECTIONS[1:], r)]
    cases = []
    for dirs in sets:
        modes = ["joint"] + (["per_direction"] if set(dirs) <= {"query_to_doc", "doc_to_query"} else [])
        for mode, hardness, focal, ids in itertools.product(
                modes, [None, "in_batch_negatives", "hard_negatives", "all_negatives"], [None, 0.3], [False, True]):
            cases += [Rules(*shape, dirs, mode, hardness, focal, ids=ids) for shape in RULE_SHAPES]
    for anchors, positives in itertools.product([True, False], repeat=2):
        for guide, focal, ids, noise in itertools.product(
                [(0.0, "absolute"), (0.1, "absolute"), (0.1, "relative")], [None, 0.3], [False, True], [False, True]):
            cases += [Rules(*shape, layout.gist(anchors, positives), focal=focal, guide=guide, ids=ids, noise=noise)
                      for shape in RULE_SHAPES]
    return cases


#: N = 19 in chunks of 5 leaves a short last chunk; M = 38 or more crosses 16-wide tiles
RULE_SHAPES = [(7, 1, 12), (19, 0, 24), (5, 2, 7)]
q2d, q2q, d2q, d2d = ALL_DIRECTIONS
#: each directions set, partition mode, hardness mode and GIST block set at least once, with
#: and without focal, ids, the guide's strategies and noise, at each shape
RULES_COVERING = [
    Rules(7, 1, 12, (q2d, q2q), hardness="in_batch_negatives", ids=True),
    Rules(19, 0, 24, (q2d, d2q), "per_direction", hardness="hard_negatives", focal=0.3),
    Rules(5, 2, 7, (q2d, d2q), "joint", hardness="all_negatives"),
    Rules(19, 0, 24, (q2d, d2d), focal=0.3, ids=True),
    Rules(7, 1, 12, ALL_DIRECTIONS, hardness="in_batch_negatives", focal=0.3),
    Rules(5, 2, 7, (q2d, q2q, d2q), "joint", hardness="hard_negatives", ids=True),
    Rules(19, 0, 24, (q2d,), hardness="all_negatives", noise=True),
    Rules(7, 1, 12, layout.gist(), guide=(0.1, "absolute"), ids=True),
    Rules(19, 0, 24, layout.gist(), guide=(0.1, "relative"), focal=0.3, noise=True),
    Rules(5, 2, 7, layout.gist(False, False), guide=(0.0, "absolute"), focal=0.3),
    Rules(7, 1, 12, layout.gist(True, False), guide=(0.1, "relative"), noise=True),
    Rules(19, 0, 24, layout.gist(False, True), guide=(0.0, "absolute"), ids=True),
]


def separated_guide(n, k):
    """Guide embeddings (anchors', positives', the K negatives' of each row) whose every
    cosine lies at least 0.04 from its row's threshold θ_i = γ_i − m (m = 0 or 0.1, absolute
    or relative), with drops in every block of GIST's, for any n. On orthogonal axes: a
    row's cluster (4), its text (rows 2t and 2t + 1 are duplicates) and its own. Anchor i:
    (cluster + text)/√2; its positive leans off it by γ_i = 0.95 (even rows) or 0.8 (odd)
    along its own axis; a negative: (cluster + its own axis)/√2, or its row's anchor (the
    same text) for every third row. Row i then sees its duplicate's anchor and the same-text
    negatives at 1 (dropped), its duplicate's positive at 0.8 (kept: θ ≥ 0.85) or 0.95
    (dropped: θ ≤ 0.8) and, from its positive, theirs at 0.76 (kept at θ = 0.95, 0.85 or 0.8,
    dropped at 0.7 or 0.72); everything else at 0.5 or below."""
    i = torch.arange(n)
    text, width = i // 2, 4 + (n + 1) // 2
    dim = width + n + n * k
    anchors = torch.zeros(n, dim)
    anchors[i, (text % 4)] = anchors[i, 4 + text] = 2 ** -0.5
    gamma = torch.where(i % 2 == 0, 0.95, 0.8)[:, None]
    own = torch.zeros(n, dim)
    own[i, width + i] = 1.0
    positives = gamma * anchors + (1 - gamma**2).sqrt() * own
    negatives = torch.zeros(n * k, dim)
    rows = torch.arange(n * k)                 # row r·n + i: the r-th negative of row i
    negatives[rows, text.repeat(k) % 4] = negatives[rows, width + n + rows] = 2 ** -0.5
    same_text = i.repeat(k) % 3 == 0
    negatives[same_text] = anchors.repeat(k, 1)[same_text]
    return [anchors, positives, negatives if k else None]


# --------------------------------------------------------------------------- per-row options
def _to(value, dtype, device):
    """``value`` (a tensor or a tuple of them) on ``device``, floating tensors in ``dtype``."""
    if isinstance(value, tuple):
        return tuple(_to(v, dtype, device) for v in value)
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype if value.is_floating_point() else value.dtype)
    return value


class Options:
    """``fastcl.contrastive(a, p, x, **options)`` for one of the per-row option families
    beside the features above, whose own literal formulas their files hold: ``soft``
    (tests/test_soft_targets.py: label smoothing, labels, a teacher), ``tau`` (a learnable
    temperature, tests/test_learnable_temperature.py: the 0-dim τ a leaf whose gradient is
    compared too) and ``rows`` (issue #46's false-negative margin and positive prior,
    tests/test_feature_masks.py). ``tol``: the family's tolerances where they are tighter
    than the grid's."""

    def __init__(self, family, name, shape, tol=None):
        self.family, self.name, self.shape, self.tol = family, name, shape, tol or {}
        self.id = f"options-{family}-{name}-" + "x".join(map(str, shape))

    def build(self, dtype, device):
        if self.family == "tau":
            n, k, d = self.shape
            a = make(n, d, dtype=dtype, seed=n + d)
            leaves = [a, correlated(a, 0.8), make(k, d, dtype=dtype, seed=3),
                      torch.tensor(0.2, dtype=dtype, requires_grad=True)]
            leaves = [t.detach().to(device).requires_grad_() for t in leaves]
            return leaves, lambda a, p, x, tau, **kw: fastcl.contrastive(
                a, p, temperature=tau, **learnable_options(a, p, x)[self.name], **kw)
        if self.family == "soft":
            n, d = self.shape
            a = make(n, d, dtype=torch.float64)
            leaves = [a, correlated(a, 0.8), make(n, d, dtype=torch.float64, seed=3)]
            options = soft_options(self.name, n, d)
            if "false_negative_margin" in options and n > 1:      # the margin drops something
                a, p, x = leaves
                without = dict(options, false_negative_margin=None)
                assert abs(fastcl.contrastive(a, p, x, temperature=0.1, backend="reference", **options).item()
                           - fastcl.contrastive(a, p, x, temperature=0.1, backend="reference",
                                                **without).item()) > 1e-3
        else:
            n, d, k = self.shape
            g = torch.Generator().manual_seed(0)
            leaves = [torch.randn(rows, d, generator=g, dtype=torch.float64) for rows in (n, n, k)]
            leaves[1] = leaves[1] + 0.8 * leaves[0]
            options = margin_options(self.name, *leaves)
        options = _to(options, dtype, device)
        leaves = [t.detach().to(device, dtype).requires_grad_() for t in leaves]
        return leaves, lambda a, p, x, **kw: fastcl.contrastive(a, p, x if x.shape[0] else None,
                                                               temperature=0.1, **options, **kw)


def soft_options(name, n, d):
    """The options of a soft-targets case (float64 tensors)."""
    labels = torch.arange(n) % 3
    g = torch.Generator().manual_seed(7)
    comp = lambda: (lambda c: (c, c.flip(1)))(  # noqa: E731
        F.one_hot(torch.arange(n) % 4, 4).double() + 0.01 * torch.randn(n, 4, generator=g, dtype=torch.float64))
    teacher = lambda: (torch.randn(n, 6, generator=g, dtype=torch.float64),  # noqa: E731
                       torch.randn(2 * n, 6, generator=g, dtype=torch.float64))
    if name.endswith("+margin"):
        # the false-negative margin beside soft targets: its drops leave the kept set K_i
        # (and the teacher's softmax); −0.2 drops some of these random candidates
        return dict(soft_options(name[:-len("+margin")], n, d), false_negative_margin=-0.2)
    if name == "smooth":
        return dict(label_smoothing=0.1)
    if name == "labels":
        return dict(labels=labels)
    if name == "both+focal+hard":
        return dict(labels=labels, label_smoothing=0.2, focal_m=0.3, hard_negative_weight=0.5)
    if name == "both+mask":
        return dict(labels=labels, label_smoothing=0.1, complementary=comp(), phi=0.2)
    if name == "both+ids+guide+q2q":
        ids = torch.arange(n) % 5
        guide = tuple(torch.randn(n, 4, generator=g, dtype=torch.float64) for _ in range(3))
        return dict(labels=labels, label_smoothing=0.3, duplicate_ids=(ids, ids + n, ids),
                    guide=guide + (guide[0],), guide_margin=0.1, directions=("query_to_doc", "query_to_query"))
    if name == "both+hardness+matryoshka":
        return dict(labels=labels, label_smoothing=0.1, hardness_mode="in_batch_negatives",
                    hardness_strength=2.0, matryoshka_dims=(2, d), matryoshka_weights=(0.5, 1.0), focal_m=0.3)
    if name == "both+symmetric+mask":
        return dict(labels=labels, label_smoothing=0.2, symmetric=True, focal_m=0.2, complementary=comp(), phi=0.2)
    if name.startswith("teacher"):
        kw = dict(teacher=teacher(), teacher_temperature=0.2, distill_weight=0.4)
        if name == "teacher":
            return kw
        if name == "teacher+smooth+hard+matryoshka":
            return dict(kw, label_smoothing=0.1, hard_negative_weight=0.5,
                        matryoshka_dims=(2, d), matryoshka_weights=(0.5, 1.0))
        if name == "teacher+labels+hardness+q2q":
            return dict(kw, labels=labels, focal_m=0.3, hardness_mode="in_batch_negatives",
                        hardness_strength=2.0, directions=("query_to_doc", "query_to_query"))
        if name == "teacher+both+ids+noise":
            ids = torch.arange(n) % 5
            return dict(labels=labels, label_smoothing=0.1, teacher=kw["teacher"], teacher_temperature=0.2,
                        distill_weight=0.3, duplicate_ids=(ids, ids + n), focal_m=0.2,
                        noise=torch.randn(3, d, generator=g, dtype=torch.float64), noise_steps=0)
    if name == "smooth+noise":
        return dict(label_smoothing=0.1, noise=torch.randn(3, d, generator=g, dtype=torch.float64), noise_steps=1)
    raise KeyError(name)


SOFT = ["smooth", "labels", "both+focal+hard", "both+mask", "both+ids+guide+q2q",
        "both+hardness+matryoshka", "both+symmetric+mask", "teacher", "teacher+smooth+hard+matryoshka",
        "teacher+labels+hardness+q2q", "teacher+both+ids+noise", "smooth+noise",
        "smooth+margin", "both+focal+hard+margin", "both+mask+margin", "both+ids+guide+q2q+margin",
        "teacher+margin", "teacher+smooth+hard+matryoshka+margin", "teacher+labels+hardness+q2q+margin"]
#: N = 1; 19 rows and 38 columns cross the 16-wide tiles. Triton's default run: these
SOFT_SHAPES = [(1, 3), (19, 5)]
SOFT_TRITON = {("smooth", (19, 5)), ("labels", (1, 3)), ("both+focal+hard", (19, 5)),
               ("both+ids+guide+q2q", (19, 5)), ("both+hardness+matryoshka", (1, 3)),
               ("both+symmetric+mask", (19, 5)), ("teacher", (19, 5)),
               ("teacher+smooth+hard+matryoshka", (1, 3)), ("teacher+labels+hardness+q2q", (1, 3)),
               ("teacher+both+ids+noise", (1, 3)), ("smooth+margin", (19, 5)),
               ("both+mask+margin", (19, 5)), ("both+ids+guide+q2q+margin", (19, 5)),
               ("teacher+margin", (19, 5)), ("teacher+labels+hardness+q2q+margin", (19, 5))}


def learnable_options(a, p, x):
    """name -> the keyword arguments of fastcl.contrastive besides the learnable temperature:
    every feature whose logits are ``s/τ`` plus terms free of τ, and focal's s²/τ, s(s+m)/τ
    (the torch engine's epilogue adds the row sum they need)."""
    n, d = a.shape
    comp = tuple(c.to(a.device, a.dtype) for c in complementary(n))
    ids = (torch.arange(max(n, x.shape[0])) % 3).to(a.device)
    guide = tuple(correlated(t.detach(), 0.3, seed=9).detach() for t in (a, p, x))
    gist = dict(negatives=x, directions=layout.gist(), guide=guide)
    return {
        "plain": {},
        "negatives": dict(negatives=x),
        "hard": dict(negatives=x[:n], hard_negative_weight=0.7),
        "symmetric": dict(symmetric=True),
        "mask": dict(complementary=comp, phi=0.5),
        "released": dict(complementary=comp, phi=0.5, noise=x, noise_steps=0, formulation="released"),
        "noise": dict(noise=x, noise_steps=2),      # Z carries no gradient, to τ neither
        "directions": dict(negatives=x[:n], directions=ALL_DIRECTIONS, hardness_mode="all_negatives",
                           hardness_strength=0.5, duplicate_ids=(ids[:n], ids[:n], ids[:n])),
        "per-direction": dict(directions=(q2d, d2q), partition_mode="per_direction"),
        "gist": dict(gist, guide_margin=0.05),
        "matryoshka": dict(negatives=x, matryoshka_dims=(2, d), matryoshka_weights=(0.5, 1.5)),
        "focal": dict(negatives=x[:n], focal_m=0.3, hard_negative_weight=0.4),
        "focal-gist": dict(gist, focal_m=-0.2),
        "focal-symmetric": dict(symmetric=True, focal_m=0.5),
    }


#: (N anchors, K extra rows, d): one anchor; rows and columns off the tiles (chunks of 3,
#: Triton's 16-row tiles) and an odd width. Triton (no focal: its learnable τ is the torch
#: engine's) takes the largest shape with a covering set of the options
TAU_SHAPES = [(1, 1, 3), (7, 7, 5), (17, 17, 9)]
TAU_NAMES = list(learnable_options(*[torch.zeros(2, 3)] * 3))


def margin_options(name, a, p, x):
    """fastcl.contrastive's options for a composition of issue #46's row features (the
    false-negative margin 0.05 in each; ``prior``: τ⁺ = 0.2) with the layouts, the guide, ids
    and Matryoshka."""
    n, d = a.shape
    kw = dict(false_negative_margin=0.05, **MARGIN[name])
    if kw.pop("guide", False):
        g = torch.Generator().manual_seed(2)
        kw["guide"] = (a + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64), p)
    if kw.pop("ids", False):
        kw["duplicate_ids"] = (torch.arange(n) % 7,)
    if kw.pop("prior", False):
        kw["positive_prior"] = 0.2
    return kw


MARGIN = {
    "symmetric": dict(symmetric=True),
    "symmetric-focal": dict(symmetric=True, focal_m=0.3),
    "directions-joint": dict(directions=(q2d, q2q, d2q)),
    "directions-per-direction": dict(directions=(q2d, d2q), partition_mode="per_direction"),
    "doc-to-doc-focal": dict(directions=(q2d, d2d), focal_m=0.3),
    "guide": dict(guide=True, directions=(q2d, d2q)),
    "ids": dict(ids=True),
    "matryoshka": dict(matryoshka_dims=(3, 7), matryoshka_weights=(0.5, 1.0)),
    "matryoshka-focal-symmetric": dict(matryoshka_dims=(3, 7), focal_m=0.3, symmetric=True),
    "matryoshka-paired-focal": dict(matryoshka_dims=(3, 7), focal_m=0.3, directions=(q2d, d2q, d2d)),
    # the debiased loss (one softmax a row), on the margin and the options it composes with
    # (the kernels' debiased loss has no positive side: the tiled path runs prior-joint)
    "prior-joint": dict(prior=True, directions=(q2d, q2q, d2q)),
    "prior-query-to-query": dict(prior=True, directions=(q2d, q2q)),
    "prior-guide": dict(prior=True, guide=True),
    "prior-ids": dict(prior=True, ids=True),
    "prior-matryoshka-focal": dict(prior=True, matryoshka_dims=(3, 7), focal_m=0.3),
}
#: Triton's default run: these (the others ``slow``)
MARGIN_TRITON = {"symmetric", "directions-joint", "guide", "matryoshka-focal-symmetric", "prior-ids",
                 "prior-matryoshka-focal"}


def options_grid():
    """The per-row option families. Tolerances: the soft targets' tiled float64 within 1e-9;
    the margin and prior's 1e-9 tiled, 2e-5 on Triton; a learnable τ's the grid's."""
    out = []
    for name, shape in itertools.product(SOFT, SOFT_SHAPES):
        case = Options("soft", name, shape, tol=dict(tiled=dict(atol=1e-9, rtol=1e-9)))
        out += [param("tiled", case, F64, chunks=(7,)),
                param("triton", case, chunks=(7,), slow=(name, shape) not in SOFT_TRITON)]
    for name, shape in itertools.product(TAU_NAMES, TAU_SHAPES):
        out.append(param("tiled", Options("tau", name, shape), F64, chunks=(3,)))
        if not name.startswith("focal") and (shape[0] <= 7 or name in ("plain", "gist", "matryoshka")):
            out.append(param("triton", Options("tau", name, shape), chunks=(3,)))
    for name in MARGIN:
        case = Options("rows", name, (19, 7, 19 if name == "doc-to-doc-focal" else 0),
                       tol=dict(tiled=dict(atol=1e-9, rtol=1e-9), triton=dict(atol=2e-5, rtol=2e-5)))
        out.append(param("tiled", case, F64, chunks=(8,)))
        if name != "prior-joint":
            out.append(param("triton", case, chunks=(8,), slow=name not in MARGIN_TRITON))
    return out


# --------------------------------------------------------------------------- the grid
NAMES = list(objectives(1, 0))
F32, F64, BF, FP16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
SLOW = pytest.mark.slow



def param(backend, case, dtype=F32, chunks=(None,), buffers=False, slow=False, gpu=False):
    dname = str(dtype)[6:]
    cid = f"{backend}-{case.id}-{dname}" + ("-16bit" if buffers else "") + ("-gpu" if gpu else "")
    cid += "".join(f"-chunk{c}" for c in chunks if c is not None)
    marks = ([needs_triton] if backend == "triton" else []) + ([needs_gpu] if gpu else [])
    return pytest.param(backend, case, dtype, chunks, buffers, id=cid, marks=marks + ([SLOW] if slow else []))


def grid():
    """The default run's cases and, marked ``slow``, the rest."""
    out = []
    # -- the named objectives. Tiled: N = 1, N not a multiple of the chunk, M ≠ N, d = 1,
    # d = 384, d not a power of two, in chunks of every size. Triton: N = 1, 17, M = 33,
    # d = 7 (below one tile), 24, 130; N = 40, M = 80 (three row tiles, three row blocks of
    # 32) for what the features' larger shapes leave out (a queue, symmetric with one, ESCL)
    for n, k, d in [(1, 0, 1), (1, 3, 24), (5, 0, 130), (17, 0, 24), (17, 13, 384), (33, 33, 7), (8, 40, 1)]:
        for name, dtype in itertools.product(NAMES, (F32, F64)):
            out.append(param("tiled", Objective(name, n, k, d), dtype, chunks=(None, 1, 4, 16)))
    for n, k, d in [(1, 0, 24), (1, 3, 130), (17, 0, 130), (17, 16, 24), (5, 28, 7)]:
        out += [param("triton", Objective(name, n, k, d)) for name in NAMES]
    out += [param("triton", Objective(name, 40, 40, 24)) for name in
            ["infonce-negatives", "infonce-symmetric", "focal-negatives", "escl", "escl-margin"]]
    # (in chunks of 7: test_triton.py's test_chunk_designs, bounded design, runs this check)
    out += [param("triton", Objective(name, 17, 16, 24), chunks=(16,))
            for name in ("dclr-weighted", "focal-negatives")]
    # -- bf16 inputs (a CPU widens the GEMM operands; the 16bit cases below do not)
    out += [param("tiled", Objective(name, 24, 24, 96), BF, chunks=(7,))
            for name in ["infonce", "focal-negatives", "dclr-weighted", "infonce-symmetric"]]
    out += [param("triton", Objective(name, 17, 16, 24), BF)
            for name in ["infonce", "focal-negatives", "dclr-weighted", "dclr-released"]]
    # -- every combination of the features. Tiled: N = 1, N not a multiple of the chunk,
    # d not a power of two, d = 1. Triton: N = 17 (M = 39 with hard negatives and noise),
    # d = 24; and on N = 1, d = 24, on N = 5, d = 7 and on N = 33, d = 40 (three row and K
    # tiles, M = 85) a covering set (the rest slow)
    for combo in COMBOS:
        out += [param("tiled", Features(combo, n, d), chunks=(None, 4))
                for n, d in [(1, 24), (17, 130), (33, 7), (6, 1)]]
        out.append(param("triton", Features(combo, 17, 24)))
        out.append(param("triton", Features(combo, 1, 24), slow=combo not in COVERING))
        out += [param("triton", Features(combo, n, d, k_noise=19), chunks=(16,), slow=combo not in COVERING)
                for n, d in [(5, 7), (33, 40)]]
    out.append(param("tiled", Features(FEATURES, 11, 20), F64, chunks=(4,)))
    out += [param("triton", Features(FEATURES, 17, 24), chunks=(c,)) for c in (1, 7)]
    for backend in ("tiled", "triton"):
        # a queue of K ≠ N negatives; the released formulation; Matryoshka's widths
        out += [param(backend, Features(c, 9, 24, k_queue=13), chunks=(4,))
                for c in [("queue",), ("queue", "focal", "mask", "noise", "symmetric")]]
        out += [param(backend, Features(("released",) + c, 17, 24), chunks=(7,))
                for c in [(), ("mask",), ("noise",), ("mask", "noise")]]
        out += [param(backend, Features(("matryoshka",) + c, 17, 24), chunks=(7,))
                for c in [(), ("focal", "hard"), ("mask",), ("queue", "symmetric")]]
        out += [param(backend, Features(c, 17, 24), BF, chunks=(7,))
                for c in [FEATURES, ("focal", "hard", "mask")]]
    # -- the layout rules on Triton (the tiled engine: test_properties.py's float64 draws)
    out += [param("triton", case, chunks=(5,)) for case in RULES_COVERING]
    covering_ids = {c.id for c in RULES_COVERING}
    out += [param("triton", case, chunks=(5,), slow=True) for case in rule_cases() if case.id not in covering_ids]
    out += [param("tiled", case, chunks=(5,)) for case in RULES_COVERING]
    out += [param("triton", Features(("matryoshka",) + c, 17, 24, **x), chunks=(7,))
            for c, x in [((), dict(directions=(q2d, q2q)))]]
    # -- on a GPU (skipped without one): larger shapes in fp32, bf16 and fp16 (real 16-bit buffers)
    for i, (n, k, d) in enumerate([(256, 0, 768), (1000, 1000, 384), (517, 300, 1024), (4096, 0, 768)]):
        out += [param("triton", Objective(name, n, k, d), dtype, gpu=True)
                for name in NAMES for dtype in (F32, BF, FP16)[:3 if i < 3 else 2]]
    return out + grid_16bit() + options_grid()


#: Positives at cosine ≈ 0.2 to their anchors: at τ = 0.05 the softmax is not saturated
#: (1 − p_pos would be below float32's resolution, in the reference too), while logits
#: still span about ±10, the range the bounded design's 16-bit tile of exp(l − 1/τ) keeps.
POSITIVE_NOISE_16 = 5.0


def grid_16bit():
    """16-bit chunk buffers as on a GPU (bf16: the bounded design with its tile of exp in
    bf16; fp16: the two-pass design). The default run: every objective in both dtypes, at
    N = 17, K = 16 in one and at K = 0 (d = 130) or an edge shape in the other, in turn (each
    shape in both dtypes), and in chunks (N = K = 40) in one dtype each in turn; the feature
    covering set in bf16 (none and all in fp16); layout rules and Matryoshka in turn. ``-m slow``: all of it in both."""
    out = []
    others = [(17, 0, 130), (1, 3, 130), (5, 28, 7)]
    for i, name in enumerate(NAMES):
        for shape in [(17, 16, 24)] + others:
            for dtype in DTYPES_16:
                # objective i: N = 17, K = 16 in one dtype and others[i % 3] in the other, so
                # each objective runs in both dtypes (both designs), each shape in both dtypes
                default = ((shape == (17, 16, 24) and dtype == DTYPES_16[i % 2])
                           or (shape == others[i % 3] and dtype != DTYPES_16[i % 2]))
                out.append(param("triton", Objective(name, *shape, noise=POSITIVE_NOISE_16), dtype,
                                 buffers=True, slow=not default))
    for i, name in enumerate(["infonce-negatives", "infonce-symmetric", "focal-negatives", "escl", "escl-margin"]):
        out += [param("triton", Objective(name, 40, 40, 24, noise=POSITIVE_NOISE_16), dtype, chunks=(16,),
                      buffers=True, slow=dtype != DTYPES_16[i % 2]) for dtype in DTYPES_16]
    out += [param("triton", Features(c, 17, 24), dtype, chunks=(7,), buffers=True,
                  slow=dtype == FP16 and len(c) not in (0, len(FEATURES)))
            for c in COVERING for dtype in DTYPES_16]
    # (8, bf16) is test_triton.py's test_guide_cast_once_a_call: this check and its GEMM dtype
    default_rules = {(4, BF), (1, FP16), (8, FP16)}
    out += [param("triton", case, dtype, chunks=(5,), buffers=True, slow=(i, dtype) not in default_rules)
            for dtype in DTYPES_16 for i, case in enumerate(RULES_COVERING)]
    out += [param("triton", Features(("matryoshka", "queue") + c, 17, 24, k_queue=17, **x), dtype, chunks=(7,),
                  buffers=True, slow=dtype != DTYPES_16[i % 2])
            for i, (c, x) in enumerate([((), {}), ((), dict(directions=(q2d, q2q))), (("focal", "hard"), {})])
            for dtype in DTYPES_16]
    return out


@pytest.mark.parametrize("backend,case,dtype,chunks,buffers", grid())
def test_matches_reference(backend, case, dtype, chunks, buffers, request):
    seen = request.getfixturevalue("gpu_buffers") if buffers else None
    leaves, call = case.build(dtype, device_of(backend))
    for chunk in chunks:
        check(call, leaves, backend, chunk, getattr(case, "tol", {}).get(backend))
    if buffers:
        assert seen and set(seen) == {dtype}


# --------------------------------------------------------------------------- slices
#: ``anchor_offset``: one process's slice of the anchors against the whole batch, as with
#: gathered negatives. Every feature combination but symmetric, a queue with focal, the
#: released formulation, Matryoshka, ESCL (its sensitive view sliced like the anchors).
SLICE_CASES = ([c for c in COMBOS if "symmetric" not in c]
               + [("focal", "queue"), ("released", "mask", "noise"), ("matryoshka", "focal", "hard"), ("escl",)])
N_ALL, SLICES = 11, [(0, 4), (4, 9), (9, 11)]


def _slice_loss(case, batch, lo, hi, backend, **kw):
    a, p, neg, z, comp = batch
    if case == ("escl",):
        return fastcl.escl_loss(a[lo:hi], p, correlated(a, 1.0, seed=8).detach()[lo:hi],
                                anchor_offset=lo, backend=backend, **kw)
    features = Features(case, N_ALL, 24, k_queue=N_ALL if "queue" in case else None)
    return features.call(z, (comp[0][lo:hi], comp[1]))(a[lo:hi], p, neg, anchor_offset=lo,
                                                       backend=backend, **kw)


#: On Triton the default run takes, of the feature combinations, a covering set of the four
#: (none, all, all but one); the other cases of SLICE_CASES and every case on the reference
#: and the tiled engine too (the rest: ``-m slow``)
SLICE_FEATURES = ("focal", "hard", "mask", "noise")
SLICE_COVERING = [(), SLICE_FEATURES] + [tuple(f for f in SLICE_FEATURES if f != g) for g in SLICE_FEATURES]


def slice_params():
    out = []
    for case in SLICE_CASES:
        name = "+".join(case) or "plain"
        out += [pytest.param(case, b, id=f"{name}-{b}") for b in ("reference", "tiled")]
        slow = case in COMBOS and case not in SLICE_COVERING
        out.append(pytest.param(case, "triton", id=f"{name}-triton", marks=[needs_triton] + ([SLOW] if slow else [])))
    return out


@pytest.mark.parametrize("case,backend", slice_params())
def test_anchor_offset_slices_add_up(case, backend):
    """Each slice's loss and gradients equal the reference's (fused engines in chunks of
    2), and weighted by their sizes the slices add up to the whole batch: the offset moves
    the positive, the hard negative and the mask's rows consistently."""
    device = device_of(backend)
    leaves, _ = Features(case, N_ALL, 24).build(F32, device)
    a, p, neg = leaves
    z = make(5, 24, seed=9, grad=False).to(device)
    batch = (a, p, neg, z, tuple(c.to(device, F32) for c in complementary(N_ALL)))
    whole = _slice_loss(case, batch, 0, N_ALL, "reference")
    g_whole = torch.autograd.grad(whole, leaves, allow_unused=True)
    total, grads = 0.0, [torch.zeros_like(t) for t in leaves]
    for lo, hi in SLICES:
        w = (hi - lo) / N_ALL
        loss = _slice_loss(case, batch, lo, hi, backend, **({} if backend == "reference" else dict(chunk_size=2)))
        ref = _slice_loss(case, batch, lo, hi, "reference")
        torch.testing.assert_close(loss, ref, **FP32_TRITON)
        got_g = torch.autograd.grad(w * loss, leaves, allow_unused=True)
        for x, y in zip(got_g, torch.autograd.grad(w * ref, leaves, allow_unused=True)):
            if y is not None:
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-4)
        total = total + w * loss.detach()
        for acc, g in zip(grads, got_g):
            if g is not None:
                acc += g
    torch.testing.assert_close(total, whole.detach(), atol=1e-5, rtol=1e-5)
    for which, g, gw in zip(("anchors", "positives", "negatives"), grads, g_whole):
        torch.testing.assert_close(g, torch.zeros_like(g) if gw is None else gw, atol=1e-6, rtol=1e-4,
                                   msg=lambda s: f"grad {which}: {s}")


# --------------------------------------------------------------------------- DCLR's noise update
NOISE_CASES = ([("tiled", shape, dtype) for shape in [(1, 1, 5, None), (9, 9, 16, 4), (17, 40, 130, 5),
                                                      (33, 8, 384, None), (6, 13, 1, 2)] for dtype in (F32, F64)]
               + [pytest.param("triton", shape, F32, marks=needs_triton)
                  for shape in [(1, 1, 24, None), (17, 33, 130, None), (9, 4, 7, None)]])


@pytest.mark.parametrize("backend,shape,dtype", NOISE_CASES)
def test_noise_update_matches_reference(backend, shape, dtype):
    """Four steps of the noise update (``fastcl.dclr_noise``) against the reference's
    autograd (tolerances: 2e-6 / 1e-5 in float32, 1e-12 / 1e-10 in float64), in the inputs'
    dtype and without a graph; a single step moves every row by lr."""
    n, k, d, chunk = shape
    device = device_of(backend)
    a = make(n, d, dtype=dtype).to(device)
    p = correlated(a)
    z0 = make(k, d, dtype=dtype, seed=9, grad=False).to(device)
    kw = dict(steps=4, lr=0.05, temperature=0.1, noise=z0)
    ref = fastcl.dclr_noise(a, p, k, backend="reference", **kw)
    got = fastcl.dclr_noise(a, p, k, backend=backend, chunk_size=chunk, **kw)
    assert got.dtype == ref.dtype == dtype and not got.requires_grad
    if d == 1:
        # in one dimension cos(h, z) = ±1 whatever z's length: the exact gradient is 0 and the
        # fused path keeps z put; autograd's rounding residue may still pick a direction
        torch.testing.assert_close(got, z0)
        return
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == F64 else dict(atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, ref, **tol)
    step = torch.linalg.vector_norm(fastcl.dclr_noise(a, p, k, steps=1, lr=0.05, noise=z0, backend=backend)
                                    - z0, dim=1)
    torch.testing.assert_close(step, torch.full_like(step, 0.05))
