"""DCLR ``formulation="released"`` against an independent re-derivation of the authors' code.

``released_dclr`` below is written from the description of the released training step, not
from fastcl's code: each noise step is the cross-entropy over the N in-batch columns and the
K noise columns (cosine / τ_u), a normalized ascent step, NaN (a zero gradient's 0/0) set to
0; then the logits cos/τ are multiplied by the weights (complementary cosine/τ ≤ 20φ on the
in-batch columns, the noise columns' complementary cosine taken as 0), and binary
cross-entropy is applied to the row softmax, averaged over all N·(N+K) entries.
"""

import pytest
import torch
import torch.nn.functional as F

import fastcl

from conftest import correlated, make


def _cos(x, y):
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-8)
    y = y / y.norm(dim=1, keepdim=True).clamp_min(1e-8)
    return x @ y.T


def released_noise(h, h_pos, z, *, steps, lr, tau_u):
    h, h_pos = h.detach(), h_pos.detach()
    labels = torch.arange(h.shape[0])
    for _ in range(steps):
        z = z.detach().requires_grad_(True)
        logits = torch.cat([_cos(h, h_pos), _cos(h, z)], dim=1) / tau_u
        (g,) = torch.autograd.grad(F.cross_entropy(logits, labels), z)
        z = z.detach() + lr * g / g.norm(dim=1, keepdim=True)      # 0/0 → NaN where g = 0
        z[torch.isnan(z)] = 0.0
    return z.detach()


def released_dclr(h, h_pos, c, c_pos, z0, *, tau, phi, steps, lr):
    n, k = h.shape[0], z0.shape[0]
    z = released_noise(h, h_pos, z0, steps=steps, lr=lr, tau_u=tau)
    logits = torch.cat([_cos(h, h_pos), _cos(h, z)], dim=1) / tau
    comp = torch.cat([_cos(c, c_pos), torch.zeros(n, k, dtype=h.dtype)], dim=1) / tau
    weights = (comp <= 20 * phi).to(h.dtype)
    weights[torch.arange(n), torch.arange(n)] = 1.0                # the positive is kept
    probs = torch.softmax(logits * weights, dim=1)
    target = F.one_hot(torch.arange(n), n + k).to(h.dtype)
    return F.binary_cross_entropy(probs, target)


def _case(n, k, d, seed=0):
    h = make(n, d, dtype=torch.float64, seed=seed)
    h_pos = correlated(h, 0.6, seed=seed + 1)
    c = make(n, 6, dtype=torch.float64, seed=seed + 2, grad=False)
    c_pos = correlated(c, 0.3, seed=seed + 3).detach()
    z0 = make(k, d, dtype=torch.float64, seed=seed + 4, grad=False)
    return h, h_pos, c, c_pos, z0


def _phi_dropping_some(c, c_pos, tau):
    """A φ with some in-batch complementary cosines above it (cos/τ > 20φ) and some below."""
    off = _cos(c, c_pos)[~torch.eye(c.shape[0], dtype=torch.bool)]
    return float(off.median()) / (20 * tau) if off.numel() else 0.01


def _compare(backend, n, k, d, tau, steps, phi=None, dtype=torch.float64, tol=None):
    h, h_pos, c, c_pos, z0 = _case(n, k, d)
    phi = _phi_dropping_some(c, c_pos, tau) if phi is None else phi
    expected = released_dclr(h, h_pos, c, c_pos, z0, tau=tau, phi=phi, steps=steps, lr=0.05)
    want = torch.autograd.grad(expected, (h, h_pos))
    a, p = (x.detach().to(dtype).requires_grad_() for x in (h, h_pos))
    got = fastcl.dclr_loss(a, p, complementary=(c.to(dtype), c_pos.to(dtype)), phi=phi,
                           noise=z0.to(dtype), noise_steps=steps, noise_lr=0.05,
                           temperature=tau, formulation="released", backend=backend)
    grads = torch.autograd.grad(got, (a, p))
    tol = tol or dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.double(), expected.detach(), **tol)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g.double(), w, atol=tol["atol"] * max(1.0, float(w.abs().max())),
                                   rtol=tol["rtol"])


