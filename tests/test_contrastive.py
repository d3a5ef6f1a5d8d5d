"""``fastcl.contrastive``: every feature combination on every backend against the reference.

Features: focal modulation (``focal_m``), a hard negative per anchor with its log-weight
(``negatives`` + ``hard_negative_weight``), DCLR's mask (``complementary`` + ``phi``), noise
columns (``noise``), ``symmetric``; also a queue of negatives (K ≠ N), ``anchor_offset`` and
``formulation="released"``. The reference itself is checked by hand on small cases and by
float64 gradcheck.

Tolerances (float32, values and every gradient, the float32 reference on the same inputs):
tiled ``atol = rtol = 1e-5`` (``conftest.TOL``), Triton in the interpreter (on a GPU with CUDA
tensors) ``atol = rtol = 1e-4``, as in tests/test_tiled.py and tests/test_triton.py; bf16
inputs: loss within 2e-2 relative, gradients within 3e-2 of the largest entry. The Triton
grid runs in Triton's interpreter on a CPU-only machine (tests/conftest.py): its shapes stay
small; the larger ones take every combination in the ``slow`` run (``pytest -m slow``) and a
covering set of them (``COVERING``) in the default one.
"""

import importlib.util
import itertools
import math

import pytest
import torch

import fastcl
from fastcl import common, reference
from fastcl.spec import build_spec

from conftest import TOL, correlated, loss_and_grads, make
from conftest import objectives as conftest_objectives

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if CUDA else "cpu"
TRITON_TOL = dict(atol=1e-4, rtol=1e-4)

FEATURES = ("focal", "hard", "mask", "noise", "symmetric")
#: Every subset of the features, by name ("plain" for none of them).
COMBOS = [combo for r in range(len(FEATURES) + 1) for combo in itertools.combinations(FEATURES, r)]
IDS = ["+".join(c) or "plain" for c in COMBOS]
#: None of the features, all of them, and all but one: every pair of features is in one of
#: them on, off, and one on with the other off (a covering array of strength 2).
COVERING = [(), FEATURES] + [tuple(f for f in FEATURES if f != g) for g in FEATURES]

TEMPERATURE = 0.1
FOCAL_M, HARD_W, PHI = 0.3, 0.8, 0.2


def _complementary(n, dtype=torch.float64):
    """A frozen model's embeddings in 6 clusters: cosines ≈ 1 within a cluster, |cos| < 0.1
    across, so φ = 0.2 drops the same-cluster negatives and no pair sits near the threshold."""
    c = torch.nn.functional.one_hot(torch.arange(n) % 6, 6).double()
    c = c + 0.01 * torch.randn(n, 6, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    c_pos = c + 0.01 * torch.randn(n, 6, generator=torch.Generator().manual_seed(12),
                                   dtype=torch.float64)
    return c.to(dtype), c_pos.to(dtype)


class Batch:
    """Views for one call: anchors, positives, N hard negatives or a K-row queue, K_z noise
    rows and the complementary embeddings, on ``device`` in ``dtype``."""

    def __init__(self, n, d, *, k_noise=5, k_queue=None, dtype=torch.float32, device="cpu"):
        self.a = make(n, d, dtype=dtype, seed=100 * n + d).to(device).detach().requires_grad_()
        self.p = correlated(self.a, 1.5).detach().requires_grad_()
        self.neg = make(n if k_queue is None else k_queue, d, dtype=dtype, seed=3).to(device)
        self.neg = self.neg.detach().requires_grad_()
        self.z = make(k_noise, d, dtype=dtype, seed=9, grad=False).to(device)
        self.comp = tuple(c.to(device, dtype) for c in _complementary(n))

    def leaves(self):
        return [self.a, self.p, self.neg]

    def float(self):
        """The same values in float32, as new leaves (the reference for 16-bit inputs)."""
        out = object.__new__(Batch)
        out.a, out.p, out.neg = (t.detach().float().requires_grad_() for t in self.leaves())
        out.z = self.z.float()
        out.comp = tuple(c.float() for c in self.comp)
        return out


def kwargs(batch, combo, **extra):
    """``fastcl.contrastive``'s arguments for a feature combination."""
    kw = dict(temperature=TEMPERATURE)
    negatives = None
    if "focal" in combo:
        kw["focal_m"] = FOCAL_M
    if "hard" in combo:
        negatives = batch.neg
        kw["hard_negative_weight"] = HARD_W
    if "queue" in combo:
        negatives = batch.neg
    if "mask" in combo:
        kw.update(complementary=batch.comp, phi=PHI)
    if "noise" in combo:
        kw.update(noise=batch.z, noise_steps=0)
    if "symmetric" in combo:
        kw["symmetric"] = True
    kw.update(extra)
    return negatives, kw


def _call(batch, combo, backend, **extra):
    negatives, kw = kwargs(batch, combo, **extra)
    return fastcl.contrastive(batch.a, batch.p, negatives, backend=backend, **kw)


def compare(batch, combo, backend, tol, ref_batch=None, grad_frac=None, **extra):
    """Loss and gradients of ``backend`` against the reference (on ``ref_batch``, the float32
    copy of 16-bit inputs); returns the reference loss."""
    ref_batch = ref_batch or batch
    ref_loss, ref_grads = loss_and_grads(lambda: _call(ref_batch, combo, "reference", **extra),
                                         ref_batch.leaves())
    loss, grads = loss_and_grads(lambda: _call(batch, combo, backend, **extra), batch.leaves())
    assert loss.dtype == ref_loss.dtype
    torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda s: f"loss: {s}")
    for which, g, rg in zip(("anchors", "positives", "negatives"), grads, ref_grads):
        if rg is None:
            assert g is None or not g.abs().any(), f"{which}: unexpected gradient"
            continue
        assert g is not None, f"{which}: missing gradient"
        g_tol = tol if grad_frac is None else dict(atol=grad_frac * rg.abs().max().item(), rtol=0)
        torch.testing.assert_close(g.to(rg.dtype), rg, **g_tol, msg=lambda s: f"grad {which}: {s}")
    return ref_loss


