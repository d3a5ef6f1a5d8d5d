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


class TestHandComputed:
    # Orthonormal 2-D vectors keep every cosine at 0 or ±1, so each term is countable.
    a = [[1.0, 0.0], [0.0, 2.0]]         # norm 2 on row 1: cosines must normalize it away

    def test_infonce_identity(self):
        # s = I, τ = 1: every row is −1 + log(e + 1)
        loss = reference.infonce(t(self.a), t([[3.0, 0.0], [0.0, 1.0]]), temperature=1.0)
        assert loss.item() == pytest.approx(-1 + math.log(E(1) + 1))

    def test_infonce_temperature(self):
        # row 0: cos = [1, 0]; row 1: cos = [0.6, 0.8] against positives [(1,0), (0.6,0.8)]
        pos = t([[1.0, 0.0], [0.6, 0.8]])
        tau = 0.5
        row0 = -1 / tau + math.log(E(1 / tau) + E(0.6 / tau))
        row1 = -0.8 / tau + math.log(E(0 / tau) + E(0.8 / tau))
        loss = reference.infonce(t(self.a), pos, temperature=tau)
        assert loss.item() == pytest.approx((row0 + row1) / 2)

    def test_supervised_hard_negative_weight(self):
        # candidates [h⁺; h⁻]; anchor i's own hard negative gets +w
        pos = t([[1.0, 0.0], [0.0, 1.0]])
        neg = t([[0.0, 1.0], [-1.0, 0.0]])
        w = 0.7
        # row 0 logits: [1, 0, 0+w, -1];  row 1 logits: [0, 1, 1, 0+w]
        row0 = -1 + math.log(E(1) + E(0) + E(w) + E(-1))
        row1 = -1 + math.log(E(0) + E(1) + E(1) + E(w))
        loss = reference.infonce(t(self.a), pos, neg, temperature=1.0, hard_negative_weight=w)
        assert loss.item() == pytest.approx((row0 + row1) / 2)

    def test_symmetric(self):
        pos = t([[1.0, 0.0], [0.6, 0.8]])
        fwd = reference.infonce(t(self.a), pos, temperature=1.0)
        rev = reference.infonce(pos, t(self.a), temperature=1.0)
        both = reference.infonce(t(self.a), pos, temperature=1.0, symmetric=True)
        assert both.item() == pytest.approx(0.5 * (fwd + rev).item())
        # reverse rows: positives (1,0) and (.6,.8) against anchors (1,0), (0,1)
        rev_hand = 0.5 * ((-1 + math.log(E(1) + E(0))) + (-0.8 + math.log(E(0.6) + E(0.8))))
        assert rev.item() == pytest.approx(rev_hand)

    def test_focal(self):
        # s = [[0.6, 0], [0.8, 1]]; positive logit s², negative s(s+m)
        anchors = t([[1.0, 0.0], [0.0, 1.0]])
        pos = t([[0.6, 0.8], [0.0, 1.0]])
        m, tau = 0.3, 0.5
        row0 = -0.36 / tau + math.log(E(0.36 / tau) + E(0 * (0 + m) / tau))
        row1 = -1 / tau + math.log(E(0.8 * (0.8 + m) / tau) + E(1 / tau))
        loss = reference.focal_infonce(anchors, pos, temperature=tau, m=m)
        assert loss.item() == pytest.approx((row0 + row1) / 2)

    def test_dclr_masked_negative_leaves_denominator(self):
        anchors = t([[1.0, 0.0], [0.0, 1.0]])
        pos = t([[0.6, 0.8], [0.8, 0.6]])
        noise = t([[-1.0, 0.0]])
        # complementary: c_0 · c⁺_1 = 0.95 ≥ φ → drop (0, 1); c_1 · c⁺_0 = 0 → keep
        comp = (t([[1.0, 0.0], [0.0, 1.0]]), t([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95**2)]]))
        tau = 1.0
        # row 0 logits [0.6, (0.8 dropped), -1];  row 1 logits [0.8, 0.6, 0]
        row0 = -0.6 + math.log(E(0.6) + E(-1))
        row1 = -0.6 + math.log(E(0.8) + E(0.6) + E(0))
        loss = reference.dclr_loss(anchors, pos, complementary=comp, phi=0.9, noise=noise,
                                   noise_steps=0, temperature=tau)
        assert loss.item() == pytest.approx((row0 + row1) / 2)

    def test_dclr_released(self):
        anchors = t([[1.0, 0.0], [0.0, 1.0]])
        pos = t([[0.6, 0.8], [0.8, 0.6]])
        noise = t([[-1.0, 0.0]])
        comp = (t([[1.0, 0.0], [0.0, 1.0]]), t([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95**2)]]))
        tau = 0.05  # the released test cos/τ ≤ 20φ equals cos ≤ φ only at τ = 0.05
        # masked logit becomes 0 (not −∞): row 0 logits [0.6/τ, 0, -1/τ]
        rows = [[0.6 / tau, 0.0, -1 / tau], [0.8 / tau, 0.6 / tau, 0.0]]
        total = 0.0
        for i, row in enumerate(rows):
            z = sum(E(v) for v in row)
            for j, v in enumerate(row):
                p = E(v) / z
                total += -math.log(p) if j == i else -math.log(1 - p)
        loss = reference.dclr_loss(anchors, pos, complementary=comp, phi=0.9, noise=noise,
                                   noise_steps=0, temperature=tau, formulation="released")
        assert loss.item() == pytest.approx(total / 6)

    def test_escl(self):
        anchors = t([[1.0, 0.0], [0.0, 1.0]])
        pos = t([[0.6, 0.8], [0.0, 1.0]])
        sens = t([[0.0, 1.0], [1.0, 1.0]])
        tau, lam = 0.5, 0.1
        info = reference.infonce(anchors, pos, temperature=tau)
        # cos(h,h⁺) = [0.6, 1]; cos(h,h⁻) = [0, 1/√2]; cos(h⁺,h⁻) = [0.8, 1/√2]
        sp = lambda v: math.log1p(E(v))
        r = 1 / math.sqrt(2)
        rd = (sp((0 - 0.6) / tau) + sp((r - 1) / tau) + sp((0.8 - 0.6) / tau) + sp((r - 1) / tau)) / 4
        loss = reference.escl_loss(anchors, pos, sens, temperature=tau, weight=lam)
        assert loss.item() == pytest.approx(info.item() + lam * rd)
        # margin form: relu(Δ + a) + relu(−Δ − b), Δ = cos(h', h⁻) − cos(h, h⁺)
        a, b = 0.1, 0.3
        mg = lambda delta: max(delta + a, 0) + max(-delta - b, 0)
        rd_m = (mg(0 - 0.6) + mg(r - 1) + mg(0.8 - 0.6) + mg(r - 1)) / 4
        loss_m = reference.escl_loss(anchors, pos, sens, temperature=tau, weight=lam, rd="margin")
        assert loss_m.item() == pytest.approx(info.item() + lam * rd_m)

    def test_alignment_uniformity(self):
        x = t([[1.0, 0.0], [0.0, 3.0]])
        y = t([[2.0, 0.0], [1.0, 0.0]])
        assert fastcl.alignment(x, y).item() == pytest.approx((0 + 2) / 2)
        assert fastcl.alignment(x, y, alpha=1).item() == pytest.approx((0 + math.sqrt(2)) / 2)
        u = t([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
        # squared distances: 2, 4, 2
        expected = math.log((E(-4) + E(-8) + E(-4)) / 3)
        assert fastcl.uniformity(u).item() == pytest.approx(expected)

    def test_noise_update_single_step_by_hand(self):
        # one anchor, one noise row: ∂/∂z of cos(h, z)/τ is the tangent (h − ẑ(ẑ·h))/(‖z‖τ)
        h = t([[1.0, 0.0]])
        z0 = t([[0.0, 2.0]])
        z = reference.dclr_noise(h, h, 1, steps=1, lr=0.1, noise=z0)
        # softmax over a single column is 1; gradient ∝ +h − 0 → direction (1, 0)
        assert torch.allclose(z, t([[0.1, 2.0]]))


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


# ------------------------------------------------------------ fastcl.contrastive's features
def _lse(*xs):
    return math.log(sum(E(x) for x in xs))


class TestHandComputedFeatures:
    # Unit 2-D vectors keep every cosine countable.
    anchors = [[1.0, 0.0], [0.0, 2.0]]     # norm 2 on row 1: cosines must normalize it away

    def test_focal_with_weighted_hard_negative(self):
        pos = t([[0.6, 0.8], [0.0, 1.0]])
        neg = t([[0.0, 1.0], [-1.0, 0.0]])
        m, tau, w = 0.3, 0.5, 0.7
        # s row 0: [0.6, 0 | 0, -1];  row 1: [0.8, 1 | 1, 0]
        # positive s²/τ, every other column s(s+m)/τ, + w on the own hard negative (N + i)
        row0 = -0.36 / tau + _lse(0.36 / tau, 0.0, 0.0 + w, (-1) * (-1 + m) / tau)
        row1 = -1 / tau + _lse(0.8 * (0.8 + m) / tau, 1 / tau, 1 * (1 + m) / tau, 0.0 + w)
        for backend in ("reference", "tiled"):
            loss = fastcl.contrastive(t(self.anchors), pos, neg, temperature=tau, focal_m=m,
                                      hard_negative_weight=w, backend=backend)
            assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-12), backend

    def test_focal_mask_and_noise(self):
        pos = t([[0.6, 0.8], [0.8, 0.6]])
        noise = t([[-1.0, 0.0]])
        # complementary: c_0 · c⁺_1 = 0.95 ≥ φ drops (0, 1); c_1 · c⁺_0 = 0 keeps (1, 0)
        comp = (t([[1.0, 0.0], [0.0, 1.0]]), t([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95**2)]]))
        m, tau = 0.3, 0.5
        # s row 0: [0.6, (0.8 dropped) | -1];  row 1: [0.8, 0.6 | 0]; the noise column gets
        # the negative modulation
        row0 = -0.36 / tau + _lse(0.36 / tau, (-1) * (-1 + m) / tau)
        row1 = -0.36 / tau + _lse(0.8 * (0.8 + m) / tau, 0.36 / tau, 0.0)
        for backend in ("reference", "tiled"):
            loss = fastcl.contrastive(t(self.anchors), pos, temperature=tau, focal_m=m,
                                      complementary=comp, phi=0.9, noise=noise, noise_steps=0,
                                      backend=backend)
            assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-12), backend

    def test_symmetric_mask_and_noise(self):
        pos = t([[0.6, 0.8], [0.8, 0.6]])
        noise = t([[-1.0, 0.0]])
        comp = (t([[1.0, 0.0], [0.0, 1.0]]), t([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95**2)]]))
        # forward (plain): row 0 [0.6, (dropped) | -1], row 1 [0.8, 0.6 | 0]
        fwd = 0.5 * ((-0.6 + _lse(0.6, -1.0)) + (-0.6 + _lse(0.8, 0.6, 0.0)))
        # reverse: positives against anchors, no noise column; α'_ij = 1[cos(c⁺_i, c_j) < φ]:
        # c⁺_1 · c_0 = 0.95 drops (1, 0); row 0 [0.6, 0.8], row 1 [(dropped), 0.6]
        rev = 0.5 * ((-0.6 + _lse(0.6, 0.8)) + (-0.6 + _lse(0.6)))
        for backend in ("reference", "tiled"):
            loss = fastcl.contrastive(t(self.anchors), pos, temperature=1.0, complementary=comp,
                                      phi=0.9, noise=noise, noise_steps=0, symmetric=True,
                                      backend=backend)
            assert loss.item() == pytest.approx(0.5 * (fwd + rev), rel=1e-12), backend


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
