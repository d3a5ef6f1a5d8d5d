"""DCLR specifics: the noise update, its reproducibility, and the instance-weighting mask."""

import importlib.util

import pytest
import torch

import fastcl
from fastcl import reference

from conftest import correlated, make
from test_matches_reference import Batch


def _batch(n=9, d=16, dtype=torch.float64):
    a = make(n, d, dtype=dtype)
    return a, correlated(a, 0.5)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_fixed_noise_without_steps_is_deterministic(backend):
    a, p = _batch()
    z = make(5, 16, dtype=torch.float64, seed=4, grad=False)
    first = fastcl.dclr_loss(a, p, noise=z, noise_steps=0, backend=backend)
    second = fastcl.dclr_loss(a, p, noise=z, noise_steps=0, backend=backend)
    assert torch.equal(first, second)
    # and it is InfoNCE against [h⁺; z]
    expected = fastcl.infonce(a, p, z, backend="reference")
    torch.testing.assert_close(first, expected)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_generator_reproducibility(backend):
    a, p = _batch()
    run = lambda seed: fastcl.dclr_loss(a, p, generator=torch.Generator().manual_seed(seed),
                                        backend=backend)
    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("formulation,ratio,rows", [("paper", 1.0, 9), ("paper", 2.5, 22), ("paper", 0.0, 0),
                                                    ("paper", 0.5, 4), ("paper", 1.5, 14), ("released", 1.5, 13)])
def test_noise_ratio_draws_its_rows(backend, formulation, ratio, rows):
    """noise_ratio draws K_z = round(ratio·N) rows with the generator (the released code's
    int(ratio·N): N = 9, ratio 1.5 gives 14 and 13), then moves them: the same loss as passing
    that draw as ``noise`` (fastcl.contrastive with DCLR's mask, and focal where it applies)."""
    assert reference.noise_count(ratio, 9, formulation) == rows
    batch = Batch(9, 16)
    _, kw = batch.kwargs(("mask",) + (("focal",) if formulation == "paper" else ()))
    kw.update(noise_steps=2, formulation=formulation, backend=backend)
    drawn = reference.draw_noise(rows, 16, generator=torch.Generator().manual_seed(2))
    by_ratio = fastcl.contrastive(batch.a, batch.p, noise_ratio=ratio,
                                  generator=torch.Generator().manual_seed(2), **kw)
    assert torch.equal(by_ratio, fastcl.contrastive(batch.a, batch.p, noise=drawn, **kw))


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("steps", [1, 4])
def test_each_step_moves_noise_by_lr(backend, steps):
    a, p = _batch(d=24)
    z = make(7, 24, dtype=torch.float64, seed=2, grad=False)
    prev = z
    for s in range(1, steps + 1):
        cur = fastcl.dclr_noise(a, p, 7, steps=s, lr=0.01, noise=z, backend=backend)
        step = torch.linalg.vector_norm(cur - prev, dim=1)
        torch.testing.assert_close(step, torch.full_like(step, 0.01), atol=1e-12, rtol=1e-9)
        prev = cur


def test_noise_moves_up_the_loss():
    """Gradient *ascent*: each step raises L_U (the noise becomes a harder negative)."""
    a, p = _batch(n=16, d=32)
    z = make(16, 32, dtype=torch.float64, seed=5, grad=False)

    def lu(noise):
        s = reference.cosine_matrix(a.detach(), noise) / 0.05
        return torch.logsumexp(s, dim=1).mean().item()

    values = [lu(fastcl.dclr_noise(a, p, 16, steps=t, lr=0.05, noise=z)) for t in range(4)]
    assert values == sorted(values) and values[-1] > values[0]