# --------------------------------------------------------------------------- tiled
# (N, d): N = 1, N not a multiple of the chunk, d not a power of two, d = 1
TILED_SHAPES = [(1, 24), (17, 130), (33, 7), (6, 1)]


@pytest.mark.parametrize("shape", TILED_SHAPES, ids=[f"N{n}d{d}" for n, d in TILED_SHAPES])
@pytest.mark.parametrize("combo", COMBOS, ids=IDS)
def test_tiled_matches_reference(combo, shape):
    n, d = shape
    batch = Batch(n, d)
    for chunk in (None, 4):
        compare(batch, combo, "tiled", TOL[torch.float32], chunk_size=chunk)


@pytest.mark.parametrize("combo", [("queue",), ("queue", "focal", "mask", "noise", "symmetric")],
                         ids=["queue", "queue+focal+mask+noise+symmetric"])
@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=needs_triton)])
def test_queue_of_negatives(combo, backend):
    """K ≠ N extra negatives (a queue), with every feature but the hard-negative weight."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    batch = Batch(9, 24, k_queue=13, device=device)
    tol = TRITON_TOL if backend == "triton" else TOL[torch.float32]
    compare(batch, combo, backend, tol, chunk_size=4)


def test_tiled_float64_is_exact():
    """In float64 the fused path and the reference agree to rounding, every feature on."""
    batch = Batch(11, 20, dtype=torch.float64)
    compare(batch, FEATURES, "tiled", TOL[torch.float64], chunk_size=4)


# --------------------------------------------------------------------------- triton
# Interpreter tiles are 16 rows × 16 columns, 16 wide in d; row blocks of 32 columns.
# N = 1; N = 17 with M = 17 + 17 + 5 = 39 candidates (neither a multiple of 16) and d = 24.
TRITON_SHAPES = [(1, 24), (17, 24)]
# d = 7, below one tile; N = 33 and d = 40: three row and K tiles, up to M = 85 candidates
# (hard negatives and noise: a third row block of 32)
TRITON_MORE_SHAPES = [(5, 7), (33, 40)]


@needs_triton
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=[f"N{n}d{d}" for n, d in TRITON_SHAPES])
@pytest.mark.parametrize("combo", COMBOS, ids=IDS)
def test_triton_matches_reference(combo, shape):
    compare(Batch(*shape, device=TRITON_DEVICE), combo, "triton", TRITON_TOL)


def _more_shapes(combo, shape):
    compare(Batch(*shape, k_noise=19, device=TRITON_DEVICE), combo, "triton", TRITON_TOL,
            chunk_size=16)


@needs_triton
@pytest.mark.parametrize("shape", TRITON_MORE_SHAPES, ids=[f"N{n}d{d}" for n, d in TRITON_MORE_SHAPES])
@pytest.mark.parametrize("combo", COVERING, ids=["+".join(c) or "plain" for c in COVERING])
def test_triton_matches_reference_more_shapes(combo, shape):
    """The larger shapes on a covering set of combinations (every pair of features on
    together, apart and off together); each combination alone is in the grid above."""
    _more_shapes(combo, shape)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("shape", TRITON_MORE_SHAPES, ids=[f"N{n}d{d}" for n, d in TRITON_MORE_SHAPES])
@pytest.mark.parametrize("combo", [c for c in COMBOS if c not in COVERING],
                         ids=["+".join(c) or "plain" for c in COMBOS if c not in COVERING])
def test_triton_matches_reference_more_shapes_every_combination(combo, shape):
    _more_shapes(combo, shape)


@needs_triton
@pytest.mark.parametrize("chunk", [1, 7])
def test_triton_chunks_every_feature(chunk):
    compare(Batch(17, 24, device=TRITON_DEVICE), FEATURES, "triton", TRITON_TOL, chunk_size=chunk)


# 16-bit inputs: the float32 reference on the same rounded inputs
BF16 = dict(atol=0, rtol=2e-2)


@pytest.mark.parametrize("combo", [FEATURES, ("focal", "hard", "mask")], ids=["all", "focal+hard+mask"])
@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=needs_triton)])
def test_bfloat16_inputs(backend, combo):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    batch = Batch(17, 24, dtype=torch.bfloat16, device=device)
    compare(batch, combo, backend, BF16, ref_batch=batch.float(), grad_frac=3e-2, chunk_size=7)


@needs_triton
@pytest.mark.parametrize("combo,dtype", [
    pytest.param(combo, dtype, id=f"{'+'.join(combo) or 'plain'}-{str(dtype)[6:]}",
                 marks=() if dtype == torch.bfloat16 or len(combo) in (0, len(FEATURES))
                 else pytest.mark.slow)
    for combo in COVERING for dtype in (torch.bfloat16, torch.float16)])
def test_triton_16bit_buffers(combo, dtype, gpu_buffers):
    """The covering flag sets on 16-bit chunk buffers, as a GPU runs them (bf16: the bounded
    design; fp16: the two-pass design; tests/conftest.py's gpu_buffers). The default run: all
    in bf16, none and all of the features in fp16; ``-m slow`` all in fp16 too."""
    batch = Batch(17, 24, dtype=dtype, device=TRITON_DEVICE)
    compare(batch, combo, "triton", BF16, ref_batch=batch.float(), grad_frac=3e-2, chunk_size=7)
    assert gpu_buffers and set(gpu_buffers) == {dtype}


# --------------------------------------------------------------------------- more options
OFFSET_COMBOS = [c for c in COMBOS if "symmetric" not in c]
N_ALL, SLICES = 11, [(0, 4), (4, 11)]


def _slice_call(batch, combo, lo, hi, backend):
    """The loss of anchors [lo, hi) against the whole batch (``anchor_offset=lo``)."""
    negatives, kw = kwargs(batch, combo)
    if "mask" in combo:
        kw["complementary"] = (batch.comp[0][lo:hi], batch.comp[1])
    return fastcl.contrastive(batch.a[lo:hi], batch.p, negatives, anchor_offset=lo,
                              backend=backend, **kw)


@pytest.mark.parametrize("backend", ["reference", "tiled",
                                     pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("combo", OFFSET_COMBOS, ids=["+".join(c) or "plain" for c in OFFSET_COMBOS])
def test_anchor_offset_slices_add_up(combo, backend):
    """Weighted by their sizes, the slices' losses and gradients are the whole batch's (the
    whole batch on the reference): the offset moves the positive, the hard negative and the
    mask's rows consistently."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    batch = Batch(N_ALL, 24, device=device)
    leaves = batch.leaves()
    whole = _call(batch, combo, "reference")
    g_whole = torch.autograd.grad(whole, leaves, allow_unused=True)
    total, grads = 0.0, [torch.zeros_like(t) for t in leaves]
    for lo, hi in SLICES:
        w = (hi - lo) / N_ALL
        loss = _slice_call(batch, combo, lo, hi, backend)
        ref = _slice_call(batch, combo, lo, hi, "reference")
        torch.testing.assert_close(loss, ref, **TRITON_TOL)
        total = total + w * loss.detach()
        for acc, g in zip(grads, torch.autograd.grad(w * loss, leaves, allow_unused=True)):
            if g is not None:
                acc += g
    torch.testing.assert_close(total, whole.detach(), **TRITON_TOL)
    for which, g, gw in zip(("anchors", "positives", "negatives"), grads, g_whole):
        torch.testing.assert_close(g, torch.zeros_like(g) if gw is None else gw, **TRITON_TOL,
                                   msg=lambda s: f"grad {which}: {s}")


RELEASED = [(), ("mask",), ("noise",), ("mask", "noise")]


@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("combo", RELEASED, ids=["+".join(c) or "plain" for c in RELEASED])
def test_released_formulation(combo, backend):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    tol = TRITON_TOL if backend == "triton" else TOL[torch.float32]
    compare(Batch(17, 24, device=device), combo, backend, tol, formulation="released",
            chunk_size=7)


@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=needs_triton)])
def test_released_formulation_with_a_saturated_negative(backend):
    """A negative 20 logits above its positive: its softmax entry is 1.0 in float32, where
    1/(1 − p) is infinite. torch's BCE clamps log(1 − p) at −100 and its backward's
    denominator p(1 − p) at 1e-12; the fused paths do the same (finite, equal gradients)."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    a = torch.tensor([[1.0, 0, 0], [0, 1, 0]], device=device, requires_grad=True)
    p = torch.tensor([[0.0, 0, 1], [1, 0, 0]], device=device, requires_grad=True)
    ref, ref_g = loss_and_grads(lambda: fastcl.contrastive(a, p, formulation="released",
                                                          backend="reference"), [a, p])
    got, g = loss_and_grads(lambda: fastcl.contrastive(a, p, formulation="released",
                                                      backend=backend), [a, p])
    assert ref_g[0].abs().max() > 1e4  # the clamp is what sets this gradient
    torch.testing.assert_close(got, ref, **TRITON_TOL)
    for x, y in zip(g, ref_g):
        torch.testing.assert_close(x, y, **TRITON_TOL)


@pytest.mark.parametrize("formulation", ["paper", "released"])
def test_noise_steps_with_anchor_offset(formulation):
    """A slice of anchors against the whole batch, noise moved by the noise update: the
    reference runs it (the update's positive term takes the slice's own positives)."""
    a, p = make(8, 16, dtype=torch.float64), correlated(make(8, 16, dtype=torch.float64))
    losses = [fastcl.contrastive(a[4:], p, anchor_offset=4, noise_ratio=1.0, noise_steps=2,
                                 noise_lr=0.05, formulation=formulation, backend=backend,
                                 generator=torch.Generator().manual_seed(4))
              for backend in ("reference", "tiled")]
    torch.testing.assert_close(losses[0], losses[1])


def test_reference_float16_zero_row_is_finite():
    """float16 rounds EPS to 0: the reference forms unit rows in float32 (a zero row is 0, not
    0/0), as the fused paths do."""
    a, p = make(6, 16), correlated(make(6, 16))
    with torch.no_grad():
        p[2] = 0.0
    loss = fastcl.infonce(a.half(), p.half(), backend="reference")
    torch.testing.assert_close(loss, fastcl.infonce(a.half(), p.half(), backend="tiled"),
                               atol=2e-2, rtol=2e-2)

@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=needs_triton)])
def test_noise_steps_every_feature(backend):
    """Noise drawn from a generator and moved by the noise update, every feature on: the
    backends update it on their own (the reference with autograd) and still agree."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    batch = Batch(12, 24, device=device)
    combo = ("focal", "hard", "mask", "symmetric")
    gen = lambda: torch.Generator(device).manual_seed(5)
    ref, _ = loss_and_grads(lambda: _call(batch, combo, "reference", noise_ratio=1.5,
                                          noise_steps=3, noise_lr=0.05, generator=gen()),
                            batch.leaves())
    got, _ = loss_and_grads(lambda: _call(batch, combo, backend, noise_ratio=1.5, noise_steps=3,
                                          noise_lr=0.05, generator=gen(), chunk_size=5),
                            batch.leaves())
    torch.testing.assert_close(got, ref, **TRITON_TOL)


