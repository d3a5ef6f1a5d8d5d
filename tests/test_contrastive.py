"""``fastcl.contrastive``'s special cases beside the grid of tests/test_matches_reference.py:
losses near zero, a saturated released negative, the noise update with every feature,
frozen inputs, the named losses as its special cases, the spec's encodings and the compiled
variants. Tolerances as the grid's: tiled 1e-5, Triton 1e-4 (float32)."""

import itertools
import math

import pytest
import torch

import fastcl
from fastcl import reference

from conftest import TOL, TRITON_TOL, backends, correlated, device_of, loss_and_grads, make, needs_triton
from conftest import objectives as conftest_objectives
from test_matches_reference import COMBOS, FEATURES, PHI, Batch
RELEASED = [(), ("mask",), ("noise",), ("mask", "noise")]


@pytest.mark.parametrize("backend", backends("tiled", "triton"))
def test_released_formulation_with_a_saturated_negative(backend):
    """A negative 20 logits above its positive: its softmax entry is 1.0 in float32, where
    1/(1 − p) is infinite. torch's BCE clamps log(1 − p) at −100 and its backward's
    denominator p(1 − p) at 1e-12; the fused paths do the same (finite, equal gradients)."""
    device = device_of(backend)
    a = torch.tensor([[1.0, 0, 0], [0, 1, 0]], device=device, requires_grad=True)
    p = torch.tensor([[0.0, 0, 1], [1, 0, 0]], device=device, requires_grad=True)
    ref, ref_g = loss_and_grads(lambda: fastcl.contrastive(a, p, formulation="released",
                                                          backend="reference"), [a, p])
    got, g = loss_and_grads(lambda: fastcl.contrastive(a, p, formulation="released",
                                                      backend=backend), [a, p])
    assert ref_g[0].abs().max() > 1e4  # the clamp is what sets this gradient
    torch.testing.assert_close(got, ref, **TRITON_TOL)
    for x, y in zip(g, ref_g):
        torch.testing.assert_close(x, y, **TRITON_TOL)


@pytest.mark.parametrize("formulation", ["paper", "released"])
def test_noise_steps_with_anchor_offset(formulation):
    """A slice of anchors against the whole batch, noise moved by the noise update: the
    reference runs it (the update's positive term takes the slice's own positives)."""
    a, p = make(8, 16, dtype=torch.float64), correlated(make(8, 16, dtype=torch.float64))
    losses = [fastcl.contrastive(a[4:], p, anchor_offset=4, noise_ratio=1.0, noise_steps=2,
                                 noise_lr=0.05, formulation=formulation, backend=backend,
                                 generator=torch.Generator().manual_seed(4))
              for backend in ("reference", "tiled")]
    torch.testing.assert_close(losses[0], losses[1])


def test_reference_float16_zero_row_is_finite():
    """float16 rounds EPS to 0: the reference forms unit rows in float32 (a zero row is 0, not
    0/0), as the fused paths do."""
    a, p = make(6, 16), correlated(make(6, 16))
    with torch.no_grad():
        p[2] = 0.0
    loss = fastcl.infonce(a.half(), p.half(), backend="reference")
    torch.testing.assert_close(loss, fastcl.infonce(a.half(), p.half(), backend="tiled"),
                               atol=2e-2, rtol=2e-2)

@pytest.mark.parametrize("backend", backends("tiled", "triton"))
def test_noise_steps_every_feature(backend):
    """Noise drawn from a generator and moved by the noise update, every feature on: the
    backends update it on their own (the reference with autograd) and still agree."""
    device = device_of(backend)
    batch = Batch(12, 24, device=device)
    combo = ("focal", "hard", "mask", "symmetric")
    gen = lambda: torch.Generator(device).manual_seed(5)
    ref, _ = loss_and_grads(lambda: batch(combo, "reference", noise_ratio=1.5,
                                          noise_steps=3, noise_lr=0.05, generator=gen()),
                            batch.leaves())
    got, _ = loss_and_grads(lambda: batch(combo, backend, noise_ratio=1.5, noise_steps=3,
                                          noise_lr=0.05, generator=gen(), chunk_size=5),
                            batch.leaves())
    torch.testing.assert_close(got, ref, **TRITON_TOL)