class TestMask:
    # (a dropped pair leaves the denominator, the noise columns stay: test_reference's
    # test_hand_computed[dclr-mask] by hand, the grid's mask cases on each engine)
    @pytest.mark.parametrize("backend", ["reference", "tiled"])
    def test_dissimilar_complementary_keeps_everything(self, backend):
        n, d = 6, 8
        a, p = _batch(n=n, d=d)
        z = make(3, d, dtype=torch.float64, seed=1, grad=False)
        kw = dict(noise=z, noise_steps=0, temperature=0.1, backend=backend)
        eye = torch.eye(n, dtype=torch.float64)         # cos(c_i, c⁺_j) = 0 for i ≠ j
        weighted = fastcl.dclr_loss(a, p, complementary=(eye, eye.clone()), phi=0.5, **kw)
        torch.testing.assert_close(weighted, fastcl.dclr_loss(a, p, **kw))

    @pytest.mark.parametrize("backend", ["reference", "tiled"])
    def test_phi_minus_one_drops_every_in_batch_negative(self, backend):
        # cos ≥ −1 always holds: without noise only the positive is left, so the loss is 0
        a, p = _batch(n=5)
        comp = (make(5, 3, seed=1, grad=False), make(5, 3, seed=2, grad=False))
        loss = fastcl.dclr_loss(a, p, complementary=comp, phi=-1.0, noise_ratio=0.0, backend=backend)
        assert abs(loss.item()) < 1e-6
        loss.backward()
        assert a.grad.abs().max() < 1e-6

    def test_released_threshold_is_twenty_phi_over_temperature(self):
        """The released test cos/τ ≤ 20φ equals the paper's only at τ = 0.05."""
        n = 4
        a, p = _batch(n=n)
        g = torch.Generator().manual_seed(0)
        c = torch.randn(n, 5, generator=g, dtype=torch.float64)
        comp = (c, c + 0.5 * torch.randn(n, 5, generator=g, dtype=torch.float64))
        cos = reference.cosine_matrix(*comp)
        phi = 0.4
        for tau in (0.05, 0.1):
            w = reference.dclr_weights(*comp, 0, phi=phi, temperature=tau, formulation="released")
            off = ~torch.eye(n, dtype=torch.bool)
            assert torch.equal(w[off], (cos / tau <= 20 * phi)[off])
        paper = reference.dclr_weights(*comp, 0, phi=phi, temperature=0.05)
        released = reference.dclr_weights(*comp, 0, phi=phi, temperature=0.05, formulation="released")
        assert torch.equal(paper, released) or bool(((cos - phi).abs() < 1e-12).any())


@pytest.mark.parametrize("formulation", ["paper", "released"])
@pytest.mark.parametrize("backend", ["reference", "tiled", pytest.param(
    "triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                       reason="triton is not installed"))])
def test_noise_rows_whose_softmax_underflows_still_move(backend, formulation):
    """The exact update moves every noise row by lr along g_j/‖g_j‖, also a row far below
    every anchor's top logit, whose softmax entries underflow float32 (τ_u ≤ 0.01, a cosine
    gap of 1.8 here: e^(−180) and less). float64 moves it; float32 now does too, in the
    same direction, on every backend (issue #42: it stayed put, paper, or was zeroed,
    released). Anchors in a cluster; noise rows near it, opposite and across."""
    g = torch.Generator().manual_seed(5)
    d = 8
    centre = torch.nn.functional.normalize(torch.randn(1, d, generator=g, dtype=torch.float64), dim=1)
    a = (3 * centre + 0.3 * torch.randn(6, d, generator=g, dtype=torch.float64)).float()
    p = (a.double() + 0.1 * torch.randn(6, d, generator=g, dtype=torch.float64)).float()
    z = torch.cat([2 * centre, -2 * centre, torch.randn(2, d, generator=g, dtype=torch.float64)]).float()
    lr = 1e-2
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    for tau in (0.01, 0.005):
        want = fastcl.dclr_noise(a.double(), p.double(), None, noise=z.double(), steps=2, lr=lr,
                                 temperature=tau, formulation=formulation, backend="reference")
        got = fastcl.dclr_noise(a.to(device), p.to(device), None, noise=z.to(device), steps=2,
                                lr=lr, temperature=tau, formulation=formulation,
                                backend=backend).double().cpu()
        step = (got - z.double()).norm(dim=1)
        assert ((want - z.double()).norm(dim=1) > 1.9 * lr).all()       # float64 moves each
        assert (step > 1.9 * lr).all(), f"τ_u={tau}: steps {step.tolist()}"
        # z's own float32 rounding (≈ 2.4e-7 at |z| ≈ 2) is 2.4e-5·lr
        assert ((got - want).norm(dim=1) <= 1e-3 * lr).all(), f"τ_u={tau}: {(got - want).norm(dim=1)}"