def test_noise_ratio_draws_round_ratio_n_rows():
    """noise_ratio draws K_z = round(ratio·N) rows with the generator: the same loss as
    passing that draw as ``noise``."""
    batch = Batch(9, 16)
    combo = ("focal", "mask")
    _, kw = kwargs(batch, combo)
    drawn = common.draw_noise(round(1.5 * 9), 16, generator=torch.Generator().manual_seed(2))
    for backend in ("reference", "tiled"):
        by_ratio = fastcl.contrastive(batch.a, batch.p, noise_ratio=1.5, noise_steps=0,
                                      generator=torch.Generator().manual_seed(2), backend=backend, **kw)
        given = fastcl.contrastive(batch.a, batch.p, noise=drawn, noise_steps=0, backend=backend, **kw)
        assert torch.equal(by_ratio, given), backend


@pytest.mark.parametrize("feature", FEATURES)
def test_every_feature_changes_the_loss(feature):
    """Each feature moves the reference loss on the grid's inputs (so the grid would notice a
    backend that ignored it), and every pair of features is not just the sum of its parts."""
    batch = Batch(17, 24)
    others = tuple(f for f in FEATURES if f != feature)
    with_all = _call(batch, FEATURES, "reference")
    without = _call(batch, others, "reference")
    alone = _call(batch, (feature,), "reference")
    plain = _call(batch, (), "reference")
    assert abs(with_all - without) > 1e-3 and abs(alone - plain) > 1e-3


