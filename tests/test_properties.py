"""Property-based tests (hypothesis): every backend against the float64 reference, or a clear error.

Drawn: shapes (N from 1, candidates M = N + K + K_z, widths d that are mostly not powers of
two, d = 1 included), dtypes (float32, float64, bfloat16), scales 1e-20 … 1e20 (rows of
norm below EPS = 1e-12 are "zero" by definition, x̂ = x/EPS, on every path alike; rows too
large to square are rescaled), temperatures (a share of them below the float32 bound, which
must be refused), anisotropy (a shared direction plus small noise, mean cosine ≈ 0.9–0.99 as
pre-trained BERT embeddings), duplicated rows and positives equal to their anchors, row
lengths that vary over a decade, and every feature of ``fastcl.contrastive`` (focal_m,
hard_negative_weight, a queue of negatives, complementary + phi, noise with noise_steps,
symmetric, formulation). The tiled backend takes every draw; Triton (in its interpreter on
a CPU-only machine) takes small shapes only.

Tolerances, against the float64 reference on the same (rounded) inputs:

* loss: ``|L − L₆₄| ≤ tol · (1 + (1 + |m|)/τ + |w|)``, the size of the logits that the
  log-sum-exp rounds;
* each gradient entry: ``|G − G₆₄| ≤ tol · (|G₆₄| + S_row)`` with ``S_row = (2 + |m| + v)/(τ ·
  max(‖x_row‖, EPS))``, the bound on that row's gradient (``v``: the released BCE's largest
  ``p/(1 − p)`` over the negatives, 0 for the paper's loss);
* ``tol``: float64 1e-9; float32 5e-5 (tiled) and 2e-4 (Triton, as tests/test_triton.py);
  bfloat16 2e-2 (as tests/test_matches_reference.py: the noise is rounded to bf16 every step, the
  gradient to bf16 at the end).

Where the float64 answer itself is not a float32 number, the draw is skipped (``assume``):
a mask threshold within 1e-3 of a complementary cosine (the 0/1 decision flips with the
rounding), and, for ``formulation="released"``, a negative whose softmax entry is within
1e-4 of 1 (torch's BCE clamps log(1 − p) at −100 where float32 rounds 1 − p to 0). The
released noise update sends a row with g = 0 to 0, so its draws keep τ ≥ 0.05 (no softmax
entry underflows to an exact 0 in float32) and, at d = 1 with two or more steps, τ ≥ 0.5 (at
z = 0 the gradient is a cancellation of e^{−1/τ} terms whose sign float32 must resolve) and
an odd N (with N even the sum can cancel exactly, and rounding alone picks the step).
Noise that takes steps does so at τ_u = τ ≥ 0.025, with rows at least as long as N(0, 1)
draws: a row whose gradient underflows float32 (every softmax entry of its column in L_U
below 1e-45, a cosine gap ≥ 103·τ_u, possible from τ_u ≈ 0.02 down) stays put where float64
moves it by lr. That matters where lr is not small next to ‖z‖, or where the row, negligible
in L_U, dominates the loss: focal's logits s(s + m)/τ are largest at s = −1.

Profiles (registered in ``conftest.py``): ``ci`` (the default: bounded, derandomized,
≤ 90 s on a 2-core CPU) and ``long`` (≥ 20,000 examples over the file):
``pytest tests/test_properties.py --hypothesis-profile long`` (or
``FASTCL_HYPOTHESIS_PROFILE=long``).
"""

import math

import pytest
import torch
hypothesis = pytest.importorskip("hypothesis", reason="needs hypothesis (the dev extra)")
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fastcl
from fastcl import reference
from fastcl.common import EPS

from conftest import needs_triton

# ------------------------------------------------------------------ profiles (conftest.py)

def _examples(share: float) -> settings:
    """This test's share of the profile's examples (the Triton interpreter is slow)."""
    return settings(max_examples=max(4, int(settings.default.max_examples * share)))



TOL = {("tiled", torch.float64): 1e-9, ("tiled", torch.float32): 5e-5,
       ("tiled", torch.bfloat16): 2e-2, ("triton", torch.float32): 2e-4,
       ("triton", torch.bfloat16): 2e-2, ("reference", torch.float32): 5e-5,
       ("reference", torch.bfloat16): 2e-2, ("reference", torch.float64): 1e-9}
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
WIDTHS = (1, 2, 3, 5, 7, 12, 24, 31, 33, 50, 64, 70)
F32_BOUND = 2.0 / math.sqrt(torch.finfo(torch.float32).max)   # fastcl._validation.temperature


# ------------------------------------------------------------------ draws

