import pytest
import torch

# Tolerances for the tiled path against the reference (values and gradients).
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-8),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}


def make(n, d, *, dtype=torch.float32, seed=0, grad=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g, dtype=torch.float64) * scale).to(dtype)
    return x.requires_grad_(grad)


def correlated(x, noise=0.5, seed=1):
    """A second view of x: x plus noise, so positives are more similar than negatives."""
    g = torch.Generator().manual_seed(seed)
    y = x.detach().double() + noise * torch.randn(x.shape, generator=g, dtype=torch.float64)
    return y.to(x.dtype).requires_grad_(x.requires_grad)


def loss_and_grads(fn, inputs):
    for t in inputs:
        t.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), [None if t.grad is None else t.grad.clone() for t in inputs]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