# --------------------------------------------------------------------------- the named losses
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_named_losses_are_special_cases(backend):
    batch = Batch(9, 16)
    a, p, neg, z, comp = batch.a, batch.p, batch.neg, batch.z, batch.comp
    c = lambda *args, **kw: fastcl.contrastive(*args, backend=backend, **kw)
    pairs = [
        (fastcl.infonce(a, p, neg, hard_negative_weight=0.5, backend=backend),
         c(a, p, neg, hard_negative_weight=0.5)),
        (fastcl.infonce(a, p, symmetric=True, backend=backend), c(a, p, symmetric=True)),
        (fastcl.focal_infonce(a, p, neg, m=0.2, backend=backend), c(a, p, neg, focal_m=0.2)),
        (fastcl.dclr_loss(a, p, complementary=comp, phi=PHI, noise=z, noise_steps=2,
                          backend=backend),
         c(a, p, complementary=comp, phi=PHI, noise=z, noise_steps=2)),
        (fastcl.dclr_loss(a, p, complementary=comp, phi=PHI, noise_ratio=1.0,
                          generator=torch.Generator().manual_seed(1), formulation="released",
                          backend=backend),
         c(a, p, complementary=comp, phi=PHI, noise_ratio=1.0,
           generator=torch.Generator().manual_seed(1), formulation="released")),
    ]
    for named, general in pairs:
        assert torch.equal(named, general)


def test_defaults_are_plain_infonce():
    batch = Batch(9, 16)
    assert torch.equal(fastcl.contrastive(batch.a, batch.p), fastcl.infonce(batch.a, batch.p))


@needs_triton
def test_every_combination_launches_a_compiled_variant(monkeypatch):
    """Every flag set the features produce (both directions, the noise update) is one of
    ``VARIANTS``, which the compile check builds for sm_80 and sm_90."""
    from fastcl import tiled
    from fastcl.kernels.configs import VARIANTS
    from fastcl.kernels.contrastive import flags
    seen = []
    # the loss calls and the noise update's driver calls
    for module, name in ((tiled, "contrastive_loss"), (tiled.noise, "contrastive_forward")):
        original = getattr(module, name)

        def spy(ep, *args, _original=original, **kw):
            seen.append(ep)
            return _original(ep, *args, **kw)
        monkeypatch.setattr(module, name, spy)
    batch = Batch(5, 8)
    for combo in COMBOS:
        _call(batch, combo, "tiled", noise_steps=1)
    for combo in RELEASED:
        _call(batch, combo, "tiled", formulation="released", noise_steps=1)
    # fastcl.layout's rules, with and without focal and GIST's guide
    guide = (batch.comp[0], batch.comp[0], None, None)
    for focal in (None, 0.3):
        fastcl.contrastive(batch.a, batch.p, backend="tiled", focal_m=focal,
                           directions=("query_to_doc", "doc_to_query"))
        fastcl.contrastive(batch.a, batch.p, backend="tiled", focal_m=focal,
                           directions=fastcl.layout.gist(), guide=guide)
    # issue #46's row features (tests/test_feature_masks.py): the margin with each of the
    # above, the debiased loss with the flag sets its Triton path takes (spec.TRITON_PRIOR)
    for combo in COMBOS:
        _call(batch, combo, "tiled", noise_steps=1, false_negative_margin=0.1)
    for focal in (None, 0.3):
        fastcl.contrastive(batch.a, batch.p, backend="tiled", focal_m=focal,
                           directions=("query_to_doc", "doc_to_query"), false_negative_margin=0.1)
        fastcl.contrastive(batch.a, batch.p, backend="tiled", focal_m=focal,
                           directions=fastcl.layout.gist(), guide=guide, false_negative_margin=0.1)
    for combo, extra in [((), {}), (("hard",), {}), (("focal",), {}), (("mask",), {}),
                         ((), dict(false_negative_margin=0.1)),
                         (("focal",), dict(false_negative_margin=0.1)),
                         (("hard",), dict(false_negative_margin=0.1)),
                         (("mask",), dict(false_negative_margin=0.1)),
                         ((), dict(directions=("query_to_doc", "query_to_query"))),
                         ((), dict(guide=guide)),
                         ((), dict(directions=("query_to_doc", "query_to_query"),
                                   false_negative_margin=0.1)),
                         ((), dict(guide=guide, false_negative_margin=0.1))]:
        _call(batch, combo, "tiled", positive_prior=0.1, **extra)
    # soft targets (tests/test_soft_targets.py): every combination and the anchor-side rules
    for combo in COMBOS:
        _call(batch, combo, "tiled", noise_steps=1, label_smoothing=0.1)
    for focal in (None, 0.3):
        fastcl.contrastive(batch.a, batch.p, backend="tiled", focal_m=focal, label_smoothing=0.1,
                           directions=("query_to_doc", "query_to_query"))
        fastcl.contrastive(batch.a, batch.p, backend="tiled", focal_m=focal, label_smoothing=0.1,
                           directions=fastcl.layout.gist(True, False), guide=guide)
    launched = {tuple(sorted(flags(ep).items())) for ep in seen}
    known = {tuple(sorted(v.items())) for v in VARIANTS.values()}
    assert launched <= known, launched - known
    assert len(launched) == len(known)     # and every variant has a caller