@st.composite
def embeddings(draw, *, max_n, widths, dtypes):
    """(anchors, positives, seed-derived generator) in float64 before rounding to dtype."""
    n = draw(st.integers(1, max_n))
    d = draw(st.sampled_from(widths))
    dtype = draw(st.sampled_from(dtypes))
    scale = 10.0 ** draw(st.integers(-20, 20))
    shared = draw(st.sampled_from([0.0, 3.0, 10.0]))      # mean cosine ≈ 0, 0.9, 0.99
    pos_noise = draw(st.sampled_from([0.05, 0.5, 2.0]))
    spread = draw(st.booleans())                           # row lengths over a decade
    dup = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**20)))
    direction = torch.randn(1, d, generator=g, dtype=torch.float64)
    a = shared * direction + torch.randn(n, d, generator=g, dtype=torch.float64)
    p = a + pos_noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    if spread:
        a = a * 10.0 ** torch.rand(n, 1, generator=g, dtype=torch.float64)
        p = p * 10.0 ** torch.rand(n, 1, generator=g, dtype=torch.float64)
    if dup and n > 1:
        a[-1] = a[0]                                       # a duplicated anchor
        p[n // 2] = a[n // 2]                              # a positive equal to its anchor
    return dict(a=a * scale, p=p * scale, dtype=dtype, g=g, shared=shared, scale=scale)


@st.composite
def problems(draw, *, max_n=20, widths=WIDTHS, dtypes=DTYPES, max_k=12):
    """A batch and a feature combination of fastcl.contrastive."""
    b = draw(embeddings(max_n=max_n, widths=widths, dtypes=dtypes))
    n, d, g = b["a"].shape[0], b["a"].shape[1], b["g"]
    released = draw(st.booleans())
    kw = {"formulation": "released" if released else "paper"}
    negatives = None
    if not released:
        if draw(st.booleans()):
            kw["focal_m"] = draw(st.sampled_from([0.0, 0.3, -0.4, 1.0]))
        k = draw(st.sampled_from(["none", "queue", "hard"]))
        if k == "hard":
            negatives = b["a"][torch.randperm(n, generator=g)] + torch.randn(n, d, generator=g,
                                                                          dtype=torch.float64) * b["scale"]
            kw["hard_negative_weight"] = draw(st.sampled_from([0.0, 0.8, -1.5]))
        elif k == "queue":
            rows = draw(st.integers(0, max_k))
            negatives = torch.randn(rows, d, generator=g, dtype=torch.float64) * b["scale"]
        kw["symmetric"] = draw(st.booleans())
    comp = None
    if draw(st.booleans()):
        # a frozen model's view in clusters: cosines ≈ 1 within one, ≈ 0 across
        clusters = draw(st.integers(1, 4))
        c = torch.nn.functional.one_hot(torch.arange(n) % clusters, 4).double()
        c = c + 0.02 * torch.randn(n, 4, generator=g, dtype=torch.float64)
        c_pos = c + 0.02 * torch.randn(n, 4, generator=g, dtype=torch.float64)
        comp = (c, c_pos)
        kw["phi"] = draw(st.sampled_from([-0.5, 0.2, 0.5, 0.8]))
    noise = None
    if draw(st.booleans()):
        rows = draw(st.integers(0, max_k))
        kw["noise_steps"] = draw(st.integers(0, 3))
        # noise rows no longer than a step (lr = 1e-3) only as given, without steps
        noise_scale = 10.0 ** draw(st.sampled_from([0, 0, 3, 20] + ([-3] if not kw["noise_steps"] else [])))
        noise = torch.randn(rows, d, generator=g, dtype=torch.float64) * noise_scale
    kind = draw(st.integers(0, 9))
    if kind == 0:                                   # below the float32 bound: refused
        tau = 10.0 ** draw(st.floats(-45.0, math.log10(F32_BOUND) - 0.01))
    elif kind == 1:
        tau = draw(st.sampled_from([1e-10, 1e-18, 0.05]))
    else:
        tau = 10.0 ** draw(st.floats(-3.0, 1.0))
    if kw.get("noise_steps") and tau >= F32_BOUND:
        tau = max(tau, 0.025)
    if released:
        tau = max(tau, 0.05) if tau >= F32_BOUND else tau
        if d == 1 and kw.get("noise_steps", 0) >= 2 and tau >= F32_BOUND:
            tau = max(tau, 0.5)
    kw["temperature"] = tau
    return dict(b, negatives=negatives, comp=comp, noise=noise, kw=kw)


# ------------------------------------------------------------------ checks

def _inputs(prob, dtype, device="cpu", grads=(True, True, True)):
    """The problem's tensors in ``dtype`` (embeddings) / the matching noise and
    complementary dtypes, as leaves; anchors, positives and negatives take a gradient where
    ``grads`` says so."""
    to = lambda t, want: t.to(dtype).to(device).requires_grad_(want)  # noqa: E731
    a, p = to(prob["a"], grads[0]), to(prob["p"], grads[1])
    neg = None if prob["negatives"] is None else to(prob["negatives"], grads[2])
    side = torch.float64 if dtype == torch.float64 else torch.float32
    comp = None if prob["comp"] is None else tuple(c.to(side).to(device) for c in prob["comp"])
    noise = None if prob["noise"] is None else prob["noise"].to(side).to(device)
    return a, p, neg, comp, noise


def _call(a, p, neg, comp, noise, kw, backend):
    return fastcl.contrastive(a, p, neg, complementary=comp, noise=noise, backend=backend, **kw)


def _released_odds(prob, a, p, comp, noise, kw):
    """The largest p/(1 − p) over the negatives of the released loss, in float64."""
    h, hp = a.detach().double(), p.detach().double()
    blocks = [hp]
    if noise is not None:
        blocks.append(reference.dclr_noise(h, hp, None, steps=kw.get("noise_steps", 4),
                                           temperature=kw["temperature"],
                                           noise=noise.double(), formulation="released"))
    cand = torch.cat(blocks)
    logits = reference.cosine_matrix(h, cand) / kw["temperature"]
    if comp is not None:
        keep = reference.dclr_weights(comp[0].double(), comp[1].double(), cand.shape[0] - hp.shape[0],
                                      phi=kw["phi"], temperature=kw["temperature"],
                                      formulation="released")
        logits = logits * keep
    probs = torch.softmax(logits, dim=1)
    n = h.shape[0]
    probs[torch.arange(n), torch.arange(n)] = 0.0
    top = probs.max().item() if probs.numel() else 0.0
    return top, (top / (1.0 - top) if top < 1 else math.inf)


def _parallel_rows(x):
    """Whether two distinct rows of x point the same way (equal cosines with every row)."""
    if x.shape[0] < 2:
        return False
    # by direction, whatever the norm (rows below EPS, x̂ = x/EPS, tie as well)
    unit = torch.nn.functional.normalize(x.double(), dim=1, eps=1e-300)
    cos = unit @ unit.T
    cos.fill_diagonal_(0.0)
    return bool((cos > 1 - 1e-9).any())


def _skip_ill_posed(prob, a64, p64, comp, noise, dtype=torch.float64, neg64=None, backend="tiled"):
    kw = prob["kw"]
    # Two candidates that point the same way tie in every row's softmax; where the logits'
    # rounding (eps/τ in absolute terms) exceeds ~1e-3, which of the two takes the mass is
    # decided by the last bit of each product, in the reference as in the backend (and by
    # the GEMM's blocking, which can depend on the buffers' alignment): no answer to compare.
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    if eps / kw["temperature"] > 1e-3:
        candidates = p64 if neg64 is None else torch.cat([p64, neg64])
        assume(not _parallel_rows(candidates.detach()))
        if kw.get("symmetric"):
            assume(not _parallel_rows(a64.detach()))
    # The reference's cosine GEMM reads 16-bit inputs as they are: where a row's two largest
    # cosines lie within that rounding (bf16: 8·2⁻⁸) and the logits' rounding is large, the
    # product's last bits pick the column that takes the whole softmax.
    if dtype == torch.bfloat16 and backend == "reference":
        bf_eps = torch.finfo(torch.bfloat16).eps
        if bf_eps / kw["temperature"] > 1e-3:
            candidates = p64 if neg64 is None else torch.cat([p64, neg64])
            for rows, cols in [(a64, candidates)] + ([(p64, a64)] if kw.get("symmetric") else []):
                if cols.shape[0] >= 2:
                    top = reference.cosine_matrix(rows.detach(), cols.detach()).topk(2, dim=1).values
                    assume(bool((top[:, 0] - top[:, 1] > 8 * bf_eps).all()))
    if comp is not None:
        cos = reference.cosine_matrix(comp[0].double(), comp[1].double())
        threshold = (20 * kw["phi"] * kw["temperature"] if kw["formulation"] == "released"
                     else kw["phi"])
        assume(bool(((cos - threshold).abs() > 1e-3).all()))
    odds = 0.0
    if kw["formulation"] == "released":
        # at d = 1 the gradient at z = 0 is Σ_i ±p_i/(NτEPS), rows grouped by sign with equal
        # p_i: an exact tie, a float's rounding then deciding the step, iff N is even
        assume(not (a64.shape[1] == 1 and kw.get("noise_steps", 0) >= 2 and noise is not None
                    and a64.shape[0] % 2 == 0))
        top, odds = _released_odds(prob, a64, p64, comp, noise, kw)
        assume(1.0 - top > 1e-4)
    return odds


def _check_against_reference(prob, backend, dtype, device="cpu", grads=(True, True, True)):
    """The backend's loss and the gradients of the inputs that ``grads`` says take one
    against the float64 reference's (all three taking one); the others get none."""
    kw = prob["kw"]
    a, p, neg, comp, noise = _inputs(prob, dtype, device, grads)
    tau = kw["temperature"]
    acc_max = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    m = abs(kw.get("focal_m") or 0.0)
    if tau < (2.0 + m) / math.sqrt(acc_max):
        with pytest.raises(ValueError, match=r"temperature=.* is too small"):
            _call(a, p, neg, comp, noise, kw, backend)
        return
    # the float64 reference on the very values the backend sees
    a64, p64 = a.detach().double().cpu().requires_grad_(), p.detach().double().cpu().requires_grad_()
    neg64 = None if neg is None else neg.detach().double().cpu().requires_grad_()
    comp64 = None if comp is None else tuple(c.double().cpu() for c in comp)
    noise64 = None if noise is None else noise.double().cpu()
    odds = _skip_ill_posed(prob, a64, p64, comp64, noise64, dtype, neg64, backend)

    want = _call(a64, p64, neg64, comp64, noise64, kw, "reference")
    want.backward()
    got = _call(a, p, neg, comp, noise, kw, backend)
    if got.requires_grad:
        got.backward()
    tol = TOL[(backend, dtype)]
    w = abs(kw.get("hard_negative_weight", 0.0))
    loss_scale = 1.0 + (1.0 + m) / tau + w
    assert math.isfinite(got.item()), f"loss {got.item()} (float64: {want.item()})"
    assert abs(got.item() - want.item()) <= tol * loss_scale, (
        f"loss {got.item()!r} vs float64 {want.item()!r} (allowed {tol * loss_scale:.3g})")
    for name, x, x64 in [("anchors", a, a64), ("positives", p, p64), ("negatives", neg, neg64)]:
        if x is None:
            continue
        if not x.requires_grad:
            assert x.grad is None, f"{name} takes no gradient but got one"
            continue
        gx, g64 = x.grad.double().cpu(), x64.grad
        assert torch.isfinite(gx).all(), f"{name}' gradient is not finite"
        norms = torch.linalg.vector_norm(x64.detach(), dim=1, keepdim=True).clamp_min(EPS)
        bound = (2.0 + m + odds) / (tau * norms)
        err = (gx - g64).abs()
        # the float64 oracle's own rounding: each logit is good to ε₆₄·(1 + m)/τ, which moves
        # a gradient entry by that fraction (it matters only where τ ≲ 1e-6)
        oracle = g64.abs() * 4 * torch.finfo(torch.float64).eps * (1.0 + m) / tau
        allowed = tol * (g64.abs() + bound) + oracle
        worst = (err / allowed).max().item() if err.numel() else 0.0
        assert worst <= 1.0, (f"{name}' gradient off by {worst:.3g}× the tolerance "
                              f"(largest error {err.max().item():.3g}, largest entry "
                              f"{g64.abs().max().item():.3g})")


# ------------------------------------------------------------------ the properties

@_examples(1.0)
@given(prob=problems())
def test_tiled_matches_the_float64_reference(prob):
    _check_against_reference(prob, "tiled", prob["dtype"])


@_examples(0.6)
@given(prob=problems(max_n=12, widths=(1, 3, 24, 33), dtypes=(torch.float32, torch.bfloat16)))
def test_reference_in_its_own_dtype_matches_float64(prob):
    """The reference in float32 / bfloat16: the oracle's own rounding is within the same
    tolerances (its cosine GEMM reads the inputs' dtype)."""
    _check_against_reference(prob, "reference", prob["dtype"])


@needs_triton
@_examples(0.06)
@given(prob=problems(max_n=6, widths=(1, 3, 17), dtypes=(torch.float32, torch.bfloat16,
                                                          torch.float64), max_k=5))
def test_triton_matches_the_float64_reference(prob):
    if prob["dtype"] == torch.float64:
        a = prob["a"]
        with pytest.raises(ValueError, match="backend='triton' cannot run here: the kernels take"):
            fastcl.infonce(a, a, backend="triton")
        return
    _check_against_reference(prob, "triton", prob["dtype"])


GRADS = st.tuples(st.booleans(), st.booleans(), st.booleans())


@_examples(0.3)
@given(prob=problems(max_n=10, widths=(1, 3, 12, 33), max_k=6), grads=GRADS)
def test_tiled_with_any_inputs_taking_a_gradient(prob, grads):
    """Any of anchors, positives and negatives may take no gradient (a frozen side, a fixed
    queue): the others' gradients are the float64 reference's with all three taking one."""
    _check_against_reference(prob, "tiled", prob["dtype"], grads=grads)


@needs_triton
@_examples(0.04)
@given(prob=problems(max_n=6, widths=(1, 3, 17), dtypes=(torch.float32, torch.bfloat16), max_k=5),
       grads=GRADS)
def test_triton_with_any_inputs_taking_a_gradient(prob, grads):
    """As above on the Triton kernels (issue #42: anchors taking a gradient with positives
    that take none crashed the launcher)."""
    _check_against_reference(prob, "triton", prob["dtype"], grads=grads)


@_examples(0.5)
@given(b=embeddings(max_n=16, widths=WIDTHS, dtypes=DTYPES),
       tau=st.floats(-1.5, 0.5).map(lambda e: 10.0 ** e), steps=st.integers(1, 3),
       released=st.booleans(), backend=st.sampled_from(["reference", "tiled"]))
def test_every_noise_step_has_length_lr(b, tau, steps, released, backend):
    """z_j moves by exactly lr a step (or stays, where g_j = 0 exactly; at d = 1 it always is
    for z_j ≠ 0), whatever the size of g_j. τ ≥ 0.03: the softmax entries then stay above
    float32's range limit (at τ = 0.01 a gap of 2/τ = 200 puts them at e^-200, which float64
    still moves by lr and float32 rounds to a gradient of exactly 0)."""
    if released:
        tau = max(tau, 0.05)
    a, p = b["a"].to(b["dtype"]), b["p"].to(b["dtype"])
    z = torch.randn(max(1, a.shape[0] // 2), a.shape[1], generator=b["g"], dtype=torch.float64)
    z = z.to(torch.float64 if b["dtype"] == torch.float64 else torch.float32)
    lr = 1e-3
    z1 = fastcl.dclr_noise(a, p, None, noise=z, steps=1, lr=lr, temperature=tau,
                           formulation="released" if released else "paper", backend=backend)
    step = (z1.double() - z.double()).norm(dim=1)
    if a.shape[1] == 1:
        want = 0.0 if not released else None
        if released:
            assert (z1 == 0).all()
        else:
            assert (step == want).all()
        return
    moved = step > 0
    if released:
        moved = moved & (z1.abs().amax(dim=1) > 0)
    rel = 1e-4 if b["dtype"] == torch.float64 else 1e-3
    assert torch.isfinite(step).all()
    assert ((step[moved] - lr).abs() <= rel * lr).all(), step
    # a row that did not move had a gradient of exactly 0 in the float64 update too
    if not bool(moved.all()):
        z64 = fastcl.dclr_noise(a.double(), p.double(), None, noise=z.double(), steps=1, lr=lr,
                                temperature=tau, formulation="released" if released else "paper",
                                backend="reference")
        assert ((z64.double() - z.double()).norm(dim=1)[~moved] <= 1e-12).all()


@_examples(0.5)
@given(b=embeddings(max_n=20, widths=WIDTHS, dtypes=DTYPES), alpha=st.sampled_from([1.0, 2.0, 0.5]),
       t=st.sampled_from([2.0, 0.5, 5.0]))
def test_alignment_and_uniformity_match_float64(b, alpha, t):
    x, y = b["a"].to(b["dtype"]), b["p"].to(b["dtype"])
    tol = 2e-2 if b["dtype"] == torch.bfloat16 else 1e-5
    want = fastcl.alignment(x.double(), y.double(), alpha=alpha).item()
    got = fastcl.alignment(x, y, alpha=alpha).item()
    assert math.isfinite(got) and abs(got - want) <= tol * (1 + abs(want))
    if x.shape[0] >= 2:
        want = fastcl.uniformity(x.double(), t=t).item()
        got = fastcl.uniformity(x, t=t).item()
        assert math.isfinite(got) and abs(got - want) <= tol * (1 + abs(want))


@st.composite
def layouts(draw):
    """A draw of :mod:`fastcl.layout`'s options: MNRL's directions and partition, GIST's
    blocks, hardness, a guide with a margin, duplicate ids from few values (so that they
    collide), focal, a slice of a larger batch (anchor_offset), whole negative columns."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n_pos = draw(st.integers(1, 9))
    offset = draw(st.integers(0, n_pos - 1)) if draw(st.booleans()) else None
    n = n_pos if offset is None else draw(st.integers(1, n_pos - offset))
    d = draw(st.sampled_from([1, 2, 5, 13]))
    cols = draw(st.integers(0, 2))
    is_gist = draw(st.booleans())
    if is_gist:
        lay = fastcl.layout.gist(draw(st.booleans()), draw(st.booleans()))
    else:
        dirs = ("query_to_doc",) + tuple(x for x in ("query_to_query", "doc_to_query", "doc_to_doc")
                                         if draw(st.booleans()))
        per = draw(st.booleans()) and set(dirs) <= {"query_to_doc", "doc_to_query"}
        lay = fastcl.layout.from_directions(dirs, "per_direction" if per else "joint")
    rand = lambda rows, width=d: torch.randn(rows, width, generator=gen, dtype=torch.float64)  # noqa: E731
    batch = rand(n_pos)
    a = (batch[offset or 0:(offset or 0) + n] if draw(st.booleans()) else rand(n)).requires_grad_()
    p = (batch + 0.5 * rand(n_pos)).requires_grad_()
    neg = rand(cols * n_pos).requires_grad_() if cols else None
    cands = None                            # the anchors block: the anchors themselves
    if lay.scores_anchors and offset is not None:
        # the whole batch's anchors, or (GIST's block) this process's own
        cands = a if is_gist and draw(st.booleans()) else rand(n_pos).requires_grad_()
    kw = dict(directions=lay, temperature=draw(st.sampled_from([0.05, 0.3, 1.0])),
              anchor_offset=offset, anchor_candidates=cands)
    if draw(st.booleans()) and cols:
        kw.update(hardness_mode=draw(st.sampled_from(fastcl.layout.HARDNESS_MODES)),
                  hardness_strength=draw(st.sampled_from([0.5, 3.0])))
    if draw(st.booleans()):
        kw["focal_m"] = draw(st.sampled_from([0.0, 0.3, -0.5]))
    n_a = 0 if not lay.scores_anchors else (n if cands is None or cands is a else n_pos)
    if draw(st.booleans()):
        width = draw(st.sampled_from([2, 7]))
        kw.update(guide=(rand(n, width), rand(n_pos, width), rand(cols * n_pos, width) if cols else None,
                         rand(n_a, width) if n_a and cands is not None else None),
                  guide_margin=draw(st.sampled_from([-0.3, 0.0, 0.2])),
                  margin_strategy=draw(st.sampled_from(fastcl.layout.MARGIN_STRATEGIES)))
    if draw(st.booleans()):
        ids = lambda rows: torch.randint(0, 3, (rows,), generator=gen)  # noqa: E731
        kw["duplicate_ids"] = (ids(n_pos), ids(cols * n_pos) if cols else None, ids(n_a) if n_a else None)
    return a, p, neg, kw, draw(st.integers(1, max(1, n)))


@_examples(0.3)
@given(prob=layouts())
def test_layout_rules_tiled_matches_the_reference(prob):
    """Every rule of fastcl.layout, alone and together, in float64: the tiled path (its own
    chunk masks, chunks of any size) against the reference (whole matrices, block by block)."""
    a, p, neg, kw, chunk = prob
    leaves = [x for x in (a, p, neg, kw.get("anchor_candidates")) if x is not None]
    leaves = list({id(x): x for x in leaves}.values())
    want = fastcl.contrastive(a, p, neg, backend="reference", **kw)
    got = fastcl.contrastive(a, p, neg, backend="tiled", chunk_size=chunk, **kw)
    assert torch.isfinite(want)
    scale = 1 + (1 + abs(kw.get("focal_m") or 0)) / kw["temperature"]
    assert abs(got.item() - want.item()) <= 1e-9 * scale
    for x, y in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        assert (x - y).abs().max() <= 1e-9 * scale * (1 + y.abs().max())


# ------------------------------------------------------------------ sentence-transformers

_TINY = {}


def _tiny_models():
    """(model, other guide): two random 1-layer width-32 BERT encoders over test_evaluate's
    word list, as SentenceTransformers in float64 eval mode (built once)."""
    if not _TINY:
        import tempfile

        st_pkg = pytest.importorskip("sentence_transformers")
        from test_evaluate import make_tiny_model
        folder = tempfile.mkdtemp(prefix="fastcl-props-")
        for seed in (0, 1):
            path = make_tiny_model(f"{folder}/m{seed}", seed=seed, layers=1)
            _TINY[seed] = st_pkg.SentenceTransformer(str(path), device="cpu").double().eval()
    return _TINY[0], _TINY[1]


@st.composite
def repeated_texts(draw):
    """Columns (anchor, positive[, negative]) of N rows drawn from a pool of 3–5 sentences,
    so that texts repeat within and across columns, and a GIST or MNRL configuration."""
    import random

    from test_evaluate import WORDS, random_sentence
    rng = random.Random(draw(st.integers(0, 2**20)))
    pool = list({random_sentence(rng) for _ in range(draw(st.integers(3, 5)))})
    n, cols = draw(st.integers(2, 6)), draw(st.sampled_from([2, 3]))
    columns = [[draw(st.sampled_from(pool)) for _ in range(n)] for _ in range(cols)]
    kind = draw(st.sampled_from(["gist", "cached-gist", "mnrl", "cached-mnrl"]))
    kw = dict(temperature=draw(st.sampled_from([0.05, 1.0])))
    if kind.endswith("gist"):
        kw.update(margin=draw(st.sampled_from([0.0, 0.0, 0.05, -0.1])),
                  margin_strategy=draw(st.sampled_from(["absolute", "relative"])),
                  contrast_anchors=draw(st.booleans()), contrast_positives=draw(st.booleans()))
    assert WORDS
    return columns, kind, kw, draw(st.booleans())


@_examples(0.1)
@given(case=repeated_texts())
def test_sentence_transformers_drop_ins_on_repeated_texts(case):
    """FastGISTEmbedLoss / FastInfoNCELoss (and their cached forms) against
    GISTEmbedLoss / MultipleNegativesRankingLoss on batches whose texts repeat (float64,
    loss and every parameter gradient within 1e-9). GIST's guide is the model or another
    one; where sentence-transformers' own forward gives equal texts different guide
    embeddings (the rounding of a row's position then decides its ties), there is no
    answer to compare and the draw is skipped."""
    losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
    from sentence_transformers.base.losses.merged_forward import embed_columns

    from fastcl.integrations.sentence_transformers import (CachedFastGISTEmbedLoss,
                                                           CachedFastInfoNCELoss,
                                                           FastGISTEmbedLoss, FastInfoNCELoss)
    columns, kind, kw, self_guided = case
    model, other = _tiny_models()
    guide = model if self_guided else other
    features = lambda: [dict(model.preprocess(c)) for c in columns]  # noqa: E731
    if kind.endswith("gist"):
        with torch.no_grad():
            rows = torch.cat(embed_columns(guide, features()))
        texts = [t for c in columns for t in c]
        for i, t in enumerate(texts):
            first = texts.index(t)
            assume(torch.equal(rows[i], rows[first]))
        theirs = losses.GISTEmbedLoss(model, guide, **kw)
        ours = (FastGISTEmbedLoss(model, guide, **kw) if kind == "gist"
                else CachedFastGISTEmbedLoss(model, guide, mini_batch_size=2, **kw))
    else:
        scale = 1.0 / kw["temperature"]
        theirs = losses.MultipleNegativesRankingLoss(model, scale=scale)
        ours = (FastInfoNCELoss(model, scale) if kind == "mnrl"
                else CachedFastInfoNCELoss(model, scale, mini_batch_size=2))
    results = []
    for loss in (theirs, ours):
        model.zero_grad(set_to_none=True)
        value = loss(features(), None)
        value.backward()
        results.append((value.detach(), {k: q.grad.clone() for k, q in model.named_parameters()
                                         if q.grad is not None}))
    (want, want_g), (got, got_g) = results
    assert abs(got.item() - want.item()) <= 1e-9 * (1 + abs(want.item())), (got.item(), want.item())
    assert want_g.keys() == got_g.keys()
    for k in want_g:
        torch.testing.assert_close(got_g[k], want_g[k], atol=1e-9, rtol=1e-7, msg=k)


# ------------------------------------------------------------------ the trainer's run folder
# (fastcl-train: what it writes lies inside its run folder, through no link; a run killed
# after its last step resumes to where the uninterrupted run ended)

RUN_NAMES = ("model", "eval", "runs", "train_log.jsonl", "fastcl_data.json", "train_results.json",
             "checkpoint-1", "checkpoint-2", "checkpoint-7", "checkpoint-x", ".stage-model-1",
             ".old-model", ".train_log.jsonl.tmp", ".loss_curve.tmp.png")
FOREIGN_NAMES = ("notes", "data.txt", ".git", "mine.tmp")


@st.composite
def run_folders(draw):
    """A run folder's entries: each a file, a folder (maybe holding a link) or a link to
    something outside the run."""
    names = draw(st.lists(st.sampled_from(RUN_NAMES + FOREIGN_NAMES), unique=True, max_size=8))
    return [(name, draw(st.sampled_from(["file", "folder", "folder+link", "link-folder", "link-file"])))
            for name in names]


def _tree(folder):
    import hashlib
    import os
    found = {}
    for root, dirs, leaves in os.walk(folder):
        for name in dirs + leaves:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = (
                "link" if os.path.islink(path) else "dir" if os.path.isdir(path)
                else hashlib.sha256(open(path, "rb").read()).hexdigest())
    return found


@_examples(0.2)
@given(entries=run_folders(), remove=st.booleans())
def test_the_run_folder_is_written_through_no_link(entries, remove):
    """guard_links refuses, naming it, the first link among or under the entries a run writes
    (a fresh run or --overwrite-output-dir unlinks them); links elsewhere and every target
    outside stay as they were; a fresh run over an old one keeps no entry of it."""
    import argparse
    import os
    import tempfile
    from pathlib import Path

    pytest.importorskip("transformers")
    from fastcl import files
    from fastcl.trainer import run

    with tempfile.TemporaryDirectory() as tmp:
        out, target = Path(tmp) / "run", Path(tmp) / "outside"
        out.mkdir()
        (target / "dir").mkdir(parents=True)
        (target / "dir" / "weights").write_text("keep")
        (target / "file").write_text("keep")
        for name, kind in entries:
            path = out / name
            if kind == "file":
                path.write_text("x")
            elif kind.startswith("folder"):
                path.mkdir()
                if kind == "folder+link":
                    os.symlink(target / "file", path / "inner")
            else:
                os.symlink(target / ("dir" if kind == "link-folder" else "file"), path)
        outside = _tree(target)
        written = sorted([out / n for n, k in entries if run.writes(n) and k.startswith("link")]
                         + [out / n / "inner" for n, k in entries if run.writes(n) and k == "folder+link"])
        before = _tree(out)
        if written and not remove:
            with pytest.raises(OSError, match=f"^{written[0]} is a link"):
                run.guard_links(out)
            assert _tree(out) == before
        else:
            run.guard_links(out, remove=remove)
            assert not files.find_links(out, run.writes)
            assert {k: v for k, v in _tree(out).items() if not run.writes(Path(k).parts[0])} == \
                {k: v for k, v in before.items() if not run.writes(Path(k).parts[0])}
        # a fresh run over an earlier one (its config there): nothing of the earlier one stays
        (out / "fastcl_config.yaml").write_text("method: simcse\n")
        args = argparse.Namespace(resume=False, overwrite_output_dir=True, allow_nonempty_output_dir=False)
        run.prepare_output(args, out).release()
        assert sorted(p.name for p in out.iterdir() if run.writes(p.name)) == [files.LOCK]
        assert _tree(target) == outside


class _Killed(BaseException):
    pass


@settings(max_examples=max(1, int(settings.default.max_examples * 0.002)))
@given(steps=st.integers(1, 4), save=st.integers(1, 4), accumulation=st.sampled_from([1, 2]),
       schedule=st.sampled_from(["constant", "linear", "cosine"]),
       point=st.sampled_from(["model-stage", "swap"]))
def test_a_run_killed_after_its_last_step_ends_where_the_uninterrupted_one_did(
        tiny, steps, save, accumulation, schedule, point):
    """Killed anywhere after its last step (writing the model, swapping it in), a run's
    resume ends with the uninterrupted run's step log, step count and model."""
    import json
    import tempfile
    from pathlib import Path
    from unittest import mock

    from safetensors.torch import load_file

    from fastcl import files
    from fastcl.trainer import run
    from fastcl.trainer.run import read_log
    from test_train import base_args

    def crash(name):
        if name == point:
            raise _Killed(name)

    extra = dict(steps=steps, save_steps=min(save, steps), lr_scheduler_type=schedule,
                 gradient_accumulation_steps=accumulation)
    with tempfile.TemporaryDirectory() as tmp:
        whole, killed = Path(tmp) / "whole", Path(tmp) / "killed"
        assert run.main(base_args(tiny, whole, **extra)) == 0
        with mock.patch.object(files, "crash_point", crash), pytest.raises(_Killed):
            run.main(base_args(tiny, killed, **extra))
        assert run.main(base_args(tiny, killed, resume=True, **extra)) == 0
        logs = [[(r["step"], r["loss"], r["learning_rate"]) for r in read_log(o) if r["type"] == "step"]
                for o in (whole, killed)]
        assert logs[0] == logs[1] and logs[0][-1][0] == steps
        assert json.loads((killed / run.RESULTS).read_text())["steps"] == steps
        a, b = (load_file(o / "model" / "model.safetensors") for o in (whole, killed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