@pytest.mark.parametrize("feature", FEATURES)
def test_every_feature_changes_the_loss(feature):
    """Each feature moves the reference loss on the grid's inputs (so the grid would notice a
    backend that ignored it), and every pair of features is not just the sum of its parts."""
    batch = Batch(17, 24)
    others = tuple(f for f in FEATURES if f != feature)
    with_all = batch(FEATURES, "reference")
    without = batch(others, "reference")
    alone = batch((feature,), "reference")
    plain = batch((), "reference")
    assert abs(with_all - without) > 1e-3 and abs(alone - plain) > 1e-3


# --------------------------------------------------------------------------- the named losses
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_named_losses_are_special_cases(backend):
    batch = Batch(9, 16)
    a, p, neg, z, comp = batch.a, batch.p, batch.neg, batch.z, batch.comp
    c = lambda *args, **kw: fastcl.contrastive(*args, backend=backend, **kw)
    pairs = [
        (fastcl.infonce(a, p, neg, hard_negative_weight=0.5, backend=backend),
         c(a, p, neg, hard_negative_weight=0.5)),
        (fastcl.infonce(a, p, symmetric=True, backend=backend), c(a, p, symmetric=True)),
        (fastcl.focal_infonce(a, p, neg, m=0.2, backend=backend), c(a, p, neg, focal_m=0.2)),
        (fastcl.dclr_loss(a, p, complementary=comp, phi=PHI, noise=z, noise_steps=2,
                          backend=backend),
         c(a, p, complementary=comp, phi=PHI, noise=z, noise_steps=2)),
        (fastcl.dclr_loss(a, p, complementary=comp, phi=PHI, noise_ratio=1.0,
                          generator=torch.Generator().manual_seed(1), formulation="released",
                          backend=backend),
         c(a, p, complementary=comp, phi=PHI, noise_ratio=1.0,
           generator=torch.Generator().manual_seed(1), formulation="released")),
    ]
    for named, general in pairs:
        assert torch.equal(named, general)


def test_defaults_are_plain_infonce():
    batch = Batch(9, 16)
    assert torch.equal(fastcl.contrastive(batch.a, batch.p), fastcl.infonce(batch.a, batch.p))


