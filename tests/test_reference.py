"""The reference objectives against cases worked by hand, and gradcheck in float64."""

import math

import pytest
import torch

import fastcl
from fastcl import reference

from fastcl.spec import build_spec

from conftest import correlated, make
from test_matches_reference import PHI, Batch


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


E = math.exp


def _lse(*xs):
    return math.log(sum(E(x) for x in xs))


def _bce(rows):
    """The released DCLR loss from its logits: binary cross-entropy of each row's softmax
    against the row's own column, over every entry."""
    total = 0.0
    for i, row in enumerate(rows):
        z = sum(E(v) for v in row)
        total += sum(-math.log(E(v) / z) if j == i else -math.log(1 - E(v) / z) for j, v in enumerate(row))
    return total / sum(map(len, rows))


# Orthonormal 2-D rows keep every cosine countable. A's row 1 has norm 2: the cosines must
# normalize it away.
A, I2 = t([[1.0, 0.0], [0.0, 2.0]]), t([[1.0, 0.0], [0.0, 1.0]])
POS = t([[1.0, 0.0], [0.6, 0.8]])          # A's cosines: row 0 [1, 0.6], row 1 [0, 0.8]
TILT = t([[0.6, 0.8], [0.0, 1.0]])         # row 0 [0.6, 0], row 1 [0.8, 1]
SKEW = t([[0.6, 0.8], [0.8, 0.6]])         # row 0 [0.6, 0.8], row 1 [0.8, 0.6]
NEG = t([[0.0, 1.0], [-1.0, 0.0]])         # row 0 [0, -1], row 1 [1, 0]
NOISE = t([[-1.0, 0.0]])                   # row 0 −1, row 1 0
# complementary: c_0 · c⁺_1 = 0.95 ≥ φ = 0.9 drops (0, 1); c_1 · c⁺_0 = 0 keeps (1, 0)
COMP = (I2, t([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95**2)]]))
R = 1 / math.sqrt(2)
softplus = lambda v: math.log1p(E(v))  # noqa: E731
hinge = lambda delta: max(delta + 0.1, 0) + max(-delta - 0.3, 0)  # noqa: E731  (margins a, b = 0.1, 0.3)
M, W = 0.3, 0.7                            # focal's m, the hard negative's log-weight

