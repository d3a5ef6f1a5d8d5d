"""Regression tests for the wrong numbers and unclear errors of issue 28's campaign.

One test (or one parametrized family) per numbered failure, on every backend it concerns
("triton" runs in Triton's interpreter on a CPU-only machine, tests/conftest.py), against the
float64 reference where there is a number to compare:

1. DCLR's noise step had length 1e10–1e13·lr where a noise row's gradient was tiny
   (‖g‖² underflowed in float32).
2. backend="tiled" under torch.autocast computed the logits in bf16.
3. Finite inputs of magnitude ≳ 1e19 gave NaN / log(M) / 0.
4. A temperature below ~3e-39 was accepted and gave NaN.
5. formulation="released" with noise steps at d = 1: three backends, three losses.

then the clear errors (inference mode, double backward through uniformity); the table of bad
arguments and the Triton backend's refusals (meta tensors among them) are
tests/test_validation.py, the evaluate command's files tests/test_evaluate_cli.py.
"""

import math

import pytest
import torch

import fastcl
from fastcl import common, reference

from conftest import backends

BACKENDS = backends("reference", "tiled", "triton")


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    loss = fn(*inputs)
    loss.backward()
    return loss.detach(), [t.grad for t in inputs]


def _close_to(got, want, rtol, what):
    """``got`` against the float64 ``want``: within ``rtol`` of want's largest entry."""
    got, want = got.double(), want.double()
    scale = want.abs().max().clamp_min(1e-300)
    err = ((got - want).abs().max() / scale).item()
    assert err <= rtol, f"{what}: error {err:.3g} of the largest entry (allowed {rtol})"


# ------------------------------------------------------------------ 1. the noise step