@needs_triton
def test_every_combination_launches_a_compiled_variant(monkeypatch):
    """Every flag set the features produce (both directions, the noise update) is one of
    ``VARIANTS``, which the compile check builds for sm_80 and sm_90."""
    from fastcl import tiled
    from fastcl.kernels.configs import VARIANTS
    from fastcl.kernels.contrastive import flags
    seen = []
    # the loss calls and the noise update's driver calls
    for module, name in ((tiled, "contrastive_loss"), (tiled.noise, "contrastive_forward")):
        original = getattr(module, name)

        def spy(ep, *args, _original=original, **kw):
            seen.append(ep)
            return _original(ep, *args, **kw)
        monkeypatch.setattr(module, name, spy)
    batch = Batch(5, 8)
    c = lambda **kw: fastcl.contrastive(batch.a, batch.p, backend="tiled", **kw)  # noqa: E731
    guide = (batch.comp[0], batch.comp[0], None, None)
    q2d_d2q, q2d_q2q = ("query_to_doc", "doc_to_query"), ("query_to_doc", "query_to_query")
    # every combination: plain, with issue #46's margin (tests/test_feature_masks.py), with
    # soft targets (tests/test_soft_targets.py); the released formulation
    margin, smooth = dict(false_negative_margin=0.1), dict(label_smoothing=0.1)
    for combo, extra in itertools.product(COMBOS, ({}, margin, smooth, dict(margin, **smooth))):
        batch(combo, "tiled", noise_steps=1, **extra)
    for combo in RELEASED:
        batch(combo, "tiled", formulation="released", noise_steps=1)
    # fastcl.layout's rules with and without focal, GIST's guide and the margin; the
    # anchor-side rules with soft targets
    for focal, extra in itertools.product((None, 0.3), ({}, margin)):
        c(focal_m=focal, directions=q2d_d2q, **extra)
        c(focal_m=focal, directions=fastcl.layout.gist(), guide=guide, **extra)
    for focal, extra in itertools.product((None, 0.3), (smooth, dict(margin, **smooth))):
        c(focal_m=focal, directions=q2d_q2q, **extra)
        c(focal_m=focal, directions=fastcl.layout.gist(True, False), guide=guide, **extra)
    # the debiased loss with the flag sets its Triton path takes (spec.TRITON_PRIOR)
    for combo, extra in itertools.product([(), ("hard",), ("focal",), ("mask",)], ({}, margin)):
        batch(combo, "tiled", positive_prior=0.1, **extra)
    for rule, extra in itertools.product([dict(directions=q2d_q2q), dict(guide=guide)], ({}, margin)):
        batch((), "tiled", positive_prior=0.1, **rule, **extra)
    # a teacher (tests/test_soft_targets.py): the combinations without DCLR's mask or a
    # positive side, and the anchor-side rules, with and without the margin
    def teacher(negatives):
        k = 5 + (0 if negatives is None else negatives.shape[0])
        return (make(5, 3, seed=20, grad=False), make(k, 3, seed=21, grad=False))
    for combo, extra in itertools.product(COMBOS, ({}, margin)):
        if not {"mask", "symmetric"} & set(combo):
            batch(combo, "tiled", noise_steps=1, teacher=teacher(batch.kwargs(combo)[0]), **extra)
    for focal, extra in itertools.product((None, 0.3), ({}, margin)):
        c(focal_m=focal, teacher=teacher(None), directions=q2d_q2q, **extra)
    launched = {tuple(sorted(flags(ep).items())) for ep in seen}
    known = {tuple(sorted(v.items())) for v in VARIANTS.values()}
    assert launched <= known, launched - known
    assert len(launched) == len(known)     # and every variant has a caller


#: Every objective of conftest.objectives, and the layout rules (MNRL's directions with a
#: hard negative each, GIST's guide): ``f(anchors, positives, extra, **kw)``.
def _objectives_with_rules(n, k):
    out = dict(conftest_objectives(n, k))
    out["mnrl-directions"] = lambda a, p, x, **kw: fastcl.contrastive(
        a, p, x[:n], directions=("query_to_doc", "query_to_query", "doc_to_query"), **kw)
    guide = lambda a: tuple(correlated(t, 0.3, seed=9).detach() for t in (a, a))  # noqa: E731
    out["gist-guide"] = lambda a, p, x, **kw: fastcl.contrastive(
        a, p, directions=fastcl.layout.gist(True, True), guide=(*guide(a), None, None), **kw)
    return out


REQUIRES_GRAD = list(itertools.product([False, True], repeat=3))