#: name -> (the reference's value, the same worked by hand)
HAND = {
    # s = I, τ = 1: every row is −1 + log(e + 1)
    "infonce-identity": (lambda: reference.infonce(A, t([[3.0, 0.0], [0.0, 1.0]]), temperature=1.0),
                         -1 + _lse(1, 0)),
    "infonce-temperature": (lambda: reference.infonce(A, POS, temperature=0.5),
                            ((-1 / 0.5 + _lse(1 / 0.5, 0.6 / 0.5)) + (-0.8 / 0.5 + _lse(0, 0.8 / 0.5))) / 2),
    # candidates [h⁺; h⁻]; anchor i's own hard negative gets +w: row 0 [1, 0 | 0 + w, −1], row 1 [0, 1 | 1, 0 + w]
    "hard-negative-weight": (lambda: reference.infonce(A, I2, NEG, temperature=1.0, hard_negative_weight=W),
                             ((-1 + _lse(1, 0, W, -1)) + (-1 + _lse(0, 1, 1, W))) / 2),
    # the reverse direction: positives (1, 0) and (.6, .8) against the anchors
    "infonce-reversed": (lambda: reference.infonce(POS, A, temperature=1.0),
                         ((-1 + _lse(1, 0)) + (-0.8 + _lse(0.6, 0.8))) / 2),
    "symmetric": (lambda: reference.infonce(A, POS, temperature=1.0, symmetric=True),
                  (((-1 + _lse(1, 0.6)) + (-0.8 + _lse(0, 0.8))) / 2
                   + ((-1 + _lse(1, 0)) + (-0.8 + _lse(0.6, 0.8))) / 2) / 2),
    # positive logit s²/τ, negative s(s+m)/τ
    "focal": (lambda: reference.focal_infonce(I2, TILT, temperature=0.5, m=M),
              ((-0.36 / 0.5 + _lse(0.36 / 0.5, 0.0)) + (-1 / 0.5 + _lse(0.8 * (0.8 + M) / 0.5, 1 / 0.5))) / 2),
    # a masked negative leaves the denominator, the noise column stays: row 0 [0.6, (0.8) | −1], row 1 [0.8, 0.6 | 0]
    "dclr-mask": (lambda: reference.dclr_loss(I2, SKEW, complementary=COMP, phi=0.9, noise=NOISE, noise_steps=0,
                                              temperature=1.0),
                  ((-0.6 + _lse(0.6, -1)) + (-0.6 + _lse(0.8, 0.6, 0))) / 2),
    # the released test cos/τ ≤ 20φ equals cos ≤ φ only at τ = 0.05; the masked logit becomes 0, not −∞
    "dclr-released": (lambda: reference.dclr_loss(I2, SKEW, complementary=COMP, phi=0.9, noise=NOISE,
                                                  noise_steps=0, temperature=0.05, formulation="released"),
                      _bce([[0.6 / 0.05, 0.0, -1 / 0.05], [0.8 / 0.05, 0.6 / 0.05, 0.0]])),
    # InfoNCE plus λ·rd: cos(h, h⁺) = [0.6, 1], cos(h, h⁻) = [0, 1/√2], cos(h⁺, h⁻) = [0.8, 1/√2]
    "escl": (lambda: reference.escl_loss(I2, TILT, t([[0.0, 1.0], [1.0, 1.0]]), temperature=0.5, weight=0.1),
             ((-0.6 / 0.5 + _lse(0.6 / 0.5, 0)) + (-1 / 0.5 + _lse(0.8 / 0.5, 1 / 0.5))) / 2
             + 0.1 * (softplus(-0.6 / 0.5) + 2 * softplus((R - 1) / 0.5) + softplus(0.2 / 0.5)) / 4),
    # the margin form: relu(Δ + a) + relu(−Δ − b), Δ = cos(h', h⁻) − cos(h, h⁺)
    "escl-margin": (lambda: reference.escl_loss(I2, TILT, t([[0.0, 1.0], [1.0, 1.0]]), temperature=0.5,
                                                weight=0.1, rd="margin"),
                    ((-0.6 / 0.5 + _lse(0.6 / 0.5, 0)) + (-1 / 0.5 + _lse(0.8 / 0.5, 1 / 0.5))) / 2
                    + 0.1 * (hinge(-0.6) + 2 * hinge(R - 1) + hinge(0.8 - 0.6)) / 4),
    "alignment": (lambda: fastcl.alignment(t([[1.0, 0.0], [0.0, 3.0]]), t([[2.0, 0.0], [1.0, 0.0]])), (0 + 2) / 2),
    "alignment-alpha-1": (lambda: fastcl.alignment(t([[1.0, 0.0], [0.0, 3.0]]), t([[2.0, 0.0], [1.0, 0.0]]),
                                                   alpha=1), (0 + math.sqrt(2)) / 2),
    # squared distances 2, 4, 2
    "uniformity": (lambda: fastcl.uniformity(t([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])),
                   math.log((E(-4) + E(-8) + E(-4)) / 3)),
    # one anchor, one noise row: ∂/∂z of cos(h, z)/τ is the tangent (h − ẑ(ẑ·h))/(‖z‖τ), the
    # softmax over a single column 1: the step is lr along (1, 0)
    "noise-step": (lambda: reference.dclr_noise(t([[1.0, 0.0]]), t([[1.0, 0.0]]), 1, steps=1, lr=0.1,
                                                noise=t([[0.0, 2.0]])), [[0.1, 2.0]]),
}
#: fastcl.contrastive's features on both the reference and the tiled path (within 1e-12)
HAND_FEATURES = {
    # every column but the positive s(s+m)/τ, + w on the own hard negative (N + i):
    # row 0 [0.6, 0 | 0, −1], row 1 [0.8, 1 | 1, 0]
    "focal-hard": (dict(negatives=NEG, temperature=0.5, focal_m=M, hard_negative_weight=W),
                   ((-0.36 / 0.5 + _lse(0.36 / 0.5, 0.0, 0.0 + W, (-1) * (-1 + M) / 0.5))
                    + (-1 / 0.5 + _lse(0.8 * (0.8 + M) / 0.5, 1 / 0.5, 1 * (1 + M) / 0.5, 0.0 + W))) / 2),
    # the noise column takes the negative modulation; (0, 1) dropped
    "focal-mask-noise": (dict(positives=SKEW, temperature=0.5, focal_m=M, complementary=COMP, phi=0.9,
                              noise=NOISE, noise_steps=0),
                         ((-0.36 / 0.5 + _lse(0.36 / 0.5, (-1) * (-1 + M) / 0.5))
                          + (-0.36 / 0.5 + _lse(0.8 * (0.8 + M) / 0.5, 0.36 / 0.5, 0.0))) / 2),
    # forward as dclr-mask; reverse (positives against anchors, no noise column),
    # α'_ij = 1[cos(c⁺_i, c_j) < φ]: c⁺_1 · c_0 = 0.95 drops (1, 0): row 0 [0.6, 0.8], row 1 [(0.8), 0.6]
    "symmetric-mask-noise": (dict(positives=SKEW, temperature=1.0, complementary=COMP, phi=0.9, noise=NOISE,
                                  noise_steps=0, symmetric=True),
                             0.5 * (0.5 * ((-0.6 + _lse(0.6, -1.0)) + (-0.6 + _lse(0.8, 0.6, 0.0)))
                                    + 0.5 * ((-0.6 + _lse(0.6, 0.8)) + (-0.6 + _lse(0.6))))),
}


