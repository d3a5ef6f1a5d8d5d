"""``anchor_offset``: the loss of a slice of the anchors against the whole batch, as each
process computes it with global negatives. Weighted by their sizes, the slices' losses and
gradients add up to the loss and gradients of the whole batch, for every backend."""

import pytest
import torch

import fastcl

from conftest import correlated, make

N, D, K = 11, 24, 11
SLICES = [(0, 4), (4, 9), (9, 11)]          # unequal slices, one ending on the last row


def _batch():
    a = make(N, D, dtype=torch.float32)
    p = correlated(a, 0.7)
    neg = make(K, D, seed=4)
    c = make(N, 6, seed=5, grad=False)
    comp = (c, correlated(c, 0.3).detach())
    z = make(7, D, seed=6, grad=False)
    return a, p, neg, comp, z


CALLS = {
    "infonce": lambda a, p, neg, comp, z, s, **kw: fastcl.infonce(a, p, **kw),
    "infonce-hard": lambda a, p, neg, comp, z, s, **kw: fastcl.infonce(
        a, p, neg, hard_negative_weight=0.7, **kw),
    "focal": lambda a, p, neg, comp, z, s, **kw: fastcl.focal_infonce(a, p, neg, **kw),
    "dclr": lambda a, p, neg, comp, z, s, **kw: fastcl.dclr_loss(
        a, p, complementary=(comp[0][s], comp[1]), phi=0.3, noise=z, noise_steps=0, **kw),
    "dclr-released": lambda a, p, neg, comp, z, s, **kw: fastcl.dclr_loss(
        a, p, complementary=(comp[0][s], comp[1]), phi=0.01, noise=z, noise_steps=0,
        formulation="released", **kw),
    "escl": lambda a, p, neg, comp, z, s, **kw: fastcl.escl_loss(
        a, p, correlated(a, 1.0, seed=8).detach(), **kw),
    # the one pass over every width (tiled), a call per width (triton), the literal sum
    "matryoshka": lambda a, p, neg, comp, z, s, **kw: fastcl.contrastive(
        a, p, neg, focal_m=0.2, hard_negative_weight=0.5, matryoshka_dims=(24, 10, 3),
        matryoshka_weights=(1.0, 0.5, 2.0), **kw),
}


@pytest.mark.parametrize("backend", ["reference", "tiled", "triton"])
@pytest.mark.parametrize("name", list(CALLS))
def test_slices_add_up_to_the_whole_batch(name, backend):
    call = CALLS[name]
    a, p, neg, comp, z = _batch()
    whole = call(a, p, neg, comp, z, slice(0, N), backend="reference")
    g_whole = torch.autograd.grad(whole, (a, p, neg), allow_unused=True)
    total = torch.zeros(())
    grads = [torch.zeros_like(t) for t in (a, p, neg)]
    for lo, hi in SLICES:
        s = slice(lo, hi)
        if name == "escl":  # the sensitive view is per anchor: slice it like the anchors
            sens = correlated(a, 1.0, seed=8).detach()[s]
            loss = fastcl.escl_loss(a[s], p, sens, anchor_offset=lo, backend=backend)
        else:
            loss = call(a[s], p, neg, comp, z, s, anchor_offset=lo, backend=backend)
        w = (hi - lo) / N
        total = total + w * loss.detach()
        for acc, g in zip(grads, torch.autograd.grad(w * loss, (a, p, neg), allow_unused=True)):
            if g is not None:
                acc += g
    torch.testing.assert_close(total, whole.detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, g_whole):
        if want is None:
            assert not got.abs().any()
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_released_dclr_slice_matches_reference(backend):
    a, p, neg, comp, z = _batch()
    call = CALLS["dclr-released"]
    for lo, hi in SLICES:
        s = slice(lo, hi)
        ref = call(a[s], p, neg, comp, z, s, anchor_offset=lo, backend="reference")
        got = call(a[s], p, neg, comp, z, s, anchor_offset=lo, backend=backend, chunk_size=2)
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
        g_ref = torch.autograd.grad(ref, (a, p))
        g_got = torch.autograd.grad(got, (a, p))
        for x, y in zip(g_got, g_ref):
            torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-4)


def test_offset_errors():
    a, p, neg, comp, z = _batch()
    with pytest.raises(ValueError, match="anchor_offset=8 with 4 anchors needs at least 12"):
        fastcl.infonce(a[:4], p, anchor_offset=8)
    with pytest.raises(ValueError, match="symmetric=True"):
        fastcl.infonce(a[:4], p, anchor_offset=4, symmetric=True)
    with pytest.raises(ValueError, match="anchor_offset"):
        fastcl.infonce(a[:4], p, anchor_offset=-1)
    with pytest.raises(ValueError, match="complementary\\[1\\] has 4 rows but 11"):
        fastcl.dclr_loss(a[:4], p, complementary=(comp[0][:4], comp[1][:4]), anchor_offset=4)
    with pytest.raises(ValueError, match="hard_negative_weight needs one hard negative per anchor"):
        fastcl.infonce(a[:4], p, neg[:4], hard_negative_weight=1.0, anchor_offset=4)
