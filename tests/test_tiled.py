"""The fused engines' own behaviour: gradient scaling, no-grad, chunk sizing, fp16 chunk
buffers, the noise update's norms, and on both engines non-contiguous, tiny and zero rows (the
grid against the reference: tests/test_matches_reference.py)."""

import pytest
import torch

import fastcl
from fastcl import tiled

from conftest import (TRITON_TOL, backends, correlated, device_of, inputs, loss_and_grads, make,
                      needs_triton)

def test_grad_output_scales():
    a, p, _ = inputs(9, 0, 16, torch.float64)
    (3.5 * fastcl.infonce(a, p, chunk_size=4)).backward()
    g_a = a.grad.clone()
    a.grad = None
    (3.5 * fastcl.infonce(a, p, backend="reference")).backward()
    torch.testing.assert_close(g_a, a.grad)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_does_no_gradient_work(mode, monkeypatch):
    asked = []
    real = tiled.driver.torch_width

    def spy(*args):
        asked.append(args[-1])
        return real(*args)

    monkeypatch.setattr(tiled.driver, "torch_width", spy)
    a, p, _ = inputs(9, 0, 16, torch.float32)
    with mode():
        loss = fastcl.infonce(a, p, backend="tiled", chunk_size=4)
    assert not loss.requires_grad
    assert asked == [False] * 3
    torch.testing.assert_close(loss, fastcl.infonce(a, p, backend="reference").detach())


@pytest.mark.parametrize("backend", backends("tiled", "triton"))
def test_non_contiguous_inputs(backend):
    n, d, dtype, chunk, tol = ((12, 40, torch.float64, 5, {}) if backend == "tiled"
                               else (17, 60, torch.float32, None, TRITON_TOL))
    base = make(n, d, dtype=dtype).to(device_of(backend))
    a, p = base[:, ::2], base.flip(0)[:, 1::2]
    assert not a.is_contiguous()
    torch.testing.assert_close(fastcl.infonce(a, p, backend=backend, chunk_size=chunk),
                               fastcl.infonce(a, p, backend="reference"), **tol)


@pytest.mark.parametrize("backend,tiny", [("tiled", False), ("tiled", True),
                                         pytest.param("triton", True, marks=needs_triton)])
def test_tiny_and_zero_norm_rows_match_the_reference(backend, tiny):
    """x̂ = x / max(‖x‖, EPS): the chain rule projects every row whose norm is above EPS, however
    small (1e-10, 1e-6 here), and none of the zero rows. Gradients scale as 1/‖x‖. ``tiny``:
    τ = 1 keeps the softmax far from saturation, whose p − 1 would cost fp32 digits on every
    backend; else one zero anchor at the default τ. The tiled engine in float64."""
    dtype, tol = (torch.float64, {}) if backend == "tiled" else (torch.float32, TRITON_TOL)
    if tiny:
        a, p, kw = make(9, 24, dtype=dtype), correlated(make(9, 24, dtype=dtype)), dict(temperature=1.0)
        with torch.no_grad():
            for x in (a, p):
                x[1] *= 1e-10 / x[1].norm()
                x[4] *= 1e-6 / x[4].norm()
            a[6], p[2] = 0.0, 0.0
    else:
        a, kw = make(4, 8, dtype=dtype), {}
        with torch.no_grad():
            a[2] = 0.0
        p = correlated(a)
    a, p = (x.detach().to(device_of(backend)).requires_grad_() for x in (a, p))
    ref, rg = loss_and_grads(lambda: fastcl.infonce(a, p, backend="reference", **kw), [a, p])
    got, g = loss_and_grads(lambda: fastcl.infonce(a, p, backend=backend, **kw), [a, p])
    torch.testing.assert_close(got, ref, **tol)
    for x, y in zip(g, rg):
        torch.testing.assert_close(x, y, **tol)


class TestChunkChoice:
    def rows(self, ep, n=16384, m=16384, dtype=torch.float32, device="cpu"):
        return tiled.chunk_rows(tiled.TORCH, ep, n, m, n, dtype, device)

    def test_budget_bounds_the_chunk(self):
        rows = self.rows(tiled.Epilogue(0.05))
        assert 16 <= rows < 16384 and rows % 16 == 0
        assert rows * 16384 * 4 <= tiled.DEFAULT_MEMORY_BUDGET["cpu"]

    def test_focal_and_mask_shrink_the_chunk(self):
        plain = self.rows(tiled.Epilogue(0.05))
        focal = self.rows(tiled.Epilogue(0.05, focal_m=0.3))
        assert focal <= plain * 3 // 4 + 16     # the cosines' slice beside D, the scratch and H

    def test_override(self):
        assert tiled.rows_per_chunk(100, 100, tiled.Epilogue(0.05, chunk_size=7), 400) == 7
        assert tiled.rows_per_chunk(5, 100, tiled.Epilogue(0.05, chunk_size=64), 400) == 5

    def test_rounded_to_the_engine_row_tile(self):
        ep = tiled.Epilogue(0.05, memory_budget=1000 * 4096)
        assert tiled.rows_per_chunk(10**6, 1, ep, 4096, multiple=128) == 896
        assert tiled.rows_per_chunk(10**6, 1, ep, 4096) == 992
        assert tiled.rows_per_chunk(10**6, 1, ep, 4096 * 100, multiple=128) == 10   # < one tile