@pytest.mark.parametrize("backend", backends("reference", "tiled", "triton"))
@pytest.mark.parametrize("name", list(_objectives_with_rules(1, 0)))
def test_every_requires_grad_combination(name, backend):
    """Each of anchors, positives and the extra rows (negatives, hard negatives or noise) may
    or may not take a gradient — a frozen document side, a fixed queue — on every objective:
    the gradients that exist equal the reference's with all three taking one (float32, the
    backend's tolerance), and the others are None (issue #42: the Triton launcher crashed
    when the anchors took a gradient and the positives did not)."""
    n, k, d = 5, 5, 7
    fn = _objectives_with_rules(n, k)[name]
    base = [make(n, d, seed=21), None, make(k, d, seed=22)]
    base[1] = correlated(base[0], 0.7)
    leaves = [t.detach().requires_grad_() for t in base]
    _, want = loss_and_grads(lambda: fn(*leaves, backend="reference"), leaves)
    tol = TRITON_TOL if backend == "triton" else TOL[torch.float32]
    for flags in REQUIRES_GRAD:
        xs = [t.detach().to(device_of(backend)).requires_grad_(f)
              for t, f in zip(base, flags)]
        loss = fn(*xs, backend=backend)
        if not loss.requires_grad:
            assert not any(flags[:2]), flags
            continue
        loss.backward()
        for which, x, w, f in zip(("anchors", "positives", "extra"), xs, want, flags):
            if not f or w is None:
                assert x.grad is None or not f, (flags, which)
                continue
            torch.testing.assert_close(x.grad.cpu(), w, **tol, msg=lambda s: f"{flags} {which}: {s}")


