"""Bad input fails early with an error that names the argument."""

import math

import pytest
import torch

import fastcl

from conftest import make

A = make(4, 8, grad=False)
P = make(4, 8, seed=1, grad=False)


def nan_at(x, i=0):
    x = x.clone()
    x.view(-1)[i] = math.nan
    return x


CASES = [
    # (call, exception, words the message must contain)
    (lambda: fastcl.infonce(A, make(5, 8, grad=False)), ValueError, "positives has 5 rows"),
    (lambda: fastcl.infonce(A, make(4, 7, grad=False)), ValueError, "positives has width 7"),
    (lambda: fastcl.infonce(A, P, make(3, 6, grad=False)), ValueError, "negatives has width 6"),
    (lambda: fastcl.infonce(A[0], P), ValueError, "anchors must be 2-D"),
    (lambda: fastcl.infonce(A.long(), P), TypeError, "anchors must have a floating dtype"),
    (lambda: fastcl.infonce(A, P.double()), TypeError, "positives has dtype torch.float64"),
    (lambda: fastcl.infonce(A.tolist(), P), TypeError, "anchors must be a torch.Tensor"),
    (lambda: fastcl.infonce(A[:0], P[:0]), ValueError, "anchors is an empty batch"),
    (lambda: fastcl.infonce(nan_at(A), P), ValueError, "anchors contains NaN or Inf"),
    (lambda: fastcl.infonce(A, P * math.inf), ValueError, "positives contains NaN or Inf"),
    (lambda: fastcl.infonce(A, P, temperature=0), ValueError, "temperature must be > 0"),
    (lambda: fastcl.infonce(A, P, temperature=-0.05), ValueError, "temperature must be > 0"),
    (lambda: fastcl.infonce(A, P, temperature=math.nan), ValueError, "temperature must be finite"),
    (lambda: fastcl.infonce(A, P, temperature="hot"), TypeError, "temperature must be a real number"),
    (lambda: fastcl.infonce(A, P, make(3, 8, grad=False), hard_negative_weight=1.0), ValueError,
     "hard_negative_weight needs one hard negative per anchor"),
    (lambda: fastcl.infonce(A, P, hard_negative_weight=1.0), ValueError, "hard_negative_weight"),
    (lambda: fastcl.infonce(A, P, backend="cuda"), ValueError, "backend must be one of"),
    (lambda: fastcl.infonce(A, P, chunk_size=0), ValueError, "chunk_size"),
    (lambda: fastcl.focal_infonce(A, P, m=math.inf), ValueError, "m must be finite"),
    (lambda: fastcl.focal_infonce(A, P, temperature=0.0), ValueError, "temperature"),
    (lambda: fastcl.dclr_loss(A, P, phi=1.5), ValueError, "phi"),
    (lambda: fastcl.dclr_loss(A, P, phi=-1.01), ValueError, "phi"),
    (lambda: fastcl.dclr_loss(A, P, complementary=(A[:3], P)), ValueError, "complementary[0] has 3 rows"),
    (lambda: fastcl.dclr_loss(A, P, complementary=(A, make(4, 5, grad=False))), ValueError,
     "complementary[1] has width 5"),
    (lambda: fastcl.dclr_loss(A, P, complementary=A), TypeError, "complementary must be a pair"),
    (lambda: fastcl.dclr_loss(A, P, complementary=(A, P.double())), TypeError,
     "complementary[1] is torch.float64 but complementary[0] is torch.float32"),
    (lambda: fastcl.infonce(A, P, symmetric="False"), TypeError, "symmetric must be True or False"),
    (lambda: fastcl.dclr_loss(A, P, complementary=(nan_at(A), P)), ValueError, "complementary[0] contains NaN"),
    (lambda: fastcl.dclr_loss(A, P, noise=make(3, 5, grad=False)), ValueError, "noise has width 5"),
    (lambda: fastcl.dclr_loss(A, P, noise_steps=-1), ValueError, "noise_steps"),
    (lambda: fastcl.dclr_loss(A, P, noise_steps=1.5), ValueError, "noise_steps"),
    (lambda: fastcl.dclr_loss(A, P, noise_ratio=-1), ValueError, "noise_ratio"),
    (lambda: fastcl.dclr_loss(A, P, noise_std=0), ValueError, "noise_std"),
    (lambda: fastcl.dclr_loss(A, P, noise_temperature=0), ValueError, "noise_temperature"),
    (lambda: fastcl.dclr_loss(A, P, formulation="bce"), ValueError, "formulation"),
    (lambda: fastcl.dclr_noise(A, P, -2), ValueError, "num"),
    (lambda: fastcl.dclr_noise(A, P, 3, noise=make(4, 8, grad=False)), ValueError, "noise has 4 rows but num=3"),
    (lambda: fastcl.escl_loss(A, P, make(3, 8, grad=False)), ValueError, "sensitive has 3 rows"),
    (lambda: fastcl.escl_loss(A, P, P, rd="hinge"), ValueError, "rd must be one of"),
    (lambda: fastcl.escl_loss(A, P, P, weight=math.nan), ValueError, "weight must be finite"),
    (lambda: fastcl.escl_loss(A, P, P, margins=(0.1,)), ValueError, "margins"),
    (lambda: fastcl.alignment(A, P[:2]), ValueError, "y has 2 rows"),
    (lambda: fastcl.alignment(A, P, alpha=0), ValueError, "alpha"),
    (lambda: fastcl.uniformity(A[:1]), ValueError, "at least 2 rows"),
    (lambda: fastcl.uniformity(A, t=-1), ValueError, "t must be > 0"),
]


@pytest.mark.parametrize("call,exc,words", CASES, ids=[c[2] for c in CASES])
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_bad_input(call, exc, words, backend, monkeypatch):
    import fastcl.functional as fn
    real = fn.resolve_backend
    # run each case under both backends: checks happen before dispatch, whatever backend
    monkeypatch.setattr(fn, "resolve_backend", lambda b, x: real(backend if b == "auto" else b, x))
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


def test_triton_backend_refuses_float64():
    with pytest.raises(ValueError, match="backend='triton' cannot run here: .*float64"):
        fastcl.infonce(A.double(), P.double(), backend="triton")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fastcl.infonce(A, P, backend="triton")


def test_finite_checks_can_be_switched_off():
    previous = fastcl.set_input_checks(False)
    try:
        assert previous is True                         # on by default
        assert torch.isnan(fastcl.infonce(nan_at(A), P))
        assert fastcl.set_input_checks(False) is False  # each call returns the setting it replaced
    finally:
        fastcl.set_input_checks(previous)
    with pytest.raises(ValueError, match="anchors"):
        fastcl.infonce(nan_at(A), P)


def test_empty_negatives_are_allowed():
    """An empty queue (K = 0) is the same as no negatives."""
    torch.testing.assert_close(fastcl.infonce(A, P, A[:0]), fastcl.infonce(A, P))