def test_fp16_gradient_does_not_underflow():
    """fp16 inputs at N=1024 in 4 chunks, τ=0.05, norms ≈ 16, with the chunk buffer in fp16
    as on a GPU (emulated here: ``gemm_dtype``). G' = ∂L/∂s/(‖q‖‖k‖) has 98.8% of its entries
    below 1e-10 there, which fp16 flushes to zero: the driver keeps the row factors outside
    the buffer, and the returned gradients stay fp32 until a loss scaler's factor is applied."""
    n, d, chunk = 1024, 256, 256
    g = torch.Generator().manual_seed(0)
    a64 = torch.randn(n, d, generator=g, dtype=torch.float64)          # ‖a_i‖ ≈ 16
    p64 = a64 + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64)
    a, p = a64.half(), p64.half()
    ref_a, ref_p = a.double().requires_grad_(), p.double().requires_grad_()
    fastcl.reference.infonce(ref_a, ref_p, temperature=0.05).backward()
    loss, grads = tiled.contrastive_forward(tiled.Epilogue(0.05, chunk_size=chunk), a, (p,),
                                            need=(True, True), gemm_dtype=torch.float16)
    for got, ref in zip(grads, (ref_a.grad, ref_p.grad)):
        rel = (got.double() - ref).norm() / ref.norm()
        assert rel < 1e-2, rel

    # Through autograd with a loss scale, as torch.amp's GradScaler does: the fp16 .grad
    # holds the scaled gradient without flushing it.
    x, y = a.clone().requires_grad_(), p.clone().requires_grad_()
    scale = 2.0**16
    (fastcl.infonce(x, y, backend="tiled", chunk_size=chunk) * scale).backward()
    assert x.grad.dtype == torch.float16
    rel = (x.grad.double() / scale - ref_a.grad).norm() / ref_a.grad.norm()
    assert rel < 1e-2, rel

    # G' with the row factors inside, stored in fp16, would have flushed most of it.
    cos = torch.nn.functional.normalize(a.double(), dim=1) @ torch.nn.functional.normalize(
        p.double(), dim=1).T
    probs = torch.softmax(cos / 0.05, dim=1) - torch.eye(n, dtype=torch.float64)
    g_prime = probs / 0.05 / n / a.double().norm(dim=1)[:, None] / p.double().norm(dim=1)[None, :]
    flushed = (g_prime.half() == 0) & (g_prime != 0)
    assert flushed.double().mean() > 0.5


@pytest.mark.parametrize("where", ["candidate", "anchor"])
def test_fp16_buffer_with_a_zero_row(where):
    """fp16 chunk buffers (as on a GPU, emulated by ``gemm_dtype``) with one zero row. A zero
    candidate (an empty memory-bank slot, say) once set H's column factor c/‖k_j‖ to EPS-scale
    for every column, and fp16 flushed every gradient to 0; a zero anchor's 1/EPS is inf in
    fp16, and 0·inf made the candidates' gradient NaN (DCLR's noise update takes that path).
    Both must match the float64 reference, the zero rows included."""
    a = make(8, 16, dtype=torch.float64, grad=False)
    p = correlated(a).detach()
    queue = make(32, 16, dtype=torch.float64, seed=3, grad=False)
    if where == "candidate":
        queue[5] = 0.0
    else:
        a[2] = 0.0
    a16, p16, q16 = a.half(), p.half(), queue.half()
    refs = [t.double().requires_grad_() for t in (a16, p16, q16)]
    fastcl.reference.infonce(refs[0], refs[1], refs[2]).backward()
    for need in [(True, True, True), (False, True, True)]:
        loss, grads = tiled.contrastive_forward(tiled.Epilogue(0.05), a16, (p16, q16), need=need,
                                                gemm_dtype=torch.float16)
        for got, ref, want in zip(grads, refs, need):
            if not want:
                assert got is None
                continue
            assert torch.isfinite(got).all()
            # row by row: a zero row's gradient (u/EPS, ~1e11) would hide the others in one norm
            rel = (got.double() - ref.grad).norm(dim=1) / ref.grad.norm(dim=1)
            assert rel.max() < 1e-2, (where, need, rel)


@pytest.mark.parametrize("positives", [False, True], ids=["paper", "released"])
def test_noise_update_takes_the_anchor_norms_once(positives, monkeypatch):
    """The anchors are the same at every step of DCLR's noise update: their norms are taken
    once a call, the candidates' (the moving noise) once a step."""
    a, p = make(20, 8, grad=False), correlated(make(20, 8, grad=False))
    z = make(12, 8, seed=3, grad=False)
    seen = []
    norms = tiled._norms
    counting = lambda x, acc: seen.append(x.shape[0]) or norms(x, acc)  # noqa: E731
    for module in (tiled.noise, tiled.driver):          # the update's and the driver's
        monkeypatch.setattr(module, "_norms", counting)
    prefix = tiled.driver._prefix_norms                 # the torch engine's (its widths pass)
    monkeypatch.setattr(tiled.driver, "_prefix_norms",
                        lambda x, bands, acc: seen.append(x.shape[0]) or prefix(x, bands, acc))
    steps = 3
    got = tiled.noise_update(a, z, steps=steps, lr=1e-3, temperature=0.05, chunk_size=8,
                             positives=p if positives else None)
    keys = 12 + (20 if positives else 0)
    assert seen == [20] + [keys] * steps
    for module in (tiled.noise, tiled.driver):
        monkeypatch.setattr(module, "_norms", norms)
    monkeypatch.setattr(tiled.driver, "_prefix_norms", prefix)
    want = fastcl.dclr_noise(a, p, None, noise=z, steps=steps, lr=1e-3, backend="reference",
                             formulation="released" if positives else "paper")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