@pytest.mark.parametrize("name,backend", [(n, None) for n in HAND]
                         + [(n, b) for n in HAND_FEATURES for b in ("reference", "tiled")])
def test_hand_computed(name, backend):
    """The reference (and for fastcl.contrastive's features the tiled path too) equals the
    value worked by hand: within 1e-6 relative, the features' within 1e-12."""
    if backend is None:
        got, want = HAND[name][0](), HAND[name][1]
        torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=1e-6, atol=1e-12)
        return
    kw, want = HAND_FEATURES[name]
    kw = dict(kw)
    got = fastcl.contrastive(A, kw.pop("positives", TILT), kw.pop("negatives", None), backend=backend, **kw)
    assert got.item() == pytest.approx(want, rel=1e-12)


# --------------------------------------------------------------------------- gradcheck
def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


N, D = 4, 5


def _views(k=N):
    a = make(N, D, dtype=torch.float64)
    return a, correlated(a), make(k, D, dtype=torch.float64, seed=7)


#: name -> (K extra rows, or None for none; the loss of (a, p[, extra]))
GRADCHECKS = {
    "infonce": (None, lambda a, p, **kw: fastcl.infonce(a, p, **kw)),
    "infonce-hard-negatives": (N, lambda a, p, n, **kw: fastcl.infonce(
        a, p, n, hard_negative_weight=0.5, temperature=0.2, **kw)),
    "infonce-symmetric": (3, lambda a, p, n, **kw: fastcl.infonce(a, p, n, symmetric=True, temperature=0.2, **kw)),
    "focal": (3, lambda a, p, n, **kw: fastcl.focal_infonce(a, p, n, temperature=0.2, **kw)),
    **{f"escl-{rd}": (N, lambda a, p, s, rd=rd, **kw: fastcl.escl_loss(a, p, s, temperature=0.2, weight=0.5,
                                                                         rd=rd, **kw))
       for rd in ("softplus", "margin")},
}


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("name", list(GRADCHECKS))
def test_gradcheck(name, backend):
    k, fn = GRADCHECKS[name]
    a, p, x = _views(k or N)
    _gradcheck(lambda *xs: fn(*xs, backend=backend, chunk_size=3), *((a, p) if k is None else (a, p, x)))


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("formulation", ["paper", "released"])
def test_gradcheck_dclr(backend, formulation):
    a, p, _ = _views()
    c = make(N, 3, dtype=torch.float64, seed=3, grad=False)
    comp = (c, c + 0.3 * make(N, 3, dtype=torch.float64, seed=4, grad=False))
    noise = make(6, D, dtype=torch.float64, seed=5, grad=False)
    kw = dict(complementary=comp, phi=0.3, temperature=0.2, formulation=formulation, backend=backend)
    # the noise update is a detached function of the anchors: the check must not see it,
    # so compare with the noise it produced held fixed
    z = fastcl.dclr_noise(a, p, 6, steps=2, noise=noise, temperature=0.2, backend=backend)
    _gradcheck(lambda a, p: fastcl.dclr_loss(a, p, noise=z, noise_steps=0, chunk_size=3, **kw), a, p)
    assert torch.allclose(fastcl.dclr_loss(a, p, noise=noise, noise_steps=2, chunk_size=3, **kw),
                          fastcl.dclr_loss(a, p, noise=z, noise_steps=0, **kw))


def test_gradcheck_metrics():
    a, p, _ = _views()
    _gradcheck(lambda x, y: fastcl.alignment(x, y), a, p)
    _gradcheck(lambda x: fastcl.uniformity(x), a)


GRADCHECK = [("focal", "hard", "mask", "noise", "symmetric"), ("focal", "mask", "symmetric"),
             ("hard", "noise"), ("focal", "queue", "noise")]


@pytest.mark.parametrize("combo", GRADCHECK, ids=["+".join(c) for c in GRADCHECK])
def test_reference_gradcheck(combo):
    batch = Batch(5, 6, k_queue=3 if "queue" in combo else None, dtype=torch.float64)
    negatives, kw = batch.kwargs(combo)
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