GRID = [(n, k) for n in (1, 2, 3, 17, 33, 100) for k in sorted({0, n, int(2.5 * n)})]
# Triton runs in float32 (in the interpreter here): float32 tolerances, τ = 0.05. N = 1, 3, 17
# with no, N and 2.5·N noise rows; N = 33 (three row tiles of 16) with N of them (2.5·N at
# N = 17 puts the candidates in two row blocks of 32 already: 17 + 42 = 59).
TRITON_GRID = [(n, k) for n in (1, 3, 17) for k in sorted({0, n, int(2.5 * n)})] + [(33, 33)]
CASES = ([pytest.param(be, n, k, tau, id=f"{be}-N{n}K{k}-tau{tau}") for be in ("reference", "tiled")
          for n, k in GRID for tau in (0.05, 0.1)]
         + [pytest.param("triton", n, k, 0.05, id=f"triton-N{n}K{k}") for n, k in TRITON_GRID])


@pytest.mark.parametrize("steps", [0, 4])
@pytest.mark.parametrize("backend,n,k,tau", CASES)
def test_released_equals_the_authors_computation(backend, n, k, tau, steps):
    if backend == "triton":
        pytest.importorskip("triton")
        _compare("triton", n, k, 24, tau, steps, dtype=torch.float32, tol=dict(atol=2e-5, rtol=2e-4))
    else:
        _compare(backend, n, k, 24, tau, steps)


@pytest.mark.parametrize("backend", ["reference", "tiled", "triton"])
def test_negative_phi_drops_the_noise_columns(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    dtype = torch.float32 if backend == "triton" else torch.float64
    tol = dict(atol=2e-5, rtol=2e-4) if backend == "triton" else None
    _compare(backend, 5, 7, 24, 0.05, 4, phi=-0.1, dtype=dtype, tol=tol)
    # every noise column dropped: the noise cannot change the loss
    h, h_pos, c, c_pos, _ = _case(5, 7, 24)
    kw = dict(complementary=(c.to(dtype), c_pos.to(dtype)), phi=-0.1, noise_steps=0,
              formulation="released", backend=backend)
    a, p = h.detach().to(dtype), h_pos.detach().to(dtype)
    one = fastcl.dclr_loss(a, p, noise=make(7, 24, dtype=dtype, seed=8, grad=False), **kw)
    two = fastcl.dclr_loss(a, p, noise=make(7, 24, dtype=dtype, seed=9, grad=False), **kw)
    torch.testing.assert_close(one, two)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_zero_noise_gradient_zeroes_the_row(backend):
    """d = 1: every cosine is ±1 and the noise gradient is 0 (exactly, or up to rounding:
    which rows get an exact 0 depends on how the gradient is formed). The released code's
    0/0 → NaN → 0 turns such a row into 0; the paper's update leaves it where it was."""
    h, h_pos = make(4, 1, dtype=torch.float64), make(4, 1, dtype=torch.float64, seed=2)
    z0 = make(3, 1, dtype=torch.float64, seed=3, grad=False)
    got = fastcl.dclr_noise(h, h_pos, 3, noise=z0, steps=1, lr=0.05, formulation="released",
                            backend=backend)
    paper = fastcl.dclr_noise(h, h_pos, 3, noise=z0, steps=1, lr=0.05, backend=backend)
    zeroed = (got == 0).squeeze(1)
    assert zeroed.any() and torch.isfinite(got).all()
    torch.testing.assert_close(paper[zeroed], z0[zeroed])           # stayed put
    moved = ~zeroed                                                  # a unit step of lr
    torch.testing.assert_close((got[moved] - z0[moved]).abs(), torch.full_like(z0[moved], 0.05))