# --------------------------------------------------------------------------- hand-computed
def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


E = math.exp


def _lse(*xs):
    return math.log(sum(E(x) for x in xs))


class TestHandComputed:
    # Unit 2-D vectors keep every cosine countable.
    anchors = [[1.0, 0.0], [0.0, 2.0]]     # norm 2 on row 1: cosines must normalize it away

    def test_focal_with_weighted_hard_negative(self):
        pos = _t([[0.6, 0.8], [0.0, 1.0]])
        neg = _t([[0.0, 1.0], [-1.0, 0.0]])
        m, tau, w = 0.3, 0.5, 0.7
        # s row 0: [0.6, 0 | 0, -1];  row 1: [0.8, 1 | 1, 0]
        # positive s²/τ, every other column s(s+m)/τ, + w on the own hard negative (N + i)
        row0 = -0.36 / tau + _lse(0.36 / tau, 0.0, 0.0 + w, (-1) * (-1 + m) / tau)
        row1 = -1 / tau + _lse(0.8 * (0.8 + m) / tau, 1 / tau, 1 * (1 + m) / tau, 0.0 + w)
        for backend in ("reference", "tiled"):
            loss = fastcl.contrastive(_t(self.anchors), pos, neg, temperature=tau, focal_m=m,
                                      hard_negative_weight=w, backend=backend)
            assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-12), backend

    def test_focal_mask_and_noise(self):
        pos = _t([[0.6, 0.8], [0.8, 0.6]])
        noise = _t([[-1.0, 0.0]])
        # complementary: c_0 · c⁺_1 = 0.95 ≥ φ drops (0, 1); c_1 · c⁺_0 = 0 keeps (1, 0)
        comp = (_t([[1.0, 0.0], [0.0, 1.0]]), _t([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95**2)]]))
        m, tau = 0.3, 0.5
        # s row 0: [0.6, (0.8 dropped) | -1];  row 1: [0.8, 0.6 | 0]; the noise column gets
        # the negative modulation
        row0 = -0.36 / tau + _lse(0.36 / tau, (-1) * (-1 + m) / tau)
        row1 = -0.36 / tau + _lse(0.8 * (0.8 + m) / tau, 0.36 / tau, 0.0)
        for backend in ("reference", "tiled"):
            loss = fastcl.contrastive(_t(self.anchors), pos, temperature=tau, focal_m=m,
                                      complementary=comp, phi=0.9, noise=noise, noise_steps=0,
                                      backend=backend)
            assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-12), backend

    def test_symmetric_mask_and_noise(self):
        pos = _t([[0.6, 0.8], [0.8, 0.6]])
        noise = _t([[-1.0, 0.0]])
        comp = (_t([[1.0, 0.0], [0.0, 1.0]]), _t([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95**2)]]))
        # forward (plain): row 0 [0.6, (dropped) | -1], row 1 [0.8, 0.6 | 0]
        fwd = 0.5 * ((-0.6 + _lse(0.6, -1.0)) + (-0.6 + _lse(0.8, 0.6, 0.0)))
        # reverse: positives against anchors, no noise column; α'_ij = 1[cos(c⁺_i, c_j) < φ]:
        # c⁺_1 · c_0 = 0.95 drops (1, 0); row 0 [0.6, 0.8], row 1 [(dropped), 0.6]
        rev = 0.5 * ((-0.6 + _lse(0.6, 0.8)) + (-0.6 + _lse(0.6)))
        for backend in ("reference", "tiled"):
            loss = fastcl.contrastive(_t(self.anchors), pos, temperature=1.0, complementary=comp,
                                      phi=0.9, noise=noise, noise_steps=0, symmetric=True,
                                      backend=backend)
            assert loss.item() == pytest.approx(0.5 * (fwd + rev), rel=1e-12), backend


# --------------------------------------------------------------------------- gradcheck
GRADCHECK = [("focal", "hard", "mask", "noise", "symmetric"), ("focal", "mask", "symmetric"),
             ("hard", "noise"), ("focal", "queue", "noise")]