def _near_zero_case(tau, focal_m, target, d=8, seed=0):
    """One anchor (float32), its positive at cosine 0.95, one hard negative at cosine 0.3,
    and the log-weight w on it that puts the true loss ``log(1 + e^(l_neg − l_pos))`` at
    ``target`` (the margin that a trained model's easy batch has)."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, 3, generator=g, dtype=torch.float64))
    u, v, w_ = basis.T
    a = u
    p = 0.95 * u + math.sqrt(1 - 0.95**2) * v
    h = 0.3 * u + math.sqrt(1 - 0.3**2) * w_
    a, p, h = (x[None].float() for x in (a, p, h))
    s = lambda x, y: float(torch.nn.functional.cosine_similarity(x.double(), y.double()))  # noqa: E731
    s_p, s_h = s(a, p), s(a, h)
    m = focal_m
    l_p = (s_p * s_p if m is not None else s_p) / tau
    l_h = (s_h * (s_h + m) if m is not None else s_h) / tau
    weight = math.log(math.expm1(target)) - (l_h - l_p)
    return a, p, h, weight


def _float64_oracle(a, p, h, tau, focal_m, weight):
    """``log(1 + Σ_{j≠i} e^(l_ij − l_ii))`` in float64 on the float32 inputs, and its
    gradients (autograd): a formula of its own, not a backend."""
    a, p, h = (x.detach().double().requires_grad_() for x in (a, p, h))
    k = torch.cat([p, h])
    s = torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(k, dim=1).T
    m = focal_m
    l = torch.stack([s[:, 0] ** 2 if m is not None else s[:, 0],
                     s[:, 1] * (s[:, 1] + m) if m is not None else s[:, 1]], dim=1) / tau
    l = l + torch.tensor([0.0, weight], dtype=torch.float64)
    loss = torch.log1p(torch.exp(l[:, 1] - l[:, 0])).mean()
    return loss.item(), torch.autograd.grad(loss, (a, p, h))


NEAR_ZERO = [(tau, m, target) for tau in (0.01, 0.05, 0.2, 1.0) for m in (None, 0.3)
             for target in (1e-3, 1e-8, 1e-15, 1e-22, 1e-30)]


@pytest.mark.parametrize("widths", [None, (8,)], ids=["one-width", "matryoshka"])
@pytest.mark.parametrize("backend", backends("reference", "tiled", "triton"))
def test_near_zero_losses_keep_their_digits(backend, widths):
    """Where the positive dominates (a trained model on an easy batch) the loss is
    ``log(1 + Σ_{j≠i} e^(l_ij − l_ii))``, not ``lse − l_ii``, and the positive's gradient is
    minus the others' share of the softmax, not ``p_ii − 1``: in float32 the loss and every
    gradient stay within 1e-5 (relative) of float64 for losses from 1e-3 down to 1e-30, over
    τ, hard-negative margins and focal modulation (issue #42: the tiled path returned exactly
    0 for a true loss of 6.5e-7 at τ = 0.05, and both gradients were 9–13 % off). Within
    ``4ε·max|l|`` where that is larger: float32's own rounding of a logit of size |l| moves
    ``e^(l_ij − l_ii)`` by as much (τ = 0.01, whose logits reach 130 with focal, and margins
    near −70 at τ = 1; measured: at most 2.5e-5 there, 8e-6 elsewhere). ``matryoshka``: the
    same loss through the Matryoshka epilogue (one width, the whole d)."""
    device = device_of(backend)
    eps = torch.finfo(torch.float32).eps
    for tau, m, target in NEAR_ZERO:
        a, p, h, weight = _near_zero_case(tau, m, target)
        want, want_g = _float64_oracle(a, p, h, tau, m, weight)
        xs = [x.to(device).requires_grad_() for x in (a, p, h)]
        loss = fastcl.contrastive(*xs, temperature=tau, focal_m=m, hard_negative_weight=weight,
                                  matryoshka_dims=widths, backend=backend)
        got_g = torch.autograd.grad(loss, xs)
        case = f"τ={tau} m={m} loss={want:.3g}"
        tol = max(1e-5, 4 * eps * ((1 + abs(m or 0)) / tau + abs(weight)))
        assert abs(loss.item() - want) <= tol * want, f"{case}: {loss.item()!r}"
        for name, g, w in zip(("anchors", "positives", "negatives"), got_g, want_g):
            err = ((g.double().cpu() - w).norm() / w.norm()).item()
            assert err <= tol, f"{case}: {name}' gradient {err:.3g} relative"


RELEASED_NEAR_ZERO = [(tau, target) for tau in (0.02, 0.05) for target in (1e-3, 1e-7, 1e-11)]


@pytest.mark.parametrize("backend", backends("reference", "tiled", "triton"))
def test_released_near_zero_losses_keep_their_digits(backend):
    """The released DCLR formulation (BCE on the row softmax) where the positive dominates:
    ``−log p_ii`` is the softplus of the others' log-sum-exp over the positive, and
    ``1 − p_ii`` their share, formed apart: in float32 the loss and the gradients are within
    1e-5 of the authors' code in float64 (itself exact to that for losses ≥ 1e-11; issue #42:
    3e-4 off before). One anchor, its positive at cosine 0.95 and a noise row placed for
    each target loss."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(3)
    u, v, w = torch.linalg.qr(torch.randn(8, 3, generator=g, dtype=torch.float64))[0].T
    for tau, target in RELEASED_NEAR_ZERO:
        kappa = 0.95 + tau * math.log(target)             # the noise row's cosine
        a, p = u[None].float(), (0.95 * u + math.sqrt(1 - 0.95**2) * v)[None].float()
        z = (kappa * u + math.sqrt(1 - kappa**2) * w)[None].float()
        a64, p64 = a.double().requires_grad_(), p.double().requires_grad_()
        logits = reference.cosine_matrix(a64, torch.cat([p64, z.double()])) / tau
        want = torch.nn.functional.binary_cross_entropy(
            torch.softmax(logits, dim=1), torch.tensor([[1.0, 0.0]], dtype=torch.float64))
        want_g = torch.autograd.grad(want, (a64, p64))
        xs = [x.to(device).requires_grad_() for x in (a, p)]
        loss = fastcl.dclr_loss(*xs, noise=z.to(device), noise_steps=0, temperature=tau,
                                formulation="released", backend=backend)
        got_g = torch.autograd.grad(loss, xs)
        case = f"τ={tau} loss={want.item():.3g}"
        assert abs(loss.item() - want.item()) <= 1e-5 * want.item(), f"{case}: {loss.item()!r}"
        for name, gx, wx in zip(("anchors", "positives"), got_g, want_g):
            err = ((gx.double().cpu() - wx).norm() / wx.norm()).item()
            assert err <= 1e-5, f"{case}: {name}' gradient {err:.3g} relative"


