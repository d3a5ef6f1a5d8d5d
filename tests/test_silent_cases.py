"""Inputs that used to give a silently wrong number or an unhelpful crash: each is now
correct or a clear error naming what is wrong."""

import pytest
import torch

import fastcl

from conftest import correlated, make

FAST = ["tiled", "triton"]


def _backend(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    return backend


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("name", ["infonce", "escl"])
def test_double_backward_is_a_clear_error(name, backend):
    """A gradient penalty through a fused backend used to drop the loss's second-order term
    (escl: 0.00063 instead of 2.0); now it is refused, and the reference supports it."""
    a = make(6, 8)
    p = correlated(a)
    sensitive = correlated(a, 1.0, seed=5).detach()
    loss_of = {"infonce": lambda be: fastcl.infonce(a, p, backend=be),
               "escl": lambda be: fastcl.escl_loss(a, p, sensitive, weight=0.5, backend=be)}[name]
    (g,) = torch.autograd.grad(loss_of("reference"), a, create_graph=True)
    g.pow(2).sum().backward()                      # the reference: second order works
    assert a.grad is not None and torch.isfinite(a.grad).all()
    with pytest.raises(RuntimeError, match="differentiated twice.*backend='reference'"):
        torch.autograd.grad(loss_of(_backend(backend)), a, create_graph=True)
    # a plain backward is unaffected
    a.grad = None
    loss_of(backend).backward()
    assert a.grad is not None


@pytest.mark.parametrize("fn,name", [("infonce", "hard_negative_weight"), ("focal_infonce", "m"),
                                     ("dclr_loss", "noise_temperature")])
def test_a_number_that_requires_grad_is_refused(fn, name):
    # (a learnable temperature is a feature: tests/test_learnable_temperature.py)
    a = make(5, 8)
    p = correlated(a)
    value = torch.tensor(0.05, requires_grad=True)
    with pytest.raises(TypeError, match=f"{name} is a tensor that requires grad"):
        getattr(fastcl, fn)(a, p, **{name: value})
    # a tensor without a graph is a number like any other
    kw = lambda: ({"generator": torch.Generator().manual_seed(0)} if fn == "dclr_loss" else {})
    torch.testing.assert_close(getattr(fastcl, fn)(a, p, temperature=torch.tensor(0.05), **kw()),
                               getattr(fastcl, fn)(a, p, temperature=0.05, **kw()))


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_escl_fp16_large_norms_are_finite(backend):
    """fp16 embeddings of norm ≈ 320: the relative-difference term's dots (≈ 10⁵) overflowed
    fp16 and the loss was NaN on every backend."""
    a = make(8, 1024, scale=10.0)                  # ‖a_i‖ ≈ 320
    p = correlated(a, 3.0)
    s = correlated(a, 8.0, seed=5)
    ref = fastcl.escl_loss(a.double(), p.double(), s.double(), weight=0.5, backend="reference")
    got = fastcl.escl_loss(a.half(), p.half(), s.half(), weight=0.5, backend=backend)
    assert torch.isfinite(got)
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_metrics_take_16_bit_embeddings(dtype):
    x = make(16, 32, scale=20.0, grad=False)
    y = correlated(x, 5.0)
    torch.testing.assert_close(fastcl.uniformity(x.to(dtype)).double(),
                               fastcl.uniformity(x.double()), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fastcl.alignment(x.to(dtype), y.to(dtype)).double(),
                               fastcl.alignment(x.double(), y.double()), rtol=2e-2, atol=2e-2)