@pytest.mark.parametrize("combo", GRADCHECK, ids=["+".join(c) for c in GRADCHECK])
def test_reference_gradcheck(combo):
    batch = Batch(5, 6, k_queue=3 if "queue" in combo else None, dtype=torch.float64)
    negatives, kw = kwargs(batch, combo)
    neg = negatives if negatives is not None else batch.neg
    fn = lambda a, p, n: reference.contrastive(*build_spec(a, p, n if negatives is not None else None,
                                                           backend="reference", **kw))
    assert torch.autograd.gradcheck(fn, (batch.a, batch.p, neg), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_reference_gradcheck_offset_and_released():
    batch = Batch(6, 5, dtype=torch.float64)
    comp = (batch.comp[0][2:5], batch.comp[1])
    fn = lambda a, p: reference.contrastive(*build_spec(a[2:5], p, temperature=0.5, focal_m=0.3,
                                                        complementary=comp, phi=PHI, noise=batch.z,
                                                        noise_steps=0, anchor_offset=2,
                                                        backend="reference"))
    assert torch.autograd.gradcheck(fn, (batch.a, batch.p), eps=1e-6, atol=1e-5, rtol=1e-4)
    fn = lambda a, p: reference.contrastive(*build_spec(a, p, temperature=0.5, complementary=batch.comp,
                                                        phi=PHI, noise=batch.z, noise_steps=0,
                                                        formulation="released", backend="reference"))
    assert torch.autograd.gradcheck(fn, (batch.a, batch.p), eps=1e-6, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("option,value,named", [
    ("focal_m", 0.3, "focal_m"), ("hard_negative_weight", 0.5, "hard_negative_weight"),
    ("symmetric", True, "symmetric"), ("negatives", True, "negatives")])
def test_released_refuses_what_the_authors_code_lacks(option, value, named):
    batch = Batch(6, 8)
    kw = {} if option == "negatives" else {option: value}
    negatives = batch.neg if option in ("negatives", "hard_negative_weight") else None
    with pytest.raises(ValueError, match=f"formulation='released'.*{named}.*formulation='paper'"):
        fastcl.contrastive(batch.a, batch.p, negatives, formulation="released",
                           complementary=batch.comp, **kw)


def test_released_names_every_extra_option():
    batch = Batch(6, 8)
    with pytest.raises(ValueError, match="got focal_m, negatives, hard_negative_weight, symmetric"):
        fastcl.contrastive(batch.a, batch.p, batch.neg, focal_m=0.3, hard_negative_weight=1.0,
                           symmetric=True, formulation="released")


@pytest.mark.parametrize("call,error,match", [
    (lambda b: fastcl.contrastive(b.a, b.p, hard_negative_weight=0.5), ValueError,
     "hard_negative_weight needs one hard negative per anchor"),
    (lambda b: fastcl.contrastive(b.a, b.p, b.neg[:3], hard_negative_weight=0.5), ValueError,
     r"hard_negative_weight needs .*\(6 negatives\), got 3 negatives"),
    (lambda b: fastcl.contrastive(b.a[:3], b.p, symmetric=True, anchor_offset=0), ValueError,
     "symmetric=True needs every anchor"),
    (lambda b: fastcl.contrastive(b.a, b.p, symmetric="yes"), TypeError, "symmetric must be True or False"),
    (lambda b: fastcl.contrastive(b.a, b.p, focal_m=float("nan")), ValueError, "focal_m must be finite"),
    (lambda b: fastcl.contrastive(b.a, b.p, focal_m="0.3x"), TypeError, "focal_m must be a real number"),
    (lambda b: fastcl.contrastive(b.a, b.p, noise_ratio=-1.0), ValueError, "noise_ratio must be >= 0"),
    (lambda b: fastcl.contrastive(b.a, b.p, noise=b.z[:, :3]), ValueError, "noise has width 3"),
    (lambda b: fastcl.contrastive(b.a, b.p, noise_steps=-1, noise_ratio=1.0), ValueError,
     "noise_steps must be a non-negative integer"),
    (lambda b: fastcl.contrastive(b.a, b.p, complementary=(b.comp[0], b.comp[1][:2])), ValueError,
     r"complementary\[1\] has 2 rows"),
    (lambda b: fastcl.contrastive(b.a, b.p, complementary=b.comp, phi=1.5), ValueError,
     r"phi is a cosine threshold and must lie in \[-1, 1\]"),
    (lambda b: fastcl.contrastive(b.a, b.p, formulation="authors"), ValueError,
     "formulation must be one of 'paper', 'released'"),
    (lambda b: fastcl.contrastive(b.a, b.p, temperature=0.0), ValueError, "temperature must be > 0"),
    (lambda b: fastcl.contrastive(b.a, b.p, b.neg[:, :4]), ValueError, "negatives has width 4"),
    # issue #42: each of these ran, or failed naming nothing
    (lambda b: fastcl.contrastive(b.a, b.p, directions=None), TypeError,
     "directions must be a tuple of names"),
    (lambda b: fastcl.contrastive(b.a, b.p, margin_strategy="x"), ValueError,
     "margin_strategy must be one of"),
    (lambda b: fastcl.contrastive(b.a, b.p, temperature=True), TypeError,
     "temperature must be a real number, got True"),
    (lambda b: fastcl.infonce(b.a, b.p, temperature=True), TypeError,
     "temperature must be a real number, got True"),
])
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call(Batch(6, 8))


#: Every objective of conftest.objectives, and the layout rules (MNRL's directions with a
#: hard negative each, GIST's guide): ``f(anchors, positives, extra, **kw)``.
def _objectives_with_rules(n, k):
    out = dict(conftest_objectives(n, k))
    out["mnrl-directions"] = lambda a, p, x, **kw: fastcl.contrastive(
        a, p, x[:n], directions=("query_to_doc", "query_to_query", "doc_to_query"), **kw)
    guide = lambda a: tuple(correlated(t, 0.3, seed=9).detach() for t in (a, a))  # noqa: E731
    out["gist-guide"] = lambda a, p, x, **kw: fastcl.contrastive(
        a, p, directions=fastcl.layout.gist(True, True), guide=(*guide(a), None, None), **kw)
    return out


REQUIRES_GRAD = list(itertools.product([False, True], repeat=3))


@pytest.mark.parametrize("backend", ["reference", "tiled", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("name", list(_objectives_with_rules(1, 0)))
def test_every_requires_grad_combination(name, backend):
    """Each of anchors, positives and the extra rows (negatives, hard negatives or noise) may
    or may not take a gradient — a frozen document side, a fixed queue — on every objective:
    the gradients that exist equal the reference's with all three taking one (float32, the
    backend's tolerance), and the others are None (issue #42: the Triton launcher crashed
    when the anchors took a gradient and the positives did not)."""
    n, k, d = 5, 5, 7
    fn = _objectives_with_rules(n, k)[name]
    base = [make(n, d, seed=21), None, make(k, d, seed=22)]
    base[1] = correlated(base[0], 0.7)
    leaves = [t.detach().requires_grad_() for t in base]
    _, want = loss_and_grads(lambda: fn(*leaves, backend="reference"), leaves)
    tol = TRITON_TOL if backend == "triton" else TOL[torch.float32]
    for flags in REQUIRES_GRAD:
        xs = [t.detach().to(TRITON_DEVICE if backend == "triton" else "cpu").requires_grad_(f)
              for t, f in zip(base, flags)]
        loss = fn(*xs, backend=backend)
        if not loss.requires_grad:
            assert not any(flags[:2]), flags
            continue
        loss.backward()
        for which, x, w, f in zip(("anchors", "positives", "extra"), xs, want, flags):
            if not f or w is None:
                assert x.grad is None or not f, (flags, which)
                continue
            torch.testing.assert_close(x.grad.cpu(), w, **tol, msg=lambda s: f"{flags} {which}: {s}")


def _near_zero_case(tau, focal_m, target, d=8, seed=0):
    """One anchor (float32), its positive at cosine 0.95, one hard negative at cosine 0.3,
    and the log-weight w on it that puts the true loss ``log(1 + e^(l_neg − l_pos))`` at
    ``target`` (the margin that a trained model's easy batch has)."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, 3, generator=g, dtype=torch.float64))
    u, v, w_ = basis.T
    a = u
    p = 0.95 * u + math.sqrt(1 - 0.95**2) * v
    h = 0.3 * u + math.sqrt(1 - 0.3**2) * w_
    a, p, h = (x[None].float() for x in (a, p, h))
    s = lambda x, y: float(torch.nn.functional.cosine_similarity(x.double(), y.double()))  # noqa: E731
    s_p, s_h = s(a, p), s(a, h)
    m = focal_m
    l_p = (s_p * s_p if m is not None else s_p) / tau
    l_h = (s_h * (s_h + m) if m is not None else s_h) / tau
    weight = math.log(math.expm1(target)) - (l_h - l_p)
    return a, p, h, weight


def _float64_oracle(a, p, h, tau, focal_m, weight):
    """``log(1 + Σ_{j≠i} e^(l_ij − l_ii))`` in float64 on the float32 inputs, and its
    gradients (autograd): a formula of its own, not a backend."""
    a, p, h = (x.detach().double().requires_grad_() for x in (a, p, h))
    k = torch.cat([p, h])
    s = torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(k, dim=1).T
    m = focal_m
    l = torch.stack([s[:, 0] ** 2 if m is not None else s[:, 0],
                     s[:, 1] * (s[:, 1] + m) if m is not None else s[:, 1]], dim=1) / tau
    l = l + torch.tensor([0.0, weight], dtype=torch.float64)
    loss = torch.log1p(torch.exp(l[:, 1] - l[:, 0])).mean()
    return loss.item(), torch.autograd.grad(loss, (a, p, h))


NEAR_ZERO = [(tau, m, target) for tau in (0.01, 0.05, 0.2, 1.0) for m in (None, 0.3)
             for target in (1e-3, 1e-8, 1e-15, 1e-22, 1e-30)]


@pytest.mark.parametrize("widths", [None, (8,)], ids=["one-width", "matryoshka"])
@pytest.mark.parametrize("backend", ["reference", "tiled", pytest.param("triton", marks=needs_triton)])
def test_near_zero_losses_keep_their_digits(backend, widths):
    """Where the positive dominates (a trained model on an easy batch) the loss is
    ``log(1 + Σ_{j≠i} e^(l_ij − l_ii))``, not ``lse − l_ii``, and the positive's gradient is
    minus the others' share of the softmax, not ``p_ii − 1``: in float32 the loss and every
    gradient stay within 1e-5 (relative) of float64 for losses from 1e-3 down to 1e-30, over
    τ, hard-negative margins and focal modulation (issue #42: the tiled path returned exactly
    0 for a true loss of 6.5e-7 at τ = 0.05, and both gradients were 9–13 % off). Within
    ``4ε·max|l|`` where that is larger: float32's own rounding of a logit of size |l| moves
    ``e^(l_ij − l_ii)`` by as much (τ = 0.01, whose logits reach 130 with focal, and margins
    near −70 at τ = 1; measured: at most 2.5e-5 there, 8e-6 elsewhere). ``matryoshka``: the
    same loss through the Matryoshka epilogue (one width, the whole d)."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    eps = torch.finfo(torch.float32).eps
    for tau, m, target in NEAR_ZERO:
        a, p, h, weight = _near_zero_case(tau, m, target)
        want, want_g = _float64_oracle(a, p, h, tau, m, weight)
        xs = [x.to(device).requires_grad_() for x in (a, p, h)]
        loss = fastcl.contrastive(*xs, temperature=tau, focal_m=m, hard_negative_weight=weight,
                                  matryoshka_dims=widths, backend=backend)
        got_g = torch.autograd.grad(loss, xs)
        case = f"τ={tau} m={m} loss={want:.3g}"
        tol = max(1e-5, 4 * eps * ((1 + abs(m or 0)) / tau + abs(weight)))
        assert abs(loss.item() - want) <= tol * want, f"{case}: {loss.item()!r}"
        for name, g, w in zip(("anchors", "positives", "negatives"), got_g, want_g):
            err = ((g.double().cpu() - w).norm() / w.norm()).item()
            assert err <= tol, f"{case}: {name}' gradient {err:.3g} relative"


RELEASED_NEAR_ZERO = [(tau, target) for tau in (0.02, 0.05) for target in (1e-3, 1e-7, 1e-11)]


@pytest.mark.parametrize("backend", ["reference", "tiled", pytest.param("triton", marks=needs_triton)])
def test_released_near_zero_losses_keep_their_digits(backend):
    """The released DCLR formulation (BCE on the row softmax) where the positive dominates:
    ``−log p_ii`` is the softplus of the others' log-sum-exp over the positive, and
    ``1 − p_ii`` their share, formed apart: in float32 the loss and the gradients are within
    1e-5 of the authors' code in float64 (itself exact to that for losses ≥ 1e-11; issue #42:
    3e-4 off before). One anchor, its positive at cosine 0.95 and a noise row placed for
    each target loss."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    g = torch.Generator().manual_seed(3)
    u, v, w = torch.linalg.qr(torch.randn(8, 3, generator=g, dtype=torch.float64))[0].T
    for tau, target in RELEASED_NEAR_ZERO:
        kappa = 0.95 + tau * math.log(target)             # the noise row's cosine
        a, p = u[None].float(), (0.95 * u + math.sqrt(1 - 0.95**2) * v)[None].float()
        z = (kappa * u + math.sqrt(1 - kappa**2) * w)[None].float()
        a64, p64 = a.double().requires_grad_(), p.double().requires_grad_()
        logits = reference.cosine_matrix(a64, torch.cat([p64, z.double()])) / tau
        want = torch.nn.functional.binary_cross_entropy(
            torch.softmax(logits, dim=1), torch.tensor([[1.0, 0.0]], dtype=torch.float64))
        want_g = torch.autograd.grad(want, (a64, p64))
        xs = [x.to(device).requires_grad_() for x in (a, p)]
        loss = fastcl.dclr_loss(*xs, noise=z.to(device), noise_steps=0, temperature=tau,
                                formulation="released", backend=backend)
        got_g = torch.autograd.grad(loss, xs)
        case = f"τ={tau} loss={want.item():.3g}"
        assert abs(loss.item() - want.item()) <= 1e-5 * want.item(), f"{case}: {loss.item()!r}"
        for name, gx, wx in zip(("anchors", "positives"), got_g, want_g):
            err = ((gx.double().cpu() - wx).norm() / wx.norm()).item()
            assert err <= 1e-5, f"{case}: {name}' gradient {err:.3g} relative"


# --------------------------------------------------------------------------- the spec
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_symmetric_is_the_per_direction_layout(backend):
    """``symmetric=True`` is ``directions=("query_to_doc", "doc_to_query"),
    partition_mode="per_direction"`` (fastcl.spec.SYMMETRIC), which the fused paths run as
    two directions: the same loss and gradients in float64 as that layout on 2N rows against
    every block (taken here through ids that drop nothing), with focal, hard negatives and
    noise (the forward direction's only)."""
    batch = Batch(7, 5, dtype=torch.float64)
    kw = dict(temperature=0.5, focal_m=0.3, hard_negative_weight=0.4, noise=batch.z,
              noise_steps=0, backend=backend)
    ids = (torch.arange(7), 100 + torch.arange(7), 200 + torch.arange(7))   # all distinct
    leaves = batch.leaves()
    sym, g_sym = loss_and_grads(lambda: fastcl.contrastive(batch.a, batch.p, batch.neg,
                                                           symmetric=True, **kw), leaves)
    lay, g_lay = loss_and_grads(lambda: fastcl.contrastive(
        batch.a, batch.p, batch.neg, directions=("query_to_doc", "doc_to_query"),
        partition_mode="per_direction", duplicate_ids=ids, **kw), leaves)
    torch.testing.assert_close(sym, lay, **TOL[torch.float64])
    for x, y in zip(g_sym, g_lay):
        torch.testing.assert_close(x, y, **TOL[torch.float64])


def test_the_epilogue_encodes_itself_for_the_custom_op():
    """Epilogue.op_args and Epilogue.from_op_args are inverses (the op's one encoding): every
    field that travels, the "off" encodings included."""
    from fastcl.layout import gist
    from fastcl.spec import Epilogue, Matryoshka
    c = (torch.ones(3, 2), torch.ones(3, 2))
    for ep in (Epilogue(0.05),
               Epilogue(0.1, focal_m=0.3, hard_negative_weight=-0.25, phi=0.5, complementary=c,
                        formulation="released", anchor_offset=2, chunk_size=7,
                        matryoshka=Matryoshka((2, 8), (0.5, 1.0))),
               Epilogue(0.05, layout=gist(), blocks=(3, 3, 0, 3), hardness=("hard_negatives", 2.0),
                        guide=(c[0], c[1], c[0][:, 0]), ids=(torch.arange(9), torch.arange(3)))):
        back = Epilogue.from_op_args(*ep.op_args())
        for field in ("temperature", "focal_m", "hard_negative_weight", "phi", "formulation",
                      "anchor_offset", "chunk_size", "matryoshka", "layout", "blocks", "hardness"):
            assert getattr(back, field) == getattr(ep, field), field
        for field in ("complementary", "guide", "ids"):
            got, want = getattr(back, field), getattr(ep, field)
            assert (got is None) == (want is None) and all(x is y for x, y in zip(got or (), want or ()))


def test_two_directions_over_given_anchor_candidates_match_the_reference():
    """``per_direction`` with ``doc_to_query`` over given ``anchor_candidates``: the positive
    side's own anchor is the anchor itself, not the candidates' row ``anchor_offset + i``
    (they differ here), so the fused path must not split it into two plain directions (the
    split gave 0.0 where the reference gives 20.0)."""
    g = torch.Generator().manual_seed(3)
    a, p, cands = (torch.randn(rows, 5, generator=g, dtype=torch.float64, requires_grad=True)
                   for rows in (3, 4, 4))
    kw = dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction",
              temperature=0.05, anchor_offset=1, anchor_candidates=cands)
    want = fastcl.contrastive(a, p, backend="reference", **kw)
    got = fastcl.contrastive(a, p, backend="tiled", chunk_size=2, **kw)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    for x, y in zip(torch.autograd.grad(got, (a, p, cands)), torch.autograd.grad(want, (a, p, cands))):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