def _one_dominant_noise_row(n=16, d=72, sigma=0.1, seed=0):
    """Anisotropic anchors (a shared direction plus small noise, mean cosine ≈ 0.99, as
    pre-trained BERT embeddings) and noise whose first row lies near that direction: at
    τ = 0.02 its column takes the whole softmax, and every other noise row's gradient is
    ≈ 1e-20, whose square is below float32's normal range (for 13 of the 15 at d = 72, 14 at
    d = 256; the interpreter's time grows with d)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(1, d, generator=g, dtype=torch.float64)
    a = shared + sigma * torch.randn(n, d, generator=g, dtype=torch.float64)
    p = a + sigma * torch.randn(n, d, generator=g, dtype=torch.float64)
    z = torch.randn(n, d, generator=g, dtype=torch.float64)
    z[0] = shared + 0.1 * torch.randn(1, d, generator=g, dtype=torch.float64)
    return a, p, z


def test_the_noise_case_has_gradients_whose_square_underflows():
    a, p, z = _one_dominant_noise_row()
    zz = z.clone().requires_grad_()
    loss = torch.logsumexp(reference.cosine_matrix(a, zz) / 0.02, dim=1).mean()
    (g,) = torch.autograd.grad(loss, zz)
    squares = (g * g).sum(dim=1)
    assert (squares[1:] < torch.finfo(torch.float32).tiny).sum() >= 10    # the case of failure 1


@pytest.mark.parametrize("formulation", ["paper", "released"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_noise_step_has_length_lr_when_the_gradient_is_tiny(backend, dtype, formulation):
    if backend == "reference" and dtype == torch.float16:
        pytest.skip("the reference's noise update runs in float32 for float16 inputs "
                    "(the float32 case covers it)")
    a, p, z = _one_dominant_noise_row()
    a, p = a.to(dtype), p.to(dtype)
    lr, tau = 1e-3, 0.02
    z1 = fastcl.dclr_noise(a, p, None, noise=z.float(), steps=1, lr=lr, temperature=tau,
                           formulation=formulation, backend=backend)
    step = (z1.double() - z.float().double()).norm(dim=1)
    assert torch.isfinite(step).all()
    torch.testing.assert_close(step, torch.full_like(step, lr), rtol=1e-3, atol=0)
    # and the loss after the default 4 steps, against the float64 reference on the same inputs
    want = fastcl.dclr_loss(a.double(), p.double(), noise=z.float().double(), temperature=tau,
                            formulation=formulation, backend="reference")
    got = fastcl.dclr_loss(a, p, noise=z.float(), temperature=tau, formulation=formulation,
                           backend=backend)
    assert torch.isfinite(got)
    rtol = 1e-4 if dtype == torch.float32 else 1e-2
    assert got.item() == pytest.approx(want.item(), rel=rtol)


def test_safe_direction_is_a_unit_vector_at_every_scale():
    for scale in (1e-44, 1e-30, 1e-20, 1.0, 1e20, 1e37):
        g = torch.tensor([[3.0, -4.0], [0.0, 0.0]]) * scale
        direction, zero = common.safe_direction(g)
        torch.testing.assert_close(direction, torch.tensor([[0.6, -0.8], [0.0, 0.0]]),
                                   rtol=1e-6 if scale > 1e-40 else 0.1, atol=0)
        assert zero.tolist() == [False, True]


# ------------------------------------------------------------------ 2. autocast

def _hard_batch(n=64, d=256, seed=0, noise=0.01):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x, x + noise * torch.randn(n, d, generator=g)


AUTOCAST_LOSSES = {
    "infonce": lambda a, p, **kw: fastcl.infonce(a, p, **kw),
    "focal": lambda a, p, **kw: fastcl.focal_infonce(a, p, **kw),
    "dclr": lambda a, p, **kw: fastcl.dclr_loss(
        a, p, generator=torch.Generator().manual_seed(3), **kw),
    "escl": lambda a, p, **kw: fastcl.escl_loss(a, p, p.detach().flip(0), **kw),
}


@pytest.mark.parametrize("name", list(AUTOCAST_LOSSES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_does_not_change_the_loss(backend, name):
    """The trainer computes the loss inside autocast (--precision bf16 --device cpu). The
    fused path forms its own GEMMs outside autocast; every backend now gives the answer it
    gives without autocast for the same input dtype (the reference used to form its cosines
    in bf16 there, 1 % off in the gradient; the tiled backend its logits, 0.0 for 2.4e-7)."""
    small = backend == "triton"
    a, p = _hard_batch(n=16 if small else 64, d=32 if small else 256, noise=0.3 if small else 0.01)
    fn = lambda x, y: AUTOCAST_LOSSES[name](x, y, backend=backend)
    want, want_grads = _grads(fn, a, p)

    def under_autocast(x, y):
        # the forward under autocast, backward outside it (as torch recommends and the
        # trainer does); the fused losses store their gradient in the forward pass, so for
        # them a backward inside autocast is checked too (not for the reference, nor ESCL's
        # relative-difference term: plain autograd, whose backward GEMMs autocast would take)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(x, y)
    got, got_grads = _grads(under_autocast, a, p)
    if backend != "reference" and name != "escl":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, inside = _grads(fn, a, p)
        for g, w in zip(inside, got_grads):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    for g, w in zip(got_grads, want_grads):
        # the gradients are ≈ 1e-9 here: the tolerance is relative to their largest entry
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())
    # and the float32 value is the float64 one (the gradient, a sum of p − 1 ≈ 1e-7 terms,
    # has float32's own error here)
    ref = AUTOCAST_LOSSES[name](a.double(), p.double(), backend="reference")
    assert got.item() == pytest.approx(ref.item(), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_leaves_the_noise_update_alone(backend):
    a, p, z = _one_dominant_noise_row(n=8, d=32)
    a, p = a.float(), p.float()
    want = fastcl.dclr_noise(a, p, None, noise=z.float(), temperature=0.05, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fastcl.dclr_noise(a, p, None, noise=z.float(), temperature=0.05, backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


# ------------------------------------------------------------------ 3. huge inputs

@pytest.mark.parametrize("scale", [1e19, 1e25, 1e36])
@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_inputs_give_the_scale_free_answer(backend, scale):
    """A cosine does not change with a row's length: inputs of magnitude 1e19+ (whose
    squared norms overflow float32) give the loss of the same rows at magnitude 1, and the
    gradient of those rows divided by the scale."""
    a, p = _hard_batch(n=12, d=24, noise=1.0)
    neg = torch.randn(12, 24, generator=torch.Generator().manual_seed(5))
    comp = (a + 0.1, p - 0.1)
    z = torch.randn(12, 24, generator=torch.Generator().manual_seed(6)) * scale   # noise: huge in both
    # name -> the loss of (x, y) with its other inputs at magnitude s, in x's dtype
    calls = {
        "infonce": lambda x, y, s, be: fastcl.infonce(x, y, backend=be),
        "negatives+focal": lambda x, y, s, be: fastcl.contrastive(x, y, (neg * s).to(x.dtype), focal_m=0.3,
                                                                  backend=be),
        "dclr": lambda x, y, s, be: fastcl.dclr_loss(x, y, complementary=tuple((c * s).to(x.dtype) for c in comp),
                                                     phi=0.5, noise=z.to(x.dtype), backend=be),
        "escl": lambda x, y, s, be: fastcl.escl_loss(x, y, ((a - p) * s).to(x.dtype), backend=be),
    }
    for name, fn in calls.items():
        got, (ga, gp) = _grads(lambda x, y: fn(x, y, scale, backend), a * scale, p * scale)
        want, (wa, wp) = _grads(lambda x, y: fn(x, y, 1.0, "reference"), a.double(), p.double())
        assert torch.isfinite(got), name
        assert got.item() == pytest.approx(want.item(), rel=1e-4, abs=1e-5), name
        _close_to(ga * scale, wa, 1e-4, f"{name} anchors' gradient")
        _close_to(gp * scale, wp, 1e-4, f"{name} positives' gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_huge_inputs_in_alignment_and_uniformity(dtype):
    a, p = _hard_batch(n=10, d=16, noise=0.5)
    big = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float64: 1e300}[dtype]
    x, y = a.to(dtype), p.to(dtype)
    for got, want in [(fastcl.alignment(x * big, y * big), fastcl.alignment(x.double(), y.double())),
                      (fastcl.uniformity(x * big), fastcl.uniformity(x.double()))]:
        assert got.item() == pytest.approx(want.item(), rel=1e-5 if dtype != torch.bfloat16 else 2e-2)


def test_huge_rows_are_rescaled_exactly():
    x = torch.tensor([[3e30, -1.0], [1.0, 2.0]])
    y = common.shrink_huge_rows(x)
    assert y[1].tolist() == [1.0, 2.0]
    assert 1024 <= y[0].abs().max() < 2048
    ratio = (x[0] / y[0])
    assert (ratio == ratio[0]).all() and math.log2(ratio[0]).is_integer()


# ------------------------------------------------------------------ 4. tiny temperatures

@pytest.mark.parametrize("backend", BACKENDS)
def test_the_smallest_temperature_accepted_gives_finite_right_numbers(backend):
    """Just above the bound, (2 + |m|)/√(float32 max): loss and gradients finite and equal to
    the float64 reference, the inputs at any length up to the rescaling threshold."""
    bound = 2.0 / math.sqrt(torch.finfo(torch.float32).max)
    a, p = _hard_batch(n=8, d=16, noise=3.0)
    for scale in (1.0, 1e15):
        for tau in (bound * 1.01, 1e-15):
            fn = lambda x, y: fastcl.infonce(x, y, temperature=tau, backend=backend)
            got, grads = _grads(fn, a * scale, p * scale)
            want, wgrads = _grads(lambda x, y: fastcl.infonce(x, y, temperature=tau, backend="reference"),
                                  (a * scale).double(), (p * scale).double())
            assert torch.isfinite(got) and got.item() == pytest.approx(want.item(), rel=1e-5)
            for g, w in zip(grads, wgrads):
                assert torch.isfinite(g).all()
                _close_to(g, w, 1e-4, f"gradient at tau={tau:.3g}, scale {scale:g}")


def test_float64_takes_smaller_temperatures():
    a, p = _hard_batch(n=8, d=16, noise=3.0)
    loss = fastcl.infonce(a.double(), p.double(), temperature=1e-100, backend="tiled")
    assert torch.isfinite(loss)         # (1e-160 is refused: tests/test_validation.py)


# ------------------------------------------------------------------ 5. released, d = 1

@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_released_noise_at_width_one_agrees_with_the_float64_reference(backend, steps):
    """At d = 1 every cosine is ±1 whatever z, so ∂L/∂z is exactly 0 and the released update
    sends each row to 0 on the first step; at z = 0 (x̂ = z/EPS, linear) the next step moves it
    by lr. The chain rule's rounding residual along z used to become a full step instead, a
    different one on each backend. At z = 0 the gradient Σ_i p_i ĥ_i/(NτEPS) cancels to first
    order when the positives have the anchors' signs (n₊·p₊ ≈ n₋·p₋ ≈ e^{−1/τ}), leaving an
    e^{−2/τ} term: τ = 0.5 keeps it within float32's resolution (at τ = 0.05 its sign is
    rounding). N is odd: with as many anchors of each sign it can cancel exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1, generator=g)
    y = x + 0.1 * torch.randn(9, 1, generator=g)
    z = torch.randn(9, 1, generator=g)
    kw = dict(noise_steps=steps, formulation="released", temperature=0.5)
    want = fastcl.dclr_loss(x.double(), y.double(), noise=z.double(), backend="reference", **kw)
    got = fastcl.dclr_loss(x, y, noise=z, backend=backend, **kw)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    z_got = fastcl.dclr_noise(x, y, None, noise=z, steps=steps, formulation="released",
                              temperature=0.5, backend=backend)
    z_want = fastcl.dclr_noise(x.double(), y.double(), None, noise=z.double(), steps=steps,
                               formulation="released", temperature=0.5, backend="reference")
    torch.testing.assert_close(z_got.double(), z_want, rtol=1e-6, atol=1e-9)
    if steps % 2:
        assert (z_got == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_paper_noise_at_width_one_stays_put(backend):
    g = torch.Generator().manual_seed(1)
    x, z = torch.randn(7, 1, generator=g), torch.randn(5, 1, generator=g)
    got = fastcl.dclr_noise(x, x.flip(0), None, noise=z, steps=3, backend=backend)
    assert torch.equal(got, z)


# ------------------------------------------------------------------ clear errors

@pytest.mark.parametrize("backend", BACKENDS)
def test_dclr_under_inference_mode(backend):
    a, p = _hard_batch(n=8, d=16, noise=0.5)
    want = fastcl.dclr_loss(a, p, generator=torch.Generator().manual_seed(2), backend=backend)
    with torch.inference_mode():
        got = fastcl.dclr_loss(a, p, generator=torch.Generator().manual_seed(2), backend=backend)
        noise = fastcl.dclr_noise(a, p, 4, generator=torch.Generator().manual_seed(2),
                                  backend=backend)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert noise.shape == (4, 16) and torch.isfinite(noise).all()


def test_uniformity_can_be_differentiated_twice():
    x = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: fastcl.uniformity(t), (x,))
    (g,) = torch.autograd.grad(fastcl.uniformity(x), x, create_graph=True)
    g.square().sum().backward()               # a gradient penalty
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() > 0


def test_uniformity_matches_pdist_and_blocks():
    x = torch.randn(50, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[3] = x[7]                                   # a duplicate pair: distance 0
    u = torch.nn.functional.normalize(x, dim=-1)
    sq = torch.pdist(u).pow(2)
    want = torch.logsumexp(-2 * sq, 0) - math.log(sq.numel())
    assert fastcl.uniformity(x).item() == pytest.approx(want.item(), rel=1e-12)
    import fastcl.metrics as metrics
    saved = metrics._UNIFORMITY_BLOCK
    metrics._UNIFORMITY_BLOCK = 120               # 2 rows a block: every block boundary
    try:
        assert fastcl.uniformity(x).item() == pytest.approx(want.item(), rel=1e-12)
    finally:
        metrics._UNIFORMITY_BLOCK = saved