# --------------------------------------------------------------------------- the spec
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_symmetric_is_the_per_direction_layout(backend):
    """``symmetric=True`` is ``directions=("query_to_doc", "doc_to_query"),
    partition_mode="per_direction"`` (fastcl.spec.SYMMETRIC), which the fused paths run as
    two directions: the same loss and gradients in float64 as that layout on 2N rows against
    every block (taken here through ids that drop nothing), with focal, hard negatives and
    noise (the forward direction's only)."""
    batch = Batch(7, 5, dtype=torch.float64)
    kw = dict(temperature=0.5, focal_m=0.3, hard_negative_weight=0.4, noise=batch.z,
              noise_steps=0, backend=backend)
    ids = (torch.arange(7), 100 + torch.arange(7), 200 + torch.arange(7))   # all distinct
    leaves = batch.leaves()
    sym, g_sym = loss_and_grads(lambda: fastcl.contrastive(batch.a, batch.p, batch.neg,
                                                           symmetric=True, **kw), leaves)
    lay, g_lay = loss_and_grads(lambda: fastcl.contrastive(
        batch.a, batch.p, batch.neg, directions=("query_to_doc", "doc_to_query"),
        partition_mode="per_direction", duplicate_ids=ids, **kw), leaves)
    torch.testing.assert_close(sym, lay, **TOL[torch.float64])
    for x, y in zip(g_sym, g_lay):
        torch.testing.assert_close(x, y, **TOL[torch.float64])


def test_the_epilogue_encodes_itself_for_the_custom_op():
    """Epilogue.op_args and Epilogue.from_op_args are inverses (the op's one encoding): every
    field that travels, the "off" encodings included."""
    from fastcl.layout import gist
    from fastcl.spec import Epilogue, Matryoshka
    c = (torch.ones(3, 2), torch.ones(3, 2))
    for ep in (Epilogue(0.05),
               Epilogue(0.1, focal_m=0.3, hard_negative_weight=-0.25, phi=0.5, complementary=c,
                        formulation="released", anchor_offset=2, chunk_size=7,
                        matryoshka=Matryoshka((2, 8), (0.5, 1.0))),
               Epilogue(0.05, layout=gist(), blocks=(3, 3, 0, 3), hardness=("hard_negatives", 2.0),
                        guide=(c[0], c[1], c[0][:, 0]), ids=(torch.arange(9), torch.arange(3)))):
        back = Epilogue.from_op_args(*ep.op_args())
        for field in ("temperature", "focal_m", "hard_negative_weight", "phi", "formulation",
                      "anchor_offset", "chunk_size", "matryoshka", "layout", "blocks", "hardness"):
            assert getattr(back, field) == getattr(ep, field), field
        for field in ("complementary", "guide", "ids"):
            got, want = getattr(back, field), getattr(ep, field)
            assert (got is None) == (want is None) and all(x is y for x, y in zip(got or (), want or ()))


def test_two_directions_over_given_anchor_candidates_match_the_reference():
    """``per_direction`` with ``doc_to_query`` over given ``anchor_candidates``: the positive
    side's own anchor is the anchor itself, not the candidates' row ``anchor_offset + i``
    (they differ here), so the fused path must not split it into two plain directions (the
    split gave 0.0 where the reference gives 20.0)."""
    g = torch.Generator().manual_seed(3)
    a, p, cands = (torch.randn(rows, 5, generator=g, dtype=torch.float64, requires_grad=True)
                   for rows in (3, 4, 4))
    kw = dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction",
              temperature=0.05, anchor_offset=1, anchor_candidates=cands)
    want = fastcl.contrastive(a, p, backend="reference", **kw)
    got = fastcl.contrastive(a, p, backend="tiled", chunk_size=2, **kw)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    for x, y in zip(torch.autograd.grad(got, (a, p, cands)), torch.autograd.grad(want, (a, p, cands))):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
